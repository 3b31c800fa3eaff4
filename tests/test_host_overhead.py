"""The host side of a batched step: the step plan (GWTOptimizer.step) and
bf16 gradients reaching the Triton kernels without a copy.

The Triton backend runs here on CPU tensors with its launches replaced by
counters (``TritonBackend(cpu=True)``, as ``benchmarks/host_time.py`` times
it): what is checked is the Python side, so no kernel runs. Results are
compared bit for bit on the CPU's batched paths (``torch._fused_adamw_`` for
level 0, the native kernels when a C compiler is there) against the same
optimizer with the plan turned off; the Triton kernels' results under the plan
are checked in Triton's interpreter (tests/test_triton.py). No timing here:
``benchmarks/host_time.py`` measures.
"""

from __future__ import annotations

import io

import pytest
import torch

from gwt_optim import GWTAdamW
from gwt_optim import _toolchain
from gwt_optim.optim import _dispatch, _native
from gwt_optim.optim import _stepper


def _plan(opt):
    """step()'s plan (the stepper's plan over every parameter), or None."""
    return opt._stepper.plans.get(_stepper.STEP)


def _param_plans(opt):
    """step_param's plans, by id(param)."""
    return {k: v for k, v in opt._stepper.plans.items() if k != _stepper.STEP}


@pytest.fixture
def mocked(monkeypatch):
    """The Triton backend on CPU tensors with counted no-op launches; counts
    _phase1 calls too (the per-parameter path a held plan skips)."""
    _triton = pytest.importorskip("gwt_optim.optim._triton", exc_type=ImportError)
    calls = {"launch": 0, "phase1": 0}

    def launch(*args, **meta):
        calls["launch"] += 1

    for name in ("_launch_phase1", "_launch_limiter", "_launch_phase2"):
        monkeypatch.setattr(_triton, name, launch)
    monkeypatch.setitem(_dispatch.BACKENDS, "triton", lambda: _triton.TritonBackend(cpu=True))
    phase1 = _stepper.Stepper._phase1

    def counted(self, *args, **kwargs):
        calls["phase1"] += 1
        return phase1(self, *args, **kwargs)

    monkeypatch.setattr(_stepper.Stepper, "_phase1", counted)
    return calls


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(8, 32), (4, 3, 16), (6, 20), (12,), (5,)]  # two 1-D: the level-0 bucket
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _reset(calls):
    calls.update(dict.fromkeys(calls, 0))


# ------------------------------------------------------------- the plan --- #


def test_a_held_plan_skips_the_per_parameter_path(mocked):
    params = _params()
    opt = GWTAdamW(params, lr=1e-2, backend="triton")
    grads = [_grads(params, 1), _grads(params, 2)]
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()
    plan = _plan(opt)
    assert plan is not None and mocked["phase1"] == len(params)
    _reset(mocked)
    for t in range(4):
        for p, g in zip(params, grads[t % 2]):  # new gradient tensors every step: a new pointer column
            p.grad = g
        opt.param_groups[0]["lr"] = 1e-2 / (t + 2)  # a scheduler: a kernel argument, no new plan
        opt.step()
    assert _plan(opt) is plan
    assert mocked["phase1"] == 0
    assert mocked["launch"] == 4 * 2 * 3  # two buckets (level 2, level 0), three launches each
    for st in opt.state.values():
        assert st["step"].dtype == torch.float32 and st["step"].device.type == "cpu" and st["step"].ndim == 0
        assert st["step"].item() == 5
    assert all(not b.grads for b in plan.flat)  # the plan keeps no gradient alive


def _new_state_tensor(opt, params):
    opt.state[params[1]]["exp_avg"] = opt.state[params[1]]["exp_avg"].clone()


def _moved_state_tensor(opt, params):
    v = opt.state[params[1]]["exp_avg_sq"]
    v.data = v.data.clone()  # the same tensor object at a new address


