r"""Optimizer memory: measured bytes of a live optimizer, and analytic estimates.

:func:`optimizer_state_bytes` counts the bytes an optimizer's state really
holds: every tensor reachable from ``optimizer.state`` (through dicts, lists
and helper objects such as GaLore's projector), with tensor subclasses such as
torchao's 8-/4-bit ``OptimState8bit``/``OptimState4bit`` and ``DTensor``
counted through their inner tensors (``__tensor_flatten__``), and each storage
counted once.

:func:`estimate` gives the analytic bytes of weights plus optimizer state for a
model -- a ``nn.Module``, a Hugging Face LLaMA config (dict or JSON path) or
the name of a packaged config (``"60m"`` ... ``"7b"``) -- under one optimizer,
tensor by tensor, following what each implementation allocates:

==================  =======================================================
``adamw``           ``torch.optim.AdamW``: 2 moments + a 4-byte step
``adamw8bit``       torchao ``AdamW8bit``: 1-byte codes, an fp32 scale per
                    256 values and a 256-entry code map per moment, for
                    tensors of >= 4096 values (others stay full precision)
``adamw4bit``       torchao ``AdamW4bit``: 4-bit codes, blocks of 128
``galore``          GaLore rank r: projector r x min(m, n) and moments
                    r x max(m, n) on the transformed weights
``apollo``          APOLLO rank r: the same layout (random projector) plus
                    the limiter's scalar
``apollo-mini``     APOLLO with rank 1 (tensor-wise scaling)
``adam-mini``       full first moment, one second-moment scalar per block
``muon``            one momentum buffer per hidden matrix, AdamW elsewhere
``adafactor``       ``torch.optim.Adafactor``: row + column statistics
``gwt-*``           each GWT family at level l: its state on the
                    approximation coefficients (ceil(n / 2^l) columns)
==================  =======================================================

The *transformed* weights are those the recipe of :mod:`gwt_optim.groups`
chooses (the paper's: attention and MLP linear weights); low-rank methods
(GaLore, APOLLO) project the same weights, Muon orthogonalizes them, and every
other parameter gets the family's plain form (AdamW for Muon). The module
imports only torch; it needs no transformers for a config.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

__all__ = [
    "optimizer_state_bytes",
    "tensor_bytes",
    "estimate",
    "MemoryEstimate",
    "TensorSpec",
    "ESTIMATORS",
    "load_config",
    "llama_skeleton",
    "memory_table",
    "TrainingEstimate",
    "training_estimate",
    "register",
]

# --------------------------------------------------------------------------- #
# Measured bytes
# --------------------------------------------------------------------------- #


def _storage_key(t: Tensor) -> tuple:
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    # Meta and zero-size storages have no address; key them by identity.
    return (t.device.type, t.device.index, ptr) if ptr else ("id", id(storage))


def tensor_bytes(t: Tensor, _seen: set | None = None) -> int:
    """Bytes held by ``t``'s storage, counting each storage once per ``_seen``.

    Wrapper subclasses (torchao's quantized optimizer states, ``DTensor``)
    hold no storage of their own: their ``__tensor_flatten__`` inner tensors
    (codes, scales, code maps, the local shard) are counted instead.
    """
    seen = set() if _seen is None else _seen
    if type(t).__name__ == "DTensor" and hasattr(t, "to_local"):
        return tensor_bytes(t.to_local(), seen)  # this rank's shard
    if hasattr(type(t), "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return sum(tensor_bytes(x, seen) for x in inner if isinstance(x, Tensor))
    key = _storage_key(t)
    if key in seen:
        return 0
    seen.add(key)
    return t.untyped_storage().nbytes()


def _walk_bytes(obj: Any, seen: set, visited: set) -> int:
    """Bytes of every tensor reachable from ``obj`` (containers, plain objects)."""
    if isinstance(obj, Tensor):
        return tensor_bytes(obj, seen)
    if isinstance(obj, (str, bytes, int, float, bool, type(None), nn.Module)):
        return 0
    if id(obj) in visited:
        return 0
    visited.add(id(obj))
    if isinstance(obj, Mapping):
        return sum(_walk_bytes(v, seen, visited) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(_walk_bytes(v, seen, visited) for v in obj)
    # Helper objects in the state, e.g. GaLore's projector holding its matrix.
    attrs = getattr(obj, "__dict__", None)
    return _walk_bytes(attrs, seen, visited) if attrs else 0


def optimizer_state_bytes(
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], *, per_param: bool = False
) -> int | dict[Tensor, int]:
    """Bytes really held by the state of one optimizer (or several, e.g. the
    Muon + AdamW pair of the usual Muon recipe).

    Counts every tensor in ``optimizer.state``, including tensors inside helper
    objects and the inner tensors of quantized tensor subclasses; shared
    storages are counted once. Call it after the first ``step()``: most
    optimizers allocate their state lazily. With ``per_param=True`` returns
    ``{param: bytes}`` instead of the total.
    """
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    seen: set = set()
    out: dict[Tensor, int] = {}
    for opt in optimizers:
        for p, state in opt.state.items():
            out[p] = out.get(p, 0) + _walk_bytes(state, seen, set())
    return out if per_param else sum(out.values())


# --------------------------------------------------------------------------- #
# Model description: parameters as (name, shape, transformed, Adam-mini block)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class TensorSpec:
    """One trainable parameter as the estimators see it."""

    name: str
    shape: tuple[int, ...]
    transformed: bool  # chosen by the recipe: gets GWT / low-rank projection / Muon
    block: str  # Adam-mini block kind (gwt_optim.optim.adam_mini.adam_mini_block)
    head_dim: int  # rows per Adam-mini head block

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Entries along all but the last axis (the rows the transform runs along)."""
        return math.prod(self.shape[:-1]) if len(self.shape) >= 2 else 1

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1


_CONFIG_DIR = "configs"


def load_config(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A LLaMA config as a dict, from a dict, a JSON path or a packaged name.

    Packaged names are ``"60m"``, ``"llama_60m"`` or ``"llama_60m.json"`` for
    the configs in ``gwt_optim/configs`` (9M to 7B).
    """
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if path.is_file():
        return json.loads(path.read_text())
    stem = path.name.removesuffix(".json")
    stem = stem if stem.startswith("llama_") else f"llama_{stem.lower()}"
    packaged = resources.files("gwt_optim").joinpath(_CONFIG_DIR, f"{stem}.json")
    if packaged.is_file():
        return json.loads(packaged.read_text())
    names = sorted(
        p.name.removesuffix(".json").removeprefix("llama_")
        for p in resources.files("gwt_optim").joinpath(_CONFIG_DIR).iterdir()
        if p.name.endswith(".json")
    )
    raise FileNotFoundError(f"no config file {str(config)!r} and no packaged config of that name; packaged: {names}")


def llama_skeleton(config: Mapping[str, Any]) -> nn.Module:
    """A parameter-only LLaMA on the meta device (no memory, no transformers).

    It has the module tree and parameter names of ``transformers``'
    ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj.weight``, ...), so
    the recipes of :mod:`gwt_optim.groups` and Adam-mini's name-based blocks
    see it exactly as they see the real model.
    """
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    attn_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))

    def block(**children: nn.Module) -> nn.Module:
        m = nn.Module()
        for k, v in children.items():
            m.add_module(k, v)
        return m

    with torch.device("meta"):
        layers = nn.ModuleList(
            block(
                self_attn=block(
                    q_proj=nn.Linear(h, heads * head_dim, bias=attn_bias),
                    k_proj=nn.Linear(h, kv_heads * head_dim, bias=attn_bias),
                    v_proj=nn.Linear(h, kv_heads * head_dim, bias=attn_bias),
                    o_proj=nn.Linear(heads * head_dim, h, bias=attn_bias),
                ),
                mlp=block(
                    gate_proj=nn.Linear(h, inter, bias=mlp_bias),
                    up_proj=nn.Linear(h, inter, bias=mlp_bias),
                    down_proj=nn.Linear(inter, h, bias=mlp_bias),
                ),
                input_layernorm=nn.RMSNorm(h),
                post_attention_layernorm=nn.RMSNorm(h),
            )
            for _ in range(config["num_hidden_layers"])
        )
        root = block(
            # _weight skips Embedding's init, whose import of torch._dynamo costs seconds
            model=block(
                embed_tokens=nn.Embedding(vocab, h, _weight=torch.empty(vocab, h)), layers=layers, norm=nn.RMSNorm(h)
            ),
            lm_head=nn.Linear(h, vocab, bias=False),
        )
    if config.get("tie_word_embeddings", False):
        root.lm_head.weight = root.model.embed_tokens.weight
    root.config = dict(config)  # type: ignore[assignment]
    return root


def _model_dims(model: nn.Module, dim: int | None, n_heads: int | None) -> tuple[int | None, int | None]:
    cfg = getattr(model, "config", None)
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    return dim or get("hidden_size", None), n_heads or get("num_attention_heads", None)


def tensor_specs(
    model: nn.Module,
    recipe: str = "paper",
    *,
    dim: int | None = None,
    n_heads: int | None = None,
) -> list[TensorSpec]:
    """Describe ``model``'s trainable parameters for the estimators."""
    from gwt_optim.groups import split_params
    from gwt_optim.optim.adam_mini import adam_mini_block

    split = split_params(model, recipe)
    chosen = {id(p) for _, p in split.transformed}
    dim, n_heads = _model_dims(model, dim, n_heads)
    head_dim = dim // n_heads if dim and n_heads else 1
    return [
        TensorSpec(name, tuple(p.shape), id(p) in chosen, adam_mini_block(name), head_dim)
        for name, p in [*split.transformed, *split.regular]
    ]


@functools.lru_cache(maxsize=32)
def _config_specs(config_json: str, recipe: str, dim: int | None, n_heads: int | None) -> list[TensorSpec]:
    # A table asks for the same config once per optimizer; build its skeleton once.
    return tensor_specs(llama_skeleton(json.loads(config_json)), recipe, dim=dim, n_heads=n_heads)


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
    level 0 is the tensor itself)."""
    if len(t.shape) < 2:
        return t.numel
    from gwt_optim.wavelets import approx_length

    return t.rows * approx_length(t.cols, level)


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

# Registry names of the same optimizers (gwt_optim.toolkit.peers) -> estimator
# names. bitsandbytes' adam8bit has torchao's layout up to its small-tensor rule.
ALIASES = {
    "adam8bit": "adamw8bit",
    "torchao-adamw8bit": "adamw8bit",
    "torchao-adamw4bit": "adamw4bit",
}


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


_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = _DTYPE_NAMES.get(dtype, getattr(torch, dtype, None))
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)} or a torch dtype name")
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
    key = ALIASES.get(optimizer_name, optimizer_name)
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
        config = load_config(model_or_config)
        label = str(model_or_config) if not isinstance(model_or_config, Mapping) else "config"
        dtype = dtype or torch.bfloat16
        specs = _config_specs(json.dumps(config, sort_keys=True), recipe, dim, n_heads)
        d = dim or config["hidden_size"]
    if rank is None:
        rank = max((d or 256) // 4, 1)
    dtype = _resolve_dtype(dtype)
    sdt = _resolve_dtype(state_dtype or dtype)
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
        cfg = load_config(model_or_config)
        if vocab_size is not None:
            cfg = {**cfg, "vocab_size": vocab_size}
        model = cfg
    e = estimate(model, optimizer_name, level=level, dtype=dtype, state_dtype=state_dtype, recipe=recipe)
    wb = e.weight_bytes // e.n_params
    specs = (tensor_specs(model_or_config, recipe) if isinstance(model_or_config, nn.Module)
             else _config_specs(json.dumps(cfg, sort_keys=True), recipe, None, None))
    sdt = _resolve_dtype(state_dtype or dtype or (torch.bfloat16 if wb == 2 else torch.float32))
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


# --------------------------------------------------------------------------- #
# The table and the CLI
# --------------------------------------------------------------------------- #

TABLE_MODELS = ("60m", "130m", "350m", "1b", "3b", "7b")
TABLE_OPTIMIZERS = (
    "adamw",
    "adamw8bit",
    "galore",
    "apollo",
    "apollo-mini",
    "adam-mini",
    "muon",
    "adafactor",
    "gwt-adamw",
    "gwt-adam-mini",
    "gwt-muon",
    "gwt-adafactor",
)
# Ranks of the GaLore and APOLLO papers' LLaMA runs.
PAPER_RANKS = {"60m": 128, "130m": 256, "350m": 256, "1b": 512, "3b": 512, "7b": 1024}
_GB = 1e9


def _label(e: MemoryEstimate) -> str:
    if e.level is not None:
        return f"{e.optimizer} (l={e.level})"
    if e.rank is not None and ESTIMATORS[e.optimizer].uses_rank:
        return f"{e.optimizer} (rank r)"
    return e.optimizer


def memory_table(
    models: Iterable[str] = TABLE_MODELS,
    optimizers: Iterable[str] = TABLE_OPTIMIZERS,
    *,
    level: int = 2,
    rank: int | None = None,
    dtype: str = "bf16",
    recipe: str = "paper",
) -> str:
    """Markdown tables: weights + state per optimizer and model, the saving
    against AdamW, and where the paper's GWT figures come from."""
    models, optimizers = list(models), list(optimizers)
    rows: dict[str, list[str]] = {}
    base: dict[str, MemoryEstimate] = {}
    for m in models:
        r = rank if rank is not None else PAPER_RANKS.get(m.lower())
        base[m] = estimate(m, "adamw", dtype=dtype, recipe=recipe)
        for name in optimizers:
            e = estimate(m, name, level=level, rank=r, dtype=dtype, recipe=recipe)
            cell = f"{e.total_bytes / _GB:.2f}"
            if name != "adamw":
                cell += f" ({-100 * e.saving(base[m]):+.0f}%)"
            rows.setdefault(_label(e), []).append(cell)
    head = "| optimizer | " + " | ".join(m.upper() for m in models) + " |"
    rule = "|---|" + "---:|" * len(models)
    lines = [
        f"Weights + optimizer state, GB (10^9 bytes), {dtype} weights and states, "
        f"recipe {recipe!r}; (change against AdamW). Ranks: "
        + ", ".join(f"{m.upper()} r={rank or PAPER_RANKS.get(m.lower(), 'd/4')}" for m in models)
        + ".",
        "",
        head,
        rule,
        "| parameters | " + " | ".join(f"{base[m].n_params / 1e6:,.0f}M" for m in models) + " |",
        "| share transformed | " + " | ".join(f"{100 * base[m].transformed_fraction:.1f}%" for m in models) + " |",
    ]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows.items()]

    # Where the paper's figures come from: GWT-AdamW against AdamW per level.
    lines += [
        "",
        "GWT-AdamW against AdamW by level: state saving on the transformed weights, "
        "on all weights, and weights + state saving.",
        "",
        "| model | level | transformed-weight state | all state | weights + state |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in models:
        for lv in (1, 2, 3):
            g = estimate(m, "gwt-adamw", level=lv, dtype=dtype, recipe=recipe)
            a = base[m]
            t_saving = 1 - g.transformed_state_bytes / a.transformed_state_bytes
            lines.append(
                f"| {m.upper()} | {lv} | {-100 * t_saving:.1f}% | {-100 * g.state_saving(a):.1f}% | "
                f"{-100 * g.saving(a):.1f}% |"
            )
    return "\n".join(lines)


def training_table(
    models: Iterable[str],
    optimizers: Iterable[str],
    *,
    level: int = 2,
    dtype: str = "bf16",
    state_dtype: str | None = None,
    batch_size: int = 1,
    seq_len: int = 256,
    gradient_checkpointing: bool = False,
    step_in_backward: bool = False,
    recipe: str = "paper",
) -> str:
    """Markdown: the peak of one training step by part (:func:`training_estimate`)."""
    cols = []
    for m in models:
        for name in optimizers:
            key = ALIASES.get(name, name)
            # GWT keeps fp32 moments unless told; other optimizers keep the weights' dtype.
            sd = state_dtype if state_dtype and (state_dtype != "int8" or key == "gwt-adamw") else None
            sd = sd or ("fp32" if key.startswith("gwt-") else dtype)
            e = training_estimate(
                m, key, level=level, dtype=dtype, state_dtype=sd, batch_size=batch_size, seq_len=seq_len,
                gradient_checkpointing=gradient_checkpointing, step_in_backward=step_in_backward, recipe=recipe,
            )
            label = f"{m.upper()} {key}" + (f" (l={level})" if ESTIMATORS[key].uses_level else "") + f", {sd} state"
            cols.append((label, e.parts()))
    mode = ("step in backward" if step_in_backward else "normal step") + (
        ", gradient checkpointing" if gradient_checkpointing else "")
    lines = [
        f"Peak of one training step, GB (10^9 bytes): {dtype} weights, batch {batch_size} x {seq_len}, {mode}. "
        "Add the process's own baseline (Python, torch, transformers: about 0.5 GB on CPU).",
        "",
        "| part | " + " | ".join(label for label, _ in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for part in cols[0][1]:
        lines.append(f"| {part} | " + " | ".join(f"{parts[part] / _GB:.2f}" for _, parts in cols) + " |")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    if args.peak:
        text = training_table(
            models, optimizers, level=args.level, dtype=args.dtype, state_dtype=args.state_dtype,
            batch_size=args.batch_size, seq_len=args.seq_len, gradient_checkpointing=args.checkpointing,
            step_in_backward=args.step_in_backward, recipe=args.recipe,
        )
    else:
        text = memory_table(models, optimizers, level=args.level, rank=args.rank, dtype=args.dtype, recipe=args.recipe)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out)  # atomic: a reader never sees half a table
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``gwt-optim memory``: the analytic weights + state table."""
    p = subparsers.add_parser(
        "memory",
        help="print the analytic weights + optimizer-state memory table (torch only)",
        description=(
            "Analytic weights + optimizer-state memory of LLaMA 60M..7B under AdamW, 8-bit Adam, GaLore, "
            "APOLLO(-Mini), Adam-mini, Muon, Adafactor and the GWT families, with the saving against AdamW."
        ),
    )
    p.add_argument(
        "--models", default=",".join(TABLE_MODELS), help="packaged config names or JSON paths, comma-separated"
    )
    p.add_argument(
        "--optimizers", default=",".join(TABLE_OPTIMIZERS), help=f"comma-separated; known: {', '.join(ESTIMATORS)}"
    )
    p.add_argument("--level", type=int, default=2, help="GWT level l (default 2)")
    p.add_argument("--rank", type=int, default=None, help="GaLore/APOLLO rank (default: the papers' rank per size)")
    p.add_argument("--dtype", default="bf16", help="weight and state dtype (default bf16, the papers' convention)")
    p.add_argument("--recipe", default="paper", choices=("paper", "hidden"), help="which weights get the transform")
    p.add_argument("--out", default=None, help="also write the markdown to this file")
    g = p.add_argument_group("training peak (--peak): weights, state, gradients, activations, step temporaries")
    g.add_argument("--peak", action="store_true", help="print the peak of a training step by part instead")
    g.add_argument("--state-dtype", default=None,
                   help="optimizer-state dtype (default: fp32 for GWT, the weights' for others; int8 for gwt-adamw)")
    g.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    g.add_argument("--checkpointing", action="store_true", help="with gradient checkpointing")
    g.add_argument("--step-in-backward", action="store_true", help="each parameter stepped inside backward")
    p.set_defaults(func=_run)
