"""What each fused backend supports, as data, and the answer of the one
function that picks a backend for a parameter.

Every backend class carries a :class:`Capabilities` (``capabilities``); the
table below is the one place they are written. :meth:`GWTOptimizer.select_backend
<gwt_optim.optim._base.GWTOptimizer.select_backend>` reads them to pick a
backend, or says why none fits (a :class:`Choice`), and
:meth:`~gwt_optim.optim._base.GWTOptimizer.route` maps that answer to a path.

This module imports only torch: the backends (``_fused``, ``_native``,
``_triton``) and the optimizer import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Capabilities", "Choice", "CAPABILITIES", "candidates", "pointer_problems", "check_pointers"]

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


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
    contiguous: bool = True  # needs a contiguous weight and gradient
    detail_clip: bool = False  # a clipped form of the details (group["detail_clip"])
    int8_moments: bool = False  # reads moment_dtype="int8" codes
    match_rms: bool = False  # rescales each row of the update (group["match_rms"], the transfer rule)
    # Runs whole steps (phase 1, limiter, phase 2) of many parameters in one
    # call (step_many): the "batched" path, and the plain level-0 step.
    batched: bool = False
    # step_batches(batches, limiter_eps, key=...) and invalidate(): keeps
    # tables per plan of the optimizer's Stepper.
    plans: bool = False
    # phase1 and phase2 apart, around the limiter's all-reduce: DTensor
    # (FSDP2-sharded) parameters, the "fused" path.
    dtensor: bool = False

    def refusal(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> str | None:
        """Why this backend does not take weight ``w`` (local, not a DTensor)
        with gradient ``G`` and moments of ``moment_dtype`` at ``level``, or None."""
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
        return None


@dataclass(frozen=True)
class Choice:
    """:meth:`~gwt_optim.optim._base.GWTOptimizer.select_backend`'s answer for one parameter."""

    backend: Any  # a built and prepared backend, or None for an eager path
    # The local gradient as the answer reads it: in its own dtype where the
    # backend takes that dtype, else in the compute dtype (at least fp32).
    grad: Tensor
    level: int  # the group's level; 0 for parameters with fewer than two dimensions
    transformed: bool  # two or more dimensions: the wavelet step, scale and limiter apply
    reason: str | None  # why no backend fits (None when one does)


def _product(weights, grads, moments) -> frozenset:
    return frozenset((w, g, m) for w in weights for g in grads for m in moments)


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
        plans=True,
        dtensor=True,
    ),
    # The Triton kernels: fp32, bf16 and fp16 weights and gradients
    # independently (a bf16 gradient is read as it is), fp32 or bf16 moments.
    # TritonBackend(cpu=True) adds "cpu" (the interpreter, host-time benchmarks).
    "triton": Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=_product((F32, BF16, F16), (F32, BF16, F16), (F32, BF16)),
        levels=range(0, 11),
        detail_clip=True,  # a kernel argument (+inf when off)
        batched=True,
        plans=True,
        dtensor=True,
    ),
}

# The backends compile=None/True tries per device type for a transformed step.
_AUTO = {"cpu": ("native",), "cuda": ("triton",)}


def candidates(compile: bool | str | None, device_type: str, level: int) -> list[tuple[str, bool]]:
    """GWT-AdamW's backends to try, in order, for a step at ``level`` on
    ``device_type`` under ``compile`` (not False), each with whether a
    failure to build or prepare it is the user's to see (a warning with
    ``compile=None``, an error otherwise) rather than a silent fall-through.

    Level 0 (plain AdamW: 1-D parameters, level-0 groups) takes
    ``torch._fused_adamw_`` on CPU, then the native kernels (bf16 weights with
    fp32 moments, which torch's kernel does not take), and the Triton kernels
    elsewhere; a named backend without that device's level-0 step gives none.
    A transformed step takes the named backend, or the device's."""
    if level == 0:
        if device_type == "cpu" and compile != "triton":
            return [("fused_adamw", False)] + ([("native", False)] if compile in (None, True, "native") else [])
        return [("triton", False)] if compile in (None, True, "triton") else []
    names = (compile,) if isinstance(compile, str) else _AUTO.get(device_type, ())
    return [(name, i == len(names) - 1) for i, name in enumerate(names)]


def pointer_problems(w: Tensor, g: Tensor, moments: dict[str, Tensor], level: int) -> list[str]:
    """What is wrong, for a kernel that walks flat memory, with weight ``w``,
    gradient ``g`` and ``moments`` (shaped like A_l): every tensor dense and
    contiguous, on one device, the gradient of the weight's shape and the
    moments of A_l's. Empty when the addresses may be handed over."""
    problems = []
    if g.shape != w.shape:
        problems.append(f"gradient shape {tuple(g.shape)} != parameter shape {tuple(w.shape)}")
    n = w.shape[-1] if w.ndim else 1
    moment_shape = (*w.shape[:-1], -(-n // (1 << level)))
    for name, x in (("parameter", w), ("gradient", g), *moments.items()):
        if x.device != w.device:
            problems.append(f"{name} on {x.device}, not {w.device}")
        if x.layout != torch.strided or not x.is_contiguous():
            problems.append(f"{name} is not contiguous")
        if name in moments and tuple(x.shape) != moment_shape:
            problems.append(f"{name} has shape {tuple(x.shape)}, expected {moment_shape}")
    return problems


def check_pointers(backend: str, w: Tensor, g: Tensor, moments: dict[str, Tensor], level: int) -> None:
    """Raise ``ValueError`` unless :func:`pointer_problems` finds nothing: the
    last check before a backend hands raw addresses to C or Triton (routing
    should never get here with such tensors; a kernel trusts no caller)."""
    problems = pointer_problems(w, g, moments, level)
    if problems:
        raise ValueError(f"GWT-AdamW ({backend}): cannot step a parameter of shape {tuple(w.shape)}: "
                         + "; ".join(problems))
