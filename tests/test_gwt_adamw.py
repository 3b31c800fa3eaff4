"""GWTAdamW against its oracles: torch AdamW at level 0, an independent float64
numpy/PyWavelets implementation of the paper's steps, the authors' update as
eps -> 0, and exact state_dict round trips."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import pywt
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gwt_optim import GWTAdamW
from gwt_optim.optim.functional import max_level, step_level


# ----------------------------------------------------------------- oracles --- #


def numpy_gwt_adamw(W0, grads, *, lr, betas, eps, wd, level, scale, gamma, authors=False, clip=None):
    """The issue's 7 steps, written independently with PyWavelets per row.

    ``authors=True`` follows the authors' public code instead: eps added to
    sqrt(V) before bias correction and weight decay applied after the step.
    ``clip`` clamps the reconstruction of the normalized details alone (before
    the limiter's r) to [-clip, clip]: the opt-in ``detail_clip`` remedy.
    """
    b1, b2 = betas
    W = W0.astype(np.float64).copy()
    n = W.shape[-1]
    M = V = None
    s = None
    for t, G in enumerate(grads, start=1):
        rows = [pywt.wavedec(r, "haar", mode="zero", level=level) for r in G.reshape(-1, n)]
        A = np.stack([r[0] for r in rows])
        details = [np.stack([r[j] for r in rows]) for j in range(1, level + 1)]  # D_l ... D_1
        M = np.zeros_like(A) if M is None else M
        V = np.zeros_like(A) if V is None else V
        M = b1 * M + (1 - b1) * A
        V = b2 * V + (1 - b2) * A * A
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        if authors:
            den = np.sqrt(V) + eps
            U = M / den
        else:
            den = np.sqrt(V) + eps * math.sqrt(bc2)
            U = M / den
        r = 1.0
        if gamma is not None:
            norm = np.linalg.norm(U)
            if t > 1:
                r = max(norm / (s + 1e-8), gamma) / gamma
            U = U / r
            s = np.linalg.norm(U)
        new_details = []
        for i, D in enumerate(details):  # coarsest first: den repeated 2^i
            rep = np.repeat(den, 2**i, axis=-1)[:, : D.shape[-1]]
            new_details.append(D / (rep * r))
        if clip is None:
            rec = np.stack(
                [pywt.waverec([U[k], *[d[k] for d in new_details]], "haar", mode="zero")[:n]
                 for k in range(U.shape[0])]
            )
        else:
            approx = [pywt.waverec([U[k], *[np.zeros_like(d[k]) for d in new_details]], "haar", mode="zero")[:n]
                      for k in range(U.shape[0])]
            detail = [pywt.waverec([np.zeros_like(U[k]), *[d[k] * r for d in new_details]], "haar",
                                   mode="zero")[:n] for k in range(U.shape[0])]
            rec = np.stack(approx) + np.clip(np.stack(detail), -clip, clip) / r
        delta = scale * rec.reshape(W.shape)
        if authors:
            # exp_avg / (sqrt(exp_avg_sq) + eps) with step_size = lr * sqrt(bc2) / bc1
            W = W - lr * math.sqrt(bc2) / bc1 * delta
            W = W * (1 - lr * wd)
        else:
            W = W * (1 - lr * wd)
            W = W - lr * math.sqrt(bc2) / bc1 * delta
    return W


def run_torch(opt_fn, W0, grads, dtype=torch.float64):
    W = torch.nn.Parameter(torch.tensor(W0, dtype=dtype))
    opt = opt_fn([W])
    for G in grads:
        W.grad = torch.tensor(G, dtype=dtype)
        opt.step()
    return W.detach()


def make_problem(shape, steps, seed=0):
    rng = np.random.default_rng(seed)
    W0 = rng.standard_normal(shape)
    grads = [rng.standard_normal(shape) * (1 + t) for t in range(steps)]
    return W0, grads


# --------------------------------------------------------------- level 0 --- #


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_level0_matches_torch_adamw(weight_decay, impl):
    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    model_b = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    model_b.load_state_dict(model_a.state_dict())
    ref = torch.optim.AdamW(model_a.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay)
    gwt = GWTAdamW(
        model_b.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay,
        level=0, scale=1.0, norm_growth_limit=None, impl=impl,
    )
    x, y = torch.randn(32, 7), torch.randn(32, 3)
    for _ in range(20):
        for model, opt in ((model_a, ref), (model_b, gwt)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- float64 paper oracle --- #


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    n=st.integers(1, 37),
    level=st.integers(1, 5),
    gamma=st.sampled_from([None, 1.01, 1.5]),
    wd=st.sampled_from([0.0, 0.05]),
    impl=st.sampled_from(["fast", "reference"]),
)
def test_matches_independent_float64_oracle(rows, n, level, gamma, wd, impl):
    assume(level <= max_level(n))  # a deeper level is capped (test_level_cap.py); the oracle pads it
    W0, grads = make_problem((rows, n), steps=4, seed=rows * 100 + n)
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=wd, level=level, scale=0.25, gamma=gamma)
    expected = numpy_gwt_adamw(W0, grads, **kw)
    got = run_torch(
        lambda p: GWTAdamW(p, lr=1e-2, detail_clip=None, eps=1e-8, weight_decay=wd, level=level, scale=0.25,
                           norm_growth_limit=gamma, impl=impl),
        W0, grads,
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_equals_authors_update_as_eps_goes_to_zero():
    W0, grads = make_problem((6, 24), steps=5)
    authors = numpy_gwt_adamw(W0, grads, lr=1e-2, betas=(0.9, 0.999), eps=0.0, wd=0.0, level=2,
                              scale=0.25, gamma=1.01, authors=True)
    ours = run_torch(lambda p: GWTAdamW(p, lr=1e-2, eps=0.0, level=2, detail_clip=None), W0, grads)
    np.testing.assert_allclose(ours.numpy(), authors, rtol=1e-10, atol=1e-12)
    # ...and with eps > 0 the two conventions differ, as documented.
    authors_eps = numpy_gwt_adamw(W0, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-3, wd=0.0, level=2,
                                  scale=0.25, gamma=1.01, authors=True)
    ours_eps = run_torch(lambda p: GWTAdamW(p, lr=1e-2, eps=1e-3, level=2, detail_clip=None), W0, grads)
    assert not np.allclose(ours_eps.numpy(), authors_eps, rtol=1e-10, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from([(3, 17), (2, 3, 9), (4, 1), (1, 64), (2, 2, 2, 5)]),
    level=st.integers(0, 6),
    gamma=st.sampled_from([None, 1.01]),
)
def test_fast_path_matches_reference_path(shape, level, gamma):
    W0, grads = make_problem(shape, steps=3, seed=level)  # a level deeper than a row's: capped on both paths
    outs = [
        run_torch(lambda p: GWTAdamW(p, lr=1e-2, weight_decay=0.1, level=level, norm_growth_limit=gamma, impl=impl), W0, grads)
        for impl in ("fast", "reference")
    ]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-14)


# ----------------------------------------------------- detail clipping --- #


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("level,n,clip,gamma", [(1, 16, 0.5, 1.01), (2, 24, 0.25, None), (3, 21, 1.0, 1.01),
                                                (2, 7, 0.5, 1.01)])
def test_detail_clip_matches_float64_oracle(impl, level, n, clip, gamma):
    W0, grads = make_problem((5, n), steps=6, seed=n)
    expected = numpy_gwt_adamw(W0, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.1, level=level,
                               scale=0.25, gamma=gamma, clip=clip)
    got = run_torch(lambda p: GWTAdamW(p, lr=1e-2, weight_decay=0.1, level=level, norm_growth_limit=gamma,
                                       detail_clip=clip, impl=impl), W0, grads)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-12)
    # the clip is active on these gradients, so the paper's update differs
    paper = run_torch(lambda p: GWTAdamW(p, lr=1e-2, detail_clip=None, weight_decay=0.1, level=level, norm_growth_limit=gamma,
                                         impl=impl), W0, grads)
    assert not np.allclose(paper.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,level", [((16, 16), 2), ((64, 256), 2), ((32, 96), 3), ((8, 64), 1)])
def test_detail_clip_bounds_the_first_step(shape, level, dtype):
    """|dW| <= lr alpha (2^(-l/2) + c sqrt(1-b2)/(1-b1)) at step 1 on N(0, 1)
    gradients; the paper's update exceeds AdamW's 1 x lr by orders of magnitude."""
    lr, alpha, clip, (b1, b2) = 1e-2, 0.25, 0.5, (0.9, 0.999)
    bound = lr * alpha * (2 ** (-level / 2) + clip * math.sqrt(1 - b2) / (1 - b1))
    worst = {}
    for c in (clip, None):
        changes = []
        for seed in range(5):
            g = torch.Generator().manual_seed(seed)
            W = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
            opt = GWTAdamW([W], lr=lr, scale=alpha, level=level, detail_clip=c)
            W.grad = torch.randn(shape, generator=g, dtype=dtype)
            opt.step()
            changes.append(W.detach().abs().max().item())
        worst[c] = max(changes)
    assert worst[clip] <= bound * (1 + 1e-5)
    assert worst[None] > 10 * lr  # the heavy tail the clip removes


def test_detail_clip_default_is_half_and_none_is_the_paper_update():
    W0, grads = make_problem((4, 16), steps=3)
    a = run_torch(lambda p: GWTAdamW(p, lr=1e-2), W0, grads)
    b = run_torch(lambda p: GWTAdamW(p, lr=1e-2, detail_clip=0.5), W0, grads)
    assert torch.equal(a, b)
    paper = run_torch(lambda p: GWTAdamW(p, lr=1e-2, detail_clip=None), W0, grads)
    expected = numpy_gwt_adamw(W0, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.0, level=2, scale=0.25,
                               gamma=1.01)
    np.testing.assert_allclose(paper.numpy(), expected, rtol=1e-10, atol=1e-12)
    for bad in (0, -1.0, float("inf"), float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="detail_clip"):
            GWTAdamW([torch.nn.Parameter(torch.zeros(2, 4))], detail_clip=bad)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_detail_clip_units(level):
    """A gradient whose blocks sum to zero has A = 0, so U = 0 and every normalized detail is clipped: each
    entry's step is then exactly the clip's bound, alpha c lr in ``"step"`` units at every t, and alpha c lr c_t,
    c_t = sqrt(1 - beta2^t)/(1 - beta1^t), in the ``"stored"`` units (the default)."""
    lr, alpha, c, (b1, b2), n = 1e-2, 2.0, 0.25, (0.9, 0.999), 4 * 2**level
    sign = torch.tensor([1.0, -1.0]).repeat(n // 2).expand(3, n).double()
    for units in ("step", "stored"):
        W = torch.nn.Parameter(torch.zeros(3, n, dtype=torch.float64))
        opt = GWTAdamW([W], lr=lr, scale=alpha, level=level, detail_clip=c, detail_clip_units=units)
        for t in range(1, 41):
            before = W.detach().clone()
            W.grad = 5.0 * sign
            opt.step()
            c_t = math.sqrt(1 - b2**t) / (1 - b1**t)
            want = lr * alpha * c * (1.0 if units == "step" else c_t)
            torch.testing.assert_close(before - W.detach(), want * sign, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="detail_clip_units"):
        GWTAdamW([torch.nn.Parameter(torch.zeros(2, 4))], detail_clip_units="adam")


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_detail_clip_units_step_matches_float64_oracle(impl):
    """``"step"`` units are the stored clip c (1 - beta1^t)/sqrt(1 - beta2^t) at each step: the float64 oracle
    stepped one step at a time with that clip (its state carried over) equals the optimizer."""
    W0, grads = make_problem((5, 24), steps=6, seed=7)
    got = run_torch(lambda p: GWTAdamW(p, lr=1e-2, weight_decay=0.1, level=2, detail_clip=0.25,
                                       detail_clip_units="step", impl=impl), W0, grads)
    b1, b2 = 0.9, 0.999
    W = torch.nn.Parameter(torch.from_numpy(W0).clone())
    opt = GWTAdamW([W], lr=1e-2, weight_decay=0.1, level=2, detail_clip=0.25, impl=impl)
    for t, g in enumerate(grads, 1):
        opt.param_groups[0]["detail_clip"] = 0.25 * (1 - b1**t) / math.sqrt(1 - b2**t)
        W.grad = torch.from_numpy(g).clone()
        opt.step()
    torch.testing.assert_close(got, W.detach(), rtol=0, atol=0)
    expected_first = numpy_gwt_adamw(W0, grads[:1], lr=1e-2, betas=(b1, b2), eps=1e-8, wd=0.1, level=2, scale=0.25,
                                     gamma=1.01, clip=0.25 * (1 - b1) / math.sqrt(1 - b2))
    first = run_torch(lambda p: GWTAdamW(p, lr=1e-2, weight_decay=0.1, level=2, detail_clip=0.25,
                                         detail_clip_units="step", impl=impl), W0, grads[:1])
    np.testing.assert_allclose(first.numpy(), expected_first, rtol=1e-10, atol=1e-12)


# GWTMuon refuses the clip in its Muon groups (tests/test_muon.py): they have no denominator to normalize by.
@pytest.mark.parametrize("family", ["GWTAdamMini", "GWTAdafactor"])
def test_detail_clip_reaches_other_families_fast_equals_reference(family):
    import gwt_optim

    W0, grads = make_problem((8, 32), steps=4, seed=3)
    cls = getattr(gwt_optim, family)
    outs = []
    for impl in ("fast", "reference"):
        outs.append(run_torch(lambda p: cls([{"params": p, "detail_clip": 0.5}], lr=1e-2, impl=impl), W0, grads))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-12)
    paper = run_torch(lambda p: cls(p, lr=1e-2), W0, grads)
    assert not torch.allclose(paper, outs[0])


def test_higher_dim_tensors_transform_along_the_last_axis():
    # A (2, 3, 8) weight is three independent (.., 8) rows per leading index.
    W0, grads = make_problem((2, 3, 8), steps=3)
    got = run_torch(lambda p: GWTAdamW(p, lr=1e-2, level=2, norm_growth_limit=None, detail_clip=None), W0, grads)
    flat = numpy_gwt_adamw(W0.reshape(6, 8), [g.reshape(6, 8) for g in grads], lr=1e-2, betas=(0.9, 0.999),
                           eps=1e-8, wd=0.0, level=2, scale=0.25, gamma=None)
    np.testing.assert_allclose(got.numpy().reshape(6, 8), flat, rtol=1e-10)


@pytest.mark.parametrize("wavelet", ["db2", "sym4"])
def test_other_wavelets_run_and_reduce_loss(wavelet):
    torch.manual_seed(0)
    target = torch.randn(8, 32)
    W = torch.nn.Parameter(torch.zeros(8, 32))
    # Zero-padded longer filters leave small boundary approximations whose
    # denominators amplify details, so non-Haar wavelets need modest steps.
    opt = GWTAdamW([W], lr=2e-2, level=2, wavelet=wavelet, detail_clip=None)
    losses = []
    for _ in range(80):
        opt.zero_grad()
        loss = (W - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# ----------------------------------------------------------- behaviour --- #


def test_one_dim_params_are_plain_adamw_in_a_gwt_group():
    torch.manual_seed(0)
    b = torch.nn.Parameter(torch.randn(9))
    b_ref = torch.nn.Parameter(b.detach().clone())
    opt = GWTAdamW([b], lr=1e-2, level=3, scale=0.25)  # scale/limiter must not apply
    ref = torch.optim.AdamW([b_ref], lr=1e-2, weight_decay=0.0)
    for t in range(5):
        g = torch.randn(9)
        b.grad, b_ref.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(b, b_ref, rtol=1e-5, atol=1e-6)
    assert "limiter_norm" not in opt.state[b]


@pytest.mark.parametrize("level", [1, 2, 3])
def test_state_is_two_to_the_minus_level_of_adamw(level):
    W = torch.nn.Parameter(torch.randn(64, 256))
    W.grad = torch.randn_like(W)
    opt = GWTAdamW([W], level=level)
    opt.step()
    st_ = opt.state[W]
    assert st_["exp_avg"].shape == (64, 256 // 2**level)
    assert st_["exp_avg_sq"].shape == (64, 256 // 2**level)
    moment_bytes = sum(st_[k].numel() * st_[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
    assert moment_bytes * 2**level == 2 * W.numel() * 4


def test_short_axis_is_zero_padded_up_to_the_deepest_level_it_can_use():
    W = torch.nn.Parameter(torch.randn(4, 3))
    W.grad = torch.randn_like(W)
    opt = GWTAdamW([W], level=2)  # ceil(log2 3) = 2: one block of 4, one zero of padding
    opt.step()
    assert opt.state[W]["exp_avg"].shape == (4, 1)
    assert torch.isfinite(W).all()


@pytest.mark.parametrize("family", ["GWTAdamW", "GWTMuon", "GWTAdamMini", "GWTAdafactor"])
@pytest.mark.parametrize("columns, deepest", [(1, 0), (3, 2), (4, 2), (5, 3), (128, 7), (129, 8)])
def test_a_level_deeper_than_a_row_can_use_is_capped(family, columns, deepest):
    """Past ceil(log2 n) a level only averages zero padding: the weight steps at the deepest level, its
    state shaped for it, with alpha times 2^((deepest - level)/2) (functional.step_level;
    tests/test_level_cap.py checks the steps bit for bit)."""
    import warnings

    import gwt_optim

    assert max_level(columns) == deepest
    assert step_level((2, columns), deepest + 2, 0.25) == (deepest, 0.125)
    assert step_level((2, columns), deepest, 0.25) == (deepest, 0.25)
    cls = getattr(gwt_optim, family)
    kw = dict(head_dim=1) if family == "GWTAdamMini" else {}
    states = []
    for level in (deepest, deepest + 1):
        W = torch.nn.Parameter(torch.zeros(2, columns))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            opt = cls([{"params": [W], "level": level}], **kw)
        assert len(said) == (level > deepest)
        W.grad = torch.ones_like(W)
        opt.step()
        states.append({k: v.shape for k, v in opt.state[W].items()})
    assert states[0] == states[1]


def test_limiter_bounds_norm_growth():
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(16, 32))
    opt = GWTAdamW([W], level=2, norm_growth_limit=1.01)
    norms = []
    for t in range(6):
        W.grad = torch.randn_like(W) * (10.0 ** t)  # exploding gradients
        opt.step()
        norms.append(opt.state[W]["limiter_norm"].item())
    for prev, cur in zip(norms, norms[1:]):
        assert cur <= 1.01 * prev * (1 + 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_near_zero_approximation_keeps_update_finite_and_bounded(dtype):
    # Every block of 4 sums to zero, so A_2 = 0 and V = 0 while the details are
    # large: they are divided by eps * sqrt(1 - beta2^t) only.
    eps, lr, beta2 = 1e-8, 1e-3, 0.999
    pattern = torch.tensor([1.0, -1.0, 1.0, -1.0]).repeat(8, 4)
    W = torch.nn.Parameter(torch.zeros(8, 16, dtype=dtype))
    W.grad = pattern.to(dtype)
    opt = GWTAdamW([W], lr=lr, eps=eps, level=2, scale=0.25, detail_clip=None)
    opt.step()
    assert opt.state[W]["exp_avg"].abs().max() == 0
    update = W.detach().float().abs().max().item()
    assert math.isfinite(update)
    # |delta| <= alpha * |G - mean| / (eps sqrt(1-beta2)); step = lr sqrt(1-beta2)/(1-beta1)
    bound = lr * math.sqrt(1 - beta2) / 0.1 * 0.25 * 1.0 / (eps * math.sqrt(1 - beta2))
    assert 0 < update <= bound * 1.01
    # A larger eps caps the gain proportionally, as documented.
    W2 = torch.nn.Parameter(torch.zeros(8, 16, dtype=dtype))
    W2.grad = pattern.to(dtype)
    GWTAdamW([W2], lr=lr, eps=1e-6, level=2, scale=0.25, detail_clip=None).step()
    ratio = update / W2.detach().float().abs().max().item()
    assert 90 < ratio < 110


def test_eps_zero_with_zero_denominator_drops_details_instead_of_nan():
    W = torch.nn.Parameter(torch.zeros(2, 8))
    W.grad = torch.tensor([1.0, -1.0]).repeat(2, 4)
    GWTAdamW([W], eps=0.0, level=1, detail_clip=None).step()
    assert torch.isfinite(W).all() and W.abs().max() == 0


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("clip,ratio", [(None, 0.2), (0.5, 0.75)])
def test_loss_goes_down_on_a_small_network(level, clip, ratio):
    # Full-batch and noise-free, the details carry signal, which the default
    # clip caps (docs/algorithm.md): slower here, as documented, but down.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(128, 16)
    y = torch.sin(x[:, :4] * 2)
    opt = GWTAdamW(model.parameters(), lr=1e-2, level=level, detail_clip=clip)  # the paper's alpha = 0.25
    # Warm-up as in the paper: at t = 1 the details are divided by |A_l| of a
    # single gradient (V has no history yet), so full-size early steps overshoot.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 15))
    first = last = None
    for _ in range(100):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        first = loss.item() if first is None else first
        last = loss.item()
    assert last < ratio * first


def test_bf16_params_get_fp32_moments_and_track_fp32_training():
    torch.manual_seed(0)
    W16 = torch.nn.Parameter(torch.randn(16, 64).bfloat16())
    W32 = torch.nn.Parameter(W16.detach().float().clone())
    o16 = GWTAdamW([W16], lr=1e-2, level=2)
    o32 = GWTAdamW([W32], lr=1e-2, level=2)
    for _ in range(5):
        g = torch.randn(16, 64)
        W16.grad, W32.grad = g.bfloat16(), g.bfloat16().float()
        o16.step()
        o32.step()
    assert o16.state[W16]["exp_avg"].dtype == torch.float32
    assert o16.state[W16]["exp_avg_sq"].dtype == torch.float32
    assert W16.dtype == torch.bfloat16
    # within a few bf16 ulps (2^-8 relative) of the fp32 run
    torch.testing.assert_close(W16.float(), W32, rtol=3 * 2**-8, atol=1e-3)


def test_bf16_moment_option_and_float64_params():
    W = torch.nn.Parameter(torch.randn(4, 16))
    W.grad = torch.randn_like(W)
    opt = GWTAdamW([W], moment_dtype="bfloat16")
    opt.step()
    assert opt.state[W]["exp_avg"].dtype == torch.bfloat16
    W64 = torch.nn.Parameter(torch.randn(4, 16, dtype=torch.float64))
    W64.grad = torch.randn_like(W64)
    opt64 = GWTAdamW([W64])
    opt64.step()
    assert opt64.state[W64]["exp_avg"].dtype == torch.float64


# ------------------------------------------------------------ state dict --- #


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_is_bitwise_exact(dtype):
    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5)).to(dtype)
        return m, GWTAdamW(m.parameters(), lr=1e-2, weight_decay=0.01, level=2)

    m_full, o_full = make()
    _train(m_full, o_full, 3, seed=1)
    _train(m_full, o_full, 3, seed=2)

    m_a, o_a = make()
    _train(m_a, o_a, 3, seed=1)
    buf = io.BytesIO()
    torch.save({"model": m_a.state_dict(), "opt": o_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    m_b, o_b = make()
    m_b.load_state_dict(ckpt["model"])
    o_b.load_state_dict(ckpt["opt"])
    for st_ in o_b.state.values():
        assert st_["exp_avg"].dtype == torch.float32  # not cast to the param dtype on load
    _train(m_b, o_b, 3, seed=2)
    for pa, pb in zip(m_full.parameters(), m_b.parameters()):
        assert torch.equal(pa, pb)


def test_old_checkpoints_without_new_keys_still_load():
    W = torch.nn.Parameter(torch.randn(4, 8))
    W.grad = torch.randn_like(W)
    opt = GWTAdamW([W])
    opt.step()
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["moment_dtype"]
    opt2 = GWTAdamW([W])
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["moment_dtype"] is None
    opt2.step()


def test_mismatched_checkpoint_is_rejected():
    W = torch.nn.Parameter(torch.randn(4, 8))
    opt = GWTAdamW([W])
    other = GWTAdamW([torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match="does not match"):
        opt.load_state_dict(other.state_dict())


# ------------------------------------------------------- torch.optim API --- #


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1.0}, "Invalid learning rate: -1.0"),
        ({"betas": (1.0, 0.999)}, "beta parameter at index 0: 1.0"),
        ({"betas": (0.9, -0.1)}, "beta parameter at index 1: -0.1"),
        ({"eps": -1e-8}, "Invalid epsilon value: -1e-08"),
        ({"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
        ({"level": -1}, "Invalid level: -1"),
        ({"level": 1.5}, "Invalid level: 1.5"),
        ({"wavelet": "nope"}, "unknown wavelet 'nope'"),
        ({"norm_growth_limit": 0.9}, "norm_growth_limit \\(gamma\\): 0.9"),
        ({"scale": 0.0}, "scale \\(alpha\\): 0.0"),
        ({"moment_dtype": "int4"}, "moment_dtype: 'int4'"),
    ],
)
def test_bad_hyperparameters_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GWTAdamW([torch.nn.Parameter(torch.randn(2, 2))], **kwargs)


def test_bad_values_in_added_param_group_raise():
    opt = GWTAdamW([torch.nn.Parameter(torch.randn(2, 4))])
    with pytest.raises(ValueError, match="Invalid level: -2"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, 2))], "level": -2})


def test_bad_impl_is_rejected():
    with pytest.raises(ValueError, match="impl must be one of"):
        GWTAdamW([torch.nn.Parameter(torch.randn(2, 2))], impl="cuda")
    with pytest.raises(TypeError):
        GWTAdamW([torch.nn.Parameter(torch.randn(2, 2))], 1e-3, (0.9, 0.99), 1e-8, 0.0, 2, "haar", 0.25, 1.01, None)


def test_closure_none_grads_schedulers_and_add_param_group():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(4, 8))
    frozen = torch.nn.Parameter(torch.randn(4, 8))
    opt = GWTAdamW([a, frozen], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = a.square().sum()
        loss.backward()
        return loss

    before = frozen.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert torch.equal(frozen, before) and frozen not in opt.state  # grad None: untouched

    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)

    extra = torch.nn.Parameter(torch.randn(3, 5))
    opt.add_param_group({"params": [extra], "level": 1, "lr": 0.01})
    g = opt.param_groups[-1]
    assert g["level"] == 1 and g["scale"] == 0.25 and g["wavelet"] == "haar"
    extra.grad = torch.randn_like(extra)
    opt.step()
    assert opt.state[extra]["exp_avg"].shape == (3, 3)


def test_gradient_accumulation_by_the_caller_equals_one_big_batch():
    torch.manual_seed(0)
    lin_a = torch.nn.Linear(8, 8, bias=False)
    lin_b = torch.nn.Linear(8, 8, bias=False)
    lin_b.load_state_dict(lin_a.state_dict())
    x = torch.randn(16, 8)
    oa, ob = GWTAdamW(lin_a.parameters(), lr=1e-2), GWTAdamW(lin_b.parameters(), lr=1e-2)
    lin_a(x).square().sum().backward()
    for chunk in x.split(4):
        lin_b(chunk).square().sum().backward()
    oa.step()
    ob.step()
    torch.testing.assert_close(lin_a.weight, lin_b.weight, rtol=1e-5, atol=1e-6)


def test_drop_in_on_model_parameters():
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    opt = GWTAdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 50, (4, 7))).logsumexp(-1).mean().backward()
    opt.step()
    assert len(opt.state) == 3


# ------------------------------------------------------- moment_dtype as torch writes it --- #


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float64", "int8"])
@pytest.mark.parametrize("family", ["GWTAdamW", "GWTMuon", "GWTAdamMini", "GWTAdafactor"])
def test_moment_dtype_takes_the_torch_dtype_of_each_name(family, name):
    import json

    import gwt_optim
    from gwt_optim.optim._backends import MOMENT_DTYPES

    cls = getattr(gwt_optim, family)
    as_torch = torch.int8 if name == "int8" else MOMENT_DTYPES[name]
    if name == "int8" and not cls._INT8_MOMENTS:
        with pytest.raises(ValueError, match="moment_dtype='int8' is not implemented"):
            cls([torch.nn.Parameter(torch.zeros(4, 8))], moment_dtype=as_torch)
        return
    runs = []
    for md in (name, as_torch):
        torch.manual_seed(0)
        W, V = torch.nn.Parameter(torch.randn(8, 32)), torch.nn.Parameter(torch.randn(8, 32))
        # in the constructor, and in a group of its own (the two paths that store it)
        opt = cls([{"params": [W]}, {"params": [V], "moment_dtype": md}], lr=1e-2, level=2, moment_dtype=md)
        for _ in range(2):
            W.grad, V.grad = torch.randn_like(W), torch.randn_like(V)
            opt.step()
        runs.append((W.detach().clone(), V.detach().clone(), opt.state_dict()))
    (W1, V1, sd1), (W2, V2, sd2) = runs
    assert torch.equal(W1, W2) and torch.equal(V1, V2)  # the same update, bit for bit
    # Saved by name: JSON-able groups, identical to the string's
    assert [g["moment_dtype"] for g in sd2["param_groups"]] == [name, name]
    assert json.dumps(sd2["param_groups"]) == json.dumps(sd1["param_groups"])
    buf = io.BytesIO()
    torch.save(sd2, buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)


def test_moment_dtype_refuses_a_torch_dtype_no_name_has():
    with pytest.raises(ValueError, match=r"Invalid moment_dtype: torch.float16 \(one of .*the torch dtype of one"):
        GWTAdamW([torch.nn.Parameter(torch.zeros(4, 8))], moment_dtype=torch.float16)
