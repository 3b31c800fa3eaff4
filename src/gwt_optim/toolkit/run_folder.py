"""A run folder: one writer at a time, and checked before a run starts or continues in it.

:func:`lock_run_dir` is the writer lock every command takes on a folder it
writes (``pretrain``, ``compare``, the runner, ``finetune``, the benchmarks'
studies). :func:`prepare_run_dir` makes, locks and checks the folder of a
pre-training run (``train.train``): it refuses a folder that holds an earlier
run unless the run resumes, and a resume with nothing to continue when the
command line asked for one; a refused run leaves the folder as it found it
(its lock file as it was; with :func:`missing_folders` and
:func:`remove_if_unused`, no folder it created).

Nothing here imports the training loop: what a resumed run may change is the
caller's to check (``check_saved``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from gwt_optim.toolkit.errors import UsageError

__all__ = ["LOCK_FILE", "RUN_FILES", "lock_run_dir", "nothing_to_resume", "prepare_run_dir", "missing_folders",
           "remove_if_unused"]

LOCK_FILE = ".writer.lock"

# Files that make a folder an earlier run's: a new run there would replace them.
RUN_FILES = ("summary.json", "metrics.jsonl", "config.json")


@contextlib.contextmanager
def lock_run_dir(folder: Path):
    """Be the only writer of ``folder`` until the block ends: an exclusive
    ``flock`` on its :data:`LOCK_FILE`, which the kernel releases when the
    process dies however it dies, so a crash never leaves a stale lock.

    Raises :class:`~gwt_optim.toolkit.errors.UsageError` naming the holder's pid
    when another process holds it. Where ``flock`` is missing (not POSIX) or
    refused (some network file systems), a warning says the folder is unguarded.
    """
    import socket

    try:
        import fcntl
    except ImportError:
        fcntl = None
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            if fcntl is None:
                raise OSError("no fcntl on this platform")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A refused run removes the lock file it created (prepare_run_dir): a lock taken on the
            # file it removed would guard nothing, so take the one now in its place.
            while not _same_file(fd, folder / LOCK_FILE):
                os.close(fd)
                fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, host = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
            where = f" on {host}" if host and host != socket.gethostname() else ""
            raise UsageError(
                f"{folder} is in use by another gwt-optim process (pid {pid or '?'}{where}); wait for it to end or "
                "stop it (it saves on Ctrl-C or SIGTERM), or choose another --out"
            ) from None
        except OSError as exc:
            print(f"warning: cannot lock {folder} ({exc}); make sure no other run writes to it", file=sys.stderr)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def nothing_to_resume(run: Path) -> str:
    """Why ``--resume`` of ``run``, which holds no checkpoint, has nothing to continue, and what to do."""
    if not run.exists():
        return f"--resume: {run} does not exist, so there is no run to continue; drop --resume to start one there"
    if any((run / f).is_file() for f in RUN_FILES):
        return (f"--resume: {run} holds a run with no checkpoint (it stopped before its first one, or its "
                "checkpoints were removed), so there is nothing to continue; start afresh with another --out, or "
                "delete that folder first")
    return f"--resume: no checkpoint in {run}, so there is no run to continue; drop --resume to start one there"


def prepare_run_dir(run: Path, *, resume: bool, is_main: bool, held: contextlib.ExitStack,
                    check_saved: Callable[[dict[str, Any]], None], must_resume: bool = False) -> Path:
    """The run folder, checked on every rank (they share it) so they all fail alike;
    rank 0 holds its lock (:func:`lock_run_dir`) in ``held``, before anything reads
    or writes in it. ``must_resume``: a resume without a checkpoint to continue is
    refused (the command line's ``--resume``) rather than started from step 0.
    ``check_saved(settings)`` raises ``UsageError`` for a resumed run's saved
    ``config.json`` that this run may not continue."""
    if run.exists() and not run.is_dir():
        raise UsageError(f"--out {run} is a file, not a folder")
    if resume and must_resume and not run.is_dir():
        raise UsageError(nothing_to_resume(run))
    lock_before: bytes | None = b""
    if is_main:
        try:
            run.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UsageError(f"--out {run}: a file is in the way of that folder") from None
        if not os.access(run, os.W_OK):
            raise PermissionError(13, "permission denied", str(run))
        try:
            lock_before = (run / LOCK_FILE).read_bytes()
        except FileNotFoundError:
            lock_before = None
        held.enter_context(lock_run_dir(run))
    try:
        _check_run_dir(run, resume=resume, must_resume=must_resume, check_saved=check_saved)
    except (UsageError, FileExistsError):
        # A refused run leaves the folder as it found it (train() removes one it created).
        if is_main and lock_before is None:
            (run / LOCK_FILE).unlink(missing_ok=True)
        elif is_main:
            (run / LOCK_FILE).write_bytes(lock_before)
        raise
    return run


def _check_run_dir(run: Path, *, resume: bool, must_resume: bool,
                   check_saved: Callable[[dict[str, Any]], None]) -> None:
    """Refuse a run folder the run cannot start or continue in (under its lock)."""
    from gwt_optim.toolkit.checkpoint import list_checkpoints

    saved = list_checkpoints(run)
    if not resume and (saved or any((run / f).is_file() for f in RUN_FILES)):
        if not saved:  # nothing --resume could continue: do not send the user there
            raise FileExistsError(f"{run} holds an earlier run, with no checkpoint to continue from; choose another "
                                  "--out, or delete that folder first")
        raise FileExistsError(
            f"{run} holds an earlier run; pass --resume to continue it or choose another --out"
        )
    if resume and must_resume and not saved:
        raise UsageError(nothing_to_resume(run))
    if resume:
        try:
            settings = json.loads((run / "config.json").read_text())
        except FileNotFoundError:
            settings = None
        except (OSError, ValueError) as exc:
            raise UsageError(f"--resume: {run / 'config.json'} is unreadable ({exc}); use a new --out") from None
        if isinstance(settings, dict):
            check_saved(settings)


def missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, innermost first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def remove_if_unused(made: list[Path]) -> None:
    """Remove the folders a failed run created, innermost first, while they hold
    nothing (the run folder: nothing but its lock file)."""
    for n, folder in enumerate(made):
        try:
            if n == 0 and [p.name for p in folder.iterdir()] == [LOCK_FILE]:
                (folder / LOCK_FILE).unlink()
            folder.rmdir()
        except OSError:  # not empty (the run wrote something), or gone: keep what is there
            return
