"""The Triton GWT-AdamW kernels (gwt_optim.optim._triton) in Triton's
interpreter on CPU tensors, against the update's one statement,
gwt_optim.optim.functional.gwt_adamw (run by tests/functional_runs.py); and the
level-0 / 1-D route through ``torch._fused_adamw_`` on CPU.

Triton picks its interpreter when it is *imported* (``TRITON_INTERPRET=1``
turns even ``tl.sum`` into interpreted code), and other tests in the same
process may have imported it for real (Inductor does). So the kernel tests run
in one child pytest process started with the variable set
(:func:`test_kernels_in_the_interpreter`); in this process they are skipped,
and nothing here changes the environment. To run them directly::

    TRITON_INTERPRET=1 GWT_TRITON_CHILD=1 python -m pytest -p no:xdist tests/test_triton.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import functional_runs as runs
from gwt_optim import GWTAdamW
from gwt_optim.optim import _dispatch

CHILD = os.environ.get("GWT_TRITON_CHILD") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
if CHILD:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the child run needs TRITON_INTERPRET=1 from its start"
    from gwt_optim.optim import _triton as _TT
else:
    _TT = None

needs_triton = pytest.mark.skipif(not CHILD, reason="runs in test_kernels_in_the_interpreter's child process")


@pytest.mark.slow
def test_kernels_in_the_interpreter():
    if CHILD:
        pytest.skip("this is the child run")
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "GWT_TRITON_CHILD": "1"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-rfE",
         str(Path(__file__).resolve()), "-k", "not test_kernels_in_the_interpreter and not on_cpu"],
        env=env, cwd=root, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"interpreter tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture
def tt(monkeypatch):
    """The kernel module, installed as the "triton" backend with 64-entry
    chunks (many per tensor, a partial last one); counts launches per kernel."""
    launches = {"phase1": 0, "limiter": 0, "phase2": 0}
    for kernel in launches:
        original = getattr(_TT, f"_launch_{kernel}")

        def counted(*args, _original=original, _kernel=kernel, **kwargs):
            launches[_kernel] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(_TT, f"_launch_{kernel}", counted)
    monkeypatch.setitem(_dispatch.BACKENDS, "triton", lambda: _TT.TritonBackend(chunk=64))
    _TT.launches = launches
    return _TT


SHAPES = [(6, 32), (5, 3, 18), (12, 40), (3, 7), (24,)]  # partial blocks: 18, 7; a 1-D bias


def _problem(shapes=SHAPES, steps=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    W0 = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[(torch.randn(s, generator=gen) * (1 + t)).to(dtype) for s in shapes] for t in range(steps)]
    return W0, grads


def _train(W0, grads, *, lrs=None, opt_out=None, **kw):
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = GWTAdamW(params, **kw)
    for t, gs in enumerate(grads):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[t]
        for p, g in zip(params, gs):
            p.grad = g.clone()  # a new gradient tensor each step: the pointer table follows it
        opt.step()
    if opt_out is not None:
        opt_out.append(opt)
    return [p.detach() for p in params]


def _close(got, want, rtol):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item())


def _functional(W0, grads, **kw):
    """The weights and the runners of gwt_adamw over the same steps (tests/functional_runs.py)."""
    return runs.train(runs.AdamW, W0, grads, **kw)


def _states_match_functional(opt, ran, rtol):
    for st, run in zip(opt.state.values(), ran):
        assert st.keys() == {*run.state, "step"}
        for key, want in run.state.items():
            _close([st[key].float()], [want.float()], rtol)
        assert st["step"].item() == run.t


# ------------------------------------------------------------ the step --- #


@needs_triton
@pytest.mark.parametrize(
    "level, gamma, wd, eps, steps",
    [(2, 1.01, 0.1, 1e-3, 4), (1, None, 0.0, 1e-3, 3), (3, 1.01, 0.0, 1e-4, 3), (2, 1.01, 0.1, 1e-3, 1)],
    ids=["l2-limiter-wd", "l1-no-limiter", "l3", "step1"],
)
def test_fp32_matches_the_functional_update(tt, level, gamma, wd, eps, steps):
    # A near-zero approximation coefficient amplifies fp32 rounding in its
    # block's details by up to 1/(eps sqrt(1 - beta2^t)) (docs/algorithm.md);
    # eps >= 1e-4 keeps that below the tolerance.
    W0, grads = _problem(steps=steps, seed=level)
    kw = dict(lr=1e-2, weight_decay=wd, eps=eps, level=level, norm_growth_limit=gamma)
    lrs = [1e-2 / (t + 1) for t in range(steps)]  # a scheduler: lr is a kernel argument
    opts = []
    got = _train(W0, grads, lrs=lrs, backend="triton", opt_out=opts, **kw)
    want, ran = _functional(W0, grads, lrs=lrs, **kw)
    exact, _ = _functional([w.double() for w in W0], [[g.double() for g in gs] for gs in grads], lrs=lrs,
                           impl="reference", **kw)
    assert set(opts[0]._kernels._backends) == {"triton"}
    assert tt.launches["phase1"] == tt.launches["limiter"] == tt.launches["phase2"] > 0
    if level == 2:  # h = 1/2: A is exact in both, the rest is the same fp32 arithmetic
        _close(got, want, 1e-6)
        _states_match_functional(opts[0], ran, 1e-6)
    else:
        # h = 2^(-l/2) is irrational: the kernels' h * sum(block) and
        # functional's matrix-vector product round differently. Both must be
        # as close to the float64 literal transform as each other.
        def err(x):
            return max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(x, exact))

        assert err(got) <= 2 * err(want) + 1e-7
        _close(got, want, 2e-5)


@needs_triton
@pytest.mark.parametrize("alpha, units", [(0.25, "stored"), (2.0, "stored"), (2.0, "step")])
def test_detail_clip_matches_the_functional_update(tt, alpha, units):
    W0, grads = _problem(shapes=SHAPES[:3], steps=2, seed=3)
    kw = dict(lr=1e-2, weight_decay=0.1, eps=1e-3, level=2, detail_clip=0.5, scale=alpha, detail_clip_units=units)
    opts = []
    got = _train(W0, grads, backend="triton", opt_out=opts, **kw)
    want, _ = _functional(W0, grads, **kw)
    unclipped = _train(W0, grads, backend="triton", **{**kw, "detail_clip": None})
    assert set(opts[0]._kernels._backends) == {"triton"}
    _close(got, want, 1e-6)
    assert any(not torch.allclose(a, b) for a, b in zip(got, unclipped))  # the clip did act


@needs_triton
def test_a_capped_weight_steps_as_at_the_level_used(tt):
    """A (6, 2) weight in a level-3 group steps at level 1 with alpha 0.25 * 2^-1 (functional.step_level):
    bit for bit as in a level-1 group at that alpha, in the same kernels (tests/test_level_cap.py: every
    family, eager and native)."""
    W0, grads = _problem(shapes=[(6, 2), (6,)], steps=3)
    opts = []
    got = _train(W0, grads, lr=1e-2, weight_decay=0.1, level=3, scale=0.25, backend="triton", opt_out=opts)
    want = _train(W0, grads, lr=1e-2, weight_decay=0.1, level=1, scale=0.125, backend="triton", opt_out=opts)
    assert all(set(o._kernels._backends) == {"triton"} for o in opts)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for p, q in zip(opts[0].state.values(), opts[1].state.values()):
        assert all(torch.equal(p[k], q[k]) for k in p)


@needs_triton
def test_level0_is_torch_adamw(tt):
    W0, grads = _problem(shapes=[(6, 10), (33,)], steps=3)
    got = _train(W0, grads, lr=1e-2, weight_decay=0.1, level=0, scale=1.0, norm_growth_limit=None, backend="triton")
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    # Both parameters in one bucket: one launch per step (+ 4 when prepare()
    # ran each form of the kernels once, with and without the limiter).
    assert tt.launches["phase2"] == 3 + 4
    _close(got, [p.detach() for p in params], 1e-6)


@needs_triton
@pytest.mark.parametrize("moment_dtype", [None, "bfloat16"])
def test_bf16_weights_are_bit_exact_against_the_functional_update(tt, moment_dtype):
    """bf16 weights and gradients (fp32 or bf16 moments) round to nearest even
    as functional.apply_update's ``copy_`` does. At level 2 the block sums of
    bf16 values and h = 1/2 are exact in fp32, and the weight update keeps
    functional's operation order, so the weights agree bit for bit. (fp32
    moments may differ in their last bit: torch's CPU lerp uses an FMA.)"""
    W0, grads = _problem(shapes=[(8, 64), (4, 36), (40,)], steps=3, dtype=torch.bfloat16, seed=5)
    kw = dict(lr=1e-2, weight_decay=0.1, eps=1e-3, level=2, moment_dtype=moment_dtype)
    opts = []
    got = _train(W0, grads, backend="triton", opt_out=opts, **kw)
    want, ran = _functional(W0, grads, **kw)
    assert set(opts[0]._kernels._backends) == {"triton"}
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
    _states_match_functional(opts[0], ran, 1e-6 if moment_dtype is None else 1e-2)