@pytest.mark.parametrize(
    "change, new_plan",
    [
        (lambda opt, params: opt.load_state_dict(opt.state_dict()), True),
        (lambda opt, params: opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 8))]}), True),
        (lambda opt, params: opt.param_groups[0].__setitem__("norm_growth_limit", None), True),
        (lambda opt, params: setattr(params[0], "data", params[0].data.clone()), True),
        (lambda opt, params: opt.state[params[1]]["exp_avg"].mul_(0.5), False),
        (_new_state_tensor, True),
        (_moved_state_tensor, True),
        (lambda opt, params: opt.state[params[2]]["step"].fill_(7), True),
        (lambda opt, params: opt.state.__setitem__(params[2], dict(opt.state[params[2]])), True),
        (lambda opt, params: setattr(params[3], "grad", None), True),
        (lambda opt, params: setattr(params[0], "grad", params[0].grad.t().contiguous().t()), True),
        (lambda opt, params: opt.param_groups[0].__setitem__("weight_decay", 0.1), False),
    ],
    ids=["load_state_dict", "add_param_group", "limiter-off", "moved-param", "in-place-state", "new-state-tensor",
         "moved-state-tensor", "step-written", "state-dict-replaced", "grad-gone", "non-contiguous-grad",
         "weight-decay"],
)
def test_what_makes_a_new_plan(mocked, change, new_plan):
    params = _params()
    opt = GWTAdamW(params, lr=1e-2, backend="triton")
    for t in range(2):
        for p, g in zip(params, _grads(params, t)):
            p.grad = g
        opt.step()
    plan = _plan(opt)
    for p, g in zip(params, _grads(params, 5)):
        p.grad = g
    change(opt, params)
    _reset(mocked)
    opt.step()
    assert (_plan(opt) is not plan) == new_plan
    with_grads = sum(p.grad is not None for g in opt.param_groups for p in g["params"])
    assert mocked["phase1"] == (with_grads if new_plan else 0)


def test_a_level_change_routes_again(mocked):
    params = _params()
    opt = GWTAdamW(params, lr=1e-2, backend="triton")
    for p, g in zip(params, _grads(params, 1)):
        p.grad = g
    opt.step()
    plan = _plan(opt)
    opt.param_groups[0]["level"] = 3
    for p, g in zip(params, _grads(params, 2)):
        p.grad = g
    # The saved moments have the level-2 shapes: the full checks run and say so.
    with pytest.raises(ValueError, match="state 'exp_avg' has shape"):
        opt.step()
    assert _plan(opt) is not plan


# ------------------------------------------------- bf16 gradients, no copy --- #


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gradients_reach_the_kernels_as_they_are(mocked, monkeypatch, dtype):
    from gwt_optim.optim import _triton

    seen = []
    step_buckets = _triton.TritonBackend.step_buckets

    def spy(self, buckets, limiter_eps, key=None):
        seen.extend((g, p.grad) for b in buckets for p, g in zip(b.params, b.grads))
        return step_buckets(self, buckets, limiter_eps, key)

    monkeypatch.setattr(_triton.TritonBackend, "step_buckets", spy)
    params = _params(dtype)
    opt = GWTAdamW(params, lr=1e-2, backend="triton")
    for t in range(2):  # the step that makes the plan, and one that holds it
        for p, g in zip(params, _grads(params, t)):
            p.grad = g
        opt.step()
    assert len(seen) == 2 * len(params)
    assert all(g is raw and g.dtype == dtype for g, raw in seen)
    for st in opt.state.values():  # the moments stay fp32
        assert st["exp_avg"].dtype == torch.float32


def test_an_fp32_weight_with_bf16_gradients(mocked):
    # torch lets a parameter's gradients have another dtype (grad_dtype); the
    # kernels read them as they are, the moments follow the weight.
    p = torch.nn.Parameter(torch.randn(8, 32))
    p.grad_dtype = None
    opt = GWTAdamW([p], lr=1e-2, backend="triton")
    p.grad = torch.randn(8, 32).bfloat16()
    opt.step()
    ((backend, _),) = _plan(opt).by_backend
    assert _plan(opt).step_params == [p]
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and backend.name == "triton"
    assert [layout[:2] for layout in _plan(opt).layouts] == [(torch.bfloat16, True)]


# ------------------------------------------- results: plan or no plan --- #


def _native_or_skip():
    try:
        _native.native_library()
    except _toolchain.KernelUnavailable as exc:
        pytest.skip(f"no C compiler for the native kernels: {exc}")


def _eventful_grads(opt, params, t, nan=False):
    """Step t's gradients, after what happens before it: a state round trip
    (t = 3), a parameter sitting out and, with ``nan``, a non-finite gradient
    (4), a moved parameter (5), a new learning rate (6)."""
    grads = _grads(params, t)
    if t == 3:
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        opt.load_state_dict(torch.load(buf, weights_only=True))
    if t == 4:
        grads[2] = None
        if nan:
            grads[0][1, 3] = float("nan")
    if t == 5:
        params[0].data = params[0].data.clone()
    if t == 6:
        opt.param_groups[0]["lr"] = 3e-3
    return grads


