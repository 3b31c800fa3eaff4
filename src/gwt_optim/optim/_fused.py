r"""Fused kernels for the GWT-AdamW step with the Haar wavelet: the backend
protocol, the state checks, and the choice of a backend.

The generic fast path (:mod:`gwt_optim.optim._base`) runs the closed-form
Haar step as a dozen eager tensor operations per parameter, many of them
broadcasts over blocks of :math:`2^l` entries that do not vectorize, plus
full-size temporaries. The step itself needs only two passes over memory: with
:math:`h = 2^{-l/2}` and blocks of :math:`b = 2^l` columns,

phase 1
    :math:`A_k = h \sum \mathrm{block}_k`; update :math:`M, V` on :math:`A`;
    return :math:`\|M/\mathrm{den}\|_F^2` for the limiter
    (:math:`\mathrm{den} = \sqrt V + \epsilon\sqrt{1-\beta_2^t}`);
phase 2
    :math:`W \leftarrow W (1 - \eta\lambda) - s \cdot \big(G_k d_k + h (M_k - A_k) d_k\big)`
    on block :math:`k`, with :math:`d = 1/\mathrm{den}` (0 where
    :math:`\mathrm{den} = 0`) and the scalar
    :math:`s = \eta\, c_t\, \alpha / r` (:math:`r` from the limiter).

Between them sits only the limiter's scalar (and, under FSDP2, its one
all-reduce). Two backends implement the phases; both are tested against the
reference path:

``"native"`` (CPU)
    :mod:`gwt_optim.optim._native`: a small C library (``_fused_cpu.c``)
    called through :mod:`ctypes`, which runs the whole steps of many
    parameters in one call. :mod:`gwt_optim.optim._toolchain` builds it on
    first use with the system C compiler and keeps it in a checked on-disk
    cache (:func:`~gwt_optim.optim._toolchain.cache_dir`).
``"triton"`` (CUDA)
    :mod:`gwt_optim.optim._triton`: every transformed weight of a bucket in
    three launches per step over pointer tables (phase 1, a deterministic
    limiter on the device, phase 2), with no host synchronization.

Level 0 (plain AdamW) on CPU also takes :class:`FusedAdamWBackend`, which
hands it to ``torch._fused_adamw_``. Parameters that no backend takes (other
dtypes, non-contiguous tensors) take the generic fast path.

This module holds what the optimizer sees of them: the :class:`FusedBackend`
protocol that every backend follows, :func:`state_problem` (the optimizer
checks each parameter's state with it before any backend sees that state:
kernels index the moments by the parameter's shape), and
:class:`AdamWHaarKernels`, which builds and prepares the backends. Which
backend a parameter takes is decided in one place,
:meth:`GWTOptimizer.select_backend <gwt_optim.optim._base.GWTOptimizer.select_backend>`,
from the capabilities each backend declares (:mod:`gwt_optim.optim._backends`).
A gradient holding a NaN or an infinity leaves that parameter's weight and
state unchanged (its step count still advances), on every path: the native
kernels find it in a first pass over the gradient, before they change
anything.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor

from gwt_optim import wavelets
from gwt_optim.optim._backends import CAPABILITIES, Capabilities, check_pointers
from gwt_optim.optim._native import NativeBackend, native_library
from gwt_optim.optim._toolchain import KernelUnavailable

__all__ = [
    "BACKENDS",
    "FusedBackend",
    "KernelUnavailable",
    "AdamWHaarKernels",
    "check_compile_option",
    "check_state",
    "native_library",
    "state_problem",
]


class FusedBackend(Protocol):
    """A fused kernel backend for the transformed Haar GWT-AdamW step.

    :meth:`GWTOptimizer.select_backend <gwt_optim.optim._base.GWTOptimizer.select_backend>`
    picks one for a parameter from its :attr:`capabilities`. The optimizer
    has checked the state with :func:`state_problem` before calling any
    method with it.

    A backend whose capabilities say ``plans`` also provides
    ``step_batches(batches, limiter_eps, *, key)``: ``step_many`` for one of
    the optimizer's plans, a list of
    :class:`~gwt_optim.optim._base.StepBatch` that stays the same from step to
    step (see there for what the optimizer has checked). ``key`` names the
    plan: ``"step"`` for :meth:`~gwt_optim.optim._base.GWTOptimizer.step`'s,
    a parameter's id for ``step_param``'s; a backend may cache what it derives
    from a list until another list comes under the same key, or until
    ``invalidate()``, which the optimizer calls when it drops its plans
    (``load_state_dict``, ``add_param_group``). Without it, the plans call
    ``step_many`` with the same ParamSteps in the same order every step.
    """

    name: str
    #: What it takes and can do (:class:`~gwt_optim.optim._backends.Capabilities`):
    #: the optimizer asks nothing else. ``batched``: the optimizer hands whole
    #: steps to :meth:`step_many` (for every parameter that needs no
    #: collective); the phases serve the rest.
    capabilities: Capabilities

    def supports(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> bool:
        """``capabilities.refusal(...) is None``: whether this backend takes
        this parameter (device, dtypes, level, layout)."""
        ...

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Build or compile what this parameter needs, before any state changes."""
        ...

    def phase1(self, group: dict, state: dict, G: Tensor, level: int, step: int) -> tuple[float | Tensor, Any]:
        """Update the moments; return the limiter's squared norm and a carry.
        Only called with a finite gradient (the optimizer checks it first)."""
        ...

    def phase2(self, w: Tensor, G: Tensor, level: int, carry: Any, r: float | Tensor, scale: float, decay: float) -> None:
        """``w <- w * decay - scale / r * delta``, right after phase 1 or later."""
        ...

    def step_many(self, steps: list, limiter_eps: float) -> Sequence[Any] | tuple[Tensor, ...]:
        """Whole steps (phase 1, limiter, phase 2) of ``(ParamStep, scale,
        decay)`` items; only called when ``capabilities.batched``. A parameter whose
        gradient is not finite keeps its weight, moments and ``limiter_norm``.
        Returns the ParamSteps so skipped (CPU), or a tuple of the backend's
        running counts on the devices (0-d integer tensors that its kernels add
        the skips to), so that counting needs no host sync."""
        ...


