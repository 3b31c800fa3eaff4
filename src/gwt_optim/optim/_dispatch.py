"""Which kernel steps a parameter, in one module: the kernel registry
(:class:`Kernels`: the backends a ``backend=`` option names, each built on
first use, what failed remembered) and the route choice (:func:`choose`, from
the backends' declared :data:`~._backends.CAPABILITIES` and the
:func:`candidates` in order; its answers kept per bucket in
``Kernels.routes``, forgotten when a backend fails).

The kernels run :func:`gwt_optim.optim.functional.gwt_adamw`'s closed-form
Haar step in two passes over memory (phase 1: A_l, the moments and the
limiter's ||U||^2; phase 2: the weight), and are tested against it:
``"native"`` on CPU (:mod:`._native`), ``"triton"`` on CUDA (:mod:`._triton`,
imported only when selected), and torch's ``_fused_adamw_`` for the plain
level-0 step on CPU (:mod:`._torch_fused`). A gradient holding a NaN or an
infinity leaves that parameter's weight and state unchanged on every backend.

The backends import only :mod:`._backends`; this module alone imports them,
and the optimizer's base (``backend_option``), GWT-AdamW (its ``Kernels``) and
the stepper (``choose``, ``route_key``) import this one.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from gwt_optim._toolchain import KernelUnavailable
from gwt_optim.optim._backends import CAPABILITIES, moment_dtype
from gwt_optim.optim._native import NativeBackend
from gwt_optim.optim._torch_fused import FusedAdamWBackend

__all__ = ["BACKENDS", "BACKEND_OPTIONS", "Kernels", "Route", "backend_option", "candidates", "choose", "route_key"]

F32 = torch.float32

# The backends "auto" tries per device type for a transformed step.
_AUTO = {"cpu": ("native",), "cuda": ("triton",)}


# ------------------------------------------------------------------- the route --- #


class _Choice(NamedTuple):
    """What :func:`choose` keeps per bucket (``Kernels.routes``)."""

    backend: Any  # a built and prepared fused backend, or None
    cast: bool  # whether the step reads the gradient in the compute dtype
    reason: str | None  # why no backend fits (None when one does)


@dataclass(frozen=True)
class Route:
    """:func:`choose`'s answer for one parameter: its bucket's :class:`_Choice`
    with this step's gradient."""

    backend: Any  # a built and prepared fused backend, or None: the family's eager halves
    # The local gradient as the step reads it: in its own dtype where the
    # backend takes that dtype, else in the compute dtype (at least fp32).
    grad: Tensor
    level: int  # the parameter's level (functional.step_level's)
    reason: str | None  # why no backend fits (None when one does)


def choose(kernels: Any, group: dict, w: Tensor, g: Tensor, sharded: bool, limited: bool, level: int,
           alpha: float) -> Route:
    """The fused backend that runs the step of weight ``w`` (local) with
    gradient ``g`` in ``group`` at ``level`` and ``alpha``
    (:func:`~gwt_optim.optim.functional.step_level`'s), or why none does: the one place that decides
    it, from the parameter's bucket (the group's options, device, dtypes,
    level and layout) and what each backend declares. The answer is kept per
    bucket (``kernels.routes``, forgotten when a backend fails).

    ``kernels`` holds the family's backends under its ``backend=`` option
    (:class:`Kernels`; None: the family has none).
    A kernel computes a transformed Haar step, or at level 0 the plain
    family's (no limiter (``limited``), alpha 1, an unsharded tensor). The
    :func:`candidates` are tried in order, with the gradient in its own dtype
    (a backend that reads it takes it without a copy) and then in the compute
    dtype; the first whose :meth:`Capabilities.refusal` is None and that
    builds and prepares wins.
    """
    cdt = torch.promote_types(w.dtype, F32)
    if kernels is None:
        return Route(None, g.to(cdt), level, "the family has no fused kernels")
    # Everything _choose reads of the parameter, its gradient and its group.
    key = (route_key(group), level, alpha == 1, w.device, w.dtype, g.device, g.dtype, min(w.ndim, 2),
           g.shape == w.shape, w.is_contiguous(), g.is_contiguous(), sharded, limited)
    known = kernels.routes.get(key)
    if known is None:
        known = kernels.routes[key] = _choose(kernels, group, w, g, sharded, limited, level, alpha, cdt)
    backend, cast, reason = known
    return Route(backend, g.to(cdt) if cast else g, level, reason)


def _choose(kernels: Any, group: dict, w: Tensor, g: Tensor, sharded: bool, limited: bool, level: int,
            alpha: float, cdt: torch.dtype) -> _Choice:
    """:func:`choose`'s answer for the parameter's bucket."""
    reason = kernels.refusal(group)
    if reason is None and level > 0 and group["wavelet"] != "haar":
        reason = f"the {group['wavelet']!r} wavelet has no closed form for the kernels"
    if reason is None and level == 0 and (w.ndim == 0 or sharded or limited or alpha != 1):
        reason = "at level 0 only the plain step (no limiter, alpha 1, an unsharded tensor) has kernels"
    if reason is not None:
        return _Choice(None, True, reason)
    md = moment_dtype(group, cdt)
    names = candidates(kernels.backend, w.device.type, level)
    refusals = [] if names else [f"no backend for level {level} on {w.device.type} under backend={kernels.backend!r}"]
    cast = False
    while True:
        for name, last in names:
            backend = kernels.get(name, last)
            why = "unavailable (it failed to build)" if backend is None else \
                backend.capabilities.refusal(w, g, md, level, group, sharded)
            if why is None:
                if kernels.prepare(backend, w, g, md, level, last):
                    return _Choice(backend, cast, None)
                why = "failed to compile for this parameter"
            refusals.append(f"{name}: {why}")
        if g.dtype == cdt:
            return _Choice(None, cast, "; ".join(refusals))
        g, cast = g.to(cdt), True


