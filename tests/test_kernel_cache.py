"""The native kernels' on-disk cache (issue 16): what is checked is what is
loaded. No symbolic link anywhere from the cache root down, every file opened
through the checked directory's descriptor, the loaded bytes the ones whose
digest was checked, builds published inside that directory; and a cache that
cannot be written still gives working kernels (built for this process only,
one warning). Owner and mode checks of folders and files are here too; the
cache's other behaviour (rebuilds, the default folder) is in
test_reliability.py."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from gwt_optim import GWTAdamW
from gwt_optim import _toolchain
from gwt_optim.optim import _native

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX ownership and permissions")

# A library someone else planted: its constructor runs at dlopen, before any
# symbol is looked up, and leaves a file behind as proof.
_PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("GWT_TEST_PLANTED");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) { fputs("ran\n", f); fclose(f); }
}
"""


def _cc() -> str:
    try:
        return _toolchain._compiler()
    except _toolchain.KernelUnavailable as exc:
        pytest.skip(f"no C compiler for the native kernels: {exc}")


# These tests are about what is refused, published and loaded, not about
# the kernels' speed: unoptimized builds take a tenth of the time.
_QUICK_FLAGS = (["-O0"],)


@pytest.fixture(autouse=True)
def quick_builds(monkeypatch):
    monkeypatch.setattr(_toolchain, "_FLAG_SETS", _QUICK_FLAGS)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A kernels folder with a verified build, copied into each test's cache
    (one build for the module instead of one per test)."""
    cache = tmp_path_factory.mktemp("seed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_toolchain, "_FLAG_SETS", _QUICK_FLAGS)
        mp.setenv("GWT_OPTIM_CACHE", str(cache))
        try:
            _native.native_library.__wrapped__()
        except _toolchain.KernelUnavailable as exc:
            pytest.skip(f"no C compiler for the native kernels: {exc}")
    return cache / "kernels"


def _seeded(built: Path, cache: Path) -> Path:
    kernels = cache / "kernels"
    shutil.copytree(built, kernels)
    kernels.chmod(0o700)
    return kernels


def _library(kernels: Path) -> tuple[Path, str]:
    """The cached library the digest file names, and that digest."""
    (pointer,) = kernels.glob("adamw_haar_*.sha256")
    digest = pointer.read_text().strip()
    return _toolchain._library_path(kernels, pointer.name[: -len(".sha256")], digest), digest


@pytest.fixture
def planted(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A planted library and the file its constructor writes if it ever loads."""
    src = tmp_path / "planted.c"
    src.write_text(_PLANTED_C)
    lib = tmp_path / "planted.so"
    proc = subprocess.run([_cc(), "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    marker = tmp_path / "planted-ran"
    monkeypatch.setenv("GWT_TEST_PLANTED", str(marker))
    return lib, marker


def _load(monkeypatch, cache: Path):
    """native_library() for ``$GWT_OPTIM_CACHE=cache``: the library and the RuntimeWarnings."""
    monkeypatch.setenv("GWT_OPTIM_CACHE", str(cache))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = _native.native_library.__wrapped__()
    assert lib.gwt_bf16_max_level() == 11  # the real kernels, bound and callable
    return lib, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _assert_private(directory: Path) -> None:
    st = directory.stat()
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


# ---------------------------------------------------------------- links --- #


@pytest.mark.parametrize("where", ["kernels", "root"])
def test_a_symlink_on_the_cache_path_is_refused(monkeypatch, tmp_path, where):
    # The case: $GWT_OPTIM_CACHE in a folder others can write, its
    # kernels/ entry a link to this user's private folder; the link could be
    # flipped to their folder between any check and the load.
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    if where == "kernels":
        cache = tmp_path / "shared"
        cache.mkdir()
        cache.chmod(0o777)
        (cache / "kernels").symlink_to(mine)
        shown = cache / "kernels"
    else:
        cache = tmp_path / "cache"
        cache.symlink_to(mine)
        shown = cache
    lib, warned = _load(monkeypatch, cache)
    assert len(warned) == 1 and f"{shown} is a symbolic link" in warned[0], warned
    assert "for this process only" in warned[0]
    assert mine not in Path(lib._name).parents and cache not in Path(lib._name).parents
    _assert_private(Path(lib._name).parent)
    assert list(mine.iterdir()) == []  # nothing written through the link


def test_a_symlinked_library_file_is_rebuilt_not_followed(monkeypatch, tmp_path, built, planted):
    planted_lib, marker = planted
    kernels = _seeded(built, tmp_path / "cache")
    (pointer,) = kernels.glob("adamw_haar_*.sha256")
    # a link named by its target's digest, which the digest file names: only the link gives it away
    digest = hashlib.sha256(planted_lib.read_bytes()).hexdigest()
    _toolchain._library_path(kernels, pointer.name[: -len(".sha256")], digest).symlink_to(planted_lib)
    pointer.write_text(digest + "\n")
    lib, warned = _load(monkeypatch, tmp_path / "cache")
    assert not marker.exists(), "the library behind the link was loaded"
    assert warned == []
    rebuilt, digest = _library(kernels)
    assert Path(lib._name) == rebuilt and not rebuilt.is_symlink()
    assert hashlib.sha256(rebuilt.read_bytes()).hexdigest() == digest


def test_a_symlink_above_the_cache_root_is_resolved_once(monkeypatch, tmp_path, built):
    real = tmp_path / "real"
    _seeded(built, real / "cache")
    (tmp_path / "link").symlink_to(real)
    lib, warned = _load(monkeypatch, tmp_path / "link" / "cache")
    assert warned == []
    assert Path(lib._name).parent == real / "cache" / "kernels"  # where it really is, as checked


# ------------------------------------------------------ check, then load --- #


def test_a_library_swapped_after_its_check_is_not_loaded(monkeypatch, tmp_path, built, planted):
    planted_lib, marker = planted
    kernels = _seeded(built, tmp_path / "cache")
    path, digest = _library(kernels)
    real_sha256 = hashlib.sha256
    swapped = []

    class SwapOnceChecked:
        """sha256 that, the moment the cached library's digest has been
        computed (its check passed), replaces the file at its path."""

        def __init__(self, data=b""):
            self._h = real_sha256(data)

        def update(self, data):
            self._h.update(data)

        def hexdigest(self):
            out = self._h.hexdigest()
            if out == digest and not swapped:
                os.replace(shutil.copy(planted_lib, kernels / "incoming.so"), path)
                swapped.append(path)
            return out

        def digest(self):
            return self._h.digest()

    monkeypatch.setattr(hashlib, "sha256", SwapOnceChecked)
    try:
        lib, warned = _load(monkeypatch, tmp_path / "cache")
    finally:
        assert not marker.exists(), "the file swapped in after the check was loaded"
    assert swapped, "the library was never checked"
    assert warned == [] and Path(lib._name) == path


def test_a_build_is_published_into_the_checked_directory(monkeypatch, tmp_path):
    """The kernels folder is swapped for a link while the compiler runs: the
    build still lands in (and loads from) the folder that was checked."""
    cc = _cc()
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    real_run = subprocess.run
    swapped = []

    def run(cmd, *args, **kwargs):
        out = real_run(cmd, *args, **kwargs)
        if cmd[0] == cc and "-shared" in cmd and not swapped:
            os.rename(cache / "kernels", cache / "moved")
            (cache / "kernels").symlink_to(elsewhere)
            swapped.append(cmd)
        return out

    monkeypatch.setattr(_toolchain.subprocess, "run", run)
    lib, warned = _load(monkeypatch, cache)
    assert swapped and warned == []
    assert list(elsewhere.iterdir()) == []
    path, digest = _library(cache / "moved")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert Path(lib._name).name == path.name


# ------------------------------------------------------- owner and mode --- #


@pytest.mark.parametrize("how", ["group-writable", "foreign owner"])
def test_a_library_file_others_could_write_is_rebuilt_not_loaded(monkeypatch, tmp_path, built, how):
    kernels = _seeded(built, tmp_path / "cache")
    path, _ = _library(kernels)
    if how == "group-writable":
        path.chmod(0o775)
    else:
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(path, 65534, -1)
    lib, warned = _load(monkeypatch, tmp_path / "cache")
    assert warned == []
    st = path.lstat()  # replaced by a fresh build of this user's
    assert st.st_uid == os.getuid() and not st.st_mode & 0o022
    assert Path(lib._name) == path


@pytest.mark.parametrize("how", ["world-writable", "foreign owner"])
def test_a_kernels_folder_others_could_write_is_not_used(monkeypatch, tmp_path, built, how):
    kernels = _seeded(built, tmp_path / "cache")
    if how == "world-writable":
        kernels.chmod(0o777)
        reason = "other users can write to it (mode 0o777)"
    else:
        if os.geteuid() != 0:
            pytest.skip("only root can give a folder to another user")
        os.chown(kernels, 65534, -1)
        reason = "it belongs to uid 65534"
    lib, warned = _load(monkeypatch, tmp_path / "cache")
    assert len(warned) == 1 and reason in warned[0], warned
    assert kernels not in Path(lib._name).parents
    _assert_private(Path(lib._name).parent)


# ------------------------------------------------------------ read-only --- #


def _make_read_only(directory: Path) -> str:
    """Make ``directory`` refuse new entries for this user, truly: its mode
    for others, the immutable attribute for root (who ignores modes)."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        how = "chmod"
    else:
        if not shutil.which("chattr"):
            pytest.skip("no chattr to make a folder read-only for root")
        proc = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"this file system has no immutable attribute: {proc.stderr.strip()}")
        how = "chattr"
    try:
        (directory / "probe").touch()
    except OSError:
        return how
    _undo_read_only(directory, how)
    pytest.skip("the folder stayed writable")


def _undo_read_only(directory: Path, how: str) -> None:
    if how == "chmod":
        directory.chmod(0o700)
    else:
        subprocess.run(["chattr", "-i", str(directory)], check=True)
    (directory / "probe").unlink(missing_ok=True)


def test_an_empty_read_only_kernel_cache_builds_privately_with_one_warning(monkeypatch, tmp_path):
    _cc()
    cache = tmp_path / "cache"
    kernels = cache / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    how = _make_read_only(kernels)
    monkeypatch.setenv("GWT_OPTIM_CACHE", str(cache))
    gen = torch.Generator().manual_seed(0)
    W0 = torch.randn(8, 32, generator=gen, dtype=torch.float64)
    grads = [torch.randn(8, 32, generator=gen, dtype=torch.float64) for _ in range(2)]

    def train(**kw):
        W = torch.nn.Parameter(W0.clone())
        opt = GWTAdamW([W], lr=1e-2, **kw)
        for g in grads:
            W.grad = g.clone()
            opt.step()
        return W.detach(), opt

    _native.native_library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            native, opt = train(backend="native")  # a failed build raises: so it built
    finally:
        _native.native_library.cache_clear()
        _undo_read_only(kernels, how)
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(warned) == 1, warned
    assert f"not caching the fused CPU kernels in {kernels} (it cannot be written" in warned[0]
    assert "for this process only" in warned[0] and "\n" not in warned[0]
    assert "native" in opt._kernels._backends
    assert list(kernels.iterdir()) == []
    reference, _ = train(backend="eager", impl="reference")
    torch.testing.assert_close(native, reference, rtol=1e-12, atol=1e-13)
