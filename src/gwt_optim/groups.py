"""Split a model into GWT and regular parameter groups.

Two recipes decide which weights get the wavelet transform:

``"paper"``
    The recipe of Wen et al. (2025) and of GaLore/APOLLO before it: the weights
    of ``nn.Linear`` modules whose qualified names contain ``attn`` or ``mlp``
    (``target_modules``). Embeddings, the output head, norms and biases are
    regular parameters.
``"hidden"``
    Every 2-D hidden weight: any parameter with ``ndim >= 2`` that is neither an
    embedding (``nn.Embedding``) nor the output head (a module named
    ``lm_head``/``output``/``classifier``... or tied to the input embedding).

The *module-wise learning rate* of the paper is the scale ``alpha`` applied to
the transformed weights only. For the GWT optimizers it is the group's
``scale``; for any other optimizer (AdamW, GaLore, 8-bit Adam, ...) the same
split is expressed as ``lr * alpha`` on those weights, so that comparisons stay
fair (:func:`lr_scaled_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from torch import nn

from gwt_optim.optim.functional import adamw_scale  # the transfer rule, stated with the update

__all__ = ["ParamSplit", "split_params", "gwt_param_groups", "adamw_scale", "lr_scaled_groups", "RECIPES"]

RECIPES = ("paper", "hidden")
_HEAD_NAMES = ("lm_head", "output", "classifier", "score", "head")


@dataclass
class ParamSplit:
    """The outcome of a split: named parameters per side and the optimizer groups.

    Iterating yields the param-group dicts, so ``Optimizer(split)`` works, and
    :meth:`summary` prints what got the transform.
    """

    transformed: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    regular: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def n_transformed(self) -> int:
        """Number of scalar parameters that get the transform."""
        return sum(p.numel() for _, p in self.transformed)

    @property
    def n_regular(self) -> int:
        return sum(p.numel() for _, p in self.regular)

    @property
    def counts(self) -> dict[str, int]:
        total = self.n_transformed + self.n_regular
        return {
            "transformed_tensors": len(self.transformed),
            "transformed_params": self.n_transformed,
            "regular_tensors": len(self.regular),
            "regular_params": self.n_regular,
            "total_params": total,
        }

    @property
    def transformed_fraction(self) -> float:
        total = self.n_transformed + self.n_regular
        return self.n_transformed / total if total else 0.0

    def summary(self) -> str:
        c = self.counts
        return (
            f"GWT: {c['transformed_tensors']} tensors, {c['transformed_params']:,} params "
            f"({100 * self.transformed_fraction:.1f}%); regular: {c['regular_tensors']} tensors, "
            f"{c['regular_params']:,} params"
        )


def _embedding_param_ids(model: nn.Module) -> set[int]:
    ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            ids.add(id(module.weight))
    return ids


def _is_head(name: str) -> bool:
    module_name = name.rsplit(".", 1)[0] if "." in name else ""
    last = module_name.rsplit(".", 1)[-1]
    return last in _HEAD_NAMES or module_name in _HEAD_NAMES


def split_params(
    model: nn.Module,
    recipe: str = "paper",
    *,
    target_modules: Sequence[str] = ("attn", "mlp"),
) -> ParamSplit:
    """Partition ``model``'s trainable parameters into transformed and regular.

    Each parameter appears once even when shared (tied embeddings).
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {RECIPES}")
    split = ParamSplit()
    seen: set[int] = set()
    if recipe == "paper":
        chosen: set[int] = set()
        for mod_name, module in model.named_modules():
            if isinstance(module, nn.Linear) and any(t in mod_name for t in target_modules):
                chosen.add(id(module.weight))
    else:
        embeddings = _embedding_param_ids(model)
        chosen = set()
        for name, p in model.named_parameters():
            if p.ndim >= 2 and id(p) not in embeddings and not _is_head(name):
                chosen.add(id(p))
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (split.transformed if id(p) in chosen else split.regular).append((name, p))
    return split


def gwt_param_groups(
    model: nn.Module,
    recipe: str = "paper",
    *,
    level: int = 2,
    wavelet: str = "haar",
    scale: float | None = None,
    norm_growth_limit: float | None = 1.01,
    target_modules: Sequence[str] = ("attn", "mlp"),
    transformed_options: dict[str, Any] | None = None,
    regular_options: dict[str, Any] | None = None,
) -> ParamSplit:
    """Param groups for a GWT optimizer: transformed weights at ``level`` with
    scale ``alpha`` and the norm-growth limiter, everything else as the plain
    base optimizer (level 0, scale 1, no limiter).

    ``scale=None`` (the default) is :func:`adamw_scale` of the level, 2 at
    level 2: with it the optimizer takes AdamW's learning rate and weight
    decay as they are (docs/algorithm.md, "Carrying AdamW's learning rate
    over"). The paper's pre-training recipe is ``scale=0.25`` with lr 1e-2.

    ``transformed_options``/``regular_options`` add group keys (``lr``,
    ``weight_decay``, ...) to either side. Empty groups are left out.
    """
    split = split_params(model, recipe, target_modules=target_modules)
    gwt = {
        "params": [p for _, p in split.transformed],
        "level": level,
        "wavelet": wavelet,
        "scale": adamw_scale(level) if scale is None else scale,
        "norm_growth_limit": norm_growth_limit,
        **(transformed_options or {}),
    }
    plain = {
        "params": [p for _, p in split.regular],
        "level": 0,
        "wavelet": wavelet,
        "scale": 1.0,
        "norm_growth_limit": None,
        **(regular_options or {}),
    }
    split.groups = [g for g in (gwt, plain) if g["params"]]
    return split


def lr_scaled_groups(
    model: nn.Module,
    lr: float,
    scale: float = 1.0,
    recipe: str = "paper",
    *,
    target_modules: Sequence[str] = ("attn", "mlp"),
    transformed_options: dict[str, Any] | None = None,
    regular_options: dict[str, Any] | None = None,
) -> ParamSplit:
    """The same split for any optimizer: transformed weights get ``lr * scale``.

    This is how the paper's module-wise learning rate is given to peers that
    have no ``scale`` of their own (AdamW, 8-bit Adam, Adam-mini, ...), so every
    optimizer in a comparison sees the same effective step on the same weights.
    """
    split = split_params(model, recipe, target_modules=target_modules)
    a = {"params": [p for _, p in split.transformed], "lr": lr * scale, **(transformed_options or {})}
    b = {"params": [p for _, p in split.regular], "lr": lr, **(regular_options or {})}
    split.groups = [g for g in (a, b) if g["params"]]
    return split
