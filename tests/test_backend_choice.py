"""Which backend each parameter takes, over the product of the options that
decide it (family, group options, weight and gradient dtype, level, moment
dtype, detail clip, a sharded parameter, ``compile``, ``impl``, wavelet,
shape), against the answers recorded before backend choice moved into one
function over declared capabilities (now :func:`gwt_optim.optim._dispatch.choose`).

``ANSWERS`` was written by this file's ``__main__`` from the commit before
that change (``PYTHONPATH=OLD/src python tests/test_backend_choice.py``), one
character per case in the order of :func:`cases`; ``LEGEND`` reads them.
Every answer without a backend must say why.

The ``"triton"`` cases run the Triton backend on CPU tensors with its launches
replaced (as tests/test_route.py does): what is checked is the choice, not
the kernels. A sharded parameter is a stand-in with DTensor's name and
``to_local`` (what the optimizer tests for), so no process group is needed;
tests/test_distributed.py runs real ones.
"""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
_NAMES = {F32: "f32", BF16: "bf16", F16: "f16", F64: "f64"}

SHAPES = {"2d": (8, 4096), "1d": (12,), "0d": ()}  # 4096 = 2^12 columns: level 12 is not capped
DTYPES = [(F32, F32), (F32, BF16), (BF16, BF16), (BF16, F32), (F16, F16), (F64, F64)]
MOMENTS = [None, "float32", "bfloat16", "int8"]
LEVELS = [0, 2, 12]  # 12: above the native bf16 bound (11) and Triton's (10)
CLIPS = [None, 0.5]
COMPILES = [None, False, True, "native", "triton"]
# The cases keep the ids their answers were recorded under, from the removed compile= option: each is
# the backend= it meant (True was "auto" with a failed build an error, which routes as "auto").
_BACKEND_OF = {None: "auto", False: "eager", True: "auto", "native": "native", "triton": "triton"}
# impl, then group options on top of GWT-AdamW's defaults
VARIANTS = {
    "default": ("fast", {}),
    "plain": ("fast", {"scale": 1.0, "norm_growth_limit": None}),  # level 0: plain AdamW
    "scaled": ("fast", {"scale": 1.0}),  # the limiter on
    "reference": ("reference", {}),
    "db2": ("fast", {"wavelet": "db2"}),
}


