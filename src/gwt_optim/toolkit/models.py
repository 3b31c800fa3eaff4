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

__all__ = ["shipped_configs", "load_config", "build_model", "count_parameters"]

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


def load_config(spec: str | Path, **overrides: Any):
    """A ``transformers`` config from a shipped name, a directory or a JSON file.

    ``overrides`` set config attributes (``vocab_size=...``); ``None`` values
    are ignored.
    """
    from transformers import AutoConfig, LlamaConfig

    shipped = _shipped_path(str(spec))
    path = Path(spec)
    if shipped is not None:
        config = LlamaConfig.from_dict(json.loads(shipped.read_text()))
    elif path.is_dir() and (path / "config.json").is_file():
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    elif path.is_file() and path.suffix == ".json":
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        raise FileNotFoundError(
            f"--model {spec!r} is neither a shipped config ({', '.join(shipped_configs())}) "
            "nor a local directory with config.json nor a config .json file"
        )
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
    **overrides: Any,
) -> nn.Module:
    """A causal LM with fresh weights (seeded by the caller's ``torch.manual_seed``).

    ``tokenizer`` fixes the vocabulary size and the bos/eos/pad ids;
    ``max_seq_len`` raises ``max_position_embeddings`` when needed.
    ``pretrained=True`` loads the weights of a local model directory instead.
    """
    from transformers import AutoModelForCausalLM

    if tokenizer is not None:
        if not pretrained:  # pretrained weights fix their own vocabulary; resized below
            overrides.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            overrides.setdefault(name, getattr(tokenizer, name, None))
    config = load_config(spec, **overrides)
    if max_seq_len is not None and getattr(config, "max_position_embeddings", max_seq_len) < max_seq_len:
        config.max_position_embeddings = max_seq_len
    if pretrained:
        if not Path(spec).is_dir():
            raise ValueError(f"--pretrained needs a local model directory with weights, got {spec!r}")
        model = AutoModelForCausalLM.from_pretrained(spec, config=config, local_files_only=True)
        if tokenizer is not None and model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
        return model
    # KV caching only matters for generation; training never reads it.
    config.use_cache = False
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable scalars (tied weights once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
