"""gwt_optim.optim.functional, the one statement of each update, against
independent oracles: a float64 NumPy/PyWavelets implementation of the paper's
steps (GWT-AdamW, GWT-Adam-mini, GWT-Muon), torch's AdamW, Muon and Adafactor
at level 0; and the optimizers' eager path, which calls its pieces, bit for
bit. The fast backends are tested against these functions in
tests/test_fast_path.py and tests/test_triton.py."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import pywt
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_runs as runs
from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon
from gwt_optim.optim import functional as F


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only contend on a loaded 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _problem(shape, steps, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), [rng.standard_normal(shape) * (1 + t) for t in range(steps)]


def _rows_dwt(G, level):
    """[A_l, D_l, ..., D_1] of each row, zero-padded as PyWavelets' mode="zero"."""
    n = G.shape[-1]
    rows = [pywt.wavedec(r, "haar", mode="zero", level=level) for r in G.reshape(-1, n)]
    return [np.stack([r[j] for r in rows]) for j in range(level + 1)]


def _rows_idwt(coeffs, n):
    return np.stack([pywt.waverec([c[k] for c in coeffs], "haar", mode="zero")[:n] for k in range(len(coeffs[0]))])


def _block_mean(A2, block, head_dim):
    """Adam's V (``"element"``) or Adam-mini's per-block mean of A_l^2, expanded over A_l."""
    if block == "element":
        return A2
    if block == "neuron":
        return np.broadcast_to(A2.mean(-1, keepdims=True), A2.shape)
    if block == "head":
        per_head = A2.reshape(-1, head_dim * A2.shape[-1]).mean(-1)
        return np.repeat(per_head, head_dim)[:, None] * np.ones_like(A2)
    return np.full_like(A2, A2.mean())  # "tensor"


def oracle_adam(W0, grads, *, lr, betas, eps, wd, level, alpha, gamma, clip=None, block="element", head_dim=None):
    """GWT-AdamW (``block="element"``) or GWT-Adam-mini in float64, per row with
    PyWavelets: docs/algorithm.md's steps 1-7, written without gwt_optim."""
    b1, b2 = betas
    W = W0.astype(np.float64).reshape(-1, W0.shape[-1]).copy()
    n = W.shape[-1]
    M = V = s = None
    for t, G in enumerate(grads, start=1):
        A, *details = _rows_dwt(G, level)
        M = (1 - b1) * A if M is None else b1 * M + (1 - b1) * A
        v_new = _block_mean(A * A, block, head_dim)
        V = (1 - b2) * v_new if V is None else b2 * V + (1 - b2) * v_new
        den = np.sqrt(V) + eps * math.sqrt(1 - b2**t)
        U = M / den
        r = 1.0
        if gamma is not None:
            norm = np.linalg.norm(U)
            r = max(norm / (s + 1e-8), gamma) / gamma if t > 1 else 1.0
            s = norm / r
        # D_l ... D_1, coarsest first: each den entry covers 2^i of level i's details
        normed = [D / np.repeat(den, 2**i, axis=-1)[:, : D.shape[-1]] for i, D in enumerate(details)]
        if clip is None:
            rec = _rows_idwt([U / r, *[D / r for D in normed]], n)
        else:
            coarse = _rows_idwt([U, *[np.zeros_like(D) for D in normed]], n)
            fine = _rows_idwt([np.zeros_like(U), *normed], n)
            rec = (coarse + np.clip(fine, -clip, clip)) / r
        W = W * (1 - lr * wd) - lr * math.sqrt(1 - b2**t) / (1 - b1**t) * alpha * rec
    return W.reshape(W0.shape)


def _level_used(shape, level):
    """The cap of docs/algorithm.md, written out: a row of n entries steps at most at ceil(log2 n)."""
    return min(level, math.ceil(math.log2(shape[-1])))


def _functional(runner, W0, grads, **kw):
    W, _ = runs.train(runner, torch.tensor(W0), [torch.tensor(g) for g in grads], **kw)
    return W.numpy()


