"""torch.optim.AdamW's implementation keywords (``maximize``, ``foreach``,
``capturable``, ``differentiable``, ``fused``) on every GWT family: taken as
torch takes them (constructor keywords with torch's defaults, kept in the
defaults and every group, also read from groups as torchtitan passes them),
and held to the one rule of ``GWTOptimizer._check_torch_keywords``
(docs/families.md): mapped onto ``backend=`` where they ask for an
implementation GWT has, a one-line ``ValueError`` where they cannot hold.

The oracles: torch's own AdamW (its signature and defaults), and the same GWT
optimizer under the ``backend=`` a keyword maps to, bitwise.
"""

from __future__ import annotations

import copy
import inspect
import io
import warnings

import pytest
import torch

import gwt_optim.optim
from gwt_optim import GWTAdamW
from gwt_optim import _toolchain
from gwt_optim.optim import _dispatch, _native
from gwt_optim.optim._base import TORCH_KEYWORDS

FAMILIES = [getattr(gwt_optim.optim, name) for name in gwt_optim.optim.__all__]
EAGER_FAMILIES = [cls for cls in FAMILIES if cls is not GWTAdamW]  # no fused kernels
IDS = [cls.__name__ for cls in FAMILIES]


def _weights():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 16, generator=g)), torch.nn.Parameter(torch.randn(16, generator=g))]


def _groups(cls, params):
    """GWT-Muon's vector goes to an AdamW group; the others take one group."""
    if "use_muon" in inspect.signature(cls).parameters:
        return [{"params": params[:1]}, {"params": params[1:], "use_muon": False}]
    return [{"params": params}]


def _train(make, steps=3):
    params = _weights()
    opt = make(params)
    for t in range(steps):
        for p in params:
            p.grad = torch.sin(torch.arange(p.numel(), dtype=p.dtype) * (t + 1.5)).reshape(p.shape)
        opt.step()
    return opt, [p.detach().clone() for p in params]


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def native():
    try:
        _native.native_library()
    except _toolchain.KernelUnavailable as exc:
        pytest.skip(f"GWT-AdamW's CPU kernels cannot be built here: {exc}")


# ------------------------------------------------------- as torch takes them --- #


@pytest.mark.parametrize("cls", FAMILIES, ids=IDS)
def test_every_family_takes_torchs_keywords_with_torchs_defaults(cls):
    torch_sig = inspect.signature(torch.optim.AdamW).parameters
    ours = inspect.signature(cls).parameters
    assert {k: torch_sig[k].default for k in TORCH_KEYWORDS} == TORCH_KEYWORDS
    assert {k: ours[k].default for k in TORCH_KEYWORDS} == TORCH_KEYWORDS
    assert all(ours[k].kind is inspect.Parameter.KEYWORD_ONLY for k in TORCH_KEYWORDS)
    # Kept in the defaults and in every group, as torch's AdamW keeps them.
    torch_defaults = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]).defaults
    opt = cls(_groups(cls, _weights()))
    assert {k: opt.defaults[k] for k in TORCH_KEYWORDS} == {k: torch_defaults[k] for k in TORCH_KEYWORDS}
    assert all({k: g[k] for k in TORCH_KEYWORDS} == TORCH_KEYWORDS for g in opt.param_groups)


@pytest.mark.parametrize("cls", FAMILIES, ids=IDS)
def test_torchs_defaults_passed_explicitly_change_nothing(cls):
    _, plain = _train(lambda ps: cls(_groups(cls, ps), lr=1e-2))
    _, explicit = _train(lambda ps: cls(_groups(cls, ps), lr=1e-2, **TORCH_KEYWORDS))
    _same(plain, explicit)


# ------------------------------------------------------------- refused --- #


@pytest.mark.parametrize("cls", FAMILIES, ids=IDS)
@pytest.mark.parametrize("key", ["maximize", "capturable", "differentiable"])
def test_what_no_gwt_step_does_is_refused_in_one_line(cls, key):
    for where in ("constructor", "group"):
        groups = _groups(cls, _weights())
        kwargs = {key: True} if where == "constructor" else {}
        if where == "group":
            groups[0][key] = True
        with pytest.raises(ValueError, match=f"^{cls.__name__}: {key}=True is not supported: [^\n]+$"):
            cls(groups, **kwargs)


