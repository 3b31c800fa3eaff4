"""The seams of the fused kernels' modules (issue 17, item 3; issue 55).

``gwt_optim._toolchain`` builds, caches and loads a C library and knows nothing
of what it computes; ``_backends`` holds what the backends share with their
caller (capabilities, the protocol, buckets, the pointer check); the backends
(``_torch_fused``, ``_native`` over ``_fused_cpu.c``, ``_triton``) import only
it; ``_dispatch`` alone builds them and picks one per parameter. The lower
modules never import the higher ones. ``_family`` holds what the family
modules share.
"""

from __future__ import annotations

import ast
import ctypes
import inspect
import os
import warnings
from pathlib import Path

import pytest
import torch

import gwt_optim
from gwt_optim import GWTMuon
from gwt_optim import _toolchain
from gwt_optim.optim import _backends, _dispatch, _family, _native, _torch_fused

OPTIM = Path(_dispatch.__file__).parent


def _imported(module: str, folder: Path = OPTIM) -> set[str]:
    """The gwt_optim modules a file of gwt_optim.optim (or of ``folder``)
    imports, at any depth in the file (lazy imports count: they close loops too)."""
    tree = ast.parse((folder / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gwt_optim"):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("gwt_optim"))
    return names


def test_the_lower_modules_do_not_import_the_higher_ones():
    # The build toolchain sits beside the cache rule, below the optimizers (as torch.utils.cpp_extension).
    toolchain = _imported("_toolchain", OPTIM.parent)
    assert toolchain == {"gwt_optim", "gwt_optim._cache"}  # only the one cache rule
    assert "gwt_optim._toolchain" in _imported("_native")
    assert _imported("_family") == set()  # the families import it; it imports none of them
    # The updates' one statement stands on the transform alone: no optimizer, no backend.
    assert _imported("functional") == {"gwt_optim", "gwt_optim.wavelets"}


def _optim_modules(names: set[str]) -> set[str]:
    """The modules of gwt_optim.optim among an _imported set."""
    return {n.split(".")[2] for n in names if n.startswith("gwt_optim.optim.")} & {p.stem for p in OPTIM.glob("*.py")}


BACKEND_MODULES = ("_torch_fused", "_native", "_triton")


def test_the_backends_import_the_shared_types_only_and_the_dispatcher_alone_imports_them():
    # A backend knows the shared types and the update's scalars, never the dispatcher nor another backend.
    for backend in BACKEND_MODULES:
        assert _optim_modules(_imported(backend)) <= {"_backends", "functional"}, backend
    # The shared types import no backend and no dispatcher: the backends and the dispatcher stand on them.
    assert _optim_modules(_imported("_backends")) == {"_family", "functional"}
    importers = {p.stem for p in OPTIM.glob("*.py")
                 if p.stem not in BACKEND_MODULES and _optim_modules(_imported(p.stem)) & set(BACKEND_MODULES)}
    assert importers == {"_dispatch"}
    # The backends the dispatcher builds are the backend modules' classes, each declaring its
    # entry of the one capability table.
    assert _dispatch.BACKENDS["native"] is _native.NativeBackend
    assert _native.NativeBackend.capabilities is _backends.CAPABILITIES["native"]
    assert _torch_fused.FusedAdamWBackend.capabilities is _backends.CAPABILITIES["fused_adamw"]
    assert set(_backends.CAPABILITIES) == {"fused_adamw", *_dispatch.BACKENDS}


def test_native_library_is_the_toolchain_with_the_kernels_interface(monkeypatch):
    calls = []

    def load_library(source, stem, bind):
        calls.append((source, stem, bind))
        return "lib"

    monkeypatch.setattr(_toolchain, "load_library", load_library)
    assert _native.native_library.__wrapped__() == "lib"
    # The stem names the cached files (adamw_haar_<key>.sha256): a new stem
    # would orphan every cache.
    assert calls == [(OPTIM / "_fused_cpu.c", "adamw_haar", _native._bind)]


_TOY_C = "int toy_answer(void) { return 42; }\n"


def _toy_bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.toy_answer.restype = ctypes.c_int
    lib.toy_answer.argtypes = []
    return lib


@pytest.fixture
def toy(tmp_path, monkeypatch) -> Path:
    try:
        _toolchain._compiler()
    except _toolchain.KernelUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")
    if not _toolchain._cache.SECURE_OPEN:
        pytest.skip("the kernel cache needs POSIX openat and O_NOFOLLOW")
    monkeypatch.setattr(_toolchain, "_FLAG_SETS", (["-O0"],))  # what is cached, not how fast
    monkeypatch.setenv("GWT_OPTIM_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "toy.c"
    source.write_text(_TOY_C)
    return source


def test_the_toolchain_builds_caches_and_binds_any_source(toy, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a private cache: no fallback warning
        lib = _toolchain.load_library(toy, "toy", _toy_bind)
    assert lib.toy_answer() == 42
    kernels = tmp_path / "cache" / "kernels"
    (pointer,) = kernels.glob("toy_*.sha256")
    assert len(list(kernels.glob("toy_*.so"))) == 1
    # A second load reads the cache: the build is never run again.
    mtime = pointer.stat().st_mtime_ns
    again = _toolchain.load_library(toy, "toy", _toy_bind)
    assert again.toy_answer() == 42 and again._name == lib._name
    assert pointer.stat().st_mtime_ns == mtime
    # Another source is another key beside it.
    toy.write_text(_TOY_C.replace("42", "43"))
    assert _toolchain.load_library(toy, "toy", _toy_bind).toy_answer() == 43
    assert len(list(kernels.glob("toy_*.sha256"))) == 2


def test_a_library_bind_refuses_is_rebuilt_once_then_unavailable(toy):
    def bind(lib):
        return lib.missing_symbol  # AttributeError, as a stale library's bind raises

    with pytest.raises(_toolchain.KernelUnavailable, match="failed after a rebuild"):
        _toolchain.load_library(toy, "toy", bind)


# GWTOptimizer's own keys, which it puts first in every group.
_BASE_KEYS = ["level", "wavelet", "scale", "norm_growth_limit", "moment_dtype", "detail_clip"]
FAMILIES = [getattr(gwt_optim.optim, name) for name in gwt_optim.optim.__all__]


@pytest.mark.parametrize("cls", FAMILIES, ids=lambda cls: cls.__name__)
def test_a_family_lists_its_own_keys_in_the_order_of_its_signature(cls):
    # Groups take their keys in this order (after GWTOptimizer's), and so does
    # a saved state_dict: splicing in transform_defaults moved none of them.
    assert list(_family.transform_defaults(2, "haar", 0.25, None)) == _BASE_KEYS[:4]
    defaults = cls([torch.nn.Parameter(torch.zeros(2, 4))]).defaults
    assert set(_BASE_KEYS) <= set(defaults)
    own = [k for k in defaults if k not in _BASE_KEYS]
    signature = [k for k in inspect.signature(cls).parameters if k not in ("params", "impl", "backend")]
    assert own == [k for k in signature if k not in _BASE_KEYS]


def test_transform_defaults_carry_the_arguments():
    assert _family.transform_defaults(3, "db2", 0.5, 1.01) == dict(
        level=3, wavelet="db2", scale=0.5, norm_growth_limit=1.01
    )
    opt = GWTMuon([torch.nn.Parameter(torch.zeros(2, 4))], level=1, wavelet="db2", scale=0.5, norm_growth_limit=1.1)
    g = opt.param_groups[0]
    assert (g["level"], g["wavelet"], g["scale"], g["norm_growth_limit"]) == (1, "db2", 0.5, 1.1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a fresh interpreter per check")
def test_importing_the_package_builds_and_imports_no_backend():
    import subprocess
    import sys

    code = (
        "import sys, gwt_optim, gwt_optim.optim._native as f\n"
        "assert 'triton' not in sys.modules, 'imported triton'\n"
        "assert f.native_library.cache_info().currsize == 0, 'built the kernels'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(OPTIM.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