# ------------------------------------------------------------ GWT-AdamW --- #


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(1, 1), (3, 17), (4, 37), (2, 3, 9), (5, 64), (1, 2, 2, 5)]),
    level=st.integers(1, 5),
    gamma=st.sampled_from([None, 1.01, 1.5]),
    wd=st.sampled_from([0.0, 0.05]),
    clip=st.sampled_from([None, 0.5, 0.1]),
    impl=st.sampled_from(["fast", "reference"]),
)
def test_gwt_adamw_is_the_float64_oracle_over_shapes(shape, level, gamma, wd, clip, impl):
    W0, grads = _problem(shape, 4, seed=level * 31 + shape[-1])
    kw = dict(lr=1e-2, eps=1e-8, level=level, norm_growth_limit=gamma, weight_decay=wd, detail_clip=clip)
    got = _functional(runs.AdamW, W0, grads, impl=impl, **kw)
    used = _level_used(shape, level)
    want = oracle_adam(W0, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=wd, level=used,
                       alpha=0.25 * 2.0 ** ((used - level) / 2), gamma=gamma, clip=clip)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from([(3, 17), (4, 37), (2, 3, 9), (5, 64)]),
    level=st.integers(1, 5),
    gamma=st.sampled_from([None, 1.01]),
    clip=st.sampled_from([None, 0.5]),
    impl=st.sampled_from(["fast", "reference"]),
    family=st.sampled_from(["adamw", "adam_mini"]),
)
def test_the_recipes_alpha_is_the_float64_oracle(shape, level, gamma, clip, impl, family):
    """The transfer rule, alpha = 2^(l/2) (groups.adamw_scale), in the functional statement of the families
    with an Adam normalizer, against the oracle at that alpha."""
    from gwt_optim.groups import adamw_scale

    W0, grads = _problem(shape, 4, seed=level * 7 + shape[-1])
    alpha = adamw_scale(level)
    kw = dict(lr=1e-2, eps=1e-8, level=level, norm_growth_limit=gamma, weight_decay=0.1, scale=alpha)
    block = "element" if family == "adamw" else "neuron"
    if family == "adamw":
        got = _functional(runs.AdamW, W0, grads, impl=impl, detail_clip=clip, **kw)
    else:  # GWT-Adam-mini keeps the paper's details: no clip
        clip = None
        got = _functional(runs.AdamMini, W0, grads, impl=impl, block=block, **kw)
    used = _level_used(shape, level)
    want = oracle_adam(W0, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.1, level=used,
                       alpha=adamw_scale(used), gamma=gamma, clip=clip, block=block)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(6, 10), (7,)])
def test_gwt_adamw_at_level0_is_torch_adamw(shape):
    W0, grads = _problem(shape, 6)
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)
    W = torch.nn.Parameter(torch.tensor(W0))
    ref = torch.optim.AdamW([W], foreach=False, **kw)
    for g in grads:
        W.grad = torch.tensor(g)
        ref.step()
    got, (run,) = runs.train(runs.AdamW, torch.tensor(W0), [torch.tensor(g) for g in grads], level=0, scale=1.0,
                             norm_growth_limit=None, **kw)
    torch.testing.assert_close(got, W.detach(), rtol=1e-12, atol=1e-14)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(run.state[key], ref.state[W][key], rtol=1e-13, atol=0)


# -------------------------------------------------------- GWT-Adam-mini --- #


@pytest.mark.parametrize("block, head_dim", [("neuron", None), ("head", 2), ("tensor", None), ("element", None)])
@pytest.mark.parametrize("level", [0, 1, 3])
def test_gwt_adam_mini_is_the_float64_oracle(block, head_dim, level):
    W0, grads = _problem((6, 21), 4, seed=level)
    kw = dict(lr=1e-2, eps=1e-8, weight_decay=0.1, level=level, norm_growth_limit=1.01)
    got = _functional(runs.AdamMini, W0, grads, block=block, head_dim=head_dim, **kw)
    want = oracle_adam(W0, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.1, level=level, alpha=0.25,
                       gamma=1.01, block=block, head_dim=head_dim)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------- GWT-Muon --- #


@pytest.mark.parametrize("shape, nesterov, adjust", [((24, 40), True, None), ((40, 24), False, "match_rms_adamw")])
def test_gwt_muon_at_level0_is_torch_muon_bit_for_bit(shape, nesterov, adjust):
    gen = torch.Generator().manual_seed(0)
    W0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(4)]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
    W = torch.nn.Parameter(W0.clone())
    ref = torch.optim.Muon([W], **kw)
    run = runs.Muon(W0.clone(), level=0, scale=1.0, **kw)
    for g in grads:
        W.grad = g.clone()
        ref.step()
        run.step(g.clone())
        assert torch.equal(run.W, W.detach())
    assert torch.equal(run.state["momentum_buffer"], ref.state[W]["momentum_buffer"])


