"""The step's few collectives and DTensor checks, for FSDP2-sharded parameters.

Parameters sharded along dim 0 (FSDP2's default) transform locally, row by
row; only two things cross ranks: whether a gradient is finite (every rank
must skip the same parameters) and the limiter's squared norms (summed, so
that sharded and single-process training agree). Each is one collective per
device mesh for all parameters.
"""

from __future__ import annotations

from typing import Any, Callable

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


# ------------------------------------------------ whole matrices (GWT-Muon) --- #
#
# Newton-Schulz needs a Muon-group matrix whole. Each one gets an owner rank in
# the mesh dimension that shards its rows; the ranks of that dimension send
# their rows of the matrix to its owner, the owner runs the function once on
# the whole matrix and sends each rank its rows of the result: one batched
# all_to_all each way per (mesh dimension, dtype), whatever the number of
# matrices. Every rank of the dimension issues both, an empty shard included.


def row_mesh_dim(p: Tensor) -> int | None:
    """The mesh dimension whose ranks hold consecutive row chunks of the
    DTensor ``p`` (``Shard(0)``; the other dimensions replicate it), or None
    if every dimension replicates it. Any other layout is a ``ValueError``:
    its owner could not reassemble the whole matrix from the shards."""
    from torch.distributed.tensor import Replicate, Shard

    dims = []
    for i, pl in enumerate(p.placements):
        if type(pl) is Shard and pl.dim % p.ndim == 0:
            dims.append(i)
        elif type(pl) is not Replicate:
            dims = None
            break
    if dims is None or len(dims) > 1:
        raise ValueError(
            f"GWT-Muon gathers each Muon-group matrix from its row shards, which needs Shard(0) on one mesh "
            f"dimension and Replicate on the others; this parameter is placed {tuple(p.placements)} "
            "(FSDP2 or HSDP without tensor parallelism, or put it in a use_muon=False group)"
        )
    return dims[0] if dims else None


def row_chunks(rows: int, ranks: int) -> list[int]:
    """The rows each coordinate of a ``Shard(0)`` mesh dimension holds (torch.chunk's split, FSDP2's and DTensor's)."""
    size = -(-rows // ranks)
    return [max(0, min(size, rows - c * size)) for c in range(ranks)]


def _owners(shapes: list[tuple[int, int]], ranks: int) -> list[int]:
    """An owner coordinate per matrix: largest Newton-Schulz cost first, each
    to the least loaded rank (the same answer on every rank)."""
    load = [0] * ranks
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -shapes[i][0] * shapes[i][1] * min(shapes[i])):
        c = min(range(ranks), key=load.__getitem__)
        owner[i] = c
        load[c] += shapes[i][0] * shapes[i][1] * min(shapes[i])
    return owner


def on_whole_matrices(items: list[tuple[Tensor, Tensor]], fn: Callable[[int, Tensor], Tensor]) -> list[Tensor]:
    """For each ``(p, X)``, ``p`` a 2-D DTensor parameter and ``X`` this
    rank's rows of a matrix laid out as ``p`` (a plain tensor): this rank's
    rows of ``fn(i, whole X)`` (``i``: the item's index; same shape and dtype),
    run once per matrix, on its owner. Every rank of each mesh passes the same
    parameters in the same order (their ``X`` are this rank's)."""
    results: list[Tensor | None] = [None] * len(items)
    batches: dict[tuple, list[int]] = {}
    for i, (p, X) in enumerate(items):
        dim = row_mesh_dim(p)
        if dim is None or p.device_mesh.size(dim) == 1:
            results[i] = fn(i, X)  # the rows here are the whole matrix
        else:
            batches.setdefault((id(p.device_mesh), dim, X.dtype), []).append(i)
    for (_, dim, _), idx in batches.items():
        _exchange([items[i] for i in idx], dim, lambda j, X, idx=idx: fn(idx[j], X), results, idx)
    return results  # type: ignore[return-value]


def _exchange(items: list[tuple[Tensor, Tensor]], dim: int, fn: Callable[[int, Tensor], Tensor],
              results: list, where: list[int]) -> None:
    """:func:`on_whole_matrices` for matrices whose rows one mesh dimension shards."""
    import torch.distributed as dist

    mesh = items[0][0].device_mesh
    group, ranks, me = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    # all_to_all's splits are in the group's rank order; the row chunks in the mesh's coordinate order.
    coordinate = list(mesh.get_coordinate())
    line = []
    for c in range(ranks):
        coordinate[dim] = c
        line.append(dist.get_group_rank(group, int(mesh.mesh[tuple(coordinate)])))
    by_group_rank = sorted(range(ranks), key=line.__getitem__)  # coordinates in group-rank order
    shapes = [tuple(p.shape) for p, _ in items]
    chunks = [row_chunks(m, ranks) for m, _ in shapes]
    owner = _owners(shapes, ranks)
    for (p, X), ch in zip(items, chunks):
        if X.shape != (ch[me], p.shape[1]):
            raise ValueError(f"a shard of {tuple(p.shape)} on {tuple(p.placements)} holds {tuple(X.shape)}, "
                             f"not the {ch[me]} rows of torch.chunk's split that GWT-Muon reassembles")
    dtype, device = items[0][1].dtype, items[0][1].device
    mine = [j for j in range(len(items)) if owner[j] == me]

    # To the owners: each rank's rows of every matrix, grouped by owner.
    send = [[items[j][1].reshape(-1) for j in range(len(items)) if owner[j] == c] for c in by_group_rank]
    send_sizes = [sum(t.numel() for t in ts) for ts in send]
    recv_sizes = [sum(chunks[j][c] * shapes[j][1] for j in mine) for c in by_group_rank]
    received = _all_to_all([t for ts in send for t in ts], send_sizes, recv_sizes, dtype, device, group)
    wholes = {j: torch.empty(shapes[j], dtype=dtype, device=device) for j in mine}
    offset = 0
    for c in by_group_rank:
        for j in mine:
            start, n = sum(chunks[j][:c]), chunks[j][c]
            wholes[j][start:start + n].view(-1).copy_(received[offset:offset + n * shapes[j][1]])
            offset += n * shapes[j][1]
    done = {j: fn(j, X) for j, X in wholes.items()}

    # Back from the owners: each rank's rows of every result it holds a shard of.
    send = [[done[j][sum(chunks[j][:c]):sum(chunks[j][:c + 1])].reshape(-1) for j in mine] for c in by_group_rank]
    send_sizes = [sum(t.numel() for t in ts) for ts in send]
    recv_sizes = [sum(chunks[j][me] * shapes[j][1] for j in range(len(items)) if owner[j] == c)
                  for c in by_group_rank]
    received = _all_to_all([t for ts in send for t in ts], send_sizes, recv_sizes, dtype, device, group)
    offset = 0
    for c in by_group_rank:
        for j in range(len(items)):
            if owner[j] == c:
                n = chunks[j][me] * shapes[j][1]
                results[where[j]] = received[offset:offset + n].view(chunks[j][me], shapes[j][1])
                offset += n


def _all_to_all(parts: list[Tensor], send_sizes: list[int], recv_sizes: list[int], dtype: torch.dtype,
                device: torch.device, group: Any) -> Tensor:
    import torch.distributed as dist

    send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
    received = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=group)
    return received


__all__ += ["row_mesh_dim", "row_chunks", "on_whole_matrices"]
