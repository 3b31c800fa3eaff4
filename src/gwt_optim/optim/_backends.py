"""What the fused backends share with their caller, and nothing that picks
one: what each backend declares it takes (:class:`Capabilities`, one table),
the protocol it follows (:class:`FusedBackend`), what a batched backend is
handed (:class:`Bucket`, with the step's :func:`kernel_scalars`), the last
check before a kernel reads raw addresses (:func:`check_pointers`), and the
moment dtypes a group may ask for.

The backends (``_torch_fused``, ``_native``, ``_triton``) import this module
and no other of ``optim`` but ``functional``; the dispatcher
(:mod:`gwt_optim.optim._dispatch`), which picks a backend per parameter, and
the stepper import them. The capability table sits here, not in each backend
nor in the dispatcher: the dispatcher reads a backend's entry before that
backend is built or imported (Triton's module needs triton), and each backend
reads its own (Triton's level bound sizes its kernels), so it is below both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

import torch
from torch import Tensor

from gwt_optim.optim._family import group_lr
from gwt_optim.optim.functional import AdamWScalars, adamw_scalars

__all__ = ["Bucket", "Capabilities", "CAPABILITIES", "FusedBackend", "MOMENT_DTYPES", "all_finite",
           "check_pointers", "kernel_scalars", "moment_dtype", "moment_dtype_name"]

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


#: What each backend takes; each backend class's ``capabilities`` is its entry (a built
#: backend may adjust it: the native library's own bf16 bound, Triton's interpreter adds CPU).
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


@dataclass
class Bucket:
    """Whole steps that a batched backend runs with one set of scalars, as
    lists of tensors (as ``torch._fused_adamw_`` takes them): the parameters
    of one group, step count and alpha (1, the group's scale, or a capped weight's:
    :func:`~gwt_optim.optim.functional.step_level`).

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
    alpha: float  # the alpha its parameters step at
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)  # emptied after the step: the plan keeps no gradient alive
    states: list[dict] = field(default_factory=list)
    levels: list[int] = field(default_factory=list)  # each parameter's (functional.step_level's)
    limited: list[bool] = field(default_factory=list)  # whether the limiter applies
    scalars: AdamWScalars | None = None  # this step's (kernel_scalars), set before each launch


def kernel_scalars(group: dict, step: int, alpha: float) -> AdamWScalars:
    """The scalars of a step of ``group``'s parameters at ``alpha`` for the
    kernels: :func:`~gwt_optim.optim.functional.adamw_scalars` on the group's
    options."""
    beta1, beta2 = group["betas"]
    return adamw_scalars(step, lr=group_lr(group), beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], alpha=alpha, detail_clip=group.get("detail_clip"),
                         detail_clip_units=group.get("detail_clip_units", "stored"))


class FusedBackend(Protocol):
    """A fused backend of the Haar GWT-AdamW step. Nothing is asked of it but
    its :attr:`capabilities` (its entry in :data:`CAPABILITIES`); each
    parameter's state is checked (:func:`gwt_optim.optim._saved.state_problem`)
    before it is handed over."""

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
        carry, which holds ``scalars`` (the step's, :func:`kernel_scalars`) for phase 2."""

    def phase2(self, w: Tensor, G: Tensor, level: int, carry: Any, r: float | Tensor) -> None:
        """``w <- w * decay - step_size / r * delta`` (the carry's scalars), right after phase 1 or later."""


def all_finite(tensors: list[Tensor]) -> list[bool]:
    """Whether each tensor (one device and dtype) holds only finite values: one
    foreach max-norm, read once (on a GPU, one wait instead of one each)."""
    return torch.stack(torch._foreach_norm(tensors, math.inf)).isfinite().tolist()


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
