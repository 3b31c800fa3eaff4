"""Models for pre-training: LLaMA from the shipped configs, or any local
Hugging Face model directory or config file, built with fresh weights.

``--model llama_60m`` (or ``60m``) picks ``gwt_optim/configs/llama_60m.json``;
``--model path/to/dir`` or ``path/to/config.json`` reads a local Hugging Face
config (``AutoConfig``; nothing is downloaded). The vocabulary size and the
special-token ids are taken from the tokenizer, so a shipped config trains with
any tokenizer (the paper's t5-base, or the demo's small BPE).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "shipped_configs",
    "check_model_spec",
    "load_model_config",
    "build_model",
    "enable_gradient_checkpointing",
    "count_parameters",
]

_CONFIG_PACKAGE = "gwt_optim.configs"


def shipped_configs() -> list[str]:
    """Names of the LLaMA configs that ship with the package, smallest first."""
    names = [p.name[: -len(".json")] for p in resources.files(_CONFIG_PACKAGE).iterdir() if p.name.endswith(".json")]

    def size(name: str) -> float:
        tag = name.split("_")[-1]
        return float(tag[:-1]) * (1000 if tag.endswith("b") else 1)

    return sorted(names, key=size)


def _shipped_path(name: str):
    for candidate in (name, f"llama_{name}"):
        path = resources.files(_CONFIG_PACKAGE) / f"{candidate}.json"
        if path.is_file():
            return path
    return None


# Sizes a config file may give: each a positive integer when given (null or
# absent: the model's own default, which may be computed from the others).
_SIZE_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "n_embd", "n_inner", "n_layer", "n_head", "n_positions",
)
# Sizes a file must give: transformers fills in a missing one from its defaults
# (LLaMA's are a 7B model's) and trains something else than the file describes.
_REQUIRED_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _config_file(spec: str | Path) -> Path:
    path = Path(spec)
    return path / "config.json" if path.is_dir() else path


def _read_config_file(file: Path) -> dict[str, Any]:
    """The settings of a local config file, checked as far as they can be
    without transformers: ``ValueError`` naming the file and the setting."""
    try:
        config = json.loads(file.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"--model {file}: not a model config (binary data, not JSON)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {file}: not a readable JSON file ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model {file}: a model config is a JSON object of settings, not a JSON "
                         f"{type(config).__name__}")
    for key in _SIZE_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"--model {file}: {key} must be a positive integer, got {value!r}")
    return config


def check_model_spec(spec: str | Path):
    """The shipped config ``spec`` names, or None for a local directory or
    .json file; ``FileNotFoundError`` when it is neither (without importing
    transformers, so a typo fails before anything is loaded) and ``ValueError``
    when its config file cannot describe a model."""
    shipped = _shipped_path(str(spec))
    path = Path(spec)
    if shipped is not None:
        return shipped
    if (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".json"):
        _read_config_file(_config_file(path))
        return None
    raise FileNotFoundError(
        f"--model {spec!r} is neither a shipped config ({', '.join(shipped_configs())}) "
        "nor a local directory with config.json nor a config .json file"
    )


def _why(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def load_model_config(spec: str | Path, **overrides: Any):
    """A ``transformers`` config from a shipped name, a directory or a JSON file.

    ``overrides`` set config attributes (``vocab_size=...``); ``None`` values
    are ignored. ``ValueError`` names the file of a local config that
    transformers refuses or that leaves out a size of the model.
    """
    from transformers import AutoConfig, LlamaConfig

    shipped = check_model_spec(spec)
    if shipped is not None:
        config = LlamaConfig.from_dict(json.loads(shipped.read_text()))
    else:
        file = _config_file(spec)
        given = _read_config_file(file)
        try:
            config = AutoConfig.from_pretrained(Path(spec), local_files_only=True)
        except Exception as exc:  # transformers' checks of a user's file raise many types, none of them a bug here
            raise ValueError(f"--model {file}: not a usable model config ({_why(exc)})") from exc
        given = set(given) | {key for key, value in overrides.items() if value is not None}
        missing = [name for name in _REQUIRED_SIZES
                   if hasattr(config, name) and not {name, config.attribute_map.get(name)} & given]
        if missing:
            raise ValueError(f"--model {file}: it does not set {', '.join(missing)}; transformers would fill in "
                             f"the defaults of {type(config).__name__} and train another model than the file describes")
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    return config


def build_model(
    spec: str | Path,
    *,
    tokenizer=None,
    max_seq_len: int | None = None,
    pretrained: bool = False,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> nn.Module:
    """A causal LM with fresh weights (seeded by the caller's ``torch.manual_seed``).

    ``tokenizer`` fixes the vocabulary size and the bos/eos/pad ids;
    ``max_seq_len`` raises ``max_position_embeddings`` when needed.
    ``pretrained=True`` loads the weights of a local model directory instead.

    With ``dtype`` or ``device``, the model is built on the meta device and
    materialized straight in ``dtype`` on ``device`` (CPU by default), then
    initialized there: no fp32 copy ever exists, so a 7B model in bf16 peaks
    at its 13.5 GB. Without them the weights are built in fp32 on the CPU, as
    always (the same seeded values as before).
    """
    from transformers import AutoModelForCausalLM

    if tokenizer is not None:
        if not pretrained:  # pretrained weights fix their own vocabulary; resized below
            overrides.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            overrides.setdefault(name, getattr(tokenizer, name, None))
    config = load_model_config(spec, **overrides)
    if max_seq_len is not None and getattr(config, "max_position_embeddings", max_seq_len) < max_seq_len:
        config.max_position_embeddings = max_seq_len
    if pretrained:
        if not Path(spec).is_dir():
            raise ValueError(f"--pretrained needs a local model directory with weights, got {spec!r}")
        extra = {} if dtype is None else {"dtype": dtype}
        if device is not None:
            extra["device_map"] = str(device)
        model = AutoModelForCausalLM.from_pretrained(spec, config=config, local_files_only=True, **extra)
        if tokenizer is not None and model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
        return model
    # KV caching only matters for generation; training never reads it.
    config.use_cache = False
    try:
        if dtype is None and device is None:
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    except (TypeError, ValueError, RuntimeError) as exc:
        # Some combinations of sizes fail only in torch, when the layers are made.
        raise ValueError(f"--model {spec}: no model can be built from this config ({_why(exc)})") from exc
    model.to_empty(device=device or "cpu")
    # Buffers (rotary frequencies) are recomputed too; their dtype stays as the model defines it.
    model.init_weights()
    return model


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (the HF switch).

    Non-reentrant checkpointing: parameter hooks (``step_in_backward``) fire
    once per parameter, and inputs that need no gradient are fine.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable scalars (tied weights once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