def candidates(backend: str, device_type: str, level: int) -> list[tuple[str, bool]]:
    """The backends to try, in order, for a step at ``level`` on
    ``device_type`` under the ``backend`` option (not "eager"), each with
    whether it is the last choice (its failure to build or prepare is the
    user's to see: a warning, or an error for a named backend).

    Level 0 (plain AdamW: 1-D parameters, level-0 groups) takes
    ``torch._fused_adamw_`` on CPU, then the native kernels (bf16 weights with
    fp32 moments, which torch's kernel does not take), and the Triton kernels
    elsewhere; a named backend without that device's level-0 step gives none.
    A transformed step takes the named backend, or the device's."""
    if level == 0:
        if device_type == "cpu" and backend != "triton":
            return [("fused_adamw", False)] + ([("native", False)] if backend in ("auto", "native") else [])
        return [("triton", False)] if backend in ("auto", "triton") else []
    names = _AUTO.get(device_type, ()) if backend == "auto" else (backend,)
    return [(name, i == len(names) - 1) for i, name in enumerate(names)]


def route_key(group: dict) -> tuple:
    """The group options that choose each parameter's backend and state,
    rather than only a kernel's arguments: a change makes a new step plan."""
    return (group["level"], group["wavelet"], group["moment_dtype"], group["scale"] == 1,
            group["norm_growth_limit"] is None, group["detail_clip"] is None)


# ------------------------------------------------------------ the kernel registry --- #


def _triton_backend() -> Any:
    try:
        from gwt_optim.optim import _triton
    except ImportError as exc:
        raise KernelUnavailable(f"Triton is not installed ({exc}); pip install triton") from exc
    return _triton.TritonBackend()


#: How each named backend is built (tests and benchmarks replace "triton" with a CPU one).
BACKENDS: dict[str, Callable[[], Any]] = {"native": NativeBackend, "triton": _triton_backend}
BACKEND_OPTIONS = ("auto", "eager", "native", "triton")


def backend_option(backend: str) -> tuple[str, bool]:
    """The ``backend=`` option as ``(name, strict)``, ``strict`` meaning that
    a backend that fails to build is an error rather than a warning and the
    eager path."""
    if backend not in BACKEND_OPTIONS:
        raise ValueError(f"backend must be one of {BACKEND_OPTIONS}, got {backend!r}")
    return backend, backend in BACKENDS


class Kernels:
    """A family's fused backends under one ``backend=`` option: each built on
    first use, what failed remembered.

    A failure to build or prepare the last candidate for a step is an error
    when the option is strict, else one warning, and the eager path runs; any
    other failure falls through silently to the next candidate."""

    def __init__(self, backend: str, strict: bool, impl: str) -> None:
        self.backend, self.strict, self.impl = backend, strict, impl
        self._backends: dict[str, Any] = {}
        self._failed: set[str] = set()
        self.routes: dict[tuple, _Choice] = {}  # choose's answers per bucket
        self._plain_cpu = FusedAdamWBackend()  # torch's kernel: nothing to build

    def refusal(self, group: dict) -> str | None:
        """Why no parameter of ``group`` can take a backend, or None (then
        :func:`choose` looks at each)."""
        if self.impl != "fast":
            return f"impl={self.impl!r} runs the eager path"
        if self.backend == "eager":
            return "backend='eager' runs the eager path"
        if group["moment_dtype"] == "int8" and not any(caps.int8_moments for caps in CAPABILITIES.values()):
            return "no backend reads int8 moments"
        return None

    def get(self, name: str, last: bool = True) -> Any | None:
        """The backend ``name``, built once, or None where it failed to build."""
        if name == FusedAdamWBackend.name:
            return self._plain_cpu
        if name not in self._backends and name not in self._failed:
            try:
                self._backends[name] = BACKENDS[name]()
            except Exception as exc:  # a missing compiler, a failed build, no triton
                self._fail(name, last, exc, "are unavailable", warn=last)
        return self._backends.get(name)

    def prepare(self, backend: Any, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int, last: bool) -> bool:
        """Build or compile what this parameter needs, before any state
        changes; False (and the backend dropped) where that failed."""
        try:
            backend.prepare(w, G, moment_dtype, level)
        except Exception as exc:  # e.g. no C compiler, or Triton fails to build
            self._fail(backend.name, last, exc, "failed to compile", warn=True)
            return False
        return True

    def _fail(self, name: str, last: bool, exc: Exception, what: str, warn: bool) -> None:
        """A failure of the last candidate is an error under a strict option;
        otherwise it is remembered (with a warning if ``warn``), and the
        answers that may name the backend are forgotten."""
        if self.strict and last:
            if isinstance(exc, KernelUnavailable):
                raise exc
            raise KernelUnavailable(f"the fused '{name}' kernels {what}: {exc}; pass backend='eager' to use the "
                                    "eager path") from exc
        if warn:
            warnings.warn(f"GWT-AdamW: the fused '{name}' kernels {what} ({exc}); using "
                          + ("the eager path" if last else "the next backend"), RuntimeWarning, stacklevel=5)
        self._failed.add(name)
        self._backends.pop(name, None)
        self.routes.clear()