@pytest.mark.parametrize("path", ["fused_adamw", "native"])
def test_the_plan_changes_no_bit(path):
    """Training through every reason for a new plan gives bit for bit what
    the same optimizer gives with no plan at all (every step the full path),
    state dicts included, at every step."""
    if path == "native":
        _native_or_skip()
        kw = dict(lr=1e-2, weight_decay=0.1, eps=1e-3, backend="native")
    else:  # level 0, alpha 1, no limiter: torch._fused_adamw_ for every parameter
        kw = dict(lr=1e-2, weight_decay=0.1, level=0, scale=1.0, norm_growth_limit=None)

    def run(plan: bool):
        with pytest.MonkeyPatch.context() as mp:
            if not plan:
                mp.setattr(_stepper, "make_plan", lambda host, key, batched, *scope: (None, batched))
            return train(plan)

    def train(plan: bool):
        params = _params()
        opt = GWTAdamW(params, **kw)
        sds = []
        for t in range(9):
            grads = _eventful_grads(opt, params, t)
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
            sds.append(opt.state_dict())
        assert (_plan(opt) is not None) == plan
        return params, sds

    got, got_sds = run(plan=True)
    want, want_sds = run(plan=False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for sa, sb in zip(got_sds, want_sds):
        assert sa["state"].keys() == sb["state"].keys()
        for i in sb["state"]:
            for key, v in sb["state"][i].items():
                assert torch.equal(sa["state"][i][key], v), (i, key)


# ------------------------------------------------- step_param's plans --- #


def _step_each(opt, params, grads):
    """What step_in_backward does: one step_param per parameter, with its group."""
    for p, g in zip(params, grads):
        p.grad = g
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                opt.step_param(p, group)
                p.grad = None


def test_step_param_holds_a_plan_per_parameter(mocked):
    params = _params()
    opt = GWTAdamW(params, lr=1e-2, backend="triton")
    _step_each(opt, params, _grads(params, 1))
    plans = _param_plans(opt)
    assert plans.keys() == {id(p) for p in params} and mocked["phase1"] == len(params)
    _reset(mocked)
    for t in range(4):
        opt.param_groups[0]["lr"] = 1e-2 / (t + 2)  # a scheduler: a kernel argument, no new plan
        _step_each(opt, params, _grads(params, t + 2))  # new gradient tensors every step
    assert all(_param_plans(opt)[k] is plan for k, plan in plans.items())
    assert mocked["phase1"] == 0
    assert mocked["launch"] == 4 * len(params) * 3  # three launches per parameter
    for st in opt.state.values():
        assert st["step"].dtype == torch.float32 and st["step"].ndim == 0 and st["step"].item() == 5
    assert all(not plan.flat[0].grads for plan in plans.values())  # no gradient kept alive
    # skips are counted in the backends' running counts: no new tensor per call
    assert len(opt._nonfinite_counters) == 1 and opt.nonfinite_skips == 0


def _a_step_between(opt, params):
    for p in params:  # step() leaves the gradients in place
        if p.grad is None:
            p.grad = torch.randn_like(p)
    opt.step()  # its plan makes the step counts views of its counter


@pytest.mark.parametrize(
    "change, new_plan",
    [
        (lambda opt, params: opt.load_state_dict(opt.state_dict()), True),
        (lambda opt, params: opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 8))]}), True),
        (lambda opt, params: opt.param_groups[0].__setitem__("norm_growth_limit", None), True),
        (lambda opt, params: setattr(params[2], "data", params[2].data.clone()), True),
        (lambda opt, params: opt.state[params[2]]["exp_avg"].mul_(0.5), False),
        (lambda opt, params: opt.state[params[2]].__setitem__("exp_avg", opt.state[params[2]]["exp_avg"].clone()),
         True),
        (lambda opt, params: setattr(opt.state[params[2]]["exp_avg_sq"], "data",
                                     opt.state[params[2]]["exp_avg_sq"].data.clone()), True),
        (lambda opt, params: opt.state[params[2]]["step"].fill_(7), True),
        (lambda opt, params: opt.state.__setitem__(params[2], dict(opt.state[params[2]])), True),
        (lambda opt, params: setattr(params[2], "grad", params[2].grad.t().contiguous().t()), True),
        (lambda opt, params: opt.param_groups[0].__setitem__("weight_decay", 0.1), False),
        (_a_step_between, True),
    ],
    ids=["load_state_dict", "add_param_group", "limiter-off", "moved-param", "in-place-state", "new-state-tensor",
         "moved-state-tensor", "step-written", "state-dict-replaced", "non-contiguous-grad", "weight-decay",
         "a-step-between"],
)
def test_what_makes_a_new_param_plan(mocked, change, new_plan):
    params = _params()
    p = params[2]
    opt = GWTAdamW(params, lr=1e-2, backend="triton")
    for t in range(2):
        _step_each(opt, params, _grads(params, t))
    plan = _param_plans(opt)[id(p)]
    p.grad = _grads(params, 5)[2]
    change(opt, params)
    _reset(mocked)
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    opt.step_param(p, group)
    # (a non-contiguous gradient takes the eager path: no plan at all)
    assert (_param_plans(opt).get(id(p)) is not plan) == new_plan
    assert mocked["phase1"] == (1 if new_plan else 0)


