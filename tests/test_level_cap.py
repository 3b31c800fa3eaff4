"""A weight whose last axis is too short for its group's level steps at the deepest level it fits
(functional.step_level): bit for bit as the same weight in a group of that level with alpha scaled by
2^((l_used - l)/2), in every family and on the eager and native paths; its state round-trips, the memory
estimate counts it, the optimizer says so once. Also torch's order of checks (hyperparameters before the
parameters) and the checks of a named parameter."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import gwt_optim
from gwt_optim.memory import estimate
from gwt_optim.optim import functional as F

SCALE = 0.25
FAMILIES = ["GWTAdamW", "GWTAdamMini", "GWTAdafactor", "GWTMuon"]


def _make(family, groups, **kw):
    cls = getattr(gwt_optim, family)
    extra = dict(head_dim=1) if family == "GWTAdamMini" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cap's advice: test_the_cap_is_said_once
        return cls(groups, **extra, **kw)


def _run(family, shape, level, scale, steps=4, backend=None, wavelet="haar", impl="fast"):
    gen = torch.Generator().manual_seed(0)
    W = torch.nn.Parameter(torch.randn(shape, generator=gen))
    params = [W]
    groups = [{"params": [W], "level": level, "scale": scale, "wavelet": wavelet}]
    if family != "GWTMuon":  # a vector in the same group: its own bucket (alpha 1) beside the weight's
        b = torch.nn.Parameter(torch.randn(shape[0], generator=gen))
        params.append(b)
        groups[0]["params"].append(b)
    kw = dict(impl=impl)
    if backend is not None:
        kw["backend"] = backend
    if family in ("GWTAdamW", "GWTAdamMini"):
        kw["norm_growth_limit"] = 1.01  # the limiter on: a capped weight keeps it
    opt = _make(family, groups, lr=1e-2, weight_decay=0.1, **kw)
    for t in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * (1 + t)
        opt.step()
    return params, opt


def _assert_same(a, b):
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    for x, y in zip(pa, pb):
        sa, sb = oa.state[x], ob.state[y]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape, level, used", [((6, 2), 3, 1), ((5, 1), 2, 0), ((2, 4, 1, 1), 2, 0)],
                         ids=["6x2-l3", "5x1-l2", "conv1x1-l2"])
def test_a_capped_weight_steps_as_at_the_level_used(family, shape, level, used):
    if family == "GWTMuon" and len(shape) != 2:
        pytest.skip("Muon groups take 2-D weights")
    assert F.step_level(shape, level, SCALE) == (used, SCALE * 2.0 ** ((used - level) / 2))
    backends = ["eager", "native"] if family == "GWTAdamW" else [None]
    for backend in backends:
        capped = _run(family, shape, level, SCALE, backend=backend)
        if backend == "native":  # level 1 runs in the kernels, at the capped weight's own alpha; level 0 eager
            assert set(capped[1]._kernels._backends) == ({"native"} if used else set())
        _assert_same(capped, _run(family, shape, used, SCALE * 2.0 ** ((used - level) / 2), backend=backend))
    if family == "GWTAdamW":  # the native kernels and the eager halves agree on the capped weight too
        a, b = _run(family, shape, level, SCALE, backend="native"), _run(family, shape, level, SCALE,
                                                                         backend="eager")
        for x, y in zip(a[0], b[0]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_the_functional_step_caps_as_the_optimizer():
    gen = torch.Generator().manual_seed(1)
    W0, G = torch.randn(6, 2, generator=gen, dtype=torch.float64), torch.randn(6, 2, generator=gen,
                                                                                   dtype=torch.float64)
    out = []
    for level, alpha in ((3, SCALE), (1, SCALE / 2)):
        W, M, V = W0.clone(), torch.zeros(6, 1, dtype=torch.float64), torch.zeros(6, 1, dtype=torch.float64)
        F.gwt_adamw(W, G, M, V, torch.zeros((), dtype=torch.float64), step=1, lr=1e-2, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.0, level=level, alpha=alpha, gamma=1.01, detail_clip=None)
        out.append(W)
    assert torch.equal(*out)


@pytest.mark.parametrize("wavelet, impl", [("haar", "fast"), ("db2", "reference")])
def test_a_capped_state_round_trips_with_weights_only(wavelet, impl):
    # db2's A_l at level 3 would be longer than at level 1: the saved-state check must expect level 1's shape.
    params, opt = _run("GWTAdamW", (6, 2), 3, SCALE, steps=2, wavelet=wavelet, impl=impl)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = _make("GWTAdamW", [{"params": twins, "level": 3, "scale": SCALE, "wavelet": wavelet}], lr=1e-2,
                  weight_decay=0.1, impl=impl, norm_growth_limit=1.01)
    other.load_state_dict(saved)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        other.step()
    _assert_same((params, opt), (twins, other))


def test_the_memory_estimate_counts_a_capped_weight_at_its_level():
    # The paper's split transforms the "mlp" matrices: a 1-column one (level 0 used), a 2-column one (level 1
    # used) and one the level fits; their state bytes as the optimizer holds them after a step.
    mlp = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Linear(2, 6), torch.nn.Linear(6, 64))
    model = torch.nn.ModuleDict({"mlp": mlp})
    est = estimate(model, "gwt-adamw", level=3)
    weights = {name: p for name, p in gwt_optim.split_params(model).transformed}
    assert list(weights) == ["mlp.0.weight", "mlp.1.weight", "mlp.2.weight"]
    opt = _make("GWTAdamW", [{"params": list(weights.values()), "level": 3}], lr=1e-2)
    for p in weights.values():
        p.grad = torch.ones_like(p)
    opt.step()
    assert [tuple(opt.state[p]["exp_avg"].shape) for p in weights.values()] == [(4, 1), (6, 1), (64, 1)]
    for name, p in weights.items():
        actual = sum(v.numel() * v.element_size() for v in opt.state[p].values())
        assert est.per_tensor[name] == actual, name


def test_the_cap_is_said_once():
    mats = [torch.nn.Parameter(torch.zeros(s)) for s in [(4, 1), (2, 4, 1, 1), (3, 2), (3, 64), (8, 0)]]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt = gwt_optim.GWTAdamW([{"params": mats[:2], "level": 2}, {"params": mats[2:], "level": 3}])
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(5, 1))], "level": 2})
        for p in opt.param_groups[0]["params"] + opt.param_groups[1]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()
    assert [str(w.message) for w in said] == [
        "GWTAdamW: the last axis of 3 weights is too short for the group's level; each steps at the deepest "
        "level it fits, ceil(log2 n), with alpha times 2^((level used - level)/2) (docs/algorithm.md): 2 from "
        "level 2 to 0 ((4, 1), (2, 4, 1, 1)); 1 from level 3 to 1 ((3, 2)). Said once per optimizer"]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fits = gwt_optim.GWTAdamW([{"params": [torch.nn.Parameter(torch.zeros(3, 64))], "level": 3}])
        fits.add_param_group({"params": [torch.nn.Parameter(torch.zeros(5, 1))], "level": 2})  # said here
        fits.add_param_group({"params": [torch.nn.Parameter(torch.zeros(5, 1))], "level": 2})  # not again
    assert len(said) == 1 and "the last axis of 1 weight is" in str(said[0].message)


# ---------------------------------------- torch's order of checks, named parameters


@pytest.mark.parametrize("family, kwargs, message", [
    ("GWTAdamW", dict(lr=torch.tensor([1e-3, 1e-3])), "Tensor lr must be 1-element"),
    ("GWTAdamW", dict(betas=(1.0, 0.0)), "Invalid beta parameter at index 0"),
    ("GWTAdamW", dict(weight_decay=-1), "Invalid weight_decay value"),
    ("GWTAdamMini", dict(lr=-1.0), "Invalid learning rate"),
    ("GWTAdafactor", dict(eps=(-1e-30, 1e-3)), "epsilon1"),
    ("GWTAdafactor", dict(d=0.0), "Clipping threshold d"),
    ("GWTAdafactor", dict(beta2_decay=0.8), "beta2_decay"),
    ("GWTMuon", dict(momentum=1.0), "Invalid momentum"),
])
def test_hyperparameters_are_checked_before_the_parameters(family, kwargs, message):
    # torch's error inputs pass params=None: the ValueError comes first, as torch's own optimizers raise it.
    with pytest.raises(ValueError, match=message):
        getattr(gwt_optim, family)(None, **kwargs)


@pytest.mark.parametrize("tensor, message", [
    (torch.zeros(2, 3, dtype=torch.complex64), "parameter 0 \\('w'\\) of group 0 \\(shape \\(2, 3\\)\\) is complex"),
    (torch.zeros(2, 3, dtype=torch.int64), "parameter 0 \\('w'\\) of group 0 .* is torch.int64"),
])
def test_a_named_parameter_is_checked_as_a_tensor(tensor, message):
    with pytest.raises(ValueError, match=message):
        gwt_optim.GWTAdamW([("w", tensor)])
    ok = torch.nn.Parameter(torch.zeros(2, 3))
    opt = gwt_optim.GWTAdamW([("w", ok)])  # torch's named-parameters form is taken
    assert opt.param_groups[0]["params"] == [ok]
