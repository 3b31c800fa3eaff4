"""The registry's machinery: :class:`OptimizerConfig`, the spec parser and its
checks, :func:`register` and :func:`build_optimizer`, plus the two entries
every comparison has, ``adamw`` and ``gwt-adamw`` (see :mod:`gwt_optim.registry`).
"""

from __future__ import annotations

import math

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
    "recipe_scale",
    "parse_optimizer_arg",
    "split_spec",
    "format_spec",
    "validate_optimizer_spec",
    "SHARED_OPTIONS",
    "GWT_OPTIONS",
    "gwt_group_options",
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
    # Module-wise alpha on the chosen weights. None: the recipe (recipe_scale), with which GWT-AdamW takes
    # AdamW's lr; a number applies to every entry alike (1: the fair view; the paper: 0.25 for GWT).
    scale: float | None = None
    recipe: str = "paper"
    target_modules: tuple[str, ...] = ("attn", "mlp")
    # Matrix-only fairness (benchmarks/quality.py): the lr of every parameter
    # outside the chosen matrices (embeddings, head, norms, biases), which then
    # trains with AdamW math at alpha 1 whatever the contender; None: ``lr``.
    regular_lr: float | None = None
    # AdamW's eps for those parameters, kept when a spec sets its own eps (set
    # by build_optimizer), so ``gwt-adamw:eps=1e-6`` changes the matrices only.
    regular_eps: float | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def pop(self, key: str, default: Any = None) -> Any:
        return self.options.pop(key, default)

    def regular_options(self, *, eps: bool = True) -> dict[str, Any]:
        """Group keys for the parameters outside the chosen matrices (empty
        unless ``regular_lr`` is set); ``eps=False`` for optimizers whose eps
        is not AdamW's."""
        if self.regular_lr is None:
            return {}
        keys: dict[str, Any] = {"lr": self.regular_lr}
        if eps and self.regular_eps is not None:
            keys["eps"] = self.regular_eps
        return keys


# Options every entry takes: they set the OptimizerConfig field of that name
# (beta1 and beta2 set the two halves of ``betas``, for every group).
SHARED_OPTIONS: tuple[str, ...] = ("lr", "weight_decay", "eps", "scale", "recipe", "regular_lr", "beta1", "beta2")
_NUMBER_OPTIONS = ("lr", "weight_decay", "eps", "scale", "regular_lr", "beta1", "beta2")


@dataclass
class OptimizerSpec:
    name: str
    factory: Callable[[nn.Module, OptimizerConfig], torch.optim.Optimizer]
    extra: str | None = None
    help: str = ""
    # Every option the entry accepts, with its default: the one place a default
    # is declared. Factories read them with ``cfg.pop(key)``.
    defaults: dict[str, Any] = field(default_factory=dict)
    # The key of its rule in gwt_optim.memory.estimate.ESTIMATORS, so the
    # memory estimate accepts every registry name without a list of its own.
    # Several entries may share a rule (8-bit Adam of bitsandbytes and torchao).
    memory: str = ""


REGISTRY: dict[str, OptimizerSpec] = {}


def register(name: str, *, extra: str | None = None, help: str = "", options: dict | None = None,
             memory: str | None = None):
    """Add the factory ``fn`` as ``name``; ``memory`` names its estimator when
    that is not ``name`` itself."""

    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"optimizer {name!r} registered twice")
        REGISTRY[name] = OptimizerSpec(name, fn, extra, help, dict(options or {}), memory or name)
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


def _check_type(name: str, key: str, value: Any, default: Any) -> None:
    """Reject a value whose kind cannot be what the option's default is."""
    if default is None or value is None:
        return  # options whose default is None take several kinds (moment_dtype=bfloat16|int8, ...)
    if isinstance(default, bool):
        ok = isinstance(value, bool)
        kind = "true or false"
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
        kind = "an integer"
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        kind = "a number"
    else:
        ok = isinstance(value, type(default))
        kind = f"a {type(default).__name__}"
    if not ok:
        raise ValueError(f"{name}: option {key}={value!r} must be {kind}")


def _check_options(name: str, opts: dict[str, Any]) -> None:
    spec = REGISTRY[name]
    unknown = sorted(set(opts) - set(spec.defaults) - set(SHARED_OPTIONS))
    if unknown:
        known = ", ".join(sorted(set(spec.defaults) | set(SHARED_OPTIONS)))
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for {name!r}; it takes: {known}")
    for key, value in opts.items():
        if key in spec.defaults:
            _check_type(name, key, value, spec.defaults[key])
        elif key in _NUMBER_OPTIONS:
            _check_type(name, key, value, 0.0)
        if key in ("beta1", "beta2") and key not in spec.defaults and not 0.0 <= value < 1.0:
            raise ValueError(f"{name}: option {key}={value!r} must be in [0, 1)")


