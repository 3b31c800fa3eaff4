"""Where a parameter's step runs: what each fused backend declares it can do
(:class:`Capabilities`), and :func:`choose`, the one function that picks a
backend from those declarations, or says why none fits.

This module imports torch, ``functional`` and ``_family``: the backends
(``_fused``, ``_native``, ``_triton``) and the stepper import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import Tensor

from gwt_optim.optim._family import group_lr
from gwt_optim.optim.functional import AdamWScalars, adamw_scalars

__all__ = ["Bucket", "Capabilities", "Route", "CAPABILITIES", "MOMENT_DTYPES", "candidates", "choose",
           "moment_dtype", "moment_dtype_name", "route_key", "check_pointers", "kernel_scalars"]

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
# moment_dtype names; "int8": blockwise 8-bit codes plus fp32 block scales (_quant), uint8 tensors.
MOMENT_DTYPES = {"float32": F32, "bfloat16": BF16, "float64": F64, "int8": torch.uint8}


@dataclass(frozen=True)
class Capabilities:
    """What a backend takes and what it can do; nothing else is asked of it."""

    devices: frozenset[str]  # device types of the weight (and its gradient and moments)
    # (weight, gradient, moments) dtypes it reads and writes as they are: a
    # gradient in another dtype is cast to the compute dtype and asked again.
    dtypes: frozenset[tuple[torch.dtype, torch.dtype, torch.dtype]]
    levels: range
    # A tighter bound on the level for some weight dtypes: (dtype, max level).
    max_level: tuple[tuple[torch.dtype, int], ...] = ()
    contiguous: bool = True  # needs a contiguous weight and gradient: it walks flat memory
    detail_clip: bool = False  # a clipped form of the details (group["detail_clip"])
    int8_moments: bool = False  # reads moment_dtype="int8" codes
    # Runs whole steps (phase 1, limiter, phase 2) of many parameters in one
    # call (step_buckets): the "batched" path, and the plain level-0 step.
    batched: bool = False
    # phase1 and phase2 apart, around the limiter's all-reduce: DTensor
    # (FSDP2-sharded) parameters.
    dtensor: bool = False

    def refusal(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int, group: dict,
                sharded: bool) -> str | None:
        """Why this backend does not take weight ``w`` (local) with gradient
        ``G``, moments of ``moment_dtype`` at ``level`` under ``group``'s
        options, or None."""
        if w.device.type not in self.devices:
            return f"runs on {'/'.join(sorted(self.devices))}, not {w.device.type}"
        if G.device != w.device or G.shape != w.shape:
            return "the gradient is not on the weight's device or not of its shape"
        if w.ndim == 0:
            return "a 0-dimensional weight"
        if (w.dtype, G.dtype, moment_dtype) not in self.dtypes:
            return f"does not take {w.dtype} weights with {G.dtype} gradients and {moment_dtype} moments"
        bound = dict(self.max_level).get(w.dtype, self.levels[-1] if self.levels else -1)
        if level not in self.levels or level > bound:
            return f"does not take level {level} for {w.dtype} weights"
        if self.contiguous and not (w.is_contiguous() and G.is_contiguous()):
            return "needs a contiguous weight and gradient"
        if group["detail_clip"] is not None and not self.detail_clip:
            return "has no clipped form of the details (detail_clip)"
        if group["moment_dtype"] == "int8" and not self.int8_moments:
            return "does not read int8 moments"
        if level == 0 and not self.batched:
            return "does not run whole plain steps"
        if sharded and not self.dtensor:
            return "has no separate phases for a sharded parameter"
        return None


#: The backends' capabilities; each class's ``capabilities`` is its entry.
CAPABILITIES: dict[str, Capabilities] = {
    # torch._fused_adamw_ (level 0 on CPU): one dtype for weights, gradients and
    # moments. It walks flat memory, so a strided view or a gradient laid out
    # unlike its weight would be read and written out of place.
    "fused_adamw": Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset((d, d, d) for d in (F32, F64, BF16, F16)),
        levels=range(0, 1),
        detail_clip=True,  # level 0 has no details: the clip changes nothing
        batched=True,
    ),
    # The C kernels of _fused_cpu.c; bf16 weights keep fp32 moments, and a
    # segment of whole blocks bounds their level (gwt_bf16_max_level()).
    "native": Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({(F32, F32, F32), (F64, F64, F64), (BF16, BF16, F32)}),
        levels=range(0, 17),
        max_level=((BF16, 11),),
        detail_clip=True,  # a hyperparameter of phase 2 (0 when off)
        batched=True,
        dtensor=True,
    ),
    # The Triton kernels: fp32, bf16 and fp16 weights and gradients
    # independently (a bf16 gradient is read as it is), fp32 or bf16 moments.
    # TritonBackend(cpu=True) adds "cpu" (the interpreter, host-time benchmarks).
    "triton": Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset((w, g, m) for w in (F32, BF16, F16) for g in (F32, BF16, F16) for m in (F32, BF16)),
        levels=range(0, 11),
        detail_clip=True,  # a kernel argument (+inf when off)
        batched=True,
        dtensor=True,
    ),
}

# The backends "auto" tries per device type for a transformed step.
_AUTO = {"cpu": ("native",), "cuda": ("triton",)}


@dataclass
class Bucket:
    """Whole steps that a batched backend runs with one set of scalars, as
    lists of tensors (as ``torch._fused_adamw_`` takes them): the parameters
    of one group and step count whose alpha is all the group's or all 1.

    While a step plan holds, the backend gets the same list of the same
    Buckets on every step with the plan's table for it, only ``step``,
    ``scalars`` and ``grads`` new, so it may keep what it derives from them
    in that table (the plan's, dropped with it): the plan has checked the parameters (address, shape,
    strides, dtype, device) and the state tensors (the same, at the same
    addresses); a gradient may be a new tensor of the same dtype, shape,
    strides and device.
    """

    group: dict
    step: int  # the step count after this step's increment
    scaled: bool  # alpha is the group's "scale" (else 1)
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)  # emptied after the step: the plan keeps no gradient alive
    states: list[dict] = field(default_factory=list)
    levels: list[int] = field(default_factory=list)  # the group's level; 0 for fewer than two dimensions
    limited: list[bool] = field(default_factory=list)  # whether the limiter applies
    scalars: AdamWScalars | None = None  # this step's (kernel_scalars), set before each launch


def kernel_scalars(group: dict, step: int, alpha: float) -> AdamWScalars:
    """The scalars of a step of ``group``'s parameters at ``alpha`` for the
    kernels: :func:`~gwt_optim.optim.functional.adamw_scalars` on the group's
    options."""
    beta1, beta2 = group["betas"]
    return adamw_scalars(step, lr=group_lr(group), beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], alpha=alpha)


@dataclass(frozen=True)
class Route:
    """:func:`choose`'s answer for one parameter."""

    backend: Any  # a built and prepared fused backend, or None: the family's eager halves
    # The local gradient as the step reads it: in its own dtype where the
    # backend takes that dtype, else in the compute dtype (at least fp32).
    grad: Tensor
    level: int  # the group's level; 0 for parameters with fewer than two dimensions
    reason: str | None  # why no backend fits (None when one does)


