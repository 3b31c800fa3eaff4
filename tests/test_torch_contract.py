"""torch.optim's contract, for every family on every backend.

What PyTorch's generic optimizer tests (``test/test_optim.py``, the
``OptimizerInfo`` ones every torch optimizer passes) check, written here for
the GWT optimizers: any layout torch accepts (strided views, transposed and
channels_last weights and gradients), state dicts that round-trip equal and
load torch's older forms, ``deepcopy``, tensor learning rates, hooks,
closures, ``None`` and zero gradients, frozen and repeated parameters, and
``weights_only`` loads.

The oracle for a layout is the same optimizer on contiguous copies, eager:
a route that cannot take a layout must fall back to one that can, and no
kernel may read or write memory outside the tensor it was handed (the first
reproduction below wrote into the neighbouring column).

The Triton backend runs in Triton's interpreter, which must be on when Triton
is imported: :func:`test_triton_backend_in_the_interpreter` reruns this file's
Triton cases in a child process with ``TRITON_INTERPRET=1``. To run them
directly::

    TRITON_INTERPRET=1 GWT_CONTRACT_TRITON=1 python -m pytest -p no:xdist tests/test_torch_contract.py -k triton
"""

from __future__ import annotations

import copy
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon
from gwt_optim.optim import _dispatch

CHILD = os.environ.get("GWT_CONTRACT_TRITON") == "1"

# (family, backend): GWT-AdamW has fused kernels; the other families run
# eager (impl="fast", the Haar closed form) or the literal transform.
CASES = [
    ("adamw", "native"), ("adamw", "step_param"), ("adamw", "eager"), ("adamw", "reference"),
    ("muon", "default"), ("muon", "reference"),
    ("adam_mini", "default"), ("adam_mini", "reference"),
    ("adafactor", "default"), ("adafactor", "reference"),
]
if CHILD:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the Triton cases need TRITON_INTERPRET=1 from the start"
    CASES = [("adamw", "triton")]
IDS = [f"{f}-{b}" for f, b in CASES]

FAMILIES = {
    "adamw": (GWTAdamW, dict(weight_decay=0.1)),
    "muon": (GWTMuon, dict(ns_dtype="float32")),
    "adam_mini": (GWTAdamMini, dict(weight_decay=0.1)),
    "adafactor": (GWTAdafactor, dict(weight_decay=0.1)),
}


@pytest.fixture(autouse=True)
def _triton_on_cpu(monkeypatch):
    if CHILD:
        from gwt_optim.optim import _triton

        monkeypatch.setitem(_dispatch.BACKENDS, "triton", lambda: _triton.TritonBackend(chunk=64, cpu=True))


def _groups(family: str, params: list, level: int = 2) -> list[dict]:
    """One group, except GWT-Muon's: its matrices in a Muon group, the rest in an AdamW group."""
    if family != "muon":
        return [{"params": params, "level": level}]
    mats = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    return [g for g in ({"params": mats, "level": level}, {"params": rest, "use_muon": False, "level": 0})
            if g["params"]]


def make(case, params, *, lr=0.05, level=2, **kw):
    family, backend = case
    cls, defaults = FAMILIES[family]
    options = {**defaults, **kw}
    if backend == "reference":
        options["impl"] = "reference"
    elif backend == "eager" or backend == "oracle":
        options["backend"] = "eager"
    elif backend in ("native", "triton"):
        options["backend"] = backend
    return cls(_groups(family, params, level), lr=lr, **options)


def step(case, opt, closure=None):
    if case[1] == "step_param":  # as step_in_backward steps: one parameter at a time
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    opt.step_param(p, group)
        return closure() if closure is not None else None
    return opt.step(closure)


def _train(case, params, grads, steps=3, **kw):
    opt = make(case, params, **kw)
    for t in range(steps):
        for p, g in zip(params, grads):
            p.grad = g(t)
        step(case, opt)
    return opt


# ------------------------------------------------------------ layouts --- #


def _layouts():
    """(name, make weights, make gradients at step t): views and layouts torch optimizers take."""
    def r(*shape, seed=0):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    g_t = [r(8, 16, seed=1), r(16, 8, seed=2), r(8, 16, 3, 3, seed=3), r(6, 32, seed=4), r(12, seed=5)]

    def grad(i, fn=lambda g: g):
        return lambda t: fn(g_t[i] * (1 + t)).clone(memory_format=torch.preserve_format)

    return [
        # a column of a matrix: stride 2, the neighbouring column in between
        ("strided-vector", lambda: [r(12, 2)[:, 0]], [grad(4)]),
        # a (6, 16) slice of every other column of a (6, 32) matrix
        ("strided-matrix", lambda: [r(6, 32)[:, ::2]], [grad(3, lambda g: g[:, ::2])]),
        ("transposed-weight", lambda: [r(16, 8).t()], [grad(0)]),
        ("transposed-grad", lambda: [r(8, 16)], [grad(1, lambda g: g.t())]),
        ("channels-last-weight", lambda: [r(8, 16, 3, 3).to(memory_format=torch.channels_last)], [grad(2)]),
        ("channels-last-grad", lambda: [r(8, 16, 3, 3)],
         [grad(2, lambda g: g.contiguous(memory_format=torch.channels_last))]),
    ]


