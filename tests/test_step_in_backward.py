"""gwt_optim.step_in_backward: a step inside backward equals a normal step."""

import io
import warnings

import pytest
import torch
from torch import nn

import gwt_optim
from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon, gwt_param_groups, step_in_backward
from gwt_optim.optim import _fused


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
            opt.zero_grad(set_to_none=True)
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
        _fused.native_library()
        return True
    except Exception:
        return False


@pytest.mark.parametrize(
    "compile_, moment_dtype",
    [
        (False, None),
        pytest.param("native", None, marks=pytest.mark.skipif(not _native_available(), reason="no C compiler")),
        (False, "int8"),
    ],
)
def test_gwt_adamw_in_backward_is_bitwise_a_normal_step(compile_, moment_dtype):
    # conftest sets one intra-op thread: the native kernels' norm sums then
    # add rows in the same order whether a parameter runs alone or batched.
    _compare(_gwt(GWTAdamW, weight_decay=0.1, compile=compile_, moment_dtype=moment_dtype))


@pytest.mark.parametrize(
    "factory",
    [
        _gwt(GWTMuon, regular={"use_muon": False}, compile=False),
        _gwt(GWTAdamMini, compile=False),
        _gwt(GWTAdafactor, compile=False),
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
    factory = _gwt(GWTAdamW, compile=False, moment_dtype="int8")
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
    model, opt, _ = _make(_gwt(GWTAdamW, compile=False))
    handle = step_in_backward(opt)
    _loss(model, _batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="steps inside backward"):
        opt.step()
    handle.remove()
    _loss(model, _batches(1)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()


def test_per_parameter_clipping_matches_manual_clipping():
    factory = _gwt(GWTAdamW, compile=False)
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
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_rejects_bad_arguments():
    model, opt, _ = _make(_gwt(GWTAdamW, compile=False))
    with pytest.raises(ValueError, match="max_grad_norm"):
        step_in_backward(opt, max_grad_norm=0.0)
    with pytest.raises(TypeError):
        step_in_backward(model)
    with pytest.raises(ValueError, match="more than one"):
        step_in_backward([opt, torch.optim.SGD(model.parameters(), lr=0.1)])
    assert gwt_optim.step_in_backward is step_in_backward
