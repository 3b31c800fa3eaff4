"""The user's mistakes as one line on stderr and exit code 2, never a traceback.

Commands raise ordinary exceptions. :func:`run_command` is the one place that
decides which of them are the user's to fix -- a bad flag value, a missing or
unreadable file, an unknown optimizer, a missing optional package, an
unreachable Hub, a full disk, a read-only folder -- and prints them as
``gwt-optim CMD: error: MESSAGE``. Anything else is a bug and keeps its
traceback. ``ValueError`` counts as the user's (it is what torch and the
optimizers raise for a bad hyperparameter); set ``GWT_OPTIM_TRACEBACK=1`` to
see the traceback of any of them anyway.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, Callable

__all__ = ["UsageError", "user_error_types", "one_line", "run_command", "EXIT_USAGE"]

EXIT_USAGE = 2  # argparse's code for a bad command line

# OSErrors of the machine, not of the code: the user frees space or picks a writable folder.
_USER_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, name)
)


class UsageError(ValueError):
    """A setting, file or environment the user can fix; the message says how."""


def user_error_types() -> tuple[type[BaseException], ...]:
    # Imported here so that `gwt-optim --help` stays free of the toolkit's imports.
    from gwt_optim.toolkit.data import DataUnavailable
    from gwt_optim.toolkit.registry import MissingDependency
    from gwt_optim.toolkit.train import NonFiniteLossError

    return (
        ValueError,  # UsageError, JSONDecodeError and UnicodeDecodeError among them
        FileNotFoundError,
        FileExistsError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,
        DataUnavailable,
        MissingDependency,
        NonFiniteLossError,
    )


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, PermissionError) and exc.filename:
        text = f"cannot write or read {exc.filename}: permission denied"
    elif isinstance(exc, OSError) and exc.errno in _USER_ERRNOS:
        where = f" {exc.filename}" if exc.filename else ""
        text = f"cannot write{where}: {os.strerror(exc.errno).lower()}"
    return text or type(exc).__name__


def run_command(command: str, func: Callable[[Any], int | None], args: Any) -> int:
    """``func(args)``'s exit code, or 2 after one line on stderr for a user error."""
    try:
        return int(func(args) or 0)
    except (*user_error_types(), OSError) as exc:
        if os.environ.get("GWT_OPTIM_TRACEBACK") or (
            isinstance(exc, OSError) and not isinstance(exc, user_error_types()) and exc.errno not in _USER_ERRNOS
        ):
            raise
        print(f"gwt-optim {command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