@needs_triton
def test_bf16_rounding_is_to_nearest_even():
    """The kernels' bf16 store (``_from_f32``) against torch's rounding, on
    values exactly between two bf16 numbers, next to them, and at the edges
    (inf, NaN, overflow, subnormals, signed zeros)."""
    base = torch.randn(256).bfloat16().float().view(torch.int32)
    bits = torch.cat([base + 0x8000, base + 0x7FFF, base + 0x8001, base + 0x18000]).view(torch.float32)
    edge = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-40, -1e-40, 0.0, -0.0])
    x = torch.cat([bits, edge])
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    _round_kernel_call(_TT, x, out)
    want = x.bfloat16()
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])


def _round_kernel_call(tt, x, out):
    """Run _from_f32 (the kernels' bf16 store) on x through a tiny jit kernel."""
    import triton
    import triton.language as tl

    key = "_round_test_kernel"
    kernel = getattr(tt, key, None)
    if kernel is None:

        @triton.jit
        def kernel(src, dst, N: tl.constexpr):
            offs = tl.arange(0, N)
            tl.store(dst.to(tl.pointer_type(tl.uint16), bitcast=True) + offs, _TT._from_f32(tl.load(src + offs), 1))

        setattr(tt, key, kernel)
    n = x.numel()
    size = 1 << (n - 1).bit_length()
    src = torch.zeros(size)
    src[:n] = x
    dst = torch.zeros(size, dtype=torch.bfloat16)
    kernel[(1,)](src, dst, N=size)
    out.copy_(dst[:n])