def split_spec(text: str) -> tuple[str, dict[str, str]]:
    """``"gwt-adamw:level=2:eps=1e-6"`` -> ``("gwt-adamw", {"level": "2", "eps": "1e-6"})``: values kept as
    written, keys with ``-`` read as ``_``; nothing is checked against the registry (see
    :func:`parse_optimizer_arg`)."""
    name, *pairs = text.strip().split(":")
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise ValueError(f"bad optimizer option {bad[0]!r} in {text!r}; expected key=value")
    return name.strip(), {k.strip().replace("-", "_"): v.strip() for k, v in (p.split("=", 1) for p in pairs)}


def format_spec(name: str, opts: dict[str, Any]) -> str:
    """The inverse of :func:`split_spec`."""
    return ":".join([name, *(f"{k}={v}" for k, v in opts.items())])


def parse_optimizer_arg(text: str) -> tuple[str, dict[str, Any]]:
    """``"gwt-adamw:level=3:scale=0.5"`` -> ``("gwt-adamw", {"level": 3, "scale": 0.5})``.

    Names and option keys and kinds are checked here, so a typo fails before
    any training starts.
    """
    name, raw = split_spec(text)
    opts: dict[str, Any] = {key: _convert(value) for key, value in raw.items()}
    if name not in REGISTRY:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(sorted(REGISTRY))}")
    _check_options(name, opts)
    return name, opts


# The bounds of the settings that a flag (``--lr``) and an optimizer spec's option
# (``gwt-adamw:lr=...``) both set: (minimum, strict). The toolkit's flags follow them too.
SHARED_BOUNDS: dict[str, tuple[float, bool]] = {
    "lr": (0, True), "regular_lr": (0, True), "scale": (0, True), "weight_decay": (0, False), "eps": (0, False),
}


def number_problem(name: str, value: Any, *, minimum: float, integer: bool = False,
                   strict: bool = False) -> str | None:
    """The one rule for a numeric setting: ``"NAME must be a number > 0, got V"``, or None when it holds."""
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if integer:
        ok = ok and float(value).is_integer()
    if not ok or not math.isfinite(value) or value < minimum or (strict and value == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        return f"{name} must be {kind} {bound}, got {value!r}"
    return None


def spec_number_problem(text: str) -> str | None:
    """What is wrong with ``text``'s shared numeric options by the rule of their flags, or None."""
    for key, raw in split_spec(text)[1].items():
        if key in SHARED_BOUNDS:
            minimum, strict = SHARED_BOUNDS[key]
            problem = number_problem(f"optimizer {text!r}: {key}", _convert(raw), minimum=minimum, strict=strict)
            if problem:
                return problem
    return None


def validate_optimizer_spec(text: str) -> None:
    """Raise ``ValueError`` for an unknown name, option or option kind in ``text``, or
    for a shared option out of the bounds its flag has (``gwt-adamw:lr=-1`` as ``--lr -1``)."""
    parse_optimizer_arg(text)
    problem = spec_number_problem(text)
    if problem:
        raise ValueError(problem)


def recipe_scale(name: str, options: dict[str, Any] | None = None) -> float:
    """The alpha of the recipe "keep your AdamW lr and weight decay" for registry entry ``name``:
    :func:`gwt_optim.optim.functional.adamw_scale` of the level for a GWT family (every entry with a ``level``
    option), 1 for any other optimizer, whose update is already at AdamW's size. Measured for GWT-AdamW
    (docs/results/transfer-cpu.md); GWT-Muon, whose step's size Newton-Schulz sets, does not take AdamW's lr
    with it (nor with 1: its tuned lr is 5x AdamW's at alpha 1), and keeps 2^(l/2) all the same: one alpha
    for every family, as :func:`gwt_optim.groups.gwt_param_groups` (which does not know the family) gives."""
    from gwt_optim.optim.functional import adamw_scale

    if name not in REGISTRY:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(sorted(REGISTRY))}")
    defaults = REGISTRY[name].defaults
    if "level" not in defaults:
        return 1.0
    return adamw_scale(int({**defaults, **(options or {})}["level"]))