LAYOUTS = _layouts()


@pytest.mark.parametrize("level", [0, 2])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay[0] for lay in LAYOUTS])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_any_layout_steps_as_contiguous_tensors_do(case, layout, level):
    name, weights, grads = layout
    views = weights()
    # The whole storage behind each view, to see that nothing outside it moved.
    bases = [v._base if v._base is not None else v for v in views]
    before = [b.clone() for b in bases]
    params = [torch.nn.Parameter(v) for v in views]
    assert all(p.data_ptr() == v.data_ptr() for p, v in zip(params, views))
    _train(case, params, grads, level=level)

    oracle = [torch.nn.Parameter(v.contiguous()) for v in weights()]
    _train((case[0], "oracle"), oracle, [lambda t, g=g: g(t).contiguous() for g in grads], level=level)
    for p, want in zip(params, oracle):
        assert p.stride() == p.data.stride()  # the parameter is still the view it was
        torch.testing.assert_close(p.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    for p, base, old in zip(params, bases, before):
        outside = torch.ones(base.numel(), dtype=torch.bool)
        idx = torch.as_strided(torch.arange(base.numel()), p.shape, p.stride(), p.storage_offset() - base.storage_offset())
        outside[idx.flatten()] = False
        assert torch.equal(base.detach().flatten()[outside], old.flatten()[outside]), "memory outside the view changed"


def test_the_reported_reproduction_writes_only_its_column():
    base = torch.zeros(4, 2)
    p = torch.nn.Parameter(base[:, 0])
    p.grad = torch.ones(4)
    GWTAdamW([p], lr=0.1).step()
    torch.testing.assert_close(p.detach(), torch.full((4,), -0.1))
    assert torch.equal(base[:, 1], torch.zeros(4))


# ------------------------------------------------------- state dicts --- #


def _model_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((8, 16), (4, 12), (16,))]


def _grads(params, seed=1):
    gen = torch.Generator().manual_seed(seed)
    fixed = [torch.randn(p.shape, generator=gen) for p in params]
    return [lambda t, g=g: g * (1 + t) for g in fixed]


def _assert_same(a, b, path="state_dict"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _continue_equal(case, opt_a, params_a, opt_b, params_b, grads):
    for t in (5, 6):
        for pa, pb, g in zip(params_a, params_b, grads):
            pa.grad, pb.grad = g(t), g(t)
        step(case, opt_a)
        step(case, opt_b)
    for pa, pb in zip(params_a, params_b):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_dict_round_trips_equal_through_weights_only(case):
    params = _model_params()
    grads = _grads(params)
    opt = _train(case, params, grads)
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = make(case, params2)
    opt2.load_state_dict(loaded)
    _assert_same(opt2.state_dict(), sd)  # no key added on the way, no dtype changed
    # torch's implementation keywords are group keys, as in torch, and stay this process's choice.
    assert all(g["differentiable"] is False and g["fused"] is None for g in opt2.param_groups)
    _continue_equal(case, opt, params, opt2, params2, grads)
    _assert_same(opt2.state_dict(), opt.state_dict())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_older_state_dicts_load(case):
    """torch's older optimizers saved the step as a number, and no `differentiable` key."""
    params = _model_params()
    grads = _grads(params)
    opt = _train(case, params, grads)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = float(st["step"].item()) if len(sd["state"]) % 2 else int(st["step"].item())
    for g in sd["param_groups"]:
        g.pop("differentiable", None)
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = make(case, params2)
    opt2.load_state_dict(sd)
    for st in opt2.state.values():
        assert isinstance(st["step"], torch.Tensor) and st["step"].dtype == torch.float32
    _continue_equal(case, opt, params, opt2, params2, grads)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_deepcopy_is_an_equal_independent_optimizer(case):
    params = _model_params()
    grads = _grads(params)
    opt = _train(case, params, grads)
    clone = copy.deepcopy(opt)
    _assert_same(clone.state_dict(), opt.state_dict())
    assert clone.param_groups[0].keys() == opt.param_groups[0].keys()
    cloned_params = [p for g in clone.param_groups for p in g["params"]]
    own = [p for g in opt.param_groups for p in g["params"]]
    _continue_equal(case, opt, own, clone, cloned_params, grads)


# ------------------------------------------------- learning-rate types --- #


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_zero_dim_tensor_lr_steps_as_the_float(case):
    # Powers of two: the fp32 tensor holds the very number the float is.
    params_f, params_t = _model_params(), _model_params()
    grads = _grads(params_f)
    opt_f = _train(case, params_f, grads, lr=2.0**-6)
    opt_t = _train(case, params_t, grads, lr=torch.tensor(2.0**-6))
    for a, b in zip(params_f, params_t):
        assert torch.equal(a, b)
    for gf, gt in zip(opt_f.param_groups, opt_t.param_groups):
        assert isinstance(gt["lr"], torch.Tensor)
        gf["lr"] = 2.0**-5
        gt["lr"].fill_(2.0**-5)  # a scheduler writing into the tensor in place
    _continue_equal(case, opt_f, params_f, opt_t, params_t, grads)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_multi_element_tensor_lr_is_a_value_error(case):
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        make(case, _model_params(), lr=torch.tensor([0.01, 0.02]))


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(weight_decay=-0.1), dict(level=-1)],
                         ids=["lr", "weight_decay", "level"])