@needs_triton
def test_nonfinite_gradient_skips_only_that_parameter(tt):
    W0, grads = _problem(steps=4, seed=7)
    grads[2][0][1, 3] = float("nan")
    grads[2][3][0, 0] = float("inf")
    grads[2][4][5] = -float("inf")  # the 1-D bias: the level-0 bucket
    kw = dict(lr=1e-2, weight_decay=0.1, eps=1e-3, level=2)
    opts = []
    want, ran = _functional(W0, grads, **kw)
    _train(W0, grads[:2], backend="triton", opt_out=opts, **kw)
    opt = opts[0]
    params = opt.param_groups[0]["params"]
    moved_before = params[1].detach().clone()
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    w_before = params[0].detach().clone()
    for p, g in zip(params, grads[2]):
        p.grad = g.clone()
    opt.step()
    after = opt.state[params[0]]
    assert torch.equal(params[0], w_before)
    for key in ("exp_avg", "exp_avg_sq", "limiter_norm"):
        assert torch.equal(after[key], before[key])
    assert after["step"].item() == before["step"].item() + 1
    assert not torch.equal(params[1], moved_before)  # the finite ones moved
    assert opt.nonfinite_skips == 3
    for p, g in zip(params, grads[3]):
        p.grad = g.clone()
    opt.step()
    assert sum(run.skips for run in ran) == 3
    _close([p.detach() for p in params], want, 1e-6)
    _states_match_functional(opt, ran, 1e-6)


