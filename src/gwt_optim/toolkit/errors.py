"""The user's mistakes as one line on stderr and exit code 2, never a traceback.

Commands raise ordinary exceptions. :func:`run_command` is the one place that
decides which of them are the user's to fix -- a bad flag value, a missing or
unreadable file, an unknown optimizer, a missing optional package, an
unreachable Hub, a full disk, a read-only folder -- and prints them as
``gwt-optim CMD: error: MESSAGE``. Anything else is a bug and keeps its
traceback. ``ValueError`` counts as the user's (it is what torch and the
optimizers raise for a bad hyperparameter); set ``GWT_OPTIM_TRACEBACK=1`` to
see the traceback of any of them anyway.

A module that defines another such exception registers it where it is
defined, with :func:`register_user_error`: this module imports none of them,
so every module may import it.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, Callable

__all__ = ["UsageError", "register_user_error", "user_error_types", "one_line", "run_command", "EXIT_USAGE",
           "install_command"]

EXIT_USAGE = 2  # argparse's code for a bad command line

# OSErrors of the machine, not of the code: the user frees space or picks a writable folder.
_USER_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, name)
)


class UsageError(ValueError):
    """A setting, file or environment the user can fix; the message says how."""


def install_command(extra: str) -> str:
    """How to install gwt-optim's ``extra``, as the README installs the package: from its checkout
    (a wheel built there installs by name too: ``pip install --find-links dist 'gwt-optim[EXTRA]'``)."""
    return f"pip install -e '.[{extra}]' in the gwt-optim checkout"


# The built-in kinds; the toolkit's own (DataUnavailable, MissingDependency,
# NonFiniteLossError) join through register_user_error.
_USER_ERRORS: list[type[BaseException]] = [
    ValueError,  # UsageError, JSONDecodeError and UnicodeDecodeError among them
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
]


def register_user_error(exc_type: type[BaseException]) -> type[BaseException]:
    """Count ``exc_type`` as the user's to fix: one line and exit status 2.

    Returns the type, so it also serves as a class decorator; registering a
    type twice is harmless.
    """
    if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
        raise TypeError(f"register_user_error takes an exception class, not {exc_type!r}")
    if exc_type not in _USER_ERRORS:
        _USER_ERRORS.append(exc_type)
    return exc_type


def user_error_types() -> tuple[type[BaseException], ...]:
    return tuple(_USER_ERRORS)


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
