"""One process or many: the same training script under ``torchrun``.

``torchrun --nproc-per-node N -m gwt_optim pretrain ...`` sets ``RANK``,
``WORLD_SIZE`` and friends; :func:`init_distributed` joins the process group
(NCCL on GPUs, gloo on CPU) and :func:`wrap_model` makes the model data
parallel:

* DDP (default): every rank holds the whole model and optimizer; gradients
  are averaged across ranks after backward.
* FSDP2 (``--fsdp``): ``torch.distributed.fsdp.fully_shard`` on every decoder
  layer and the root shards each parameter by rows (``Shard(0)``) across
  ranks; the optimizer sees ``DTensor`` shards. GWT's transform runs along
  the last axis, so it is local to each row shard and needs no gather; only
  its norm-growth limiter needs whole-matrix norms, which ``GWTAdamW``
  reduces across ranks itself.

Every rank draws the same global batch from the data (the data position is
identical everywhere, so checkpoints store it once) and trains on its own
slice of it: one process with batch B and N processes with B/N each see the
same sequences per step and, the losses being per-token means of equal-size
slices, the same averaged gradient.

A rank that stops answering (SIGSTOP, a dead host, a hung GPU) leaves the
others waiting in their next collective until the process-group timeout
(``pretrain --dist-timeout``); then they fail and torchrun ends the job.
torch's default of 30 minutes is meant for long NCCL checkpoints and
compiles; on CPU (gloo) steps, evaluations and saves take seconds, so 5
minutes is the default there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistContext", "init_distributed", "wrap_model", "unwrap", "shard_rows", "all_reduce", "DEFAULT_TIMEOUT_S",
]

# Seconds a rank waits for the others in a collective, per backend, when --dist-timeout is not given.
DEFAULT_TIMEOUT_S = {"gloo": 300.0, "nccl": 1800.0}


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _pick_device(preference: str, local_rank: int) -> torch.device:
    from gwt_optim.toolkit.errors import UsageError

    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
    if preference.split(":")[0] == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {preference}: no CUDA GPU is available to torch here; use --device cpu or auto")
    if preference == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    try:
        return torch.device(preference)
    except RuntimeError:
        raise UsageError(f"--device {preference!r}: use auto, cpu or cuda") from None


def init_distributed(device: str = "auto", timeout_s: float | None = None) -> DistContext:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1); a
    collective fails after ``timeout_s`` seconds (None: :data:`DEFAULT_TIMEOUT_S`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        seconds = DEFAULT_TIMEOUT_S[backend] if timeout_s is None else timeout_s
        dist.init_process_group(backend, timeout=timedelta(seconds=seconds))
    return DistContext(rank=rank, world_size=world, local_rank=local, device=dev)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one (Hugging Face ``model.model.layers``)."""
    for name in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj = model
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return list(obj)
    return []


def wrap_model(model: nn.Module, ctx: DistContext, *, fsdp: bool = False) -> nn.Module:
    """DDP or FSDP2 for a multi-process run; the model unchanged otherwise.

    FSDP2 shards in place and returns the same module; DDP returns a wrapper
    (use :func:`unwrap` to reach the model).
    """
    if not ctx.distributed:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def shard_rows(batch: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (rows split evenly)."""
    if batch.shape[0] % ctx.world_size:
        raise ValueError(
            f"a global batch of {batch.shape[0]} sequences does not split over {ctx.world_size} ranks; "
            "make --batch-size a multiple of the number of processes"
        )
    per = batch.shape[0] // ctx.world_size
    return batch[ctx.rank * per : (ctx.rank + 1) * per]


def all_reduce(t: torch.Tensor, ctx: DistContext, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce when distributed; a no-op otherwise."""
    if ctx.distributed:
        dist.all_reduce(t, op=op)
    return t
