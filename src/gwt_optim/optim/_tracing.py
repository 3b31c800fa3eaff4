"""The step's relations to its caller's frames: opting out of
``torch.compile`` tracing (:func:`untraced`), and the ``stacklevel`` that
points a warning at the user's call (:func:`caller_stacklevel`). Shared by
``_base`` (``step``, ``step_param``, the non-finite warning) and ``_advice``;
imports no other optimizer module."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

import torch

__all__ = ["untraced", "make_untraced", "caller_stacklevel"]

# Traced by torch.compile (its compiled-optimizer recipe, torch.compile(opt.step)),
# the step's Python (plans, .item() reads, ctypes and Triton calls) trained
# silently wrong; like torch's own untraceable optimizer methods, it opts out.
_UNTRACED_REASON = (
    "the gwt-optim optimizer step cannot be compiled (it runs native and Triton kernels through "
    "Python-side step plans): call opt.step() / opt.step_param() eagerly; compile the model, not the step"
)
_untraced_pending: list[tuple[Callable, list]] = []


def untraced(fn: Callable) -> Callable:
    """``fn`` as ``torch.compiler.disable(fn, reason=...)`` makes it, made by
    :func:`make_untraced` with the first optimizer, not at import: importing
    ``torch._dynamo`` takes seconds (torch's ``add_param_group`` imports it
    anyway), and under tracing it is too late (Dynamo cannot trace ``disable``)."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return disabled[0](*args, **kwargs)

    _untraced_pending.append((fn, disabled))
    return wrapper


def make_untraced() -> None:
    if _untraced_pending:
        for fn, disabled in _untraced_pending:
            if not disabled:
                disabled.append(torch.compiler.disable(fn, reason=_UNTRACED_REASON))
        # Cleared only once all are made: a constructor racing this one finds them all made.
        _untraced_pending.clear()


# Frames in these folders are the optimizer's own machinery (gwt_optim, and
# torch's optimizer hooks, no_grad wrappers and autograd for step_in_backward):
# a warning about the user's data should point past them, at the user's call.
_INTERNAL_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules["gwt_optim"], torch))


def caller_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` made by this function's caller
    that names the first frame outside gwt_optim and torch (how deep that is
    depends on the route: step(), step_param, a backward hook, a compiled step)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level
