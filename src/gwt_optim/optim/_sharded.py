"""The one rule for sharded (DTensor) parameters, every family's: the step's
collectives and DTensor checks.

A DTensor parameter on a device mesh of any dimension (FSDP2, HSDP, tensor
or expert parallelism, or a plain ``distribute_tensor``) is stepped shard by
shard, each rank on its local rows, under one rule:

* The transform runs along the last axis, so every axis but the last may be
  sharded (``Shard``, FSDP2's ``_StridedShard``) or replicated
  (``Replicate``) on any mesh dimension; a matrix or higher sharded on its
  last axis, or a ``Partial`` placement, is refused (:func:`check_sharding`).
* The state lives at the global shape with the parameter's placements: each
  state tensor of the parameter's dimensionality is a DTensor whose axes that
  follow the parameter's (an axis that doubles when the parameter's does)
  keep the parameter's placement, and whose reduced axes (a statistic of size
  1 over a sharded axis, e.g. Adafactor's column statistic) are replicated;
  scalars and whole-tensor statistics stay plain tensors, equal on every rank
  (:func:`distribute_state`). Checkpoints (``torch.distributed.checkpoint``)
  save and reshard the DTensors like the parameters.
* Every reduction a family needs -- the limiter's norm, the non-finite check,
  Adam-mini's block means, Adafactor's row and column statistics and RMS --
  sums (or maxes) over exactly the mesh dimensions that shard the reduced axes
  (:class:`Sharding`): never over a replicated dimension, whose ranks hold the
  same rows. Every rank issues the same collectives in the same order: the
  parameters in the same order, an empty shard included, and the non-finite
  check agreed before any other (:func:`finite_across_ranks`).

The non-finite check and the limiter's norms are one collective per (mesh,
mesh dimension) for all parameters; a family's own reductions (Adam-mini's
whole-tensor blocks, Adafactor's statistics) are one small all-reduce per
parameter and statistic, in its halves (``reduce=`` of :mod:`.functional`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor

__all__ = ["is_dtensor", "local", "check_sharding", "Sharding", "distribute_state", "head_shards_problem",
           "finite_across_ranks", "reduce_limiter_norms"]


def is_dtensor(t: Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def local(t: Tensor) -> Tensor:
    return t.to_local() if is_dtensor(t) else t


def _sharded_axis(placement: Any, ndim: int) -> int | None:
    """The parameter axis a placement shards (``Shard``, FSDP2's
    ``_StridedShard``: both have ``dim``), or None (``Replicate``)."""
    dim = getattr(placement, "dim", None)
    return None if dim is None else dim % max(ndim, 1)


def check_sharding(p: Tensor) -> None:
    """Refuse a layout the transform cannot take: a DTensor of two or more
    dimensions sharded along the last axis (the transform's), or a pending
    reduction (``Partial``), which is not a parameter's layout."""
    for pl in p.placements:
        if pl.is_partial():
            raise ValueError(f"a DTensor parameter placed {tuple(p.placements)} holds partial sums; "
                             "GWT optimizers step Shard and Replicate placements only")
        if p.ndim >= 2 and _sharded_axis(pl, p.ndim) == p.ndim - 1:
            raise ValueError(
                "GWT transforms along the last axis, which this DTensor parameter is sharded "
                f"on ({tuple(p.placements)}); shard it along another axis (FSDP2's dim 0, ColwiseParallel) "
                "instead"
            )


class Sharding:
    """A DTensor parameter's layout as the family's reductions read it:
    :meth:`sum_` all-reduces a statistic over the mesh dimensions that shard
    the reduced axes, :meth:`size` counts the reduced entries globally. Passed
    to the families' halves as ``reduce=`` (None: one process)."""

    __slots__ = ("mesh", "shape", "axes")

    def __init__(self, p: Tensor) -> None:
        self.mesh = p.device_mesh
        self.shape = tuple(p.shape)
        # Per mesh dimension, the parameter axis it shards (None: replicated).
        self.axes = tuple(_sharded_axis(pl, p.ndim) for pl in p.placements)

    def mesh_dims(self, axes: Iterable[int] | None = None) -> tuple[int, ...]:
        """The mesh dimensions of more than one rank that shard one of
        ``axes`` (the parameter's axes; None: all of them)."""
        ndim = len(self.shape)
        wanted = None if axes is None else {a % max(ndim, 1) for a in axes}
        return tuple(i for i, a in enumerate(self.axes)
                     if a is not None and (wanted is None or a in wanted) and self.mesh.size(i) > 1)

    def sum_(self, x: Tensor, axes: Iterable[int] | None = None, op: Any = None) -> Tensor:
        """``x`` (this rank's partial statistic over ``axes``) summed in place
        over the ranks that hold the other parts of those axes."""
        import torch.distributed as dist

        for i in self.mesh_dims(axes):
            dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=self.mesh.get_group(i))
        return x

    def size(self, x: Tensor, axes: Iterable[int]) -> int:
        """The global number of entries of local ``x`` (the parameter's
        dimensionality, e.g. A_l) along ``axes``: a sharded axis counts the
        parameter's whole length, another ``x``'s own (the last axis, A_l's)."""
        sharded = {a for a in self.axes if a is not None}
        n = 1
        for a in axes:
            a %= x.ndim
            n *= self.shape[a] if a in sharded else x.shape[a]
        return n


