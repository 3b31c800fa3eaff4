"""The seams of the fused kernels' modules (issue 17, item 3).

``gwt_optim._toolchain`` builds, caches and loads a C library and knows nothing
of what it computes; ``_native`` is the ctypes backend over ``_fused_cpu.c``;
``_fused`` is the protocol, torch's level-0 kernel and ``Kernels`` (the built
and failed backends), the facade the optimizers and tests import; the choice of
a backend is ``_backends.choose``. The lower modules never import the
higher ones. ``_family`` holds what the family modules share.
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
from gwt_optim.optim import _family, _fused, _native

OPTIM = Path(_fused.__file__).parent


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
    native = _imported("_native")
    assert not any("_fused" in name for name in native), native
    assert "gwt_optim._toolchain" in native
    assert _imported("_family") == set()  # the families import it; it imports none of them
    # The updates' one statement stands on the transform alone: no optimizer, no backend.
    assert _imported("functional") == {"gwt_optim", "gwt_optim.wavelets"}


def test_fused_is_the_facade_the_optimizers_and_tests_use():
    # One object under both names: a monkeypatch on _native reaches the backend.
    assert _fused.native_library is _native.native_library
    assert _fused.NativeBackend is _native.NativeBackend
    assert _fused.KernelUnavailable is _toolchain.KernelUnavailable
    assert _fused.BACKENDS["native"] is _native.NativeBackend
    for name in ("backend_option", "all_finite", "FusedBackend", "Kernels"):
        assert callable(getattr(_fused, name)), name
    for name in _fused.__all__:
        assert hasattr(_fused, name), name


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
        "import sys, gwt_optim, gwt_optim.optim._fused as f\n"
        "assert 'triton' not in sys.modules, 'imported triton'\n"
        "assert f.native_library.cache_info().currsize == 0, 'built the kernels'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(OPTIM.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
