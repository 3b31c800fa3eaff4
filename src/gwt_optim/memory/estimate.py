"""Analytic bytes of weights and optimizer state, tensor by tensor, and the
peak of a training step (see :mod:`gwt_optim.memory`)."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from gwt_optim.memory.skeleton import TensorSpec, _config_specs, _model_dims, load_config_json, tensor_specs
from gwt_optim.registry import REGISTRY

__all__ = ["ESTIMATORS", "ALIASES", "estimator_key", "MemoryEstimate", "estimate", "TrainingEstimate",
           "training_estimate", "DTYPE_NAMES", "STATE_DTYPE_NAMES"]


# --------------------------------------------------------------------------- #
# Analytic state, tensor by tensor
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Settings:
    """What the per-tensor rules need besides the tensor."""

    level: int
    rank: int
    weight_bytes: int  # bytes per weight
    state_bytes: int  # bytes per optimizer-state element
    state_dtype: torch.dtype = torch.float32
    scalar_bytes: int = 4  # fp32 step counters and norms


# A rule gives the state bytes one optimizer keeps for one tensor.
Rule = Callable[[TensorSpec, Settings], int]


def _approx_numel(t: TensorSpec, level: int) -> int:
    """Entries of A_l: the rows times ceil(n / 2^l) columns (GWT on ndim >= 2;
    level 0 is the tensor itself), at the level the weight steps at
    (:func:`gwt_optim.optim.functional.step_level`: at most ceil(log2 n))."""
    if len(t.shape) < 2:
        return t.numel
    from gwt_optim.optim.functional import step_level
    from gwt_optim.wavelets import approx_length

    return t.rows * approx_length(t.cols, step_level(t.shape, level, 1.0)[0])


def _adam(t: TensorSpec, s: Settings, *, step_bytes: int = 4) -> int:
    return 2 * t.numel * s.state_bytes + step_bytes


def _quantized_adam(t: TensorSpec, s: Settings, *, bits: int, block: int, qmap: int) -> int:
    # torchao (like bitsandbytes) quantizes only tensors of >= 4096 values
    # that split into whole blocks; the rest keep full-precision moments.
    if t.numel < 4096 or t.numel % block:
        return _adam(t, s)
    per_moment = t.numel * bits // 8 + (t.numel // block) * 4 + qmap * 4
    return 2 * per_moment + 4


def _low_rank(t: TensorSpec, s: Settings, *, rank: int | None, limiter: bool, svd: bool) -> int:
    if len(t.shape) != 2:
        return _adam(t, s, step_bytes=0)
    m, n = t.shape
    r = min(rank or s.rank, m, n)
    # GaLore keeps its fp32 projector as a slice of the SVD factor, which holds
    # the whole min(m, n) x min(m, n) factor alive; other dtypes are cast,
    # which copies just the r rows/columns. APOLLO draws a fresh r x min(m, n).
    proj = min(m, n) if svd and s.state_dtype == torch.float32 else r
    # projector on the short side, both moments on the long side; steps are ints
    return (proj * min(m, n) + 2 * r * max(m, n)) * s.state_bytes + (s.state_bytes if limiter else 0)


def _adam_mini(t: TensorSpec, s: Settings, *, level: int = 0, step_bytes: int = 0, limiter: bool = False) -> int:
    blocks = {
        "element": t.numel,  # plain Adam: the second moment is full size
        "head": t.rows // max(t.head_dim, 1),
        "neuron": t.rows,
        "tensor": 1,
    }[t.block]
    return (_approx_numel(t, level) + blocks) * s.state_bytes + step_bytes + (s.scalar_bytes if limiter else 0)


def _muon(t: TensorSpec, s: Settings, *, level: int = 0, step_bytes: int = 0) -> int:
    if len(t.shape) != 2:  # Muon orthogonalizes matrices: the registry steps the rest with AdamW
        return _adam(t, s)
    return _approx_numel(t, level) * s.state_bytes + step_bytes


def _adafactor(t: TensorSpec, s: Settings, *, level: int = 0, limiter: bool = False) -> int:
    if len(t.shape) < 2:
        return t.numel * s.state_bytes + 4
    cols = _approx_numel(t, level) // t.rows
    # row statistics per row, column statistics per (leading index, column)
    factored = (t.rows + math.prod(t.shape[:-2]) * cols) * s.state_bytes
    return factored + 4 + (s.scalar_bytes if limiter else 0)


def _gwt_adam(t: TensorSpec, s: Settings, *, level: int, limiter: bool) -> int:
    if s.state_dtype == torch.int8:  # moment_dtype="int8"
        return 2 * _int8_moment(t, s, level) + 4 + (s.scalar_bytes if limiter else 0)
    return 2 * _approx_numel(t, level) * s.state_bytes + 4 + (s.scalar_bytes if limiter else 0)


def _int8_moment(t: TensorSpec, s: Settings, level: int) -> int:
    """One 8-bit moment (gwt_optim.optim._quant): a byte per value and an fp32
    scale per block of a row; vectors keep moments in the compute dtype."""
    if len(t.shape) < 2:
        return t.numel * max(s.weight_bytes, 4)
    from gwt_optim.optim._quant import blocks

    cols = _approx_numel(t, level) // t.rows
    return t.rows * (cols + 4 * blocks(cols))


@dataclass(frozen=True)
class Estimator:
    """State rules of one optimizer: for transformed weights and for the rest."""

    transformed: Callable[[TensorSpec, Settings], int]
    regular: Callable[[TensorSpec, Settings], int]
    help: str
    uses_level: bool = False
    uses_rank: bool = False  # the rank argument applies
    fixed_rank: int | None = None  # a rank the method fixes (APOLLO-Mini: 1)


def _at_level(rule: Callable[..., int], **fixed: Any) -> Rule:
    """Bind a GWT rule to the level in the settings."""
    return lambda t, s: rule(t, s, level=s.level, **fixed)


ESTIMATORS: dict[str, Estimator] = {
    "adamw": Estimator(_adam, _adam, "torch.optim.AdamW"),
    "adamw8bit": Estimator(
        functools.partial(_quantized_adam, bits=8, block=256, qmap=256),
        functools.partial(_quantized_adam, bits=8, block=256, qmap=256),
        "torchao AdamW8bit (bitsandbytes' layout up to its shared code map)",
    ),
    "adamw4bit": Estimator(
        functools.partial(_quantized_adam, bits=4, block=128, qmap=16),
        functools.partial(_quantized_adam, bits=4, block=128, qmap=16),
        "torchao AdamW4bit",
    ),
    "galore": Estimator(
        functools.partial(_low_rank, rank=None, limiter=False, svd=True),
        functools.partial(_adam, step_bytes=0),
        "galore_torch GaLoreAdamW, rank r",
        uses_rank=True,
    ),
    "apollo": Estimator(
        functools.partial(_low_rank, rank=None, limiter=True, svd=False),
        functools.partial(_adam, step_bytes=0),
        "apollo_torch APOLLOAdamW, rank r (channel-wise)",
        uses_rank=True,
    ),
    "apollo-mini": Estimator(
        functools.partial(_low_rank, rank=1, limiter=True, svd=False),
        functools.partial(_adam, step_bytes=0),
        "APOLLO-Mini: rank 1, tensor-wise scaling",
        fixed_rank=1,
    ),
    "adam-mini": Estimator(_adam_mini, _adam_mini, "adam_mini.Adam_mini"),
    "muon": Estimator(_muon, _adam, "torch.optim.Muon on hidden matrices + AdamW"),
    "adafactor": Estimator(_adafactor, _adafactor, "torch.optim.Adafactor"),
    "gwt-adamw": Estimator(
        _at_level(_gwt_adam, limiter=True),
        functools.partial(_gwt_adam, level=0, limiter=False),
        "GWTAdamW at level l",
        uses_level=True,
    ),
    "gwt-muon": Estimator(_at_level(_muon, step_bytes=4), _adam, "GWTMuon at level l + AdamW", uses_level=True),
    "gwt-adam-mini": Estimator(
        _at_level(_adam_mini, step_bytes=4, limiter=True),
        functools.partial(_adam_mini, step_bytes=4),
        "GWTAdamMini at level l",
        uses_level=True,
    ),
    "gwt-adafactor": Estimator(
        _at_level(_adafactor), _adafactor, "GWTAdafactor at level l (no first moment, no limiter)", uses_level=True
    ),
}



def estimator_key(optimizer_name: str) -> str:
    """The :data:`ESTIMATORS` key for ``optimizer_name``: a registry entry's
    ``memory`` (``adam8bit -> adamw8bit``), else the name itself.

    The registry is read on every call, so an entry registered after this
    module was imported is estimated too.
    """
    spec = REGISTRY.get(optimizer_name)
    return spec.memory if spec is not None else optimizer_name


# Registry names whose rule has another name, read off the registry (each
# entry's ``memory``) rather than kept as a second list of names.
ALIASES = {name: spec.memory for name, spec in REGISTRY.items() if spec.memory != name}


@dataclass
class MemoryEstimate:
    """Analytic bytes of weights and optimizer state for one model and optimizer."""

    model: str
    optimizer: str
    level: int | None
    rank: int | None
    weight_bytes: int
    state_bytes: int
    transformed_state_bytes: int  # part of state_bytes held for the transformed weights
    n_params: int
    n_transformed: int
    per_tensor: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.state_bytes

    @property
    def transformed_fraction(self) -> float:
        return self.n_transformed / self.n_params if self.n_params else 0.0

    def saving(self, baseline: "MemoryEstimate") -> float:
        """Fraction of the baseline's weights + state that this one saves."""
        return 1.0 - self.total_bytes / baseline.total_bytes

    def state_saving(self, baseline: "MemoryEstimate") -> float:
        return 1.0 - self.state_bytes / baseline.state_bytes


