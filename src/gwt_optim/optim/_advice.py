"""What an optimizer says about the parameters it is given: warnings that name
the parameter and the fix, for choices that are allowed but rarely meant.
Never a refusal (those are ``ValueError`` in the optimizer's validation)."""

from __future__ import annotations

import warnings

from torch import Tensor

from gwt_optim.optim._tracing import caller_stacklevel
from gwt_optim.optim.functional import step_level

__all__ = ["say_what_a_flat_list_does", "say_which_weights_are_capped"]

_said_flat = False


def say_what_a_flat_list_does(family: str, params: list, group: dict) -> None:
    """Warn once per process when a plain list of tensors (``model.parameters()``,
    the torch habit) puts embeddings and the output head under the transform:
    every tensor of two or more dimensions is transformed, where the paper
    transforms only the attention and MLP weights. Param groups say what the
    user chose, and are never warned about."""
    global _said_flat
    if _said_flat or isinstance(params, Tensor) or not params or not all(isinstance(p, Tensor) for p in params) or not group["level"]:
        return
    mats = [p for p in params if p.ndim >= 2]
    if not mats:
        return
    _said_flat = True
    warnings.warn(
        f"{family}: a plain list of parameters transforms all {len(mats)} tensors with two or more dimensions "
        f"({sum(p.numel() for p in mats):,} values) at level {group['level']}, embeddings and output head "
        f"included, each stepping at scale {group['scale']:g} x lr; the paper transforms only attention and MLP "
        "weights. For its split, at the alpha 2^(level/2) with which AdamW's lr carries over, pass "
        "gwt_optim.gwt_param_groups(model); or param groups of your own (then this is not said)",
        UserWarning,
        stacklevel=caller_stacklevel(),
    )


def say_which_weights_are_capped(family: str, groups: list[dict]) -> bool:
    """Warn (once per optimizer: the caller keeps the answer) when weights of
    ``groups`` have a last axis too short for their group's level and step at a
    lower one (:func:`~gwt_optim.optim.functional.step_level`): how many, from
    which level to which. True when it warned."""
    capped: dict[tuple[int, int], list[tuple]] = {}
    for g in groups:
        for p in g["params"]:
            if isinstance(p, Tensor) and p.ndim >= 2 and p.numel():  # an empty one never steps
                used, _ = step_level(p.shape, g["level"], g["scale"])
                if used != g["level"]:
                    capped.setdefault((g["level"], used), []).append(tuple(p.shape))
    if not capped:
        return False
    n = sum(map(len, capped.values()))
    which = "; ".join(f"{len(shapes)} from level {level} to {used} ({', '.join(map(str, shapes[:3]))}"
                      f"{', ...' if len(shapes) > 3 else ''})" for (level, used), shapes in sorted(capped.items()))
    warnings.warn(
        f"{family}: the last axis of {n} weight{'s' if n > 1 else ''} is too short for the group's level; each "
        "steps at the deepest level it fits, ceil(log2 n), with alpha times 2^((level used - level)/2) "
        f"(docs/algorithm.md): {which}. Said once per optimizer",
        UserWarning,
        stacklevel=caller_stacklevel(),
    )
    return True
