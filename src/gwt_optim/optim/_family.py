"""What every GWT family module shares and :mod:`gwt_optim.optim._base` does not
own: a family's constructor builds its ``defaults`` with it, and a group's
:class:`Rule` is what the stepper runs.

Kept out of the base so that the base holds torch.optim's contract, and the
families' conventions sit in one small place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor

__all__ = ["Rule", "transform_defaults", "check_adam_hyperparameters", "group_lr"]


@dataclass(frozen=True, eq=False)
class Rule:
    """How a group's parameters step: everything the stepper
    (:mod:`gwt_optim.optim._stepper`) and the saved-state checks
    (:mod:`gwt_optim.optim._saved`) know of a family. A family makes one per
    kind of group (GWT-Muon: its Muon groups' and its AdamW groups')."""

    family: str  # the family's name, in messages
    # (group, state, approx, moment_dtype, transformed): create the state tensors for A_l shaped like approx.
    init_state: Callable[..., None]
    # (group, state, W, G, step[, reduce=]) -> functional.Moments: the first half (reduce: a sharded
    # parameter's _sharded.Sharding, passed only for one).
    moments: Callable[..., Any]
    # (group, W, moments, r, step[, reduce=]): the second half, with the limiter's r.
    apply: Callable[..., None]
    kernels: Any = None  # the fused kernels (_dispatch.Kernels) its steps may run on; None: every step eager
    # Its sharded second half needs each matrix whole: those steps wait for between_phases.
    whole_matrix: bool = False
    # (pending ParamSteps, the same on every rank): its collectives between the halves of sharded steps,
    # after the limiter's all-reduce.
    between_phases: Callable[[list], None] | None = None
    limiter: bool = True  # whether its update takes Fira's limiter at all (GWT-Muon's Muon groups' does not)

    def limited(self, group: dict, transformed: bool) -> bool:
        """Whether Fira's limiter applies to a step of ``group``: a transformed
        parameter's, with a ``norm_growth_limit``, under a rule that takes it."""
        return self.limiter and transformed and group["norm_growth_limit"] is not None


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
