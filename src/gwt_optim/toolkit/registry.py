"""Optimizer registry: names map to factories that build an optimizer for a model.

Every factory receives the model and one :class:`OptimizerConfig`, and must
apply the same module-wise split (``gwt_optim.groups``): the weights chosen by
``recipe`` get the scale ``alpha`` (``config.scale``) -- as the GWT ``scale``
for the GWT families and as ``lr * alpha`` for every other optimizer -- so a
comparison gives every optimizer the same effective step on the same weights.

Options given on the command line as ``name:key=value:key=value`` arrive in
``config.options`` (already converted to int/float/bool/None where they parse).
A peer whose package is missing raises :class:`MissingDependency` naming the
extra to install.

Add an optimizer with::

    @register("my-opt", extra="peers", help="...")
    def _my_opt(model, cfg): ...
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = [
    "OptimizerConfig",
    "OptimizerSpec",
    "REGISTRY",
    "MissingDependency",
    "register",
    "build_optimizer",
    "parse_optimizer_arg",
    "require",
]


class MissingDependency(ImportError):
    """An optional package a command needs is not installed."""


def require(module: str, extra: str, package: str | None = None):
    """Import ``module`` or raise a :class:`MissingDependency` naming the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pkg = package or module
        raise MissingDependency(
            f"{module!r} is not installed; install it with "
            f"`pip install 'gwt-optim[{extra}]'` (or `pip install {pkg}`)"
        ) from exc


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    scale: float = 1.0  # module-wise alpha on the chosen weights (paper: 0.25 for GWT)
    recipe: str = "paper"
    target_modules: tuple[str, ...] = ("attn", "mlp")
    options: dict[str, Any] = field(default_factory=dict)

    def pop(self, key: str, default: Any = None) -> Any:
        return self.options.pop(key, default)


@dataclass
class OptimizerSpec:
    name: str
    factory: Callable[[nn.Module, OptimizerConfig], torch.optim.Optimizer]
    extra: str | None = None
    help: str = ""
    # Values the spec applies when neither the user nor a recipe gave one.
    defaults: dict[str, Any] = field(default_factory=dict)


REGISTRY: dict[str, OptimizerSpec] = {}


def register(name: str, *, extra: str | None = None, help: str = "", defaults: dict | None = None):
    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"optimizer {name!r} registered twice")
        REGISTRY[name] = OptimizerSpec(name, fn, extra, help, dict(defaults or {}))
        return fn

    return deco


def _convert(value: str) -> Any:
    low = value.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for typ in (int, float):
        try:
            return typ(value)
        except ValueError:
            pass
    return value


def parse_optimizer_arg(text: str) -> tuple[str, dict[str, Any]]:
    """``"gwt-adamw:level=3:scale=0.5"`` -> ``("gwt-adamw", {"level": 3, "scale": 0.5})``."""
    name, *pairs = text.strip().split(":")
    opts: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"bad optimizer option {pair!r} in {text!r}; expected key=value")
        key, value = pair.split("=", 1)
        opts[key.strip().replace("-", "_")] = _convert(value.strip())
    if name not in REGISTRY:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return name, opts


def build_optimizer(name: str, model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    if name not in REGISTRY:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(sorted(REGISTRY))}")
    spec = REGISTRY[name]
    opts = {**spec.defaults, **config.options}
    cfg = OptimizerConfig(**{**config.__dict__, "options": opts})
    for key in ("lr", "weight_decay", "eps", "scale", "recipe"):
        if key in cfg.options:  # name:lr=... overrides the shared value
            setattr(cfg, key, cfg.options.pop(key))
    opt = spec.factory(model, cfg)
    if cfg.options:
        raise ValueError(f"unknown option(s) for {name!r}: {sorted(cfg.options)}")
    return opt


# --------------------------------------------------------------------------- #
# Built-in optimizers. Peers are registered in ``peers.py``.
# --------------------------------------------------------------------------- #


@register("adamw", help="torch.optim.AdamW (fused on CPU/GPU where available)")
def _adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    from gwt_optim.groups import lr_scaled_groups

    groups = lr_scaled_groups(model, cfg.lr, cfg.scale, cfg.recipe, target_modules=cfg.target_modules)
    fused = cfg.pop("fused", None)
    return torch.optim.AdamW(
        list(groups), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused
    )


@register(
    "gwt-adamw",
    help="GWT-AdamW: Adam moments on Haar approximation coefficients (level, wavelet, scale, norm_growth_limit)",
    defaults={"level": 2},
)
def _gwt_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    from gwt_optim.groups import gwt_param_groups
    from gwt_optim.optim import GWTAdamW

    split = gwt_param_groups(
        model,
        cfg.recipe,
        level=cfg.pop("level", 2),
        wavelet=cfg.pop("wavelet", "haar"),
        scale=cfg.scale,
        norm_growth_limit=cfg.pop("norm_growth_limit", 1.01),
        target_modules=cfg.target_modules,
    )
    kwargs = {k: cfg.pop(k) for k in ("impl", "moment_dtype", "detail_clip") if k in cfg.options}
    return GWTAdamW(list(split), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **kwargs)


# Populate the rest of the registry: peers (AdamW8bit, GaLore, APOLLO, Adam-mini,
# Muon, ...) and the other GWT families. Those modules import their optional
# packages inside the factories, never at import time.
def _load_builtin_modules() -> None:
    for mod in ("gwt_optim.toolkit.peers", "gwt_optim.toolkit.families"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if not (exc.name and exc.name.startswith("gwt_optim")):
                raise


_load_builtin_modules()
