"""Checks on saved state: before :meth:`GWTOptimizer.load_state_dict` loads
any of a state dict (which optimizer saved it, and whether every saved state
tensor fits its parameter at its group's level; nothing is changed when one
fails), and before an eager step uses an existing state."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gwt_optim import wavelets
from gwt_optim.optim._fused import state_shape_problem

__all__ = ["approx_shape", "check_family", "check_saved_state", "eager_state_problem"]


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


def _guess_family(keys: set[str], families: dict[str, str | None]) -> str | None:
    for name, key in families.items():
        if key is not None and key in keys:
            return name
    return "GWTAdamW" if "betas" in keys else None


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
    other = _guess_family(keys, families)
    if other is not None and other != mine and mine in families:
        raise ValueError(f"this state dict was saved by {other}; it cannot be loaded into {mine}")


def check_saved_state(opt: Any, state_dict: dict[str, Any]) -> None:
    """Check every saved state tensor's shape against its parameter and
    its group's saved level, before anything is loaded."""
    for gi, (group, saved) in enumerate(zip(opt.param_groups, state_dict["param_groups"])):
        if len(group["params"]) != len(saved["params"]):
            continue  # torch raises its own error for this
        options = {**opt.defaults, **{k: v for k, v in saved.items() if k != "params"}}
        for pi, (p, pid) in enumerate(zip(group["params"], saved["params"])):
            st = state_dict["state"].get(pid)
            if not st:
                continue
            transformed = p.ndim >= 2
            level = options["level"] if transformed else 0
            try:
                approx = approx_shape(tuple(p.shape), level, options["wavelet"])
                spec = opt._expected_state(options, approx, transformed)
            except Exception as exc:  # options a family cannot build state for
                raise ValueError(
                    f"{opt._family}: parameter {pi} of group {gi} (shape {tuple(p.shape)}): "
                    f"cannot check its saved state ({exc})"
                ) from exc
            for key, shape in spec.items():
                t = st.get(key)
                if not isinstance(t, Tensor):
                    problem = f"the saved state has no tensor {key!r} (keys: {sorted(st)})"
                elif tuple(t.shape) != shape:
                    problem = (
                        f"the saved state {key!r} has shape {tuple(t.shape)}, but level {level} needs {shape}: "
                        "the state dict belongs to another model, parameter order or level"
                    )
                else:
                    continue
                where = f"parameter {pi} of group {gi} (shape {tuple(p.shape)})"
                raise ValueError(f"{opt._family}: {where}: {problem}")


def eager_state_problem(opt: Any, group: dict, state: dict, G: Tensor, level: int, moment_dtype,
                        transformed: bool) -> str | None:
    """What makes an existing state unfit for this eager step of ``opt`` (its
    gradient ``G`` in the compute dtype), or None (the fused paths check with
    :func:`gwt_optim.optim._fused.state_problem`)."""
    key = (id(group), tuple(G.shape), level, group["wavelet"], transformed, moment_dtype)
    spec = opt._state_specs.get(key)
    if spec is None:
        spec = opt._state_specs[key] = opt._expected_state(group, approx_shape(tuple(G.shape), level, group["wavelet"]),
                                                           transformed)
    for name, shape in spec.items():
        problem = state_shape_problem(state, name, shape, level)
        if problem is not None:
            return problem
        t = state[name]
        if t.device != G.device or not (t.is_floating_point() or t.dtype == torch.uint8):  # uint8: int8 codes
            return f"state {name!r} is a {t.dtype} tensor on {t.device}, the step runs in {G.dtype} on {G.device}"
    return None