@pytest.mark.parametrize("path", ["fused_adamw", "native"])
def test_step_param_plans_change_no_bit(path):
    """step_param on each parameter, through every reason for a new plan and
    a non-finite gradient, gives bit for bit what step() gives, and what
    step_param gives with no plan (every call the full path)."""
    if path == "native":
        _native_or_skip()
        kw = dict(lr=1e-2, weight_decay=0.1, eps=1e-3, backend="native")
    else:
        kw = dict(lr=1e-2, weight_decay=0.1, level=0, scale=1.0, norm_growth_limit=None)

    def train(mode: str):
        with pytest.MonkeyPatch.context() as mp:
            if mode == "no plan":
                mp.setattr(_stepper, "plannable", lambda ps: False)
            params = _params()
            opt = GWTAdamW(params, **kw)
            sds = []
            for t in range(9):
                grads = _eventful_grads(opt, params, t, nan=True)
                if mode == "step":
                    for p, g in zip(params, grads):
                        p.grad = g
                    opt.step()
                else:
                    _step_each(opt, params, grads)
                sds.append(opt.state_dict())
            assert bool(_param_plans(opt)) == (mode == "plans")
            assert opt.nonfinite_skips == 1
            return params, sds

    want, want_sds = train("step")
    for mode in ("plans", "no plan"):
        got, got_sds = train(mode)
        for a, b in zip(got, want):
            assert torch.equal(a, b), mode
        for sa, sb in zip(got_sds, want_sds):
            assert sa["state"].keys() == sb["state"].keys()
            for i in sb["state"]:
                for key, v in sb["state"][i].items():
                    assert torch.equal(sa["state"][i][key], v), (mode, i, key)


def test_a_cast_gradient_does_not_unmake_the_plan():
    """A gradient the backend cannot read as it is (bf16 for an fp32 weight on
    the native kernels) is cast on every step, so the plan leaves it out and
    steps it apart; the plan itself holds from step to step."""
    _native_or_skip()
    gen = torch.Generator().manual_seed(3)
    a = torch.nn.Parameter(torch.randn(8, 32, generator=gen))
    b = torch.nn.Parameter(torch.randn(6, 16, generator=gen))
    b.grad_dtype = None  # torch then lets its gradients be bf16
    twin_a, twin_b = (torch.nn.Parameter(p.detach().clone()) for p in (a, b))
    opt = GWTAdamW([a, b], lr=1e-2, backend="native")
    ref = GWTAdamW([twin_a, twin_b], lr=1e-2, backend="native")
    plans = []
    for t in range(4):
        ga, gb = torch.randn(8, 32, generator=gen), torch.randn(6, 16, generator=gen).bfloat16()
        a.grad, b.grad = ga, gb
        twin_a.grad, twin_b.grad = ga.clone(), gb.float()  # what the optimizer casts it to
        opt.step()
        ref.step()
        plans.append(_plan(opt))
    assert plans[1] is plans[2] is plans[3] and plans[3].step_params == [a]
    assert torch.equal(a, twin_a) and torch.equal(b, twin_b)


@pytest.mark.parametrize("each", [False, True], ids=["step", "step_param"])
@pytest.mark.parametrize("path", ["fused_adamw", "native"])
def test_loading_a_state_dict_frees_the_old_moments(path, each):
    """The backends' tables for the plans reach the state tensors; a loaded
    state dict replaces those, and the old ones must not live on in the
    tables (a second copy of the moments until each parameter's next step)."""
    import gc
    import weakref

    if path == "native":
        _native_or_skip()
        kw = dict(lr=1e-2, backend="native")
    else:
        kw = dict(lr=1e-2, level=0, scale=1.0, norm_growth_limit=None)
    params = _params()
    opt = GWTAdamW(params, **kw)
    for t in range(2):
        if each:
            _step_each(opt, params, _grads(params, t))
        else:
            for p, g in zip(params, _grads(params, t)):
                p.grad = g
            opt.step()
    old = [weakref.ref(st["exp_avg"]) for st in opt.state.values()]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    gc.collect()
    assert all(ref() is None for ref in old)