def choose(kernels: Any, group: dict, w: Tensor, g: Tensor, sharded: bool, limited: bool) -> Route:
    """The fused backend that runs the step of weight ``w`` (local) with
    gradient ``g`` in ``group``, or why none does: the one place that decides
    it, from the parameter's bucket (the group's options, device, dtypes,
    level and layout) and what each backend declares. The answer is kept per
    bucket (``kernels.routes``, forgotten when a backend fails).

    ``kernels`` holds the family's backends under its ``backend=`` option
    (:class:`gwt_optim.optim._fused.Kernels`; None: the family has none).
    A kernel computes a transformed Haar step, or at level 0 the plain
    family's (no limiter (``limited``), alpha 1, an unsharded tensor). The
    :func:`candidates` are tried in order, with the gradient in its own dtype
    (a backend that reads it takes it without a copy) and then in the compute
    dtype; the first whose :meth:`Capabilities.refusal` is None and that
    builds and prepares wins.
    """
    level = group["level"] if w.ndim >= 2 else 0
    cdt = torch.promote_types(w.dtype, F32)
    if kernels is None:
        return Route(None, g.to(cdt), level, "the family has no fused kernels")
    # Everything _choose reads of the parameter, its gradient and its group.
    key = (route_key(group), w.device, w.dtype, g.device, g.dtype, min(w.ndim, 2), g.shape == w.shape,
           w.is_contiguous(), g.is_contiguous(), sharded, limited)
    known = kernels.routes.get(key)
    if known is None:
        known = kernels.routes[key] = _choose(kernels, group, w, g, sharded, limited, level, cdt)
    backend, cast, reason = known
    return Route(backend, g.to(cdt) if cast else g, level, reason)


