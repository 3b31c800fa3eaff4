"""Checkpoints that survive crashes: written atomically, the last K kept.

A checkpoint is a directory ``RUN/checkpoints/step_00001234/`` holding one
``rank{r}.pt`` per rank that owns distinct state (one file for a single
process or DDP, whose replicas are identical; one per rank under FSDP, whose
shards differ) and ``meta.json``. It is first written under a hidden
temporary name and renamed into place only when every file is complete, so
``latest_checkpoint`` never returns a torn checkpoint -- a run killed while
saving, or stopped by a non-finite loss, leaves the previous one intact.

Re-saving a step that already exists (resuming a finished run) swaps the
new directory in before the old one is removed, so a crash at any moment
leaves a complete checkpoint of that step. A checkpoint damaged later (a
truncated copy) raises :class:`CheckpointUnreadable` on load, so the caller
can fall back to the previous one.

Each ``rank{r}.pt`` holds the model, optimizer and LR-scheduler state dicts,
the data position, the RNG states and the step. Optimizer states may contain
helper objects (GaLore's projector), so files are loaded with
``weights_only=False``: only resume from checkpoints you wrote yourself.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from gwt_optim.toolkit.metrics import atomic_write_json

__all__ = [
    "CHECKPOINT_DIR",
    "CheckpointUnreadable",
    "read_meta",
    "list_checkpoints",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
]

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d{8})$")
_REPLACED = ".replaced_"  # the old copy of a step being re-saved, until the new one is in place


class CheckpointUnreadable(ValueError):
    """A checkpoint's files exist but cannot be read (truncated, emptied, corrupt)."""


def _restore_interrupted_replace(root: Path) -> None:
    # A crash between the two renames of a re-save leaves only the old copy: put it back.
    for old in root.glob(_REPLACED + "step_*"):
        final = root / old.name[len(_REPLACED):]
        if not final.exists():
            try:
                os.replace(old, final)
            except OSError:  # another rank put it back first
                pass
        else:
            shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    _restore_interrupted_replace(root)
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    payload: dict[str, Any],
    *,
    keep_last: int = 2,
    rank: int = 0,
    world_size: int = 1,
    sharded: bool = False,
    barrier=None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``payload`` as the checkpoint of ``step`` and prune to ``keep_last``.

    Collective when ``world_size > 1``: every rank calls it, ``barrier`` (a
    callable) synchronizes them. With ``sharded=False`` only rank 0 writes.
    """
    root = Path(run_dir) / CHECKPOINT_DIR
    final = root / f"step_{step:08d}"
    staging = root / f".staging_step_{step:08d}"
    barrier = barrier or (lambda: None)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed mid-save
        staging.mkdir(parents=True)
    barrier()
    if sharded or rank == 0:
        _atomic_save(payload, staging / f"rank{rank}.pt")
    barrier()
    if rank == 0:
        atomic_write_json(
            staging / "meta.json",
            {"step": step, "world_size": world_size, "sharded": sharded, **(meta or {})},
        )
        if final.exists():  # a resumed run re-saving the same step: swap, then remove the old copy
            old = root / (_REPLACED + final.name)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, final)
        for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """``meta.json`` of a checkpoint; :class:`CheckpointUnreadable` when damaged."""
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointUnreadable(f"{file}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(meta, dict) or not {"step", "world_size", "sharded"} <= set(meta):
        raise CheckpointUnreadable(f"{file}: not a checkpoint's meta.json")
    return meta


def load_checkpoint(path: str | os.PathLike, *, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """The payload this rank saved (or rank 0's for an unsharded checkpoint).

    Raises :class:`CheckpointUnreadable` when a file is damaged, and
    ``ValueError`` when FSDP shards were saved for another world size."""
    path = Path(path)
    meta = read_meta(path)
    if meta["sharded"] and meta["world_size"] != world_size:
        raise ValueError(
            f"{path} holds FSDP shards for {meta['world_size']} ranks; resume it with "
            f"--nproc-per-node {meta['world_size']} (this run has {world_size})"
        )
    file = path / f"rank{rank if meta['sharded'] else 0}.pt"
    # Optimizer states may hold helper objects (GaLore's projector): not weights-only.
    # FSDP shards are DTensors tied to their device mesh; leave them where they were.
    try:
        return torch.load(file, map_location=None if meta["sharded"] else "cpu", weights_only=False)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as exc:
        # torch reports a truncated zip archive as a RuntimeError from its stream reader.
        raise CheckpointUnreadable(f"{file}: {type(exc).__name__}: {' '.join(str(exc).split())}") from exc