@pytest.mark.parametrize("cls", FAMILIES, ids=IDS)
def test_foreach_true_and_bad_values_are_refused(cls):
    params = _groups(cls, _weights())
    with pytest.raises(ValueError, match="no foreach .multi-tensor. step"):
        cls(params, foreach=True)
    with pytest.raises(ValueError, match="`fused` and `foreach` cannot be `True` together"):
        cls(params, fused=True, foreach=True)
    with pytest.raises(ValueError, match="fused must be None, False or True, got 'yes'"):
        cls(params, fused="yes")


def test_a_bare_tensor_is_still_torchs_to_refuse():
    # Reading the groups' requests must not iterate it (a 0-d tensor cannot be).
    for params in (torch.zeros(()), torch.zeros(3, 4)):
        with pytest.raises(TypeError, match="params argument given to the optimizer should be an iterable"):
            GWTAdamW(params, fused=False)


@pytest.mark.parametrize("cls", EAGER_FAMILIES, ids=lambda c: c.__name__)
def test_fused_true_is_refused_where_there_are_no_kernels(cls):
    with pytest.raises(ValueError, match=f"^{cls.__name__}: fused=True cannot hold: {cls.__name__} has no fused "
                                         "kernels; pass fused=None or False"):
        cls(_groups(cls, _weights()), fused=True)


@pytest.mark.parametrize("kwargs,why", [
    (dict(backend="eager"), "backend='eager' runs the eager path"),
    (dict(impl="reference"), "impl='reference' runs the eager path"),
    (dict(moment_dtype="int8"), "no backend reads int8 moments"),
])
def test_fused_true_is_refused_where_gwt_adamw_would_run_eager(kwargs, why):
    with pytest.raises(ValueError, match=f"fused=True cannot hold: {why}"):
        GWTAdamW(_weights(), fused=True, **kwargs)


def test_the_eager_loop_is_refused_under_a_named_backend():
    for kwargs in (dict(fused=False), dict(foreach=False)):
        with pytest.raises(ValueError, match="=False asks for the eager step, but this optimizer runs fused "
                                             "kernels .backend='native'."):
            GWTAdamW(_weights(), backend="native", **kwargs)


# ------------------------------------------------------------- mapped --- #


@pytest.mark.parametrize("kwargs", [dict(fused=False), dict(foreach=False), dict(fused=False, foreach=False)],
                         ids=["fused=False", "foreach=False", "both False"])
def test_the_eager_loop_is_backend_eager(kwargs):
    opt, got = _train(lambda ps: GWTAdamW(ps, lr=1e-2, **kwargs))
    assert opt._backend == "eager"
    _, want = _train(lambda ps: GWTAdamW(ps, lr=1e-2, backend="eager"))
    _same(got, want)


@pytest.mark.parametrize("cls", EAGER_FAMILIES, ids=lambda c: c.__name__)
def test_families_without_kernels_take_the_eager_loop_unchanged(cls):
    _, got = _train(lambda ps: cls(_groups(cls, ps), lr=1e-2, fused=False, foreach=False))
    _, want = _train(lambda ps: cls(_groups(cls, ps), lr=1e-2))
    _same(got, want)


def _native_fails(monkeypatch):
    def fail():
        raise _toolchain.KernelUnavailable("no C compiler (simulated)")

    monkeypatch.setitem(_dispatch.BACKENDS, "native", fail)


def test_fused_true_runs_the_kernels_and_a_failed_build_is_an_error(native, monkeypatch):
    opt, got = _train(lambda ps: GWTAdamW(ps, lr=1e-2, fused=True))
    assert (opt._backend, opt._strict) == ("auto", True)
    _, want = _train(lambda ps: GWTAdamW(ps, lr=1e-2))
    _same(got, want)
    _native_fails(monkeypatch)
    with pytest.raises(_toolchain.KernelUnavailable, match="simulated"):
        _train(lambda ps: GWTAdamW(ps, lr=1e-2, fused=True), steps=1)
    # Without the request: one warning, and the eager path.
    with pytest.warns(RuntimeWarning, match="using the eager path"):
        _train(lambda ps: GWTAdamW(ps, lr=1e-2), steps=1)


