"""torch.compile around a GWT optimizer's step (issue 16).

torch's compiled-optimizer recipe, ``torch.compile(opt.step)``, traced the
step's Python (its plans, ``.item()`` reads, ctypes and Triton calls) and
trained silently wrong: step counts [11, 1] after six steps, a layer that
stopped moving. The step opts out of tracing instead, so a compiled caller
runs it eagerly: each case below must give eager's weights and state bit for
bit, and ``fullgraph=True`` must say that the step cannot be compiled.

``backend="eager"`` keeps these fast (Dynamo traces, nothing is generated);
it reproduced the wrong training on the old code as inductor did.
"""

from __future__ import annotations

import pytest
import torch

from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon

FAMILIES = [GWTAdamW, GWTMuon, GWTAdamMini, GWTAdafactor]
# Level 0 as the plain family (alpha 1, no limiter): for GWT-AdamW that is the
# batched torch._fused_adamw_ plan; level 2 on the default path is its native
# kernels' plan (with a C compiler), the eager path otherwise.
LEVELS = {"level0": dict(level=0, scale=1.0, norm_growth_limit=None), "level2": dict(level=2)}
VARIANTS = {"default": {}, "backend=eager": dict(backend="eager"), "reference": dict(impl="reference")}
STEPS = 6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's caches from another test would count as recompiles here."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layers(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 16, generator=gen) / 4) for _ in range(2)]


def _grads(t):
    gen = torch.Generator().manual_seed(100 + t)
    return [torch.randn(16, 16, generator=gen) for _ in range(2)]


def _train(family, kw, wrap, *, each=False):
    """Six steps of two 16x16 weights, stepped by ``wrap(opt.step)`` (or
    ``wrap(opt.step_param)`` on each weight); the weights and the state dict."""
    params = _layers()
    opt = family(params, lr=1e-2, **kw)
    step = wrap(opt.step_param if each else opt.step)
    for t in range(STEPS):
        for p, g in zip(params, _grads(t)):
            p.grad = g
        if each:
            for p in params:
                step(p)
        else:
            step()
    return params, opt.state_dict()


def _assert_same(got, want):
    (got_params, got_sd), (want_params, want_sd) = got, want
    for a, b in zip(got_params, want_params):
        assert torch.equal(a, b)
    assert [float(st["step"]) for st in got_sd["state"].values()] == [STEPS, STEPS]
    assert got_sd["state"].keys() == want_sd["state"].keys()
    for i, st in want_sd["state"].items():
        assert got_sd["state"][i].keys() == st.keys()
        for key, v in st.items():
            assert torch.equal(got_sd["state"][i][key], v), (i, key)


def _compiled(fn):
    return torch.compile(fn, backend="eager")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
def test_a_compiled_step_equals_eager(family, level, variant):
    kw = {**LEVELS[level], **VARIANTS[variant]}
    want = _train(family, kw, lambda fn: fn)
    # The old code also hit Dynamo's recompile limit (in _phase1): every call
    # after the first must reuse what the first compiled.
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _train(family, kw, _compiled)
    _assert_same(got, want)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
def test_a_compiled_step_param_equals_eager(family, level):
    kw = LEVELS[level]
    want = _train(family, kw, lambda fn: fn)
    _assert_same(_train(family, kw, _compiled, each=True), want)


@pytest.mark.parametrize("each", [False, True], ids=["step", "step_param"])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
def test_fullgraph_says_the_step_cannot_be_compiled(family, each):
    params = _layers()
    opt = family(params, lr=1e-2)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    before = [p.detach().clone() for p in params]
    fn = opt.step_param if each else opt.step
    args = (params[0],) if each else ()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(fn, backend="eager", fullgraph=True)(*args)
    message = str(info.value)
    assert "gwt-optim" in message and "cannot be compiled" in message
    assert "eagerly" in message and "compile the model, not the step" in message
    # Nothing ran; the same call, eager, still steps.
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state
    fn(*args)
    assert not torch.equal(params[0], before[0])
