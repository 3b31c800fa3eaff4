"""Measured bytes of a live optimizer's state (see :mod:`gwt_optim.memory`)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import Tensor, nn

__all__ = ["tensor_bytes", "optimizer_state_bytes"]


def _storage_key(t: Tensor) -> tuple:
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    # Meta and zero-size storages have no address; key them by identity.
    return (t.device.type, t.device.index, ptr) if ptr else ("id", id(storage))


def tensor_bytes(t: Tensor, _seen: set | None = None) -> int:
    """Bytes held by ``t``'s storage, counting each storage once per ``_seen``.

    Wrapper subclasses (torchao's quantized optimizer states, ``DTensor``)
    hold no storage of their own: their ``__tensor_flatten__`` inner tensors
    (codes, scales, code maps, the local shard) are counted instead.
    """
    seen = set() if _seen is None else _seen
    if type(t).__name__ == "DTensor" and hasattr(t, "to_local"):
        return tensor_bytes(t.to_local(), seen)  # this rank's shard
    if hasattr(type(t), "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return sum(tensor_bytes(x, seen) for x in inner if isinstance(x, Tensor))
    key = _storage_key(t)
    if key in seen:
        return 0
    seen.add(key)
    return t.untyped_storage().nbytes()


def _walk_bytes(obj: Any, seen: set, visited: set) -> int:
    """Bytes of every tensor reachable from ``obj`` (containers, plain objects)."""
    if isinstance(obj, Tensor):
        return tensor_bytes(obj, seen)
    if isinstance(obj, (str, bytes, int, float, bool, type(None), nn.Module)):
        return 0
    if id(obj) in visited:
        return 0
    visited.add(id(obj))
    if isinstance(obj, Mapping):
        return sum(_walk_bytes(v, seen, visited) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(_walk_bytes(v, seen, visited) for v in obj)
    # Helper objects in the state, e.g. GaLore's projector holding its matrix.
    attrs = getattr(obj, "__dict__", None)
    return _walk_bytes(attrs, seen, visited) if attrs else 0


def optimizer_state_bytes(
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], *, per_param: bool = False
) -> int | dict[Tensor, int]:
    """Bytes really held by the state of one optimizer (or several, e.g. the
    Muon + AdamW pair of the usual Muon recipe).

    Counts every tensor in ``optimizer.state``, including tensors inside helper
    objects and the inner tensors of quantized tensor subclasses; shared
    storages are counted once. Call it after the first ``step()``: most
    optimizers allocate their state lazily. With ``per_param=True`` returns
    ``{param: bytes}`` instead of the total.
    """
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    seen: set = set()
    out: dict[Tensor, int] = {}
    for opt in optimizers:
        for p, state in opt.state.items():
            out[p] = out.get(p, 0) + _walk_bytes(state, seen, set())
    return out if per_param else sum(out.values())
