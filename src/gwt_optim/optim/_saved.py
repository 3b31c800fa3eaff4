"""Checks on state: before :meth:`GWTOptimizer.load_state_dict` loads any of
a state dict (which optimizer saved it, and whether every saved state tensor
fits its parameter at its group's level; nothing is changed when one fails),
and before a step uses an existing state (:func:`state_problem`, the one
check of a state's tensors)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gwt_optim import wavelets
from gwt_optim.optim.functional import step_level

__all__ = ["approx_shape", "check_family", "check_saved_state", "describe", "expected_state", "saved_group", "shipped_families",
           "state_problem"]


def approx_shape(shape: tuple[int, ...], level: int, wavelet: str) -> tuple[int, ...]:
    """The shape of A_l for a parameter of ``shape`` (the transform runs along the last axis)."""
    if level == 0 or not shape:
        return shape
    n = shape[-1]
    if wavelet == wavelets.HAAR:
        k = wavelets.approx_length(n, level)
    else:  # longer filters add boundary coefficients: ask the transform itself
        k = wavelets.wavedec(torch.zeros(1, n), level, wavelet, dim=-1).approx.shape[-1]
    return (*shape[:-1], k)


def expected_state(rule: Any, group: dict, approx: tuple[int, ...], transformed: bool) -> dict[str, tuple]:
    """The shapes of the state tensors that ``rule`` (a group's
    :class:`~gwt_optim.optim._family.Rule`) keeps for approximation
    coefficients of shape ``approx``: what its ``init_state`` creates, on the
    meta device (no memory, no second statement of the state)."""
    state: dict[str, Any] = {}
    meta = torch.empty(approx, device="meta")
    rule.init_state(group, state, meta, meta.dtype, transformed)
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)}


def shipped_families(base: type) -> dict[str, str | None]:
    """The families this package ships (subclasses of ``base``), with their group keys."""
    found, todo = {}, list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("gwt_optim.optim."):
            found[cls._family] = cls._GROUP_KEY
    return found


def describe(groups: list[dict], p: Tensor) -> str:
    """``parameter i of group j (shape ...)``, for messages (a scan: errors only)."""
    for gi, group in enumerate(groups):
        for pi, q in enumerate(group["params"]):
            if q is p:
                return f"parameter {pi} of group {gi} (shape {tuple(p.shape)})"
    return f"a parameter of shape {tuple(p.shape)}"


def state_problem(state: dict, spec: dict[str, tuple], level: int, w: Tensor | None = None,
                  fused_dtype: torch.dtype | None = None) -> str | None:
    """Why ``state`` cannot take a level-``level`` step, or None: every tensor
    of ``spec`` (name -> the shape the family makes for this parameter and
    level) there and of its shape. With the weight ``w`` (a live state, not a
    saved one): on its device, of a floating (or int8 code) dtype. For the
    fused kernels, which index the state through raw pointers sized by the
    weight (``fused_dtype``: the moments' dtype they read), also of that dtype
    and contiguous, with a one-element limiter norm (the weight and gradient
    are :func:`~gwt_optim.optim._dispatch.choose`'s to check)."""
    saved = "the saved " if w is None else ""
    for key, shape in spec.items():
        t = state.get(key)
        if not isinstance(t, Tensor):
            return f"{saved or 'its '}state has no tensor {key!r} (keys: {sorted(state)})"
        if tuple(t.shape) != tuple(shape):
            return (f"{saved}state {key!r} has shape {tuple(t.shape)}, but level {level} needs {tuple(shape)}: "
                    "the state belongs to another model, parameter (order) or level")
        if w is None:
            continue
        if t.device != w.device or not (t.is_floating_point() or t.dtype == torch.uint8):  # uint8: int8 codes
            return f"state {key!r} is a {t.dtype} tensor on {t.device}, the parameter is on {w.device}"
        if fused_dtype is not None and t.dtype != fused_dtype:
            return (f"state {key!r} is {t.dtype} but the group's moments are {fused_dtype}; set the group's "
                    "moment_dtype to match the checkpoint, or pass backend='eager'")
        if fused_dtype is not None and not t.is_contiguous():
            return f"state {key!r} is not contiguous"
    s = state.get("limiter_norm")
    if fused_dtype is not None and s is not None and not (isinstance(s, Tensor) and s.numel() == 1):
        return f"state 'limiter_norm' must be a one-element tensor, got {s!r}"
    return None


def check_family(mine: str, saved_groups: list[dict[str, Any]], families: dict[str, str | None]) -> None:
    """Refuse a state dict saved by another optimizer or GWT family.
    ``families`` maps each shipped family to a group key only it has (or None):
    an untagged (pre-tag) GWT state dict is named by it."""
    tags = {g["optimizer"] for g in saved_groups if "optimizer" in g}
    if tags:
        if tags != {mine}:
            raise ValueError(
                f"this state dict was saved by {', '.join(sorted(map(str, tags)))}; it cannot be loaded into {mine}"
            )
        return
    # Untagged: another library's optimizer, or a GWT state dict saved before the tag.
    keys = set().union(*(g.keys() for g in saved_groups)) if saved_groups else set()
    if saved_groups and not {"level", "scale"} <= keys:
        if "amsgrad" in keys:
            adam = saved_groups[0].get("decoupled_weight_decay") is False
            other = "torch.optim.Adam" if adam else "torch.optim.AdamW"
        else:
            other = "a non-GWT optimizer"
        raise ValueError(
            f"this state dict was saved by {other} (its param groups have no GWT 'level'); "
            f"it cannot be loaded into {mine}"
        )
    other = next((name for name, key in families.items() if key is not None and key in keys),
                 "GWTAdamW" if "betas" in keys else None)
    if other is not None and other != mine and mine in families:
        raise ValueError(f"this state dict was saved by {other}; it cannot be loaded into {mine}")


def check_saved_state(family: str, groups: list[dict], defaults: dict[str, Any], rule_of: Any,
                      state_dict: dict[str, Any]) -> None:
    """Check every saved state tensor's shape against its parameter (of
    ``groups``) and its group's saved level and rule (``rule_of`` of the
    saved options over ``defaults``), before anything is loaded."""
    for gi, (group, saved) in enumerate(zip(groups, state_dict["param_groups"])):
        if len(group["params"]) != len(saved["params"]):
            continue  # torch raises its own error for this
        options = {**defaults, **{k: v for k, v in saved.items() if k != "params"}}
        for pi, (p, pid) in enumerate(zip(group["params"], saved["params"])):
            st = state_dict["state"].get(pid)
            if not st:
                continue
            transformed = p.ndim >= 2
            level, _ = step_level(p.shape, options["level"], options["scale"])
            where = f"parameter {pi} of group {gi} (shape {tuple(p.shape)})"
            try:
                spec = expected_state(rule_of(options), options,
                                      approx_shape(tuple(p.shape), level, options["wavelet"]), transformed)
            except Exception as exc:  # options a family cannot build state for
                raise ValueError(f"{family}: {where}: cannot check its saved state ({exc})") from exc
            problem = state_problem(st, spec, level)
            if problem is not None:
                raise ValueError(f"{family}: {where}: {problem}")


# Transfer-rule candidates of issue 46, measured and removed (docs/results/transfer-cpu.md): False is the
# update every version runs, so a group saved with it loads; True named a step this version does not have.
_REMOVED_OPTIONS = ("match_rms", "adamw_units")


def saved_group(group: dict[str, Any]) -> dict[str, Any]:
    """A saved group without the family tag and the removed options; ``ValueError`` if one was on."""
    on = [key for key in _REMOVED_OPTIONS if group.get(key)]
    if on:
        raise ValueError(f"this state dict was saved with {on[0]}=True, a transfer rule removed after it was "
                         "measured (docs/results/transfer-cpu.md); load it with gwt-optim at commit 84d482b or "
                         "earlier, or start the optimizer afresh")
    return {k: v for k, v in group.items() if k != "optimizer" and k not in _REMOVED_OPTIONS}