def state_shape_problem(state: dict, key: str, expected: tuple, level: int, *, of: str = "") -> str | None:
    """Why ``state[key]`` is missing or has the wrong shape for a level-``level``
    step (``of`` names the parameter's shape), or None. Shared by the kernels'
    check and the eager paths' (``_saved.eager_state_problem``)."""
    t = state.get(key)
    if not isinstance(t, Tensor):
        return f"its state has no tensor {key!r} (keys: {sorted(state)})"
    if tuple(t.shape) != tuple(expected):
        return (
            f"state {key!r} has shape {tuple(t.shape)}, but a level-{level} step{of} needs {tuple(expected)}: "
            "the state belongs to another parameter or level"
        )
    return None


def state_problem(param: Tensor, grad: Tensor, state: dict, level: int, moment_dtype: torch.dtype) -> str | None:
    """What makes ``state`` unfit for a fused level-``level`` GWT-AdamW step
    of ``param``, or None. The kernels read and write the moments through raw
    pointers sized by the parameter, so anything else is out of bounds."""
    shape = tuple(param.shape)
    if tuple(grad.shape) != shape:
        return f"its gradient has shape {tuple(grad.shape)}, the parameter {shape}"
    if grad.device != param.device:
        return f"its gradient is on {grad.device}, the parameter on {param.device}"
    if not (param.is_contiguous() and grad.is_contiguous()):
        return "the fused kernels need a contiguous parameter and gradient"
    if not 0 <= level <= 16:  # level 0: plain AdamW (FusedAdamWBackend, Triton)
        return f"level {level} is outside the fused kernels' 0..16"
    expected = (*shape[:-1], wavelets.approx_length(shape[-1], level)) if shape else ()
    for key in ("exp_avg", "exp_avg_sq"):
        problem = state_shape_problem(state, key, expected, level, of=f" of a parameter of shape {shape}")
        if problem is not None:
            return problem
        t = state[key]
        if t.dtype != moment_dtype:
            return (
                f"state {key!r} is {t.dtype} but the group's moments are {moment_dtype}; set the group's "
                "moment_dtype to match the checkpoint, or pass compile=False"
            )
        if t.device != param.device:
            return f"state {key!r} is on {t.device}, the parameter on {param.device}"
        if not t.is_contiguous():
            return f"state {key!r} is not contiguous"
    s = state.get("limiter_norm")
    if s is not None and not (isinstance(s, Tensor) and s.numel() == 1):
        return f"state 'limiter_norm' must be a one-element tensor, got {s!r}"
    return None


def check_state(
    param: Tensor, grad: Tensor, state: dict, level: int, moment_dtype: torch.dtype, name: str = "a parameter"
) -> None:
    """Raise ``ValueError`` naming ``name`` unless the fused kernels may take
    this state (see :func:`state_problem`). The optimizer does not call it:
    it asks :func:`state_problem` and words its own error; this is for
    callers that want the check as an exception (the tests)."""
    problem = state_problem(param, grad, state, level, moment_dtype)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")


# ------------------------------------------------------ level 0 on CPU --- #