#: The short names ``dtype`` takes (and ``gwt-optim memory --dtype`` lists), besides torch's own names.
DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
#: Those ``state_dtype`` takes (``--state-dtype``): the weights' and GWT-AdamW's 8-bit moments.
STATE_DTYPE_NAMES = {**DTYPE_NAMES, "int8": torch.int8}


def _resolve_dtype(dtype: torch.dtype | str, names: dict[str, torch.dtype] = DTYPE_NAMES,
                   what: str = "dtype") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = names.get(dtype, getattr(torch, dtype, None))
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown {what} {dtype!r}; use one of {', '.join(names)} or a torch dtype name")
    return resolved


MAX_LEVEL = 16  # the optimizers accept no more (gwt_optim.optim)


def estimate(
    model_or_config: nn.Module | Mapping[str, Any] | str | Path,
    optimizer_name: str,
    *,
    level: int = 2,
    rank: int | None = None,
    dtype: torch.dtype | str | None = None,
    state_dtype: torch.dtype | str | None = None,
    recipe: str = "paper",
    dim: int | None = None,
    n_heads: int | None = None,
) -> MemoryEstimate:
    """Analytic bytes of weights plus optimizer state.

    Args:
        model_or_config: a module, a LLaMA config dict, a JSON path, or a
            packaged config name (``"60m"``, ``"llama_1b"``, ...).
        optimizer_name: a key of :data:`ESTIMATORS` (or a registry alias).
        level: GWT level ``l`` for the ``gwt-*`` families.
        rank: projection rank for GaLore/APOLLO (default: hidden size // 4).
        dtype: weight dtype; default the module's, or bf16 for a config (the
            GaLore/GWT papers' convention).
        state_dtype: optimizer-state dtype (default ``dtype``). Note that
            GWT's default keeps fp32 moments for bf16 weights
            (``moment_dtype="bfloat16"`` matches this estimate). ``"int8"``:
            GWT-AdamW's 8-bit moments (``moment_dtype="int8"``).
        recipe: which weights get the transform (:mod:`gwt_optim.groups`).
        dim, n_heads: hidden size and heads for Adam-mini's head blocks, if
            the module has no ``config``.
    """
    key = estimator_key(optimizer_name)
    if key not in ESTIMATORS:
        raise ValueError(f"no memory estimate for {optimizer_name!r}; known: {', '.join(ESTIMATORS)}")
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= MAX_LEVEL:
        raise ValueError(f"level must be an integer from 0 to {MAX_LEVEL} (each level halves the state), got {level!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if isinstance(model_or_config, nn.Module):
        model = model_or_config
        label = type(model).__name__
        if dtype is None:
            dtype = next(model.parameters()).dtype
        specs = tensor_specs(model, recipe, dim=dim, n_heads=n_heads)
        d, _ = _model_dims(model, dim, n_heads)
    else:
        config = load_config_json(model_or_config)
        label = str(model_or_config) if not isinstance(model_or_config, Mapping) else "config"
        dtype = dtype or torch.bfloat16
        specs = _config_specs(json.dumps(config, sort_keys=True), recipe, dim, n_heads)
        d = dim or config["hidden_size"]
    if rank is None:
        rank = max((d or 256) // 4, 1)
    dtype = _resolve_dtype(dtype)
    sdt = _resolve_dtype(state_dtype or dtype, STATE_DTYPE_NAMES, "state dtype")
    if sdt == torch.int8 and key != "gwt-adamw":
        raise ValueError(f"int8 state is estimated for gwt-adamw only (moment_dtype='int8'), not {key!r}")
    wb = dtype.itemsize
    settings = Settings(level=level, rank=rank, weight_bytes=wb, state_bytes=sdt.itemsize, state_dtype=sdt)
    est = ESTIMATORS[key]
    per_tensor = {t.name: (est.transformed if t.transformed else est.regular)(t, settings) for t in specs}
    return MemoryEstimate(
        model=label,
        optimizer=key,
        level=level if est.uses_level else None,
        rank=est.fixed_rank or (rank if est.uses_rank else None),
        weight_bytes=sum(t.numel for t in specs) * wb,
        state_bytes=sum(per_tensor.values()),
        transformed_state_bytes=sum(per_tensor[t.name] for t in specs if t.transformed),
        n_params=sum(t.numel for t in specs),
        n_transformed=sum(t.numel for t in specs if t.transformed),
        per_tensor=per_tensor,
    )


# --------------------------------------------------------------------------- #
# The training peak: weights, state, gradients, activations, step temporaries
# --------------------------------------------------------------------------- #


@dataclass
class TrainingEstimate:
    """Analytic peak bytes of one training step of a LLaMA model (CPU, no
    autocast: activations in the weights' dtype), by part. Excludes the
    process's own baseline (the Python runtime and libraries): add it to
    compare with a peak RSS."""

    model: str
    optimizer: str
    weights: int
    state: int
    gradients: int  # alive at the peak: all of them, or the largest one in backward
    activations: int  # saved for backward, plus the loss's and one layer's backward buffers
    workspace: int  # the largest temporaries of one parameter's step
    held_activations: int  # still held when the head (the first parameter in backward) is stepped
    step_in_backward: bool
    gradient_checkpointing: bool
    batch_size: int
    seq_len: int

    @property
    def total(self) -> int:
        if self.step_in_backward:
            # The head is stepped first in backward, after the loss's buffers
            # are gone but with every layer's activations still held.
            step = self.held_activations + self.gradients + self.workspace
        else:
            # Activations shrink as gradients grow; the step holds every gradient.
            step = self.gradients + self.workspace
        return self.weights + self.state + max(self.activations, step)

    def parts(self) -> dict[str, int]:
        return {"weights": self.weights, "optimizer state": self.state, "gradients": self.gradients,
                "activations": self.activations, "step workspace": self.workspace, "total": self.total}


def _activation_bytes(cfg: Mapping[str, Any], batch: int, seq: int, ab: int, checkpointing: bool) -> tuple[int, int, int]:
    """Bytes autograd saves for a Hugging Face LLaMA forward (sdpa attention),
    fitted to what ``saved_tensors_hooks`` records (tests/test_memory_training.py):
    per layer and token ab (10 h + 4 i) (norm inputs, q/k/v and rotated q/k,
    attention output, the MLP's gate, up, SiLU and product) plus fp32 copies
    of the norm inputs for low-precision weights; the final norm and
    head's input (3 h); the fp32 log-softmax over the vocabulary. Returns what
    the forward saves, the peak, and what is held when the head's gradient is
    complete (every layer's activations and the logits' gradient)."""
    h, i, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    L, H = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    up = 0 if ab == 4 else 4  # an fp32 copy made from low-precision values
    per_layer = ab * (10 * h + 4 * i) + up * h + 4 * H + 8
    # Checkpointing keeps each layer's input and recomputes one layer at a time in backward.
    layers = L * ab * h if checkpointing else L * per_layer
    rest = ab * 3 * h + up * h + 4 * V + 276
    saved = layers + rest
    # Backward starts with the loss: the gradients of the log-probabilities and
    # the logits (fp32, plus the cast back); later each layer holds one layer's
    # buffers (and its recomputed activations, under checkpointing).
    extra = max(V * (8 + (ab if ab != 4 else 0)), per_layer * (2 if checkpointing else 1))
    held = saved - 4 * V + ab * V
    return batch * seq * saved, batch * seq * (saved + extra), batch * seq * held


def _step_workspace(t: TensorSpec, key: str, s: Settings) -> int:
    """Bytes of temporaries while one parameter is stepped (the paths on CPU)."""
    n = t.numel
    if key == "adamw":
        return 0  # the toolkit's fused AdamW updates in place
    if key != "gwt-adamw":
        return 2 * 4 * n  # not calibrated: two fp32 copies
    approx = _approx_numel(t, s.level if t.transformed else 0)
    if s.state_dtype != torch.int8 and s.weight_bytes >= 4:
        # The native C kernels (transformed) and torch's fused AdamW (level 0).
        return 2 * 4 * approx if t.transformed else 0
    # The eager path: an fp32 copy of a low-precision gradient and of the
    # weight, the full-size direction, and (level 0) U and den.
    casts = 2 * 4 * n if s.weight_bytes < 4 else 0
    if t.transformed:
        return casts + 4 * n + 6 * 4 * approx
    return casts + 4 * n + (2 if s.state_dtype == torch.int8 else 6) * 4 * n


def training_estimate(
    model_or_config: nn.Module | Mapping[str, Any] | str | Path,
    optimizer_name: str,
    *,
    level: int = 2,
    dtype: torch.dtype | str | None = None,
    state_dtype: torch.dtype | str | None = None,
    batch_size: int = 1,
    seq_len: int = 256,
    gradient_checkpointing: bool = False,
    step_in_backward: bool = False,
    vocab_size: int | None = None,
    recipe: str = "paper",
) -> TrainingEstimate:
    """Peak bytes of a training step: :func:`estimate`'s weights and state,
    plus gradients, activations and the step's temporaries.

    A normal step holds every gradient when it runs; a step inside backward
    (:func:`gwt_optim.step_in_backward`) holds only the one being stepped (the
    largest: the embedding or the head), but while the activations are still
    held. ``state_dtype`` as :func:`estimate` (``"int8"`` for GWT-AdamW's
    8-bit moments); ``vocab_size`` overrides the config's.
    """
    if isinstance(model_or_config, nn.Module):
        cfg_obj = getattr(model_or_config, "config", None)
        cfg = cfg_obj if isinstance(cfg_obj, dict) else (cfg_obj.to_dict() if cfg_obj is not None else {})
        model = model_or_config
    else:
        cfg = load_config_json(model_or_config)
        if vocab_size is not None:
            cfg = {**cfg, "vocab_size": vocab_size}
        model = cfg
    e = estimate(model, optimizer_name, level=level, dtype=dtype, state_dtype=state_dtype, recipe=recipe)
    wb = e.weight_bytes // e.n_params
    specs = (tensor_specs(model_or_config, recipe) if isinstance(model_or_config, nn.Module)
             else _config_specs(json.dumps(cfg, sort_keys=True), recipe, None, None))
    sdt = _resolve_dtype(state_dtype or dtype or (torch.bfloat16 if wb == 2 else torch.float32), STATE_DTYPE_NAMES,
                         "state dtype")
    settings = Settings(level=level, rank=1, weight_bytes=wb, state_bytes=sdt.itemsize, state_dtype=sdt)
    grads = max(t.numel for t in specs) * wb if step_in_backward else e.n_params * wb
    _, activations, held = _activation_bytes(cfg, batch_size, seq_len, wb, gradient_checkpointing)
    return TrainingEstimate(
        model=e.model,
        optimizer=e.optimizer,
        weights=e.weight_bytes,
        state=e.state_bytes,
        gradients=grads,
        activations=activations,
        workspace=max(_step_workspace(t, e.optimizer, settings) for t in specs),
        held_activations=held,
        step_in_backward=step_in_backward,
        gradient_checkpointing=gradient_checkpointing,
        batch_size=batch_size,
        seq_len=seq_len,
    )