def test_group_keys_ask_as_torchtitan_passes_them(monkeypatch):
    """torchtitan 0.3.0 puts ``fused``/``foreach`` in every group, not in the constructor."""
    def groups(ps, **keys):
        return [{"params": ps[:1], **keys}, {"params": ps[1:], **keys}]

    opt, got = _train(lambda ps: GWTAdamW(groups(ps, fused=False, foreach=False), lr=1e-2))
    assert opt._backend == "eager"
    _, want = _train(lambda ps: GWTAdamW(groups(ps), lr=1e-2, backend="eager"))
    _same(got, want)
    opt = GWTAdamW(groups(_weights(), fused=True, foreach=False))
    assert (opt._backend, opt._strict) == ("auto", True)
    with pytest.raises(ValueError, match="fused=False asks for the eager step"):
        GWTAdamW([{"params": _weights()[:1], "fused": True}, {"params": _weights()[1:], "fused": False}])


def test_the_call_of_torchtitans_builder_builds():
    """The call that raised ``TypeError: ... unexpected keyword argument 'fused'`` (issue 53): keyword
    arguments as torchtitan's optimizer builder passes them to ``torch.optim.AdamW``."""
    for fused, foreach, backend in ((True, False, "auto"), (False, False, "eager"), (False, None, "eager")):
        opt = GWTAdamW([{"params": _weights()}], lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                       fused=fused, foreach=foreach)
        assert (opt._backend, opt._strict, opt.defaults["fused"]) == (backend, fused, fused)


def test_a_group_added_later_must_agree():
    opt = GWTAdamW(_weights()[:1], fused=False)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, 4))]})  # None asks for nothing
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, 4))], "foreach": False})
    with pytest.raises(ValueError, match="fused=True cannot hold: backend='eager'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, 4))], "fused": True})
    opt = GWTAdamW(_weights()[:1])
    with pytest.raises(ValueError, match="fused=False asks for the eager step"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, 4))], "fused": False})
    assert len(opt.param_groups) == 1


# ---------------------------------------------------------- state dicts --- #


def test_the_live_keywords_stay_when_a_state_dict_loads(native):
    """Each process chooses its implementation: a checkpoint's keywords do not
    replace the live ones (and torch never sees fused=True, which would move
    the step counts onto a GPU)."""
    opt, _ = _train(lambda ps: GWTAdamW(ps, lr=1e-2, fused=True))
    sd = opt.state_dict()
    assert all(g["fused"] is True for g in sd["param_groups"])
    fresh = GWTAdamW(_weights(), lr=1e-2, fused=False)
    fresh.load_state_dict(sd)
    assert all(g["fused"] is False for g in fresh.param_groups) and fresh._backend == "eager"
    assert all(st["step"].device.type == "cpu" and st["step"].dtype == torch.float32 for st in fresh.state.values())


@pytest.mark.parametrize("cls", FAMILIES, ids=IDS)
def test_state_dicts_and_pickles_from_before_the_keywords_load(cls):
    opt, params = _train(lambda ps: cls(_groups(cls, ps), lr=1e-2))
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        for k in TORCH_KEYWORDS:
            del g[k]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh = cls(_groups(cls, [torch.nn.Parameter(p.clone()) for p in params]), lr=1e-2)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    # An optimizer pickled before: torch's __setstate__ runs on defaults and groups without them.
    old = copy.deepcopy(opt)
    for d in (old.defaults, *old.param_groups):
        for k in TORCH_KEYWORDS:
            del d[k]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        revived = copy.deepcopy(old)
    assert {k: revived.defaults[k] for k in TORCH_KEYWORDS} == TORCH_KEYWORDS
    assert all({k: g[k] for k in TORCH_KEYWORDS} == TORCH_KEYWORDS for g in revived.param_groups)
