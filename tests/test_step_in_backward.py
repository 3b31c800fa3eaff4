"""gwt_optim.step_in_backward: a step inside backward equals a normal step."""

import io
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from _launch import join_group, launch
from torch import nn

import gwt_optim
from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon, gwt_param_groups, step_in_backward
from gwt_optim.optim import _native


class Net(nn.Module):
    """Matrices of several shapes (one with an odd last axis), biases, a norm."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.attn = nn.Linear(24, 36)
        self.mlp = nn.Linear(36, 23)
        self.norm = nn.LayerNorm(23)
        self.head = nn.Linear(23, 50, bias=False)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.mlp(torch.tanh(self.attn(self.emb(x)))))))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (4, 9), generator=g) for _ in range(n)]


def _loss(model, x):
    logits = model(x[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 50), x[:, 1:].reshape(-1))


def _make(factory, dtype=torch.float32):
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = factory(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 3 if s < 3 else 1.0)
    return model, opt, sched


def _train(model, opt, sched, batches, *, in_backward):
    losses = []
    for x in batches:
        loss = _loss(model, x)
        loss.backward()
        if not in_backward:
            opt.step()
        opt.zero_grad(set_to_none=True)  # in backward: marks the next backward as a new step
        sched.step()
        losses.append(loss.item())
    return losses


def _compare(factory, steps=5, exact=True, dtype=torch.float32, atol=1e-6):
    ref_model, ref_opt, ref_sched = _make(factory, dtype)
    ref = _train(ref_model, ref_opt, ref_sched, _batches(steps), in_backward=False)
    model, opt, sched = _make(factory, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. the scheduler's "step() before optimizer.step()"
        with step_in_backward(opt) as handle:
            got = _train(model, opt, sched, _batches(steps), in_backward=True)
    assert handle.steps == steps * len([p for p in model.parameters()])
    assert all(p.grad is None for p in model.parameters())
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-5, msg=name)
    assert ref == got if exact else True
    return opt


def _gwt(cls, regular=None, **kw):
    def factory(model):
        groups = gwt_param_groups(model, level=2, target_modules=("attn", "mlp"), regular_options=regular)
        return cls(groups, lr=1e-2, **kw)

    return factory


def _native_available():
    try:
        _native.native_library()
        return True
    except Exception:
        return False


@pytest.mark.parametrize(
    "backend, moment_dtype",
    [
        ("eager", None),
        pytest.param("native", None, marks=pytest.mark.skipif(not _native_available(), reason="no C compiler")),
        ("eager", "int8"),
    ],
)
def test_gwt_adamw_in_backward_is_bitwise_a_normal_step(backend, moment_dtype):
    # conftest sets one intra-op thread: the native kernels' norm sums then
    # add rows in the same order whether a parameter runs alone or batched.
    _compare(_gwt(GWTAdamW, weight_decay=0.1, backend=backend, moment_dtype=moment_dtype))


@pytest.mark.parametrize(
    "factory",
    [
        _gwt(GWTMuon, regular={"use_muon": False}, backend="eager"),
        _gwt(GWTAdamMini, backend="eager"),
        _gwt(GWTAdafactor, backend="eager"),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-1, momentum=0.9),
    ],
    ids=["muon", "adam-mini", "adafactor", "torch-adamw", "torch-adamw-foreach", "torch-adamw-fused", "torch-sgd"],
)
def test_other_families_and_torch_optimizers_match_a_normal_step(factory):
    _compare(factory, exact=False)


def test_state_dict_round_trip_while_stepping_in_backward():
    factory = _gwt(GWTAdamW, backend="eager", moment_dtype="int8")
    ref_model, ref_opt, ref_sched = _make(factory)
    _train(ref_model, ref_opt, ref_sched, _batches(6), in_backward=False)

    model, opt, sched = _make(factory)
    handle = step_in_backward(opt)
    _train(model, opt, sched, _batches(6)[:3], in_backward=True)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # plain tensors only, int8 codes included
    model2, opt2, sched2 = _make(factory)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])  # replaces the param groups: the hooks must find the new ones
    sched.load_state_dict(ckpt["sched"])
    _train(model, opt, sched, _batches(6)[3:], in_backward=True)
    handle.remove()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_calling_step_while_active_raises_and_remove_restores_step():
    model, opt, _ = _make(_gwt(GWTAdamW, backend="eager"))
    handle = step_in_backward(opt)
    _loss(model, _batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="steps inside backward"):
        opt.step()
    handle.remove()
    _loss(model, _batches(1)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()


def test_per_parameter_clipping_matches_manual_clipping():
    factory = _gwt(GWTAdamW, backend="eager")
    ref_model, ref_opt, _ = _make(factory)
    model, opt, _ = _make(factory)
    for x in _batches(3):
        _loss(ref_model, x).backward()
        for p in ref_model.parameters():
            torch.nn.utils.clip_grad_norm_([p], 0.05, norm_type=2.0)
        ref_opt.step()
        ref_opt.zero_grad()
    with step_in_backward(opt, max_grad_norm=0.05):
        for x in _batches(3):
            _loss(model, x).backward()
            opt.zero_grad()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_rejects_bad_arguments():
    model, opt, _ = _make(_gwt(GWTAdamW, backend="eager"))
    with pytest.raises(ValueError, match="max_grad_norm"):
        step_in_backward(opt, max_grad_norm=0.0)
    with pytest.raises(TypeError):
        step_in_backward(model)
    with pytest.raises(ValueError, match="more than one"):
        step_in_backward([opt, torch.optim.SGD(model.parameters(), lr=0.1)])
    with step_in_backward(opt):
        with pytest.raises(RuntimeError, match="already active"):
            step_in_backward(opt)
    assert "zero_grad" not in vars(opt)  # remove() left the class's zero_grad
    step_in_backward(opt).remove()
    assert gwt_optim.step_in_backward is step_in_backward


def test_refuses_a_gradient_left_over_at_install():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    _loss(model, _batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"'emb\.weight' already has a \.grad.*zero_grad\(set_to_none=True\)"):
        step_in_backward(opt)
    # Refused whole: no hook stayed behind, so the normal workflow still runs.
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert all(p.grad is not None for p in model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad(set_to_none=True)
    with step_in_backward(opt) as handle:
        _loss(model, _batches(1)[0]).backward()
    assert handle.steps == len(grads)


def test_refuses_accumulation_before_any_parameter_steps_twice():
    model, opt, _ = _make(_gwt(GWTAdamW, backend="eager"))
    first, second = _batches(2)
    handle = step_in_backward(opt)
    _loss(model, first).backward()
    after_one = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"already stepped since the last optimizer\.zero_grad\(\)"):
        _loss(model, second).backward()  # a second micro-batch, no zero_grad between
    for a, b in zip(after_one, model.parameters()):
        assert torch.equal(a, b)
    assert {int(opt.state[p]["step"]) for p in model.parameters()} == {1}
    assert handle.steps == len(after_one)
    # zero_grad starts a new step: the next backward steps again, as opt.step() would.
    ref_model, ref_opt, _ = _make(_gwt(GWTAdamW, backend="eager"))
    for x in (first, second):
        _loss(ref_model, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.zero_grad()
    _loss(model, second).backward()
    handle.remove()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_backwards_over_disjoint_parameters_each_step_once():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4)
    ref = [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with step_in_backward(opt) as handle:
        a(x).square().sum().backward()  # e.g. a generator's loss, then a discriminator's:
        b(x).square().sum().backward()  # no parameter gets a second gradient
    assert handle.steps == 4
    ref_a, ref_b = nn.Linear(4, 4), nn.Linear(4, 4)
    with torch.no_grad():
        for p, v in zip((*ref_a.parameters(), *ref_b.parameters()), ref):
            p.copy_(v)
    ref_opt = torch.optim.SGD([*ref_a.parameters(), *ref_b.parameters()], lr=0.1)
    (ref_a(x).square().sum() + ref_b(x).square().sum()).backward()
    ref_opt.step()
    for p, q in zip((*ref_a.parameters(), *ref_b.parameters()), (*a.parameters(), *b.parameters())):
        torch.testing.assert_close(p, q)


def _distributed_worker(rank, out_dir):
    torch.manual_seed(0)
    # Installed before the process group exists: the first backward must notice it.
    early = nn.Linear(6, 3)
    early_opt = torch.optim.SGD(early.parameters(), lr=0.1)
    step_in_backward(early_opt)
    join_group(rank, 2)
    try:
        x = torch.randn(4, 6) + rank
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(6, 3))
        with pytest.raises(RuntimeError, match=r"2 processes.*local gradient.*allow_distributed=True"):
            step_in_backward(torch.optim.SGD(ddp.parameters(), lr=0.1))

        before = [p.detach().clone() for p in early.parameters()]
        with pytest.raises(RuntimeError, match="allow_distributed=True"):
            early(x).sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(before, early.parameters()))

        # Said to be rank-local (an independent model per rank): a plain local step.
        torch.manual_seed(rank)
        local, ref = nn.Linear(6, 3), nn.Linear(6, 3)
        ref.load_state_dict(local.state_dict())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        ref(x).sum().backward()
        ref_opt.step()
        opt = torch.optim.SGD(local.parameters(), lr=0.1)
        with step_in_backward(opt, allow_distributed=True):
            local(x).sum().backward()
        for a, b in zip(ref.parameters(), local.parameters()):
            torch.testing.assert_close(a, b)
        with open(os.path.join(out_dir, f"ok{rank}"), "w") as f:
            f.write("ok")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_refuses_a_multi_process_group_unless_told_the_gradients_are_local(tmp_path):
    # DDP reduces a bucket after its parameters' hooks ran: stepping there
    # used each rank's local gradient (ranks drifted 7.7e-3 apart in 3 steps).
    launch(_distributed_worker, 2, tmp_path, str(tmp_path), group=False)
    assert {"ok0", "ok1"} <= set(os.listdir(tmp_path))