@needs_triton
def test_state_round_trip_mid_training_is_bitwise(tt):
    W0, grads = _problem(shapes=SHAPES[2:], steps=4, seed=11)
    kw = dict(lr=1e-2, weight_decay=0.1, level=2, backend="triton")
    straight = _train(W0, grads, **kw)
    opts = []
    first = _train(W0, grads[:2], opt_out=opts, **kw)
    buf = io.BytesIO()
    torch.save(opts[0].state_dict(), buf)
    buf.seek(0)
    params = [torch.nn.Parameter(w.clone()) for w in first]
    opt = GWTAdamW(params, **{k: v for k, v in kw.items()})
    opt.load_state_dict(torch.load(buf, weights_only=True))
    for gs in grads[2:]:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    for a, b in zip(params, straight):
        assert torch.equal(a.detach(), b)


def _train_through_changes(W0, grads, step, limiter_off_at=None):
    """Train with a state round trip before step 2, a moved parameter and a
    gradient that sits out step 3 and (``limiter_off_at``) a routing option
    changed; ``step(opt, params)`` takes each step."""
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = GWTAdamW(params, lr=1e-2, weight_decay=0.1, level=2, backend="triton")
    for t, gs in enumerate(grads):
        gs = [g.clone() for g in gs]
        if t == 2:
            opt.load_state_dict(opt.state_dict())
        if t == 3:
            params[0].data = params[0].data.clone()
            gs[1] = None
        if t == limiter_off_at:
            opt.param_groups[0]["norm_growth_limit"] = None
        for p, g in zip(params, gs):
            p.grad = g
        step(opt, params)
    return params, opt


def _assert_same(got, opt, want, ref):
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for sa, sb in zip(opt.state.values(), ref.state.values()):
        for key in sb:
            assert torch.equal(sa[key], sb[key]), key


@needs_triton
def test_the_step_plan_changes_no_bit(tt):
    """Through every reason for a new step plan (a state round trip, a moved
    parameter, a gradient that goes and comes back, a level-independent
    option) the kernels give bit for bit what they give with no plan."""
    from gwt_optim.optim import _stepper

    W0, grads = _problem(shapes=SHAPES[1:], steps=6, seed=19)
    got, opt = _train_through_changes(W0, grads, lambda opt, params: opt.step(), limiter_off_at=4)
    assert opt._stepper.plans.get(_stepper.STEP) is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_stepper, "make_plan", lambda host, key, batched, *scope: (None, batched))
        want, ref = _train_through_changes(W0, grads, lambda opt, params: opt.step(), limiter_off_at=4)
    assert ref._stepper.plans.get(_stepper.STEP) is None
    _assert_same(got, opt, want, ref)


def _step_each(opt, params):
    """As step_in_backward steps: step_param on each parameter with a gradient."""
    for p in params:
        if p.grad is not None:
            opt.step_param(p, opt.param_groups[0])
            p.grad = None


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_param_plans_change_no_bit(tt, dtype):
    """step_param on each parameter, through the same changes and a
    non-finite gradient, gives bit for bit what step() gives: the same
    kernels on one-parameter buckets."""
    W0, grads = _problem(shapes=SHAPES[1:], steps=6, seed=23, dtype=dtype)
    grads[4][0][1, 2, 5] = float("inf")
    got, opt = _train_through_changes(W0, grads, _step_each)
    want, ref = _train_through_changes(W0, grads, lambda opt, params: opt.step())
    param_plans = [k for k in opt._stepper.plans if k != "step"]  # step_param's, by id(param)
    assert len(param_plans) == len(got) and not [k for k in ref._stepper.plans if k != "step"]
    assert opt.nonfinite_skips == ref.nonfinite_skips == 1
    _assert_same(got, opt, want, ref)


