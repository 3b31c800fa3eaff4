"""What every GWT family module shares and :mod:`gwt_optim.optim._base` does not
own: a family's constructor builds its ``defaults`` with it.

Kept out of the base so that the base holds the step, and the families'
conventions sit in one small place that only the family modules import.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["transform_defaults", "check_adam_hyperparameters", "group_lr"]


def transform_defaults(level: int, wavelet: str, scale: float, norm_growth_limit: float | None) -> dict[str, Any]:
    """The wavelet transform's options, which every family takes and
    :class:`~gwt_optim.optim._base.GWTOptimizer` validates, keyed as the
    groups hold them.

    A family splices them into its ``defaults`` where it lists them.
    GWTOptimizer puts its own keys (these among them) first in every group,
    and the family's other keys follow in the order of its ``defaults``, which
    a saved ``state_dict`` keeps.
    """
    return dict(level=level, wavelet=wavelet, scale=scale, norm_growth_limit=norm_growth_limit)


def check_adam_hyperparameters(g: dict[str, Any]) -> None:
    """``ValueError`` for a group's Adam ``betas`` or ``eps`` out of range
    (GWT-AdamW, GWT-Adam-mini, and GWT-Muon's AdamW groups)."""
    betas = g["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"Invalid betas: {betas!r} (a pair (beta1, beta2))")
    if len({isinstance(b, Tensor) for b in betas}) > 1:
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        b = b.item() if hasattr(b, "item") else b  # a 0-d tensor
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b} (must be in [0, 1))")
    if not 0.0 <= g["eps"]:
        raise ValueError(f"Invalid epsilon value: {g['eps']} (must be >= 0)")


def group_lr(group: dict[str, Any]) -> float:
    """The group's learning rate as a float (a 0-d tensor lr is read once per use)."""
    lr = group["lr"]
    return lr.item() if isinstance(lr, Tensor) else lr
