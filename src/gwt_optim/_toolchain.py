"""The C toolchain and the on-disk kernel cache of the fused CPU kernels.

:func:`load_library` compiles a C source with the system C compiler (the same
requirement as ``torch.compile`` on CPU), keeps the shared library in the
``kernels`` folder of the one cache rule (:func:`cache_dir`), and loads it
through :mod:`ctypes`. Compiled code runs in this process, so the cache is
handled as :mod:`gwt_optim._cache` prescribes for files that run as code: the
folder is walked without following symbolic links and checked on its
descriptor, a library is loaded only when its bytes match the SHA-256 that the
build published beside it, and what is loaded is a private copy of exactly the
bytes checked. A cache that another user could write to, or that cannot be
written, gives way to a private folder for this process (one warning).

This module knows nothing about what the library computes: the caller passes
the source and a ``bind`` function that declares the library's symbols
(:mod:`gwt_optim.optim._native` does, for ``_fused_cpu.c``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Callable

from gwt_optim import _cache

__all__ = ["KernelUnavailable", "cache_dir", "load_library"]


class KernelUnavailable(RuntimeError):
    """A fused backend cannot run here (no compiler, no Triton, ...)."""


# Tried in order: the fastest flags first, then without the ones a compiler
# may lack (-march=native on some ARM toolchains, OpenMP on Apple clang; the
# kernels then run on one thread).
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3", "-march=native"],
    ["-O3"],
)
# Vectorizing the selects around divisions needs -fno-trapping-math; the
# kernels never read floating-point exception flags or errno.
_COMMON_FLAGS = ["-std=gnu11", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-Wno-unknown-pragmas"]

Bind = Callable[[ctypes.CDLL], ctypes.CDLL]


def cache_dir() -> Path:
    """Where built kernels are kept: the ``kernels`` folder of the one cache
    rule (:mod:`gwt_optim._cache`), ``~/.cache/gwt-optim/kernels`` by default."""
    return _cache.cache_dir("kernels")


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise KernelUnavailable(
        "the fused CPU kernels need a C compiler and none was found (set $CC, or install gcc/clang, "
        "e.g. apt-get install gcc); pass backend='eager' to use the eager path"
    )


def _host_fingerprint(cc: str) -> str:
    """What a ``-march=native`` build depends on: compiler version and CPU features."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                cpu += line
                break
    except OSError:
        pass
    return version + cpu


