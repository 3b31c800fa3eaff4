"""The one rule for gwt-optim's on-disk caches.

Every cache lives under one root: ``$GWT_OPTIM_CACHE`` when set, else
``$XDG_CACHE_HOME/gwt-optim``, else ``~/.cache/gwt-optim``. Each kind of
cache has its own folder below it (``data`` for tokenizers and tokenized
corpora, ``kernels`` for built native kernels), so one variable moves all of
them and no kind can read another's files.

A cache whose files run as code (built kernels) is opened with
:func:`open_private_dir`, :func:`read_private_file` and
:func:`write_private_file`: the folder is walked one component at a time
without following symbolic links, checked on its descriptor, and every file is
read and written relative to that descriptor, so what was checked is what is
used, whatever happens to the path meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

__all__ = [
    "UnsafePath",
    "SECURE_OPEN",
    "cache_root",
    "cache_dir",
    "open_private_dir",
    "read_private_file",
    "write_private_file",
]


def cache_root() -> Path:
    env = os.environ.get("GWT_OPTIM_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gwt-optim"


def cache_dir(kind: str) -> Path:
    """``cache_root() / kind``; not created here (each user creates what it writes)."""
    return cache_root() / kind


class UnsafePath(Exception):
    """A cache folder or file that another user could have written, or that a
    symbolic link leads to; the message says which and why."""


# Opening relative to a folder's descriptor without following links (POSIX);
# elsewhere (Windows) there is no such guarantee to give.
SECURE_OPEN = (
    hasattr(os, "O_NOFOLLOW")
    and hasattr(os, "O_DIRECTORY")
    and hasattr(os, "getuid")
    and {os.open, os.mkdir, os.stat, os.rename, os.unlink} <= os.supports_dir_fd  # os.replace is os.rename's renameat
)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# Passing through a folder needs only search permission, as a path lookup
# does (home folders under a mode-0711 /home), hence O_PATH where there is one.
_SEARCH = getattr(os, "O_PATH", os.O_RDONLY)


def _open_component(parent_fd: int, name: str, path: Path, *, create_mode: int | None, access: int) -> int:
    """``name`` in the folder ``parent_fd`` (shown as ``path``), opened as a
    folder without following a link; created with ``create_mode`` if given."""
    flags = access | os.O_DIRECTORY | _NOFOLLOW
    for attempt in range(2):
        try:
            return os.open(name, flags, dir_fd=parent_fd)
        except FileNotFoundError:
            if create_mode is None or attempt:
                raise
        except OSError as exc:
            _explain(exc, parent_fd, name, path, "a directory")
            raise
        try:
            os.mkdir(name, create_mode, dir_fd=parent_fd)
        except FileExistsError:
            pass  # a concurrent process made it: opened and checked like any other
    raise AssertionError("unreachable")


def _explain(exc: OSError, parent_fd: int, name: str, path: Path, wanted: str) -> None:
    """Raise :class:`UnsafePath` when ``exc`` came from a link or the wrong
    kind of file (O_NOFOLLOW reports a link as ELOOP, or EMLINK on BSDs)."""
    if exc.errno not in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
        return
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path} is a symbolic link") from None
    raise UnsafePath(f"{path} is not {wanted}") from None


def _owner_problem(st: os.stat_result) -> str | None:
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to this user"
    if st.st_mode & 0o022:
        return f"other users can write to it (mode {oct(stat.S_IMODE(st.st_mode))})"
    return None


def open_private_dir(root: Path, *parts: str, repair: bool = False) -> tuple[Path, int]:
    """``root / parts`` as a folder only this user can change: its path and
    an open descriptor (the caller closes it). Missing folders are created
    (the last one mode 0700).

    The folders above ``root`` are resolved once; ``root`` and everything
    below must not be symbolic links, so no link can be flipped between a
    check and a use. Each component is opened relative to its parent's
    descriptor with ``O_NOFOLLOW``, and the last one is checked on its own
    descriptor: owned by this user, writable by no one else, in a folder
    others cannot rename it out of (or that has the sticky bit, as /tmp).
    ``repair`` first takes group and other write access away from a last
    folder of this user's (a default cache created under a umask of 002).
    Raises :class:`UnsafePath` or ``OSError``.
    """
    root = Path(os.path.abspath(root))
    base = Path(os.path.realpath(root.parent))
    names = [*base.parts[1:], *(n for n in (root.name, *parts) if n)]
    path = Path(base.anchor or "/")
    fd = os.open(path, _SEARCH | os.O_DIRECTORY | _NOFOLLOW)
    parent_fd = -1
    try:
        for i, name in enumerate(names):
            path = path / name
            last = i == len(names) - 1
            child = _open_component(fd, name, path, create_mode=0o700 if last else 0o777,
                                    access=os.O_RDONLY if last else _SEARCH)
            if parent_fd >= 0:
                os.close(parent_fd)
            parent_fd, fd = fd, child
        st = os.fstat(fd)
        if repair and st.st_uid == os.getuid() and st.st_mode & 0o022:
            os.fchmod(fd, 0o700)
            st = os.fstat(fd)
        problem = _owner_problem(st)
        if problem is None and parent_fd >= 0:
            # Whoever can write to the folder above (without the sticky bit)
            # can rename this one away and put theirs in its place.
            pst = os.fstat(parent_fd)
            if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
                problem = (f"other users can replace it: {path.parent} is writable by them "
                           f"(mode {oct(stat.S_IMODE(pst.st_mode))})")
        if problem is not None:
            raise UnsafePath(problem)
        result, fd = (path, fd), -1
        return result
    finally:
        for f in (fd, parent_fd):
            if f >= 0:
                os.close(f)


def read_private_file(dir_fd: int, name: str, shown: Path) -> bytes:
    """The bytes of ``name`` in the folder ``dir_fd`` (shown as ``shown``),
    read through one descriptor: a regular file, not a link, owned by this user
    and writable by no one else. Raises :class:`UnsafePath` or ``OSError``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        _explain(exc, dir_fd, name, shown, "a regular file")
        raise
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        problem = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else _owner_problem(st)
        if problem is not None:
            raise UnsafePath(f"{shown}: {problem}")
        return f.read()


def write_private_file(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Publish ``data`` as ``name`` in the folder ``dir_fd``, atomically: a new
    file (``O_EXCL``, never through a link) renamed over ``name`` inside that
    folder, so readers see the old file or the whole new one."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode, dir_fd=dir_fd)
    try:
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