class DTensor:
    """What the optimizer tests for a sharded parameter: the name and ``to_local``."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def to_local(self) -> torch.Tensor:
        return self._t

    @property
    def ndim(self) -> int:
        return self._t.ndim

    @property
    def shape(self):
        return self._t.shape


def cases():
    """(id, family, impl, compile, group options, shape, weight dtype, gradient dtype, sharded)."""
    out = []
    for variant, shape, (wd, gd), md, level, clip, sharded, compile in itertools.product(
            VARIANTS, SHAPES, DTYPES, MOMENTS, LEVELS, CLIPS, (False, True), COMPILES):
        if shape == "0d" and (sharded or level or variant not in ("default", "plain")):
            continue
        # The full product for the defaults; the other variants change the
        # path's preconditions, not the backends' capabilities.
        if variant != "default" and (clip is not None or compile not in (None, False, "triton") or md not in
                                     (None, "int8") or (wd, gd) not in DTYPES[::2] or (sharded and variant != "plain")):
            continue
        impl, opts = VARIANTS[variant]
        group = {**opts, "level": level, "moment_dtype": md, "detail_clip": clip}
        cid = (f"adamw-{variant}-{shape}-{_NAMES[wd]}/{_NAMES[gd]}-m{md}-l{level}-c{clip}"
               f"-{'sharded' if sharded else 'local'}-{compile}")
        out.append((cid, "GWTAdamW", impl, compile, group, shape, wd, gd, sharded))
    for family, impl, shape, (wd, gd), level in itertools.product(
            ("GWTMuon", "GWTAdamMini", "GWTAdafactor"), ("fast", "reference"), ("2d", "1d"),
            [(F32, F32), (BF16, BF16)], (0, 2)):
        group = {"level": level}
        if family == "GWTMuon" and shape == "1d":
            group["use_muon"] = False
        out.append((f"{family}-{impl}-{shape}-{_NAMES[wd]}-l{level}", family, impl, None, group, shape, wd, gd, False))
    return out


def _triton_on_cpu(patch) -> None:
    from gwt_optim.optim import _dispatch, _triton

    for name in ("_launch_phase1", "_launch_limiter", "_launch_phase2"):
        patch(_triton, name, lambda *a, **k: None)
    patch(_dispatch.BACKENDS, "triton", lambda: _triton.TritonBackend(cpu=True), item=True)


def answers(select: bool = False):
    """(path, backend name, gradient dtype read, level) of each case, and,
    with ``select``, the Route that choose gives."""
    import gwt_optim
    from gwt_optim.optim._dispatch import choose
    from gwt_optim.optim.functional import step_level

    opts: dict = {}
    gen = torch.Generator().manual_seed(0)
    out = []
    for cid, family, impl, compile, group, shape, wd, gd, sharded in cases():
        key = (family, impl, compile)
        if key not in opts:
            kw = {"backend": _BACKEND_OF[compile]} if family == "GWTAdamW" else {}
            opts[key] = getattr(gwt_optim, family)([torch.nn.Parameter(torch.zeros(2, 4))], lr=1e-3, impl=impl, **kw)
        opt = opts[key]
        g = {**opt.defaults, **group}
        w = torch.randn(SHAPES[shape], generator=gen).to(wd)
        grad = torch.randn(SHAPES[shape], generator=gen).to(gd)
        r = choose(opt._kernels, g, w, grad, sharded, opt._rule_of(g).limited(g, w.ndim >= 2),
                   *step_level(w.shape, g["level"], g["scale"]))
        if r.backend is not None:
            path = "batched" if r.backend.capabilities.batched and not sharded else "fused"
        else:
            path = "plain" if r.level == 0 else "haar" if impl == "fast" and g["wavelet"] == "haar" else "reference"
        answer = (path, getattr(r.backend, "name", None), _NAMES[r.grad.dtype], r.level)
        out.append((cid, answer, r if select else None))
    return out


# One character per distinct answer: (path, backend, gradient dtype read, level).
LEGEND = {
    'A': ('plain', None, 'f32', 0),
    'B': ('batched', 'native', 'f32', 2),
    'C': ('haar', None, 'f32', 2),
    'D': ('batched', 'triton', 'f32', 2),
    'E': ('fused', 'native', 'f32', 2),
    'F': ('fused', 'triton', 'f32', 2),
    'G': ('batched', 'native', 'f32', 12),
    'H': ('haar', None, 'f32', 12),
    'I': ('fused', 'native', 'f32', 12),
    'J': ('batched', 'triton', 'bf16', 2),
    'K': ('fused', 'triton', 'bf16', 2),
    'L': ('batched', 'native', 'bf16', 2),
    'M': ('fused', 'native', 'bf16', 2),
    'N': ('batched', 'triton', 'f16', 2),
    'O': ('fused', 'triton', 'f16', 2),
    'P': ('plain', None, 'f64', 0),
    'Q': ('batched', 'native', 'f64', 2),
    'R': ('haar', None, 'f64', 2),
    'S': ('fused', 'native', 'f64', 2),
    'T': ('batched', 'native', 'f64', 12),
    'U': ('haar', None, 'f64', 12),
    'V': ('fused', 'native', 'f64', 12),
    'W': ('batched', 'fused_adamw', 'f32', 0),
    'X': ('batched', 'triton', 'f32', 0),
    'Y': ('batched', 'triton', 'bf16', 0),
    'Z': ('batched', 'native', 'bf16', 0),
    'a': ('batched', 'fused_adamw', 'bf16', 0),
    'b': ('batched', 'triton', 'f16', 0),
    'c': ('batched', 'fused_adamw', 'f64', 0),
    'd': ('reference', None, 'f32', 2),
    'e': ('reference', None, 'f32', 12),
}
ANSWERS = (
    'AAAAAAAAAAAAAAAAAAAABCBBDECEEFBCBBDECEEFGHGGHIHIIHGHGGHIHIIHAAAAAAAAAAAAAAAAAAAABCBBDECEEFBCBBDECEEF'
    'GHGGHIHIIHGHGGHIHIIHAAAAAAAAAAAAAAAAAAAACCCCDCCCCFCCCCDCCCCFHHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAA'
    'CCCCCCCCCCCCCCCCCCCCHHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAABCBBJECEEKBCBBJECEEKGHGGHIHIIHGHGGHIHIIH'
    'AAAAAAAAAAAAAAAAAAAABCBBJECEEKBCBBJECEEKGHGGHIHIIHGHGGHIHIIHAAAAAAAAAAAAAAAAAAAACCCCJCCCCKCCCCJCCCCK'
    'HHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAACCCCCCCCCCCCCCCCCCCCHHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAA'
    'LCLLJMCMMKLCLLJMCMMKHHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAALCLLJMCMMKLCLLJMCMMKHHHHHHHHHHHHHHHHHHHH'
    'AAAAAAAAAAAAAAAAAAAACCCCJCCCCKCCCCJCCCCKHHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAACCCCCCCCCCCCCCCCCCCC'
    'HHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAACCCCDCCCCFCCCCDCCCCFHHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAA'
    'CCCCDCCCCFCCCCDCCCCFHHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAACCCCDCCCCFCCCCDCCCCFHHHHHHHHHHHHHHHHHHHH'
    'AAAAAAAAAAAAAAAAAAAACCCCCCCCCCCCCCCCCCCCHHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAACCCCNCCCCOCCCCNCCCCO'
    'HHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAACCCCNCCCCOCCCCNCCCCOHHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAA'
    'CCCCNCCCCOCCCCNCCCCOHHHHHHHHHHHHHHHHHHHHAAAAAAAAAAAAAAAAAAAACCCCCCCCCCCCCCCCCCCCHHHHHHHHHHHHHHHHHHHH'
    'PPPPPPPPPPPPPPPPPPPPQRQQRSRSSRQRQQRSRSSRTUTTUVUVVUTUTTUVUVVUPPPPPPPPPPPPPPPPPPPPRRRRRRRRRRRRRRRRRRRR'
    'UUUUUUUUUUUUUUUUUUUUPPPPPPPPPPPPPPPPPPPPRRRRRRRRRRRRRRRRRRRRUUUUUUUUUUUUUUUUUUUUPPPPPPPPPPPPPPPPPPPP'
    'RRRRRRRRRRRRRRRRRRRRUUUUUUUUUUUUUUUUUUUUWAWWXAAAAAWAWWXAAAAAWAWWXAAAAAWAWWXAAAAAWAWWXAAAAAWAWWXAAAAA'
    'WAWWXAAAAAWAWWXAAAAAWAWWXAAAAAWAWWXAAAAAWAWWXAAAAAWAWWXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAA'
    'AAAAXAAAAAAAAAXAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAWAWWYAAAAAWAWWYAAAAA'
    'WAWWYAAAAAWAWWYAAAAAWAWWYAAAAAWAWWYAAAAAWAWWYAAAAAWAWWYAAAAAWAWWYAAAAAWAWWYAAAAAWAWWYAAAAAWAWWYAAAAA'
    'AAAAYAAAAAAAAAYAAAAAAAAAYAAAAAAAAAYAAAAAAAAAYAAAAAAAAAYAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA'
    'AAAAAAAAAAAAAAAAAAAAZAZZYAAAAAZAZZYAAAAAZAZZYAAAAAZAZZYAAAAAZAZZYAAAAAZAZZYAAAAAZAZZYAAAAAZAZZYAAAAA'
    'ZAZZYAAAAAZAZZYAAAAAZAZZYAAAAAZAZZYAAAAAaAaaYAAAAAaAaaYAAAAAaAaaYAAAAAaAaaYAAAAAaAaaYAAAAAaAaaYAAAAA'
    'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAA'
    'AAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAA'
    'AAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAXAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA'
    'AAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAA'
    'AAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAbAAAAAAAAAAAAAAAAAAAAAAAAA'
    'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAcPccPPPPPPcPccPPPPPPcPccPPPPPPcPccPPPPPPcPccPPPPPPcPccPPPPPP'
    'PPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPP'
    'PPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPAAAAAAAAAAAAAAAAAAAA'
    'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA'
    'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAPPPPPPPPPPPPPPPPPPPP'
    'PPPPPPPPPPPPPPPPPPPPWAXAAABCDECFGHHIHHAAAAAACCCCCCHHHHHHZAYAAALCJMCKHHHHHHAAAAAACCCCCCHHHHHHAAbAAACC'
    'NCCOHHHHHHAAAAAACCCCCCHHHHHHWAXAAAWAXAAAWAXAAAAAAAAAAAAAAAAAAAAAZAYAAAZAYAAAZAYAAAAAAAAAAAAAAAAAAAAA'
    'AAbAAAAAbAAAAAbAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAABCDGHHAAACCCHHHAAALCJHHHAAACCCHHHAAACCNHHHA'
    'AACCCHHHWAXWAXWAXAAAAAAAAAZAYZAYZAYAAAAAAAAAAAbAAbAAbAAAAAAAAAAAAdddeeeAAAdddeeeAAAdddeeeAAAdddeeeAA'
    'AdddeeeAAAdddeeeAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAdddeeeAAAdddeeeAAAdddeeeAAA'
    'dddeeeAAAdddeeeAAAdddeeeWAXWAXWAXAAAAAAAAAZAYZAYZAYAAAAAAAAAAAbAAbAAbAAAAAAAAAACACAAAAAdAdAAAAACACAA'
    'AAAdAdAAAAACACAAAAAdAdAAAA'
)


def _encode(found) -> tuple[dict, str]:
    legend: dict = {}
    codes = []
    for _, answer, _ in found:
        if answer not in legend.values():
            legend["ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"[len(legend)]] = answer
        codes.append(next(c for c, a in legend.items() if a == answer))
    return legend, "".join(codes)


@pytest.fixture
def on_cpu_triton(monkeypatch):
    pytest.importorskip("gwt_optim.optim._triton", exc_type=ImportError)
    from gwt_optim import _toolchain
    from gwt_optim.optim import _native

    try:
        _native.native_library()
    except _toolchain.KernelUnavailable:
        pytest.skip("no C compiler for the native kernels")

    def patch(obj, name, value, item=False):
        (monkeypatch.setitem if item else monkeypatch.setattr)(obj, name, value)

    _triton_on_cpu(patch)


def test_every_case_takes_the_backend_it_took_before(on_cpu_triton):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = answers(select=True)
    assert len(found) == len(ANSWERS)
    wrong = [(cid, LEGEND[code], answer) for (cid, answer, _), code in zip(found, ANSWERS) if LEGEND[code] != answer]
    assert not wrong, f"{len(wrong)} cases changed, e.g. (case, before, now): {wrong[:5]}"
    for cid, answer, choice in found:
        if choice.backend is None:
            assert isinstance(choice.reason, str) and choice.reason, cid
        else:
            assert choice.reason is None and choice.backend.name == answer[1], cid


def test_the_capability_table_is_what_the_kernels_take():
    from gwt_optim import _toolchain
    from gwt_optim.optim import _native, _torch_fused
    from gwt_optim.optim._backends import CAPABILITIES

    native = CAPABILITIES["native"]
    assert native.dtypes == {(w, w, _native._STATE_DTYPE[w]) for w in _native._DTYPE_SUFFIX}
    try:
        backend = _native.NativeBackend()
    except _toolchain.KernelUnavailable:
        pass
    else:  # the library's own bound on bf16 levels is the declared one
        assert backend.capabilities == native
    assert _torch_fused.FusedAdamWBackend.capabilities is CAPABILITIES["fused_adamw"]
    _triton = pytest.importorskip("gwt_optim.optim._triton", exc_type=ImportError)
    triton = CAPABILITIES["triton"]
    assert triton.dtypes == {(w, g, m) for w in _triton._KIND for g in _triton._KIND for m in _triton._MOMENT_KINDS}
    assert triton.levels == range(0, _triton.MAX_LEVEL + 1)
    assert _triton.TritonBackend(cpu=False).capabilities is triton
    assert _triton.TritonBackend(cpu=True).capabilities.devices == {"cuda", "cpu"}


def test_choose_answers_once_per_bucket(monkeypatch):
    """choose keeps its answer per bucket (the group's routing options, the
    device, dtypes, rank and layout): another parameter of the same bucket
    asks nothing again, another dtype or routing option does, and a failed
    backend makes every bucket ask again."""
    from gwt_optim import GWTAdamW
    from gwt_optim.optim._dispatch import choose

    params = [torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(6, 16)),
              torch.nn.Parameter(torch.randn(6, 16).double())]
    opt = GWTAdamW(params, backend="eager")
    kernels, group = opt._kernels, opt.param_groups[0]
    asked = []
    monkeypatch.setattr(kernels, "refusal", lambda g: asked.append(g) or "eager here")
    routes = [choose(kernels, group, p, torch.zeros_like(p), False, True, 2, 0.25) for p in params]
    assert len(asked) == 2 and {r.reason for r in routes} == {"eager here"} and len(kernels.routes) == 2
    group["detail_clip"] = None
    choose(kernels, group, params[0], torch.zeros_like(params[0]), False, True, 2, 0.25)
    assert len(asked) == 3

    class Failing:
        name = "native"

        def prepare(self, *args):
            raise RuntimeError("no compiler")

    with pytest.warns(RuntimeWarning, match="no compiler"):
        assert not kernels.prepare(Failing(), params[0], params[0], torch.float32, 2, True)
    assert not kernels.routes


def test_candidates_per_backend_device_and_level():
    from gwt_optim.optim._dispatch import candidates

    assert candidates("auto", "cuda", 2) == [("triton", True)]
    assert candidates("auto", "cuda", 0) == [("triton", False)]
    assert candidates("native", "cuda", 0) == []
    assert candidates("native", "cpu", 2) == [("native", True)]
    assert candidates("auto", "cpu", 2) == [("native", True)]
    assert candidates("auto", "cpu", 0) == [("fused_adamw", False), ("native", False)]
    assert candidates("triton", "cpu", 0) == [("triton", False)]
    assert candidates("auto", "mps", 2) == []


def test_the_backend_option():
    from gwt_optim import GWTAdamW

    p = torch.nn.Parameter(torch.zeros(2, 4))
    assert (GWTAdamW([p])._backend, GWTAdamW([p])._strict) == ("auto", False)
    for backend in ("auto", "eager", "native", "triton"):
        opt = GWTAdamW([p], backend=backend)
        assert (opt._backend, opt._strict) == (backend, backend in ("native", "triton"))
    with pytest.raises(ValueError, match="backend must be one of"):
        GWTAdamW([p], backend="cuda")


def test_no_capability_is_probed_with_getattr():
    import re
    from pathlib import Path

    import gwt_optim.optim as optim

    for path in Path(optim.__file__).parent.glob("*.py"):
        probe = r"(?:getattr|hasattr)\([^)]*[\"'](batched|detail_clip|step_buckets|invalidate|supports)[\"']"
        found = re.findall(probe, path.read_text())
        assert not found, (path.name, found)


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")

    def _patch(obj, name, value, item=False):
        if item:
            obj[name] = value
        else:
            setattr(obj, name, value)

    _triton_on_cpu(_patch)
    legend, codes = _encode(answers())
    print("LEGEND = {")
    for code, (path, backend, read, level) in legend.items():
        print(f"    {code!r}: ({path!r}, {backend!r}, {read!r}, {level}),")
    print("}")
    print("ANSWERS = (")
    for i in range(0, len(codes), 100):
        print(f"    {codes[i:i + 100]!r}")
    print(")")
    print(f"# {len(codes)} cases", file=sys.stderr)
