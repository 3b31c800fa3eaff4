"""The fused GWT-AdamW kernels (gwt_optim.optim._dispatch picks them) against the update's
one statement, gwt_optim.optim.functional.gwt_adamw (tests/functional_runs.py
runs it): the native C kernels on CPU in float64 (to 1e-12) and float32 (their
SIMD code), the deferred phase 2 that FSDP2 uses, and the ``backend``
option's fallbacks. The Triton kernels: tests/test_triton.py."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import functional_runs as runs
from gwt_optim import GWTAdamW
from gwt_optim import _toolchain
from gwt_optim.optim import _native, _stepper


def _native_or_skip():
    try:
        _native.native_library()
    except _toolchain.KernelUnavailable as exc:
        pytest.skip(f"no C compiler for the native kernels: {exc}")


def _run(W0, grads, *, lrs=None, **kw):
    """Train one parameter from W0 on the given gradients; return it and the optimizer."""
    W = torch.nn.Parameter(W0.clone())
    opt = GWTAdamW([W], **kw)
    for t, g in enumerate(grads):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[t]
        W.grad = g.clone()
        opt.step()
    return W.detach(), opt


def _problem(shape, steps, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    W0 = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    grads = [(torch.randn(shape, generator=gen, dtype=torch.float64) * (1 + t)).to(dtype) for t in range(steps)]
    return W0, grads


@pytest.fixture
def count_fused(monkeypatch):
    """Counts the parameter steps each fused backend ran (its phase 2 calls
    and the parameters of its batched calls), to prove the fused path ran."""
    calls: dict[str, int] = {}

    def counting(method, count):
        def counted(self, *args, **kwargs):
            calls[self.name] = calls.get(self.name, 0) + count(args)
            return method(self, *args, **kwargs)

        return counted

    monkeypatch.setattr(_native.NativeBackend, "phase2", counting(_native.NativeBackend.phase2, lambda args: 1))
    monkeypatch.setattr(_native.NativeBackend, "step_buckets", counting(
        _native.NativeBackend.step_buckets, lambda args: sum(len(b.params) for b in args[0])))
    return calls


# --------------------------------------------------------------- native --- #


@pytest.mark.parametrize(
    "shape, level",
    [((3, 17), 1), ((2, 3, 9), 2), ((4, 5), 3), ((5, 70), 6), ((6, 64), 2), ((3, 48), 3), ((2, 160), 4), ((9, 2101), 2)],
)
@pytest.mark.parametrize("gamma, wd", [(1.01, 0.1), (None, 0.0)])
@pytest.mark.parametrize("clip, alpha, units", [(0.5, 0.25, "stored"), (None, 0.25, "stored"), (0.5, 2.0, "stored"),
                                                (None, 2.0, "stored"), (0.25, 2.0, "step")])
def test_native_float64_matches_the_functional_update(shape, level, gamma, wd, clip, alpha, units, count_fused):
    # clip 0.5: the default; None: the paper's update; alpha 0.25: the class's, 2: the recipe's at level 2;
    # "step": the clip in the step's units (a stored clip that changes every step)
    _native_or_skip()
    W0, grads = _problem(shape, 4, torch.float64, seed=level)
    kw = dict(lr=1e-2, weight_decay=wd, level=level, norm_growth_limit=gamma, detail_clip=clip, scale=alpha,
              detail_clip_units=units)
    native, opt = _run(W0, grads, backend="native", **kw)
    reference, (run,) = runs.train(runs.AdamW, W0, grads, **kw)
    assert count_fused == {"native": 4}
    torch.testing.assert_close(native, reference, rtol=1e-12, atol=1e-13)
    (st,), ref_st = opt.state.values(), run.state
    for key in ("exp_avg", "exp_avg_sq", "limiter_norm"):
        if key in ref_st:
            want = ref_st[key]
            torch.testing.assert_close(st[key], want, rtol=1e-12, atol=1e-12 * want.abs().max().item())


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # the two branches of torch's lerp
@pytest.mark.parametrize("clip", [0.5, None])
@pytest.mark.parametrize("alpha", [0.25, 2.0])
def test_native_float32_simd_matches_the_float64_functional_update(level, beta1, clip, alpha, count_fused):
    # Rows of 8 * 37 + 3 blocks: the 8-block SIMD loop, its remainder and a
    # zero-padded tail block. eps = 1 keeps den >= 0.03: a den near 0 would
    # amplify float32 rounding in the details of its block, in every path.
    _native_or_skip()
    n = (8 * 37 + 3) * 2**level - 1
    W0, grads = _problem((5, n), 5, torch.float64, seed=level)
    kw = dict(lr=1e-3, eps=1.0, betas=(beta1, 0.999), weight_decay=0.1, level=level, detail_clip=clip,
              scale=alpha)
    got, _ = _run(W0.float(), [g.float() for g in grads], backend="native", **kw)
    want, _ = runs.train(runs.AdamW, W0.float().double(), [g.float().double() for g in grads], **kw)
    assert count_fused == {"native": 5}
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)


def test_native_uses_all_threads_consistently():
    _native_or_skip()
    W0, grads = _problem((256, 512), 3, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _run(W0, grads, backend="native", level=2)
        torch.set_num_threads(max(2, threads))
        many, _ = _run(W0, grads, backend="native", level=2)
    finally:
        torch.set_num_threads(threads)
    # Rows are independent; only the order of the limiter's norm sum differs.
    torch.testing.assert_close(one, many, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("threads", [1, 2])
def test_batched_steps_match_the_functional_update(threads, count_fused):
    # Parameters that need no collective run as one batch: with enough of
    # them, each on its own thread.
    _native_or_skip()
    shapes = [(6, 40), (3, 2, 24), (9, 33), (5, 64), (4, 16), (7, 20)]
    gen = torch.Generator().manual_seed(0)
    W0 = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(3)]

    def train(**kw):
        params = [torch.nn.Parameter(w.clone()) for w in W0]
        opt = GWTAdamW(params, lr=1e-2, weight_decay=0.1, level=2, **kw)
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params]

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = train(backend="native")
    finally:
        torch.set_num_threads(saved)
    want, _ = runs.train(runs.AdamW, W0, grads, lr=1e-2, weight_decay=0.1, level=2)
    assert count_fused == {"native": 3 * len(shapes)}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("clip", [0.5, None])
def test_pipelined_batch_skips_a_nonfinite_parameter_mid_pipeline(threads, clip, count_fused):
    # Each thread runs phase 2 of one parameter interleaved with the block
    # sums of the next: a parameter whose gradient is not finite must leave
    # the pipeline (weight, moments and limiter norm unchanged) without
    # disturbing the parameters around it.
    _native_or_skip()
    shapes = [(40, 96), (3, 2, 24), (33, 70), (5, 64), (64, 48), (7, 20), (12, 130), (9, 9)]
    gen = torch.Generator().manual_seed(1)
    W0 = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(4)]
    bad = {(2, 2), (2, 5), (3, 0)}  # (step, parameter)
    for t, i in bad:
        grads[t][i].view(-1)[7] = float("nan") if i != 5 else float("inf")

    def train(**kw):
        params = [torch.nn.Parameter(w.clone()) for w in W0]
        opt = GWTAdamW(params, lr=1e-2, weight_decay=0.1, level=2, detail_clip=clip, **kw)
        snapshots = []
        for gs in grads:
            for q, g in zip(params, gs):
                q.grad = g.clone()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # counted below
                opt.step()
            snapshots.append([q.detach().clone() for q in params])
        return snapshots, opt

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got, opt = train(backend="native")
    finally:
        torch.set_num_threads(saved)
    _, ref, want = runs.train(runs.AdamW, W0, grads, lr=1e-2, weight_decay=0.1, level=2, detail_clip=clip,
                              snapshots=True)
    assert count_fused == {"native": 4 * len(shapes)}  # the kernels find the non-finite ones
    for t, (a_step, b_step) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(a_step, b_step)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
            if (t, i) in bad:
                assert torch.equal(a, got[t - 1][i])
    assert opt.nonfinite_skips == sum(run.skips for run in ref) == len(bad)
    for p, run in zip(opt.param_groups[0]["params"], ref):
        for key in ("exp_avg", "exp_avg_sq", "limiter_norm"):
            torch.testing.assert_close(opt.state[p][key], run.state[key], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("share, pipelined", [(1.0, True), (0.25, False)])
def test_pipelining_is_refused_when_its_workspace_would_be_large(monkeypatch, share, pipelined):
    # Two workspace slots per thread, each the size of the largest moments:
    # with eight equal weights on two threads that is half the moments.
    _native_or_skip()
    monkeypatch.setattr(_native, "_PIPELINE_WORKSPACE_SHARE", share)
    monkeypatch.setattr(_native, "_PIPELINE_WORKSPACE_BYTES", 0)
    params = [torch.nn.Parameter(torch.randn(16, 64)) for _ in range(8)]
    opt = GWTAdamW(params, lr=1e-2, backend="native")
    for p in params:
        p.grad = torch.randn_like(p)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        opt.step()
    finally:
        torch.set_num_threads(saved)
    (table,) = opt._stepper.plans["step"].tables  # the plan's table for its one backend
    (entry,) = table["native"][1]
    assert entry.pipelined == pipelined and entry.stride == 2 * 16 * 16


def _bf16_bits(x):
    return x.view(torch.int16).int()


@pytest.mark.parametrize(
    "shape, level",
    # rows longer than a conversion segment (2048 entries), partial last
    # segments and blocks, and the widest block the bf16 kernel takes (2^11)
    [((5, 300), 1), ((3, 2101), 2), ((2, 4100), 3), ((4, 64), 4), ((2, 2, 130), 5), ((2, 4097), 11)],
)
@pytest.mark.parametrize("clip", [0.5, None])
def test_native_bfloat16_matches_the_functional_update(shape, level, clip, count_fused):
    # bf16 weights and gradients with fp32 moments: the native kernel reads the
    # gradient as bf16 (no fp32 copy) and rounds the new weight to nearest
    # even once, as functional.apply_update's W.copy_(w32) does. The fp32 arithmetic
    # differs from functional's by a rounding here and there (block sums in another
    # order), which after 4 steps moves a few weights by a bf16 ulp or two:
    # 2 of 8194 at level 11 in the paper's update, none elsewhere.
    _native_or_skip()
    W0, grads = _problem(shape, 4, torch.float64, seed=level)
    W0, grads = (W0 * 0.1).bfloat16(), [g.bfloat16() for g in grads]
    kw = dict(lr=1e-2, weight_decay=0.1, level=level, detail_clip=clip)
    got, opt = _run(W0, grads, backend="native", **kw)
    want, (run,) = runs.train(runs.AdamW, W0, grads, **kw)
    assert count_fused == {"native": 4}
    assert got.dtype == want.dtype == torch.bfloat16
    ulps = (_bf16_bits(got) - _bf16_bits(want)).abs()
    assert ulps.max().item() <= 2 and (ulps == 0).float().mean().item() >= 0.999
    (st,), want_st = opt.state.values(), run.state
    for key in ("exp_avg", "exp_avg_sq", "limiter_norm"):
        assert st[key].dtype == torch.float32
        torch.testing.assert_close(st[key], want_st[key], rtol=1e-6, atol=1e-6 * want_st[key].abs().max().item())


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_native_bfloat16_level0_vectors_beside_matrices(scale, count_fused):
    # torch's CPU AdamW kernel takes one dtype for weights and moments, so bf16
    # vectors with fp32 moments step on the native kernels' level 0 (blocks of
    # one entry), in the same batch as the group's matrices at their level.
    _native_or_skip()
    gen = torch.Generator().manual_seed(3)
    W0 = [(torch.randn(s, generator=gen) * 0.1).bfloat16() for s in [(300,), (6, 64), (40,), (5, 36)]]
    grads = [[torch.randn(w.shape, generator=gen).bfloat16() for w in W0] for _ in range(4)]

    def train(**kw):
        params = [torch.nn.Parameter(w.clone()) for w in W0]
        opt = GWTAdamW(params, lr=1e-2, weight_decay=0.1, level=2, scale=scale, **kw)
        for gs in grads:
            for q, g in zip(params, gs):
                q.grad = g.clone()
            opt.step()
        return [q.detach() for q in params], opt

    got, opt = train(backend="native")
    want, ref = runs.train(runs.AdamW, W0, grads, lr=1e-2, weight_decay=0.1, level=2, scale=scale)
    assert count_fused == {"native": 4 * len(W0)}
    for a, b in zip(got, want):
        ulps = (_bf16_bits(a) - _bf16_bits(b)).abs()
        # a weight that an update nearly cancels is tiny, and an fp32 rounding
        # of the update moves it by many of its own ulps: compare those by value
        close = torch.isclose(a.float(), b.float(), rtol=0, atol=1e-6)
        assert bool((close | (ulps <= 2)).all()) and (ulps == 0).float().mean().item() >= 0.99
    for p, run in zip(opt.param_groups[0]["params"], ref):
        torch.testing.assert_close(opt.state[p]["exp_avg"], run.state["exp_avg"], rtol=1e-5, atol=1e-7)


def test_native_bfloat16_skips_nonfinite_and_bounds_the_level():
    _native_or_skip()
    backend = _native.NativeBackend()
    w = torch.zeros(4, 8192, dtype=torch.bfloat16)
    group = {"detail_clip": None, "moment_dtype": None}

    def supports(md, level):
        return backend.capabilities.refusal(w, w, md, level, group, False) is None

    assert supports(torch.float32, 11)
    assert not supports(torch.float32, 12)  # blocks wider than a segment: eager
    assert not supports(torch.bfloat16, 2)  # bf16 moments: eager
    W0, grads = _problem((3, 2100), 2, torch.float64)
    W0, grads = W0.bfloat16(), [g.bfloat16() for g in grads]
    grads[1][2, 2099] = float("inf")  # in the last, partial segment of the last row
    W = torch.nn.Parameter(W0.clone())
    opt = GWTAdamW([W], lr=1e-2, level=2, backend="native")
    W.grad = grads[0]
    opt.step()
    before = W.detach().clone(), {k: v.clone() for k, v in opt.state[W].items()}
    W.grad = grads[1]
    with pytest.warns(RuntimeWarning, match="NaN or an infinity"):
        opt.step()
    assert torch.equal(W.detach(), before[0])
    for key in ("exp_avg", "exp_avg_sq", "limiter_norm"):
        assert torch.equal(opt.state[W][key], before[1][key])


@pytest.mark.parametrize("level, scale", [(2, 0.25), (1, 2**0.5), (3, 2**1.5)])  # the recipe's alpha at l = 1, 3
def test_two_phase_and_deferred_paths_match_the_batch(monkeypatch, level, scale):
    # FSDP2 parameters run phase 1, then wait for the all-reduce of every
    # parameter's limiter norm, then phase 2 (each with its own workspace).
    # Bit for bit, also at an alpha that is not a power of two.
    _native_or_skip()
    # float64, where one ulp of the step size shows in the weights
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24)).double()
    x = torch.randn(16, 24, dtype=torch.float64)

    def train(batched, defer):
        m = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24)).double()
        m.load_state_dict(model.state_dict())
        opt = GWTAdamW(m.parameters(), lr=3e-3, level=level, scale=scale, backend="native")
        with monkeypatch.context() as mp:
            caps = _native.NativeBackend.capabilities
            mp.setattr(_native.NativeBackend, "capabilities", dataclasses.replace(caps, batched=batched))
            if defer:
                mp.setattr(_stepper, "_needs_collective", lambda ps: True)
            for _ in range(4):
                opt.zero_grad()
                m(x).square().mean().backward()
                opt.step()
        return [p.detach() for p in m.parameters()]

    batch = train(batched=True, defer=False)
    for a, b, c in zip(batch, train(batched=False, defer=False), train(batched=False, defer=True)):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_unsupported_parameters_fall_back_to_the_generic_path(count_fused):
    _native_or_skip()
    W0, grads = _problem((4, 32), 3, torch.float32)
    W = torch.nn.Parameter(W0.t().contiguous().t())  # non-contiguous
    opt = GWTAdamW([W], lr=1e-2, level=2, backend="native")
    for g in grads:
        W.grad = g.clone()
        opt.step()
    fp16, _ = _run(W0.half(), [g.half() for g in grads], lr=1e-2, level=2, backend="native")
    assert count_fused == {}
    want, _ = _run(W0, grads, lr=1e-2, level=2, backend="eager")
    torch.testing.assert_close(W.detach(), want, rtol=1e-5, atol=1e-6)
    assert fp16.dtype == torch.float16


# --------------------------------------------------------- backend names --- #


def test_the_unreleased_compile_alias_is_gone_and_its_pickles_load():
    p = torch.nn.Parameter(torch.randn(2, 4))
    with pytest.raises(TypeError, match="compile"):
        GWTAdamW([p], compile=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        GWTAdamW([p], backend="inductor")
    # An optimizer pickled before backend= (issue 45) kept only _compile: it maps as the alias did.
    for compile, backend, strict in ((None, "auto", False), (True, "auto", True), (False, "eager", False),
                                     ("native", "native", True)):
        state = {k: v for k, v in GWTAdamW([p]).__getstate__().items() if k not in ("_backend", "_strict")}
        old = GWTAdamW.__new__(GWTAdamW)
        old.__setstate__({**state, "_compile": compile})
        assert (old._backend, old._strict) == (backend, strict) and "_compile" not in old.__dict__


def test_the_eager_backend_never_builds_kernels(monkeypatch, count_fused):
    monkeypatch.setattr(_native, "native_library", lambda: pytest.fail("built a kernel"))
    _run(torch.randn(4, 16), [torch.randn(4, 16)], level=2, backend="eager")
    assert count_fused == {}


def test_missing_compiler_warns_once_in_auto_mode_and_raises_when_required(monkeypatch):
    def no_compiler():
        raise _toolchain.KernelUnavailable("no C compiler (test)")

    monkeypatch.setattr(_native, "native_library", no_compiler)
    W0, grads = _problem((4, 16), 3, torch.float32)
    with pytest.warns(RuntimeWarning, match="no C compiler") as record:
        auto, _ = _run(W0, grads, lr=1e-2)
    assert len(record) == 1  # once per optimizer, not per step or parameter
    eager, _ = _run(W0, grads, lr=1e-2, backend="eager")
    assert torch.equal(auto, eager)
    with pytest.raises(_toolchain.KernelUnavailable, match="no C compiler"):
        _run(W0, grads, backend="native")
