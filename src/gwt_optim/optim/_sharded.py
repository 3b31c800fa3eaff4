"""The step's few collectives and DTensor checks, for FSDP2-sharded parameters.

Parameters sharded along dim 0 (FSDP2's default) transform locally, row by
row; only two things cross ranks: whether a gradient is finite (every rank
must skip the same parameters) and the limiter's squared norms (summed, so
that sharded and single-process training agree). Each is one collective per
device mesh for all parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["is_dtensor", "local", "check_sharding", "distribute_state", "finite_across_ranks",
           "reduce_limiter_norms"]


def is_dtensor(t: Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def local(t: Tensor) -> Tensor:
    return t.to_local() if is_dtensor(t) else t


def check_sharding(p: Tensor) -> None:
    """Refuse a DTensor sharded along the axis the transform runs on."""
    from torch.distributed.tensor import Shard

    for pl in p.placements:
        if isinstance(pl, Shard) and pl.dim % p.ndim == p.ndim - 1 and p.ndim >= 2:
            raise ValueError(
                "GWT transforms along the last axis, which this DTensor parameter is sharded "
                f"on ({p.placements}); shard it along dim 0 (FSDP2's default) instead"
            )


def distribute_state(p: Tensor, local_param: Tensor, state: dict) -> None:
    """Wrap state tensors that follow the parameter's row sharding as DTensors
    with the parameter's placements, so that distributed checkpointing
    (``torch.distributed.checkpoint``) saves and reshards them correctly.
    Scalars and statistics that are not row-aligned stay plain tensors."""
    from torch.distributed.tensor import DTensor

    rows = local_param.shape[0] if local_param.ndim else None
    for key, v in list(state.items()):
        if key == "step" or not isinstance(v, Tensor) or v.ndim != p.ndim or v.shape[0] != rows:
            continue
        shape = (p.shape[0], *v.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        state[key] = DTensor.from_local(v, p.device_mesh, p.placements, shape=shape, stride=stride)


def finite_across_ranks(params: list[Tensor]) -> dict[int, bool]:
    """Whether each sharded parameter's whole gradient is finite, by id, in one
    collective per device mesh: every rank must skip the same parameters, or
    the limiter's all-reduce and the shards would disagree."""
    import torch.distributed as dist

    by_mesh: dict[int, list[Tensor]] = {}
    for p in params:
        by_mesh.setdefault(id(p.device_mesh), []).append(p)
    finite: dict[int, bool] = {}
    for group in by_mesh.values():
        bad = torch.stack([(~torch.isfinite(local(p.grad))).any() for p in group]).to(torch.int32)
        mesh = group[0].device_mesh
        if mesh.size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=mesh.get_group())
        for p, b in zip(group, bad.tolist()):
            finite[id(p)] = not b
    return finite


def reduce_limiter_norms(pending: list[Any]) -> None:
    """Sum the limiter's squared norms (``ParamStep.norm_sq``) of the sharded
    ParamSteps across ranks, in one collective per device mesh."""
    sharded = [ps for ps in pending if ps.limited and is_dtensor(ps.full_param)]
    if not sharded:
        return
    import torch.distributed as dist

    by_mesh: dict[int, list[Any]] = {}
    for ps in sharded:
        by_mesh.setdefault(id(ps.full_param.device_mesh), []).append(ps)
    for steps in by_mesh.values():
        mesh = steps[0].full_param.device_mesh
        if mesh.size() == 1:
            continue
        values = [ps.norm_sq for ps in steps]
        if all(isinstance(v, Tensor) for v in values):
            flat = torch.stack(values)
            dist.all_reduce(flat, group=mesh.get_group())
            summed = flat.unbind()
        else:  # fused CPU kernels return Python floats
            flat = torch.tensor([float(v) for v in values], dtype=torch.float64)
            dist.all_reduce(flat, group=mesh.get_group())
            summed = flat.tolist()
        for ps, v in zip(steps, summed):
            ps.norm_sq = v