class FusedAdamWBackend:
    """Level-0 and 1-D parameters of a GWT-AdamW group on CPU: that is plain
    AdamW, so ``torch._fused_adamw_`` steps all of them in one call per set of
    hyperparameters instead of about fifteen eager operations each.

    A parameter whose gradient has a NaN or an Inf is left out of the call
    (its weight and moments keep their values): on CPU that check costs no
    synchronization.
    """

    name = "fused_adamw"
    capabilities = CAPABILITIES["fused_adamw"]

    def supports(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> bool:
        return self.capabilities.refusal(w, G, moment_dtype, level) is None

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Nothing to build: the kernel ships with torch."""

    def step_many(self, steps: list, limiter_eps: float) -> list:
        """One ``torch._fused_adamw_`` call per set of hyperparameters; returns
        the ParamSteps skipped for a non-finite gradient."""
        skipped = []
        calls: dict[tuple, list] = {}
        for ps, _, _ in steps:
            g = ps.group
            lr = g["lr"].item() if isinstance(g["lr"], Tensor) else g["lr"]
            key = (ps.param.dtype, lr, *g["betas"], g["eps"], g["weight_decay"])
            calls.setdefault(key, []).append(ps)
        for (_, lr, beta1, beta2, eps, wd), items in calls.items():
            finite = all_finite([ps.grad for ps in items])
            if not all(finite):
                skipped += [ps for ps, ok in zip(items, finite) if not ok]
                items = [ps for ps, ok in zip(items, finite) if ok]
                if not items:
                    continue
            for ps in items:
                check_pointers(self.name, ps.param, ps.grad,
                               {"exp_avg": ps.state["exp_avg"], "exp_avg_sq": ps.state["exp_avg_sq"]}, 0)
            torch._fused_adamw_(
                [ps.param for ps in items],
                [ps.grad for ps in items],
                [ps.state["exp_avg"] for ps in items],
                [ps.state["exp_avg_sq"] for ps in items],
                [],
                # The optimizer has advanced the step counts (CPU float32
                # tensors, as fused AdamW keeps them on CPU) before this call.
                [ps.state["step"] for ps in items],
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
            )
        return skipped


def all_finite(tensors: list[Tensor]) -> list[bool]:
    """Whether each tensor (one device and dtype) holds only finite values: one
    foreach max-norm, read once (on a GPU, one wait instead of one each)."""
    return torch.stack(torch._foreach_norm(tensors, math.inf)).isfinite().tolist()


# ------------------------------------------------------------- building --- #


def _triton_backend() -> Any:
    try:
        from gwt_optim.optim import _triton
    except ImportError as exc:
        raise KernelUnavailable(f"Triton is not installed ({exc}); pip install triton") from exc
    return _triton.TritonBackend()


BACKENDS: dict[str, Callable[[], Any]] = {
    "native": NativeBackend,
    "triton": _triton_backend,
}


def check_compile_option(compile: bool | str | None) -> None:
    """Validate the optimizers' ``compile`` argument."""
    if compile is None or isinstance(compile, bool) or compile in BACKENDS:
        return
    if compile == "inductor":
        raise ValueError('compile="inductor" was removed: on CUDA the Triton backend ("triton", the default) '
                         "replaces it")
    raise ValueError(f"compile must be None (auto), True, False or one of {sorted(BACKENDS)}, got {compile!r}")


class AdamWHaarKernels:
    """GWT-AdamW's built backends, per ``compile`` (``None``: auto, ``True``:
    required, or a name from :data:`BACKENDS`): it builds each on first use
    and compiles what a parameter needs, and remembers what failed.
    :meth:`GWTOptimizer.select_backend <gwt_optim.optim._base.GWTOptimizer.select_backend>`
    decides which backend to ask for.

    A failure to build or prepare a backend the caller marks ``strict`` (the
    last choice for a transformed step) is an error unless ``compile`` is
    ``None``, where it warns once and the eager path runs; any other failure
    falls through silently to the next choice.
    """

    def __init__(self, compile: bool | str | None) -> None:
        check_compile_option(compile)
        self.compile = compile
        self._backends: dict[str, Any] = {}
        self._failed: set[str] = set()
        # torch's kernel: nothing to build, and not one of the named backends.
        self._plain_cpu = FusedAdamWBackend()

    def _backend(self, name: str, strict: bool = True) -> Any | None:
        """The backend ``name``, built once, or None where it failed to build."""
        if name == FusedAdamWBackend.name:
            return self._plain_cpu
        if name in self._backends:
            return self._backends[name]
        if name in self._failed:
            return None
        try:
            backend = BACKENDS[name]()
        except Exception as exc:  # a missing compiler, a failed build, no torch.compile, no triton
            if self.compile is not None and strict:
                raise
            if strict:
                warnings.warn(
                    f"GWT-AdamW: the fused '{name}' kernels are unavailable ({exc}); using the eager path",
                    RuntimeWarning,
                    stacklevel=3,  # at route(), which asked for it
                )
            self._failed.add(name)
            return None
        self._backends[name] = backend
        return backend

    def prepare(self, backend: Any, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int,
                strict: bool) -> bool:
        """Build or compile what this parameter needs, before any state
        changes; False (and the backend dropped) where that failed."""
        try:
            backend.prepare(w, G, moment_dtype, level)
        except Exception as exc:  # e.g. no C compiler, or Triton fails to build
            if self.compile is not None and strict:
                raise KernelUnavailable(
                    f"compiling the fused '{backend.name}' kernels failed: {exc}; pass compile=False to use the "
                    "eager path"
                ) from exc
            warnings.warn(
                f"GWT-AdamW: compiling the fused '{backend.name}' kernels failed ({exc}); using "
                + ("the eager path" if strict else "the next backend"),
                RuntimeWarning,
                stacklevel=3,  # at route(), which asked for it
            )
            self._failed.add(backend.name)
            self._backends.pop(backend.name, None)
            return False
        return True