@functools.lru_cache(maxsize=None)
def _private_dir() -> Path:
    """A fresh directory only this process's user can use (mode 0700)."""
    import atexit

    directory = Path(tempfile.mkdtemp(prefix="gwt_optim-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _open_private_dir() -> tuple[Path, int]:
    """:func:`_private_dir`, opened and checked as the cache is: path and descriptor."""
    try:
        return _cache.open_private_dir(_private_dir())
    except (_cache.UnsafePath, OSError) as exc:
        raise KernelUnavailable(
            f"no private folder for the fused CPU kernels ({exc}); set $TMPDIR to a folder only you can "
            "write to, or pass backend='eager' to use the eager path"
        ) from exc


def _fall_back(directory: Path, reason: str) -> tuple[Path, int]:
    private, fd = _open_private_dir()
    warnings.warn(
        f"GWT: not caching the fused CPU kernels in {directory} ({reason}); building them in {private} "
        "for this process only. Set $GWT_OPTIM_CACHE to a directory only you can write to",
        RuntimeWarning,
        stacklevel=3,
    )
    return private, fd


def _kernel_dir() -> tuple[Path, int]:
    """:func:`cache_dir` when it is this user's alone (see
    :func:`gwt_optim._cache.open_private_dir`), else a private temporary
    directory: its path and an open descriptor, which the caller closes."""
    if not _cache.SECURE_OPEN:
        raise KernelUnavailable(
            "loading the fused CPU kernels safely needs POSIX openat and O_NOFOLLOW, which this platform "
            "lacks; pass backend='eager' to use the eager path"
        )
    try:
        # Our own default cache may have been created group-writable under a umask of 002.
        return _cache.open_private_dir(_cache.cache_root(), "kernels", repair="GWT_OPTIM_CACHE" not in os.environ)
    except _cache.UnsafePath as exc:
        reason = str(exc)
    except OSError as exc:
        reason = f"it cannot be used: {exc}"
    return _fall_back(cache_dir(), reason)


def _library_path(directory: Path, name: str, digest: str) -> Path:
    # Named by content, so that a concurrent build never replaces the file a
    # digest names with another build (compilers need not be deterministic).
    return directory / f"{name}-{digest[:16]}.so"


# What a missing, stale, foreign or broken cached library raises on loading.
_LOAD_ERRORS = (OSError, ValueError, AttributeError, _cache.UnsafePath)
_copies = itertools.count()


def _load_checked(dir_fd: int, directory: Path, name: str, bind: Bind) -> ctypes.CDLL:
    """Open the library the digest file ``name.sha256`` names in the checked
    kernels folder ``dir_fd`` (shown as ``directory``), check it, load
    exactly the bytes checked, and ``bind`` it.

    dlopen takes a path and opens it again, so it never sees the cache: the
    bytes read through one descriptor (a regular file of this user's, no
    link) are hashed, written to a new file in this process's private folder
    and that file is loaded, through that folder's descriptor where /proc
    allows. A file swapped in at the cache's path after the check never loads,
    nor does a truncated one (it would SIGBUS the process when it maps the
    missing pages). Raises one of :data:`_LOAD_ERRORS` (``bind`` raises
    AttributeError for a library without the expected symbols).
    """
    pointer = directory / f"{name}.sha256"
    digest = _cache.read_private_file(dir_fd, pointer.name, pointer).decode("ascii", "replace").strip()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError(f"{pointer} holds no SHA-256 digest")
    path = _library_path(directory, name, digest)
    data = _cache.read_private_file(dir_fd, path.name, path)
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"{path} no longer matches its digest")
    private, fd = _open_private_dir()
    # A new name for every load: dlopen hands back whatever library it
    # already loaded under a name, without opening the file.
    copy = f"loaded-{os.getpid()}-{next(_copies)}-{path.name}"
    try:
        _cache.write_private_file(fd, copy, data, mode=0o700)
        via_fd = f"/proc/self/fd/{fd}"
        lib = ctypes.CDLL(f"{via_fd}/{copy}" if os.path.isdir(via_fd) else str(private / copy))
    finally:
        # The mapping outlives the file, so the copy goes at once: a process that never runs its atexit
        # handlers (multiprocessing's workers end in os._exit) left one folder in $TMPDIR per process.
        with contextlib.suppress(OSError):
            os.unlink(copy, dir_fd=fd)
        os.close(fd)
        _drop_private_dir_if_empty()
    lib._name = str(path)  # the file it was checked as, for messages: the copy is gone
    return bind(lib)


def _drop_private_dir_if_empty() -> None:
    """Remove :func:`_private_dir` when nothing is left in it (only a fall-back build keeps one there); the
    next use makes a fresh one."""
    if _private_dir.cache_info().currsize:
        with contextlib.suppress(OSError):  # not empty: a fall-back build lives there for this process
            os.rmdir(_private_dir())
            _private_dir.cache_clear()


def _build_library(cc: str, source: Path) -> bytes:
    """Compile ``source`` with the first flag set that works; the library's bytes.

    The compiler writes by path, so it writes into a fresh private folder;
    :func:`_publish` copies the result into the cache through its descriptor."""
    errors = []
    with tempfile.TemporaryDirectory(prefix="gwt_optim-build-") as work:
        out = os.path.join(work, "kernels.so")
        for flags in _FLAG_SETS:
            proc = subprocess.run([cc, *flags, *_COMMON_FLAGS, "-o", out, str(source)], capture_output=True, text=True)
            if proc.returncode == 0:
                with open(out, "rb") as f:
                    return f.read()
            errors.append(f"{' '.join(flags)}: {proc.stderr.strip()[-500:]}")
    raise KernelUnavailable(
        f"building the fused CPU kernels with {cc} failed; pass backend='eager' to use the eager path. "
        + "\n".join(errors)
    )


def _publish(dir_fd: int, name: str, data: bytes) -> None:
    """Write a build, then the digest file naming it, into the kernels folder
    ``dir_fd``, each atomically: concurrent processes (pytest -n, torchrun)
    may build the same library at once."""
    digest = hashlib.sha256(data).hexdigest()
    _cache.write_private_file(dir_fd, _library_path(Path(), name, digest).name, data, mode=0o755)
    _cache.write_private_file(dir_fd, f"{name}.sha256", f"{digest}\n".encode())


def load_library(source: Path, stem: str, bind: Bind) -> ctypes.CDLL:
    """Build (once per host and source version) and load the C file ``source``.

    The library is cached in :func:`cache_dir` as ``{stem}_{key}`` beside its
    SHA-256, where the key hashes the source, the compiler's version, the
    CPU's features and the flags; it is opened through that folder's checked
    descriptor and verified before every load (:func:`_load_checked`), and a
    missing, stale or unfit library is rebuilt once. When another user could
    write there, or it is no folder, the kernels are built in a private
    temporary directory instead, and so they are when it cannot be written
    (one warning each: training still gets its kernels). Raises
    :class:`KernelUnavailable` with the compiler's message when no flag set
    compiles. Not cached in memory: the caller loads once.
    """
    cc = _compiler()
    text = source.read_text()
    key = hashlib.sha256((text + _host_fingerprint(cc) + repr(_FLAG_SETS + (_COMMON_FLAGS,))).encode()).hexdigest()[:20]
    name = f"{stem}_{key}"
    directory, fd = _kernel_dir()
    try:
        try:
            return _load_checked(fd, directory, name, bind)
        except _LOAD_ERRORS:
            pass
        data = _build_library(cc, source)
        try:
            _publish(fd, name, data)
        except OSError as exc:  # a read-only cache (or a full disk): training still gets its kernels
            os.close(fd)
            fd = -1
            directory, fd = _fall_back(directory, f"it cannot be written: {exc.strerror or exc}")
            try:
                _publish(fd, name, data)
            except OSError as again:
                raise KernelUnavailable(
                    f"writing the fused CPU kernels to {directory} failed ({again}); "
                    "pass backend='eager' to use the eager path"
                ) from again
        try:
            return _load_checked(fd, directory, name, bind)
        except _LOAD_ERRORS as exc:
            raise KernelUnavailable(
                f"loading the fused CPU kernels from {directory} failed after a rebuild ({exc}); "
                "pass backend='eager' to use the eager path"
            ) from exc
    finally:
        if fd >= 0:
            os.close(fd)