@needs_triton
def test_step_issues_three_launches_per_bucket(tt):
    """O(buckets), not O(parameters): one bucket of level-2 fp32 matrices, one
    of bf16 ones (another group) and one of level-0 biases."""

    def launches(n_layers):
        torch.manual_seed(0)
        weights = [torch.nn.Parameter(torch.randn(4, 8 + 4 * i)) for i in range(n_layers)]
        halves = [torch.nn.Parameter(torch.randn(2, 8).bfloat16()) for _ in range(n_layers)]
        biases = [torch.nn.Parameter(torch.randn(4)) for _ in range(n_layers)]
        opt = GWTAdamW([{"params": weights + biases}, {"params": halves}], lr=1e-2, level=2, backend="triton")
        for p in weights + halves + biases:
            p.grad = torch.randn_like(p)
        opt.step()  # the first step also compiles (in the interpreter: runs) each variant once
        for key in tt.launches:
            tt.launches[key] = 0
        opt.step()
        return dict(tt.launches)

    assert launches(2) == launches(5) == {"phase1": 3, "limiter": 3, "phase2": 3}


@needs_triton
def test_step_one_matches_the_batch(tt, monkeypatch):
    W0, grads = _problem(shapes=SHAPES[1:], steps=2, seed=13)
    kw = dict(lr=1e-2, weight_decay=0.1, level=2, backend="triton")
    batch = _train(W0, grads, **kw)
    step_buckets = _TT.TritonBackend.step_buckets

    def one_by_one(self, buckets, limiter_eps, key=None):
        # each parameter a bucket of its own, without a plan
        ones = [dataclasses.replace(b, params=[b.params[i]], grads=[b.grads[i]], states=[b.states[i]],
                                    levels=[b.levels[i]], limited=[b.limited[i]])
                for b in buckets for i in range(len(b.params))]
        return tuple(c for one in ones for c in step_buckets(self, [one], limiter_eps))

    monkeypatch.setattr(_TT.TritonBackend, "step_buckets", one_by_one)
    single = _train(W0, grads, **kw)
    for a, b in zip(single, batch):
        assert torch.equal(a, b)


@needs_triton
def test_unsupported_parameters_take_the_eager_path(tt):
    W0, grads = _problem(shapes=[(4, 32)], steps=2)
    W = torch.nn.Parameter(W0[0].t().contiguous().t())  # non-contiguous
    opt = GWTAdamW([W], lr=1e-2, backend="triton")
    for gs in grads:
        W.grad = gs[0].clone()
        opt.step()
    assert sum(tt.launches.values()) == 0
    _close([W.detach()], _train(W0, grads, lr=1e-2, backend="eager"), 1e-6)


# ------------------------------------------------- level 0 on CPU (fused) --- #


@pytest.mark.skipif(CHILD, reason="runs in the parent process")
def test_level0_and_1d_parameters_take_fused_adamw_on_cpu(monkeypatch):
    calls = []
    original = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(len(a[0])), original(*a, **k)))
    W0, grads = _problem(shapes=[(6, 16), (8,), (5,), (3, 4)], steps=3, seed=17)
    grads[1][1][0] = float("nan")
    kw = dict(lr=1e-2, weight_decay=0.1)
    groups = lambda ps: [{"params": ps[:3], "level": 2}, {"params": ps[3:], "level": 0, "scale": 1.0,  # noqa: E731
                                                           "norm_growth_limit": None}]
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = GWTAdamW(groups(params), **kw)
    with pytest.warns(RuntimeWarning, match="NaN or an infinity"):
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
    want, ran = _functional(W0[:3], [gs[:3] for gs in grads], level=2, **kw)
    want_0, ran_0 = _functional(W0[3:], [gs[3:] for gs in grads], level=0, scale=1.0, norm_growth_limit=None, **kw)
    # One call per step for the two biases and the level-0 matrix (two groups,
    # the same hyperparameters); the NaN bias sits out of the step-2 call.
    assert calls == [3, 2, 3]
    assert opt.nonfinite_skips == sum(run.skips for run in ran + ran_0) == 1
    _close([p.detach() for p in params], want + want_0, 1e-6)