def distribute_state(p: Tensor, state: dict, spec: Callable[[tuple[int, ...]], dict[str, tuple]]) -> None:
    """Wrap the state tensors of DTensor ``p`` as DTensors at the global shape
    with ``p``'s placements (the rule above), so that distributed
    checkpointing saves and reshards them correctly. ``spec(shape)`` gives
    the family's state shapes for a parameter of ``shape`` (meta tensors): at
    ``p``'s global shape, the global shapes; with a sharded axis doubled, which
    state axes follow it."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(p.shape)
    full = spec(shape)
    axes = [_sharded_axis(pl, p.ndim) for pl in p.placements]
    split = {a for i, a in enumerate(axes) if a is not None and p.device_mesh.size(i) > 1}
    follows: dict[str, set[int]] = {}
    for d in {a for a in axes if a is not None}:
        grown = spec((*shape[:d], 2 * shape[d], *shape[d + 1:]))
        for key, s in full.items():
            if len(s) == p.ndim and len(grown[key]) == p.ndim and grown[key][d] != s[d]:
                follows.setdefault(key, set()).add(d)
            elif len(s) != p.ndim and grown[key] != s and d in split:
                # e.g. Adam-mini's row statistics of a 3-D weight, kept flattened over its leading axes
                raise ValueError(
                    f"the state {key!r} of shape {s} of a DTensor parameter {shape} placed {tuple(p.placements)} "
                    f"depends on its sharded axis {d} without following it; its shards cannot hold it"
                )
    for key, v in list(state.items()):
        if key == "step" or not isinstance(v, Tensor) or v.ndim != p.ndim or key not in full:
            continue
        placements = tuple(pl if a is not None and a in follows.get(key, ()) else Replicate()
                           for pl, a in zip(p.placements, axes))
        global_shape = full[key]
        expected, _ = compute_local_shape_and_global_offset(global_shape, p.device_mesh, placements)
        if tuple(expected) != tuple(v.shape):
            raise ValueError(
                f"the state {key!r} of a DTensor parameter {shape} placed {tuple(p.placements)} holds "
                f"{tuple(v.shape)} here, not the {tuple(expected)} of its global {global_shape}: its shards do not "
                "split the state's blocks evenly; choose another block or layout"
            )
        stride = torch.empty(global_shape, device="meta").stride()
        state[key] = DTensor.from_local(v, p.device_mesh, placements, shape=global_shape, stride=stride)


def _chunks(length: int, ranks: int) -> list[int]:
    """The lengths torch.chunk's split gives each coordinate of a mesh dimension (DTensor's ``Shard``)."""
    size = -(-length // ranks)
    return [max(0, min(size, length - c * size)) for c in range(ranks)]


def head_shards_problem(p: Tensor, rows_per_block: int) -> str | None:
    """Why the shards of DTensor ``p`` (two or more dimensions) do not each
    hold whole blocks of ``rows_per_block`` consecutive rows (its leading axes
    flattened, as Adam-mini's heads), split as DTensor splits the blocks' own
    statistic; None if they do. The same answer on every rank."""
    dims = [(i, pl) for i, pl in enumerate(p.placements)
            if _sharded_axis(pl, p.ndim) is not None and p.device_mesh.size(i) > 1]
    if not dims:
        return None
    (i, pl), = dims if len(dims) == 1 else ((None, None),)
    if i is None or _sharded_axis(pl, p.ndim) != 0 or type(pl).__name__ != "Shard":
        return f"is placed {tuple(p.placements)}: only Shard(0) on one mesh dimension keeps its heads whole"
    ranks, rows = p.device_mesh.size(i), p.shape[0]
    per_index = 1
    for n in p.shape[1:-1]:
        per_index *= n
    blocks = rows * per_index // rows_per_block
    if [c * per_index for c in _chunks(rows, ranks)] != [b * rows_per_block for b in _chunks(blocks, ranks)]:
        return (f"has its {rows} rows split {_chunks(rows, ranks)} over {ranks} ranks, which cuts heads of "
                f"{rows_per_block} rows")
    return None


def _by_reduction(items: list[Any], param: Callable[[Any], Tensor]) -> list[tuple[Any, tuple[int, ...], list]]:
    """``items`` grouped by (device mesh, mesh dimensions that shard the
    parameter), in first-seen order: the same order on every rank."""
    groups: dict[tuple, tuple[Any, tuple[int, ...], list]] = {}
    for item in items:
        p = param(item)
        dims = Sharding(p).mesh_dims()
        key = (id(p.device_mesh), dims)
        if key not in groups:
            groups[key] = (p.device_mesh, dims, [])
        groups[key][2].append(item)
    return list(groups.values())


def finite_across_ranks(params: list[Tensor]) -> dict[int, bool]:
    """Whether each sharded parameter's whole gradient is finite, by id, in one
    collective per (mesh, sharding mesh dimension): every rank must skip the
    same parameters, or the later collectives and the shards would disagree."""
    import torch.distributed as dist

    finite: dict[int, bool] = {}
    for mesh, dims, group in _by_reduction(params, lambda p: p):
        bad = torch.stack([(~torch.isfinite(local(p.grad))).any() for p in group]).to(torch.int32)
        for i in dims:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=mesh.get_group(i))
        for p, b in zip(group, bad.tolist()):
            finite[id(p)] = not b
    return finite


def reduce_limiter_norms(pending: list[Any]) -> None:
    """Sum the limiter's squared norms (``ParamStep.norm_sq``) of the sharded
    ParamSteps over the mesh dimensions that shard them, in one collective per
    (mesh, mesh dimension)."""
    sharded = [ps for ps in pending if ps.limited and is_dtensor(ps.full_param)]
    if not sharded:
        return
    import torch.distributed as dist

    for mesh, dims, steps in _by_reduction(sharded, lambda ps: ps.full_param):
        if not dims:
            continue
        values = [ps.norm_sq for ps in steps]
        tensors = all(isinstance(v, Tensor) for v in values)
        # fused CPU kernels return Python floats
        flat = torch.stack(values) if tensors else torch.tensor([float(v) for v in values], dtype=torch.float64)
        for i in dims:
            dist.all_reduce(flat, group=mesh.get_group(i))
        for ps, v in zip(steps, flat.unbind() if tensors else flat.tolist()):
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


def row_starts(rows: int, ranks: int) -> list[int]:
    """Where each coordinate's rows start along a ``Shard(0)`` mesh dimension,
    and the end: torch.chunk's split (FSDP2's and DTensor's), empty chunks last."""
    size = -(-rows // ranks)
    return [min(rows, c * size) for c in range(ranks + 1)]


def row_chunks(rows: int, ranks: int) -> list[int]:
    """The rows each coordinate holds (:func:`row_starts`)."""
    starts = row_starts(rows, ranks)
    return [b - a for a, b in zip(starts, starts[1:])]


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
    starts = [row_starts(m, ranks) for m, _ in shapes]
    chunks = [[b - a for a, b in zip(st, st[1:])] for st in starts]
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
            start, n = starts[j][c], chunks[j][c]
            wholes[j][start:start + n].view(-1).copy_(received[offset:offset + n * shapes[j][1]])
            offset += n * shapes[j][1]
    done = {j: fn(j, X) for j, X in wholes.items()}

    # Back from the owners: each rank's rows of every result it holds a shard of.
    send = [[done[j][starts[j][c]:starts[j][c + 1]].reshape(-1) for j in mine] for c in by_group_rank]
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


__all__ += ["row_mesh_dim", "row_starts", "row_chunks", "on_whole_matrices"]