def test_bad_hyperparameters_are_value_errors(case, bad):
    with pytest.raises(ValueError):
        make(case, _model_params(), **bad)


# ------------------------------------------- hooks, closures, gradients --- #


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_hooks_run_around_step_and_state_dict(case):
    params = _model_params()
    opt = make(case, params)
    calls = []
    handles = [
        opt.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
        opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
        opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre")),
        opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd_post")),
        opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre")),
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post")),
    ]
    for p, g in zip(params, _grads(params)):
        p.grad = g(0)
    opt.step()  # the hooks wrap step() itself
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "sd_pre", "sd_post", "load_pre", "load_post"]
    for h in handles:
        h.remove()
    opt.step()
    assert len(calls) == 6


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_closure_is_called_once_with_grad_enabled_and_its_loss_returned(case):
    params = _model_params()
    opt = make(case, params)
    x = torch.randn(16)
    seen = []

    def closure():
        opt.zero_grad()
        seen.append(torch.is_grad_enabled())
        loss = sum((p.flatten()[:4] * x[:4]).sum() ** 2 for p in params)
        loss.backward()
        return loss

    loss = opt.step(closure) if case[1] != "step_param" else step(case, opt, closure)
    assert seen == [True] and isinstance(loss, torch.Tensor)
    assert all("step" in opt.state[p] for p in params) or case[1] == "step_param"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_none_and_zero_gradients_and_frozen_parameters(case):
    params = _model_params()
    frozen = torch.nn.Parameter(torch.randn(4, 12), requires_grad=False)
    before = [p.detach().clone() for p in params] + [frozen.detach().clone()]
    opt = make(case, params + [frozen])
    params[0].grad = None
    params[1].grad = torch.zeros_like(params[1])
    params[2].grad = torch.zeros_like(params[2])
    for _ in range(3):
        step(case, opt)
    assert torch.equal(params[0], before[0]) and params[0] not in opt.state
    assert torch.equal(frozen, before[3]) and frozen not in opt.state
    for p in params[1:]:
        assert torch.isfinite(p).all()
        assert opt.state[p]["step"].item() == 3


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_parameter_in_two_groups_is_a_value_error(case):
    p = _model_params()[0]
    cls, defaults = FAMILIES[case[0]]
    with pytest.raises(ValueError, match="more than one parameter group"):
        cls([{"params": [p]}, {"params": [p]}], lr=0.01, **defaults)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_zero_grad_sets_gradients_to_none(case):
    params = _model_params()
    opt = make(case, params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


# ---------------------------------------------------------- Triton --- #


@pytest.mark.slow
def test_triton_backend_in_the_interpreter():
    if CHILD:
        pytest.skip("this is the child run")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "GWT_CONTRACT_TRITON": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-rfE",
         str(Path(__file__).resolve()), "-k", "triton and not in_the_interpreter"],
        env=env, cwd=root, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"Triton contract cases failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout


# ------------------------------------------------- torch's error texts --- #


_ERRORS = {  # (ours, torch's, the text both raise)
    "adamw-betas": (GWTAdamW, torch.optim.AdamW, dict(betas=(0.9, torch.tensor(0.99))),
                    "betas must be either both floats or both Tensors"),
    "adam-mini-betas": (GWTAdamMini, torch.optim.Adam, dict(betas=(torch.tensor(0.9), 0.99)),
                        "betas must be either both floats or both Tensors"),
    "muon-adjust-lr": (GWTMuon, torch.optim.Muon, dict(adjust_lr_fn="arbitrary"),
                       "Adjust learning rate function arbitrary is not supported"),
    "adafactor-eps1": (GWTAdafactor, torch.optim.Adafactor, dict(eps=(-1e-30, 1e-3)),
                       "epsilon1 should be >= 0 but is: -1e-30"),
    "adafactor-d": (GWTAdafactor, torch.optim.Adafactor, dict(d=0.0), "Clipping threshold d should be >= 1 but is: 0.0"),
    "adafactor-beta2-decay": (GWTAdafactor, torch.optim.Adafactor, dict(beta2_decay=0.8),
                              "beta2_decay should be <= 0 but is: 0.8"),
}


@pytest.mark.parametrize("name", list(_ERRORS))
def test_bad_values_raise_torchs_value_error_text(name):
    """The texts torch's own optimizers raise for the same values (its generic test_errors matches them)."""
    ours, theirs, bad, message = _ERRORS[name]
    pattern = message.replace("(", r"\(").replace(")", r"\)")
    for cls in (theirs, ours):
        with pytest.raises(ValueError, match=pattern):
            cls([torch.nn.Parameter(torch.rand(2, 3))], **bad)
