"""What an optimizer says about the parameters it is given: warnings that name
the parameter and the fix, for choices that are allowed but rarely meant.
Never a refusal (those are ``ValueError`` in the optimizer's validation)."""

from __future__ import annotations

import warnings

from torch import Tensor

from gwt_optim.optim._tracing import caller_stacklevel

__all__ = ["say_what_a_flat_list_does"]

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