@pytest.mark.parametrize("level, shape, alpha", [(1, (16, 30), 0.5), (2, (24, 37), 0.3), (3, (40, 16), 2.0)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_gwt_muon_is_the_float64_oracle(level, shape, alpha, nesterov):
    W0, grads = _problem(shape, 3, seed=level)
    mu, lr, wd = 0.9, 0.05, 0.01
    W, B = W0.copy(), None
    for G in grads:  # written with PyWavelets; Newton-Schulz itself is torch's (tests/test_muon.py)
        A, *details = _rows_dwt(G, level)
        B = (1 - mu) * A if B is None else mu * B + (1 - mu) * A
        X = _rows_idwt([(1 - mu) * A + mu * B if nesterov else B, *details], shape[-1])
        O = F.zeropower_via_newtonschulz(torch.tensor(X), dtype=torch.float64).numpy()
        W = W * (1 - lr * wd) - lr * math.sqrt(max(1.0, shape[0] / shape[1])) * alpha * O
    got = _functional(runs.Muon, W0, grads, lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov, level=level,
                      scale=alpha, ns_dtype="float64")
    np.testing.assert_allclose(got, W, rtol=1e-10, atol=1e-12)


def test_gwt_muon_applies_alpha_once_after_newton_schulz():
    # Newton-Schulz divides X by its norm: alpha scales the step linearly, in any precision.
    W0, grads = _problem((12, 20), 1)
    steps = [torch.tensor(W0) - torch.tensor(_functional(runs.Muon, W0, grads, lr=0.1, weight_decay=0.0,
                                                        scale=alpha, ns_dtype="float64"))
             for alpha in (1.0, 0.3)]
    torch.testing.assert_close(steps[1], 0.3 * steps[0], rtol=1e-12, atol=1e-15)


# -------------------------------------------------------- GWT-Adafactor --- #


@pytest.mark.parametrize("shape", [(12, 20), (30,)])
def test_gwt_adafactor_at_level0_is_torch_adafactor(shape):
    W0, grads = _problem(shape, 5)
    W = torch.nn.Parameter(torch.tensor(W0))
    ref = torch.optim.Adafactor([W], lr=1e-2, weight_decay=0.1, foreach=False)
    for g in grads:
        W.grad = torch.tensor(g) * 3.0
        ref.step()
    got, (run,) = runs.train(runs.Adafactor, torch.tensor(W0), [torch.tensor(g) * 3.0 for g in grads], lr=1e-2,
                             weight_decay=0.1, level=0, scale=1.0)
    # the update-clipping factor is folded into U here and into the step size in torch
    torch.testing.assert_close(got, W.detach(), rtol=1e-12, atol=1e-14)
    for key in ("row_var", "col_var", "variance"):
        if key in ref.state[W]:
            torch.testing.assert_close(run.state[key], ref.state[W][key], rtol=1e-13, atol=0)


# ------------------------------------ the eager path is these functions --- #

SHAPES = [(24, 32), (40,), (7, 12), (3, 5, 16)]


def _eager_vs_functional(make, runner, shapes, dtype, steps=4, **kw):
    gen = torch.Generator().manual_seed(0)
    W0 = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]
    grads[2][1].view(-1)[0] = float("nan")  # skipped on both sides, its step counted
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = make(params)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the skip's; counted below
            opt.step()
    want, ran = runs.train(runner, W0, grads, **kw)
    for p, w, run in zip(params, want, ran):
        assert torch.equal(p.detach(), w)
        for key, value in run.state.items():
            assert torch.equal(opt.state[p][key], value), key
        assert int(opt.state[p]["step"]) == run.t
    assert opt.nonfinite_skips == sum(run.skips for run in ran) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("clip", [0.5, None])
def test_gwt_adamw_eager_path_is_the_function(dtype, impl, clip):
    kw = dict(lr=1e-2, weight_decay=0.1, level=2, detail_clip=clip, impl=impl)
    _eager_vs_functional(lambda ps: GWTAdamW(ps, backend="eager", **kw), runs.AdamW, SHAPES, dtype, **kw)


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("block", ["neuron", "tensor"])
def test_gwt_adam_mini_eager_path_is_the_function(impl, block):
    kw = dict(lr=1e-2, weight_decay=0.1, level=2, block=block, impl=impl)
    _eager_vs_functional(lambda ps: GWTAdamMini(ps, **kw), runs.AdamMini, SHAPES, torch.float32, **kw)


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("beta1", [None, 0.9])
def test_gwt_adafactor_eager_path_is_the_function(impl, beta1):
    kw = dict(lr=1e-2, level=2, beta1=beta1, impl=impl)
    _eager_vs_functional(lambda ps: GWTAdafactor(ps, **kw), runs.Adafactor, SHAPES, torch.float32, **kw)


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("alpha", [0.25, 0.3])
def test_gwt_muon_eager_path_is_the_function(impl, alpha):
    kw = dict(lr=1e-2, level=2, scale=alpha, impl=impl, ns_dtype="float32")
    _eager_vs_functional(lambda ps: GWTMuon(ps, **kw), runs.Muon, [(24, 32), (16, 12), (8, 20)], torch.float32,
                         **kw)


def test_gwt_muon_adamw_groups_are_the_adamw_function():
    # Muon's defaults there: weight decay 0.1, no limiter, no clip.
    kw = dict(lr=1e-2, level=2, weight_decay=0.1, norm_growth_limit=None, detail_clip=None)
    _eager_vs_functional(lambda ps: GWTMuon([{"params": ps, "use_muon": False}], lr=1e-2, level=2),
                         runs.AdamW, SHAPES, torch.float32, **kw)