def build_optimizer(name: str, model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    if name not in REGISTRY:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(sorted(REGISTRY))}")
    spec = REGISTRY[name]
    _check_options(name, config.options)
    opts = {**spec.defaults, **config.options}
    cfg = OptimizerConfig(**{**config.__dict__, "options": opts})
    if cfg.regular_eps is None:
        cfg.regular_eps = cfg.eps
    betas = list(cfg.betas)
    for i, key in enumerate(("beta1", "beta2")):
        if key in cfg.options and key not in spec.defaults:  # an entry's own beta1 (Adafactor) is its own
            betas[i] = float(cfg.options.pop(key))
    cfg.betas = (betas[0], betas[1])
    for key in SHARED_OPTIONS:
        if key in cfg.options and key not in ("beta1", "beta2"):  # name:lr=... overrides the shared value
            setattr(cfg, key, cfg.options.pop(key))
    if cfg.scale is None:
        cfg.scale = recipe_scale(name, cfg.options)
    opt = spec.factory(model, cfg)
    if cfg.options:  # a declared option its factory forgot to read: a bug here, not the user's
        raise RuntimeError(f"registry entry {name!r} ignored its option(s) {sorted(cfg.options)}")
    return opt


# --------------------------------------------------------------------------- #
# The baseline and the first GWT family. Peers are registered in ``peers.py``,
# the other GWT families in ``families.py``.
# --------------------------------------------------------------------------- #


@register("adamw", help="torch.optim.AdamW (fused on CPU/GPU where available)", options={"fused": None})
def _adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    from gwt_optim.groups import lr_scaled_groups

    groups = lr_scaled_groups(
        model, cfg.lr, cfg.scale, cfg.recipe, target_modules=cfg.target_modules,
        regular_options=cfg.regular_options(),
    )
    return torch.optim.AdamW(
        list(groups), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=cfg.pop("fused")
    )


# Options of every GWT family's transformed group, with the library's defaults.
GWT_OPTIONS: dict[str, Any] = {
    "level": 2,
    "wavelet": "haar",
    "norm_growth_limit": 1.01,
    "detail_clip": None,
    "impl": "fast",
    "moment_dtype": None,
}


def gwt_group_options(cfg: OptimizerConfig) -> dict[str, Any]:
    """Pop the shared GWT options: the transform's keyword arguments of
    :func:`gwt_optim.groups.gwt_param_groups` plus ``detail_clip``."""
    return {
        "level": cfg.pop("level"),
        "wavelet": cfg.pop("wavelet"),
        "norm_growth_limit": cfg.pop("norm_growth_limit"),
        "transformed_options": {"detail_clip": cfg.pop("detail_clip")},
    }


def _class_default(cls: type, name: str) -> Any:
    """A keyword's default in an optimizer class: the registry mirrors it
    rather than declaring a second one."""
    import inspect

    return inspect.signature(cls).parameters[name].default


def _gwt_adamw_options() -> dict[str, Any]:
    from gwt_optim.optim import GWTAdamW

    # ``detail_clip=none`` in a spec selects the paper's update.
    # ``detail_clip_end``: the clip anneals to it over training (train.DetailClipAnneal), a
    # zero-state remedy candidate of issue 18; None keeps the clip constant.
    return {**GWT_OPTIONS, "detail_clip": _class_default(GWTAdamW, "detail_clip"), "backend": None,
            "detail_clip_end": None, "detail_clip_units": _class_default(GWTAdamW, "detail_clip_units")}


@register(
    "gwt-adamw",
    help="GWT-AdamW: Adam moments on Haar approximation coefficients "
    "(level, wavelet, scale, norm_growth_limit, detail_clip (default 0.5; none = the paper's update), "
    "detail_clip_end (anneal the clip to it over a toolkit run), detail_clip_units=stored|step, moment_dtype, "
    "backend=auto|eager|native|triton)",
    options=_gwt_adamw_options(),
)
def _gwt_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    from gwt_optim.groups import gwt_param_groups
    from gwt_optim.optim import GWTAdamW

    split = gwt_param_groups(
        model, cfg.recipe, scale=cfg.scale, target_modules=cfg.target_modules,
        regular_options=cfg.regular_options(), **gwt_group_options(cfg),
    )
    end = cfg.pop("detail_clip_end")
    if end is not None and (isinstance(end, bool) or not isinstance(end, (int, float)) or not 0 < end < math.inf):
        raise ValueError(f"gwt-adamw: option detail_clip_end={end!r} must be a finite number > 0")
    opt = GWTAdamW(
        list(split), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
        impl=cfg.pop("impl"), moment_dtype=cfg.pop("moment_dtype"), backend=cfg.pop("backend") or "auto",
        detail_clip_units=cfg.pop("detail_clip_units"),
    )
    if end is not None:
        if not any(g.get("level") and g.get("detail_clip") is not None for g in opt.param_groups):
            raise ValueError("gwt-adamw: detail_clip_end anneals the clip; it needs a detail_clip, not none")
        opt.detail_clip_end = float(end)  # read by the training loop, which knows the run's length
    return opt
