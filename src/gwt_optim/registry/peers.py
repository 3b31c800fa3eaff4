"""The peers GWT is compared against, registered in the optimizer registry.

=====================  =========================================================
``adam8bit``           bitsandbytes ``AdamW8bit`` (block-wise 8-bit moments)
``torchao-adamw8bit``  torchao ``AdamW8bit`` (tensor-subclass 8-bit moments;
                       compiled with ``torch.compile`` on first use)
``torchao-adamw4bit``  torchao ``AdamW4bit``
``galore``             galore-torch ``GaLoreAdamW``: ``rank`` (128),
                       ``update_proj_gap`` (200), ``proj_type`` (``std``)
``apollo``             apollo-torch ``APOLLOAdamW``: random projection of
                       ``rank`` (128), channel-wise scaling, ``apollo_scale`` (1)
``apollo-mini``        APOLLO with rank 1, tensor-wise scaling, ``apollo_scale`` 128
``adam-mini``          adam-mini ``Adam_mini`` (one second moment per block)
``muon``               ``torch.optim.Muon`` on 2-D hidden weights, AdamW on the
                       rest, as one optimizer (:class:`ChainedOptimizer`)
=====================  =========================================================

Fair comparisons: every factory applies the same module-wise split
(:mod:`gwt_optim.groups`). The weights the recipe chooses (the paper's:
attention and MLP linear weights) get the scale ``alpha`` (``--scale``):
GaLore takes it as its own ``scale`` -- GaLore's ``scale`` *is* the paper's
module-wise alpha -- and every other peer as ``lr * alpha`` on those weights.
The low-rank methods project exactly those weights.

The packages are optional (``pip install 'gwt-optim[peers]'``); each factory
imports its package when called and raises
:class:`~gwt_optim.registry.MissingDependency` naming the extra.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from gwt_optim.groups import lr_scaled_groups, split_params
from gwt_optim.registry.base import OptimizerConfig, register, require

__all__ = ["ChainedOptimizer"]


def _plain_groups(model: nn.Module, cfg: OptimizerConfig, **transformed_options: Any) -> list[dict]:
    """The module-wise split as ``lr * alpha`` groups (plus options on the chosen weights)."""
    return list(
        lr_scaled_groups(
            model, cfg.lr, cfg.scale, cfg.recipe, target_modules=cfg.target_modules,
            transformed_options=transformed_options or None, regular_options=cfg.regular_options(),
        )
    )


def _adam_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    return {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}


# --------------------------------------------------------------------------- #
# Quantized Adam
# --------------------------------------------------------------------------- #


# bitsandbytes keeps tensors under min_8bit_size in 32 bits (its default, 4096).
# Its memory rule is torchao's layout, which bitsandbytes' matches up to its small-tensor rule.
@register("adam8bit", extra="peers", help="bitsandbytes AdamW8bit (option: min_8bit_size, default 4096)",
          options={"min_8bit_size": 4096}, memory="adamw8bit")
def _adam8bit(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    bnb = require("bitsandbytes", "peers")
    return bnb.optim.AdamW8bit(_plain_groups(model, cfg), min_8bit_size=cfg.pop("min_8bit_size"), **_adam_kwargs(cfg))


def _torchao(cls_name: str) -> Callable[[nn.Module, OptimizerConfig], torch.optim.Optimizer]:
    def factory(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        require("torchao", "peers")
        from torchao import optim as ao

        block_size = cfg.pop("block_size")
        block = {"block_size": block_size} if block_size is not None else {}
        return getattr(ao, cls_name)(_plain_groups(model, cfg), **_adam_kwargs(cfg), **block)

    return factory


register("torchao-adamw8bit", extra="peers", help="torchao AdamW8bit (torch.compile'd; option: block_size)",
         options={"block_size": None}, memory="adamw8bit")(
    _torchao("AdamW8bit")
)
register("torchao-adamw4bit", extra="peers", help="torchao AdamW4bit (torch.compile'd; option: block_size)",
         options={"block_size": None}, memory="adamw4bit")(
    _torchao("AdamW4bit")
)


# --------------------------------------------------------------------------- #
# Low-rank projection: GaLore, APOLLO
# --------------------------------------------------------------------------- #


def _low_rank_groups(model: nn.Module, cfg: OptimizerConfig, projected: dict[str, Any]) -> list[dict]:
    """Projected groups for the chosen 2-D weights, plain groups for the rest."""
    split = split_params(model, cfg.recipe, target_modules=cfg.target_modules)
    chosen = [p for _, p in split.transformed if p.ndim == 2]
    ids = {id(p) for p in chosen}
    rest = [p for _, p in split.transformed + split.regular if id(p) not in ids]
    groups = [{"params": chosen, **projected}] if chosen else []
    return groups + ([{"params": rest, **cfg.regular_options()}] if rest else [])


@register(
    "galore",
    extra="peers",
    help="GaLore AdamW: low-rank gradient projection (rank=128, update_proj_gap=200, proj_type=std; "
    "its scale is the module-wise alpha)",
    options={"rank": 128, "update_proj_gap": 200, "proj_type": "std"},
)
def _galore(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    require("galore_torch", "peers", "galore-torch")
    from galore_torch import GaLoreAdamW

    projected = {
        "rank": cfg.pop("rank"),
        "update_proj_gap": cfg.pop("update_proj_gap"),
        "scale": cfg.scale,  # GaLore's alpha: the same module-wise scale GWT uses
        "proj_type": cfg.pop("proj_type"),
    }
    return GaLoreAdamW(_low_rank_groups(model, cfg, projected), no_deprecation_warning=True, **_adam_kwargs(cfg))


def _apollo_options(rank: int, scale_type: str, apollo_scale: float) -> dict:
    return {"rank": rank, "proj": "random", "scale_type": scale_type, "update_proj_gap": 200,
            "apollo_scale": apollo_scale, "proj_type": "std"}


def _apollo_factory():
    def factory(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        require("apollo_torch", "peers", "apollo-torch")
        from apollo_torch import APOLLOAdamW

        projected = {
            "rank": cfg.pop("rank"),
            "proj": cfg.pop("proj"),
            "scale_type": cfg.pop("scale_type"),
            "update_proj_gap": cfg.pop("update_proj_gap"),
            "scale": float(cfg.pop("apollo_scale")),  # APOLLO's gradient scale, not alpha
            "proj_type": cfg.pop("proj_type"),
        }
        groups = _low_rank_groups(model, cfg, projected)
        # APOLLO's own scale multiplies the update by sqrt(scale); the module-wise
        # alpha is applied, as for the other peers, as lr * alpha.
        if groups and "rank" in groups[0]:
            groups[0]["lr"] = cfg.lr * cfg.scale
        return APOLLOAdamW(groups, **_adam_kwargs(cfg))

    return factory


register(
    "apollo",
    extra="peers",
    help="APOLLO AdamW: random projection, channel-wise scaling (rank=128, apollo_scale=1, update_proj_gap=200)",
    options=_apollo_options(128, "channel", 1.0),
)(_apollo_factory())
register(
    "apollo-mini",
    extra="peers",
    help="APOLLO-Mini: rank 1, tensor-wise scaling, apollo_scale=128",
    options=_apollo_options(1, "tensor", 128.0),
)(_apollo_factory())


# --------------------------------------------------------------------------- #
# Adam-mini
# --------------------------------------------------------------------------- #


def _attention_shape(model: nn.Module) -> tuple[int, int, int | None]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "hidden_size"):
        raise ValueError("adam-mini needs a transformers model (config.hidden_size, num_attention_heads)")
    return config.hidden_size, config.num_attention_heads, getattr(config, "num_key_value_heads", None)


@register("adam-mini", extra="peers", help="Adam-mini: one second-moment value per block (head, neuron)")
def _adam_mini(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    require("adam_mini", "peers", "adam-mini")
    from adam_mini import Adam_mini

    dim, n_heads, n_kv_heads = _attention_shape(model)
    opt = Adam_mini(
        model.named_parameters(), dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, verbose=False,
        **_adam_kwargs(cfg),
    )
    # Adam-mini builds one group per parameter from names; give the chosen ones alpha.
    chosen = {id(p) for _, p in split_params(model, cfg.recipe, target_modules=cfg.target_modules).transformed}
    for group in opt.param_groups:
        if any(id(p) in chosen for p in group["params"]):
            group["lr"] = cfg.lr * cfg.scale
        elif cfg.regular_lr is not None:
            group["lr"] = cfg.regular_lr
    return opt


# --------------------------------------------------------------------------- #
# Muon
# --------------------------------------------------------------------------- #


class ChainedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, used as one.

    ``param_groups`` are the inner optimizers' own group dicts (so an LR
    scheduler or gradient clipping acting on this object acts on them),
    ``state`` is the union of their states, and ``state_dict`` nests theirs
    by name, so checkpoints round-trip. Needed for Muon, which only takes 2-D
    weights and leaves the rest to AdamW.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        if not optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        self.optimizers = dict(optimizers)
        # Optimizer.__init__ keeps the very dicts it is given, so the groups stay shared.
        super().__init__([g for o in self.optimizers.values() for g in o.param_groups], {})

    @property
    def state(self) -> dict:  # type: ignore[override]
        merged: dict = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value) -> None:
        # Optimizer.__init__ assigns an empty state; ours lives in the inner optimizers.
        if value:
            raise AttributeError("ChainedOptimizer.state is the union of its optimizers' states")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        missing = set(self.optimizers) - set(state_dict)
        if missing:
            raise KeyError(f"state dict lacks optimizer(s) {sorted(missing)}; was it saved by another optimizer?")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={type(o).__name__}" for n, o in self.optimizers.items())
        return f"ChainedOptimizer({inner})"


@register(
    "muon",
    help="torch.optim.Muon on 2-D hidden weights (momentum=0.95, nesterov, adjust_lr_fn=match_rms_adamw), "
    "AdamW on embeddings, head, norms",
    options={"momentum": 0.95, "nesterov": True, "ns_steps": 5, "adjust_lr_fn": "match_rms_adamw"},
)
def _muon(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"torch.optim.Muon needs torch >= 2.9 (this is {torch.__version__})")
    hidden = {id(p) for _, p in split_params(model, "hidden").transformed if p.ndim == 2}
    muon_groups, adam_groups = [], []
    for group in _plain_groups(model, cfg):
        params = group["params"]
        for target, keep in ((muon_groups, lambda p: id(p) in hidden), (adam_groups, lambda p: id(p) not in hidden)):
            chosen = [p for p in params if keep(p)]
            if chosen:
                target.append({**group, "params": chosen})
    muon_kwargs = dict(
        momentum=float(cfg.pop("momentum")),
        nesterov=cfg.pop("nesterov"),
        ns_steps=cfg.pop("ns_steps"),
        # Scale Muon's orthogonal update to AdamW's RMS so one lr serves both parts.
        adjust_lr_fn=cfg.pop("adjust_lr_fn"),
    )
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if muon_groups:
        optimizers["muon"] = torch.optim.Muon(muon_groups, lr=cfg.lr, weight_decay=cfg.weight_decay, **muon_kwargs)
    if adam_groups:
        optimizers["adamw"] = torch.optim.AdamW(adam_groups, **_adam_kwargs(cfg))
    return ChainedOptimizer(optimizers)