def _choose(kernels: Any, group: dict, w: Tensor, g: Tensor, sharded: bool, limited: bool, level: int,
            cdt: torch.dtype) -> tuple[Any, bool, str | None]:
    """:func:`choose`'s answer as (backend, whether the gradient is cast, reason)."""
    reason = kernels.refusal(group)
    if reason is None and level > 0 and group["wavelet"] != "haar":
        reason = f"the {group['wavelet']!r} wavelet has no closed form for the kernels"
    if reason is None and level == 0 and (w.ndim == 0 or sharded or limited or (w.ndim >= 2 and group["scale"] != 1)):
        reason = "at level 0 only the plain step (no limiter, alpha 1, an unsharded tensor) has kernels"
    if reason is not None:
        return None, True, reason
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
                    return backend, cast, None
                why = "failed to compile for this parameter"
            refusals.append(f"{name}: {why}")
        if g.dtype == cdt:
            return None, cast, "; ".join(refusals)
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


def moment_dtype_name(md: Any) -> Any:
    """``moment_dtype`` as groups hold it (a :data:`MOMENT_DTYPES` name, saved as is in a state
    dict): a torch dtype becomes its name (``torch.int8``: ``"int8"``); any other value is left for
    the validation to refuse."""
    if isinstance(md, torch.dtype):
        names = {v: k for k, v in MOMENT_DTYPES.items() if k != "int8"}  # int8's codes are uint8: not that dtype
        return "int8" if md == torch.int8 else names.get(md, md)
    return md


def moment_dtype(group: dict, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the group's moments: its ``moment_dtype``, else the compute dtype."""
    md = group["moment_dtype"]
    return MOMENT_DTYPES[md] if md is not None else compute_dtype


def route_key(group: dict) -> tuple:
    """The group options that choose each parameter's backend and state,
    rather than only a kernel's arguments: a change makes a new step plan."""
    return (group["level"], group["wavelet"], group["moment_dtype"], group["scale"] == 1,
            group["norm_growth_limit"] is None, group["detail_clip"] is None)


def check_pointers(backend: str, w: Tensor, g: Tensor, state: dict | None, level: int,
                   extra: Iterable[str] = ()) -> None:
    """Raise ``ValueError`` unless weight ``w``, gradient ``g`` and the
    moments of ``state`` (None: none) are fit for a kernel that walks flat
    memory (every tensor dense and contiguous, on one device, the gradient of
    the weight's shape and the moments of A_l's) and the backend found no
    problems of its own (``extra``): the last check before a backend hands
    raw addresses to C or Triton (routing should never get here with such
    tensors; a kernel trusts no caller)."""
    problems = []
    if g.shape != w.shape:
        problems.append(f"gradient shape {tuple(g.shape)} != parameter shape {tuple(w.shape)}")
    n = w.shape[-1] if w.ndim else 1
    moment_shape = (*w.shape[:-1], -(-n // (1 << level)))
    moments = {} if state is None else {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
    for name, x in (("parameter", w), ("gradient", g), *moments.items()):
        if x.device != w.device:
            problems.append(f"{name} on {x.device}, not {w.device}")
        if x.layout != torch.strided or not x.is_contiguous():
            problems.append(f"{name} is not contiguous")
        if name in moments and tuple(x.shape) != moment_shape:
            problems.append(f"{name} has shape {tuple(x.shape)}, expected {moment_shape}")
    problems += extra
    if problems:
        raise ValueError(f"GWT-AdamW ({backend}): cannot step a parameter of shape {tuple(w.shape)}: "
                         + "; ".join(problems))
