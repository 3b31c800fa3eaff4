"""GWT-AdamW's fused backends as the optimizer sees them: the protocol they
follow, torch's own kernel for the plain level-0 step, and :class:`Kernels`,
which builds the backends a ``backend=`` option names and remembers what
failed. Which backend a parameter takes is decided in one place,
:func:`gwt_optim.optim._backends.choose`.

The kernels run :func:`gwt_optim.optim.functional.gwt_adamw`'s closed-form
Haar step in two passes over memory (phase 1: A_l, the moments and the
limiter's ||U||^2; phase 2: the weight), and are tested against it:
``"native"`` on CPU (:mod:`._native`), ``"triton"`` on CUDA (:mod:`._triton`,
imported only when selected). A gradient holding a NaN or an infinity leaves
that parameter's weight and state unchanged on every backend.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from gwt_optim.optim._backends import CAPABILITIES, Bucket, Capabilities, check_pointers
from gwt_optim.optim._native import NativeBackend, native_library
from gwt_optim._toolchain import KernelUnavailable
from gwt_optim.optim.functional import AdamWScalars

__all__ = ["BACKENDS", "BACKEND_OPTIONS", "FusedBackend", "FusedAdamWBackend", "KernelUnavailable", "Kernels",
           "all_finite", "backend_option", "native_library"]


class FusedBackend(Protocol):
    """A fused backend of the Haar GWT-AdamW step. Nothing is asked of it but
    its :attr:`capabilities`; each parameter's state is checked
    (:func:`gwt_optim.optim._saved.state_problem`) before it is handed over."""

    name: str
    capabilities: Capabilities

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Build or compile what this parameter needs, before any state changes."""

    def step_buckets(self, buckets: list[Bucket], limiter_eps: float, table: dict | None = None) -> list | tuple:
        """Whole steps of the parameters of ``buckets``; one with a non-finite
        gradient keeps its weight and state. Returns the parameters so
        skipped, or a tuple of running device counts of them (no host sync).
        ``table``: a step plan's dict for this backend (see :class:`Bucket`),
        where the backend keeps what it derives from these buckets; the plan
        owns it and drops it with itself. None: not under a plan."""

    def phase1(self, group: dict, state: dict, G: Tensor, level: int, step: int,
               scalars: AdamWScalars) -> tuple[float | Tensor, Any]:
        """Update the moments (a finite gradient); the limiter's ||U||^2 and a
        carry, which holds ``scalars`` (the step's, :func:`._backends.kernel_scalars`) for phase 2."""

    def phase2(self, w: Tensor, G: Tensor, level: int, carry: Any, r: float | Tensor) -> None:
        """``w <- w * decay - step_size / r * delta`` (the carry's scalars), right after phase 1 or later."""


class FusedAdamWBackend:
    """Level-0 and 1-D parameters of a GWT-AdamW group on CPU: that is plain
    AdamW, so ``torch._fused_adamw_`` steps all of them in one call per set of
    hyperparameters instead of about fifteen eager operations each. A
    parameter whose gradient has a NaN or an Inf is left out of the call: on
    CPU that check costs no synchronization."""

    name = "fused_adamw"
    capabilities = CAPABILITIES["fused_adamw"]

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Nothing to build: the kernel ships with torch."""

    def step_buckets(self, buckets: list[Bucket], limiter_eps: float, table: dict | None = None) -> list[Tensor]:
        skipped = []
        calls: dict[tuple, list[tuple[Tensor, Tensor, dict]]] = {}
        for b in buckets:
            g = b.group
            lr = g["lr"].item() if isinstance(g["lr"], Tensor) else g["lr"]
            for w, grad, st in zip(b.params, b.grads, b.states):
                calls.setdefault((w.dtype, lr, *g["betas"], g["eps"], g["weight_decay"]), []).append((w, grad, st))
        for (_, lr, beta1, beta2, eps, wd), items in calls.items():
            finite = all_finite([grad for _, grad, _ in items])
            if not all(finite):
                skipped += [w for (w, _, _), ok in zip(items, finite) if not ok]
                items = [item for item, ok in zip(items, finite) if ok]
                if not items:
                    continue
            for w, grad, st in items:
                check_pointers(self.name, w, grad, st, 0)
            torch._fused_adamw_(
                [w for w, _, _ in items], [grad for _, grad, _ in items], [st["exp_avg"] for _, _, st in items],
                [st["exp_avg_sq"] for _, _, st in items], [],
                # The stepper has advanced the step counts (CPU float32 tensors,
                # as fused AdamW keeps them on CPU) before this call.
                [st["step"] for _, _, st in items],
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
            )
        return skipped


def all_finite(tensors: list[Tensor]) -> list[bool]:
    """Whether each tensor (one device and dtype) holds only finite values: one
    foreach max-norm, read once (on a GPU, one wait instead of one each)."""
    return torch.stack(torch._foreach_norm(tensors, math.inf)).isfinite().tolist()


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
        self.routes: dict[tuple, tuple] = {}  # choose's answers per bucket
        self._plain_cpu = FusedAdamWBackend()  # torch's kernel: nothing to build

    def refusal(self, group: dict) -> str | None:
        """Why no parameter of ``group`` can take a backend, or None (then
        :func:`~gwt_optim.optim._backends.choose` looks at each)."""
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
