"""Model description for the estimates: a LLaMA config, its parameter-only
skeleton on the meta device, and each parameter as a :class:`TensorSpec`."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["TensorSpec", "load_config_json", "llama_skeleton", "tensor_specs"]


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


def load_config_json(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
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
