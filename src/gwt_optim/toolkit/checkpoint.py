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
leaves a complete checkpoint of that step. A save that fails (a full disk)
removes its staging folder and raises :class:`CheckpointNotWritten`, a user
error naming the previous checkpoint, which stays intact. A checkpoint
damaged later (a truncated copy, a file of text) raises
:class:`CheckpointUnreadable` on load, and so does a payload that does not fit
the run (:func:`restore_training_state`), so the caller can fall back to the
previous one.

Each ``rank{r}.pt`` holds the model, optimizer and LR-scheduler state dicts,
the data position, the RNG states (as tensors) and the step, and loads with
``torch.load(weights_only=True)``: a crafted file cannot run code on
``--resume``. The few helper objects optimizer states hold (GaLore's and
APOLLO's projectors) are saved as their attributes and rebuilt from
:data:`HELPER_CLASSES` only. ``meta.json`` says the format (:data:`FORMAT`);
checkpoints of older versions, which needed ``weights_only=False``, are
refused with a message rather than loaded.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from gwt_optim.toolkit.errors import UsageError
from gwt_optim.toolkit.metrics import atomic_write_json

__all__ = [
    "CHECKPOINT_DIR",
    "FORMAT",
    "HELPER_CLASSES",
    "CheckpointUnreadable",
    "CheckpointNotWritten",
    "OldCheckpoint",
    "read_meta",
    "list_checkpoints",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "restore_training_state",
    "rng_state",
    "set_rng_state",
]

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d{8})$")
_REPLACED = ".replaced_"  # the old copy of a step being re-saved, until the new one is in place
# meta.json's "format": 2 loads with weights_only=True. Version 1 (never written
# as such: its meta.json has no "format") pickled objects and needed weights_only=False.
FORMAT = 2
# The non-tensor objects optimizer states hold: saved as their attributes and
# rebuilt without calling the class; a file naming any other class is refused.
HELPER_CLASSES = frozenset({
    "galore_torch.galore_projector.GaLoreProjector",
    "apollo_torch.random_projector.GradientProjector",
})
_OBJECT = "__gwt_optim_object__"
_PLAIN = (torch.Tensor, str, bytes, bool, int, float, complex, type(None), torch.dtype, torch.device, torch.Size)


class CheckpointUnreadable(ValueError):
    """A checkpoint's files exist but cannot be read (truncated, emptied, corrupt),
    or hold a payload that does not fit the run being resumed."""


class CheckpointNotWritten(UsageError):
    """A checkpoint could not be written (a full disk, a read-only folder); the
    previous one is intact."""


class OldCheckpoint(UsageError):
    """A checkpoint of a gwt-optim version whose files need ``weights_only=False``."""


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


def seed_all(seed: int) -> None:
    """Seed every generator :func:`rng_state` saves, so that a fresh run is as reproducible as a resumed one
    (a data collator or user callback may draw from Python's or NumPy's)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def rng_state() -> dict[str, Any]:
    """This process's random generators as tensors and numbers: numpy's own
    state holds an array, which a weights-only load refuses."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((int(py["version"]), tuple(py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))


def _encode(obj: Any, where: str) -> Any:
    """``obj`` with every helper object replaced by plain data; containers
    that hold none are returned as they are (a state dict keeps its ``_metadata``)."""
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, dict):
        items = {k: _encode(v, f"{where}.{k}") for k, v in obj.items()}
        if all(items[k] is obj[k] for k in obj):
            return obj
        new = copy.copy(obj)
        new.update(items)
        return new
    if type(obj) in (list, tuple):
        items = [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if name not in HELPER_CLASSES:
        # A new optimizer's helper object: a bug here, found before any file is written.
        raise TypeError(
            f"checkpoint: {where} is a {name}, which a weights-only checkpoint cannot hold; "
            "add its class to gwt_optim.toolkit.checkpoint.HELPER_CLASSES if its attributes are plain data"
        )
    return {_OBJECT: name, "attributes": _encode(vars(obj), f"{where}.attributes")}


def _decode(obj: Any, file: Path) -> Any:
    if isinstance(obj, dict):
        if _OBJECT in obj:
            return _rebuild(obj, file)
        items = {k: _decode(v, file) for k, v in obj.items()}
        if all(items[k] is obj[k] for k in obj):
            return obj
        new = copy.copy(obj)
        new.update(items)
        return new
    if type(obj) in (list, tuple):
        items = [_decode(v, file) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    return obj


def _rebuild(encoded: dict[str, Any], file: Path) -> Any:
    name, attributes = encoded.get(_OBJECT), encoded.get("attributes")
    if name not in HELPER_CLASSES or not isinstance(attributes, dict):
        raise CheckpointUnreadable(f"{file}: holds an object of class {name!r}, which checkpoints may not hold")
    module, _, cls_name = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except ImportError:
        from gwt_optim.toolkit.errors import install_command
        from gwt_optim.toolkit.registry import MissingDependency

        raise MissingDependency(f"{file} holds a {name}: install the package {module.split('.')[0]!r} "
                                f"({install_command('peers')})") from None
    obj = cls.__new__(cls)  # its attributes, not its constructor, make it what was saved
    obj.__dict__.update(_decode(attributes, file))
    return obj


def _why_not_written(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return os.strerror(exc.errno).lower()
    text = " ".join(str(exc).split())
    if "unexpected pos" in text or "file write failed" in text:  # torch's zip writer, short of room
        return "the file came out shorter than written: is the disk full?"
    return f"{type(exc).__name__}: {text}"


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
    payload = _encode(payload, "payload")

    def not_written(exc: BaseException) -> CheckpointNotWritten:
        if rank == 0:  # the staging folder's owner: its room back, for the next try
            shutil.rmtree(staging, ignore_errors=True)
        previous = [p for p in list_checkpoints(run_dir) if p != final]
        kept = (f"the previous checkpoint, {previous[-1].name}, is intact" if previous
                else "no earlier checkpoint of this run exists")
        return CheckpointNotWritten(f"cannot write the checkpoint {final} ({_why_not_written(exc)}); {kept}. "
                                    "Free some space (or make the folder writable), then continue with --resume")

    if rank == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)  # left by a run killed mid-save
            staging.mkdir(parents=True)
        except OSError as exc:
            raise not_written(exc) from exc
    barrier()
    if sharded or rank == 0:
        try:
            _atomic_save(payload, staging / f"rank{rank}.pt")
        except (OSError, RuntimeError) as exc:  # torch's writer reports a full disk as a RuntimeError
            raise not_written(exc) from exc
    barrier()
    if rank == 0:
        try:
            atomic_write_json(
                staging / "meta.json",
                {"step": step, "world_size": world_size, "sharded": sharded, **(meta or {}), "format": FORMAT},
            )
        except OSError as exc:
            raise not_written(exc) from exc
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
    if not isinstance(meta.get("format", 1), int):
        raise CheckpointUnreadable(f"{file}: its format is {meta['format']!r}, not a number")
    return meta


def _why_unreadable(exc: BaseException) -> str:
    text = str(exc)
    # torch's weights-only refusal is a page of advice around the news: what it refused.
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation of torch.load", 1)[0]
    text = " ".join(text.split())
    if len(text) > _REASON_CHARS:  # a page of text: cut at a word, and say so
        text = text[: text.rfind(" ", 0, _REASON_CHARS + 1)].rstrip(",;:") + " ..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# Long enough for torch's whole message about a truncated file (337 characters in torch 2.x).
_REASON_CHARS = 400


def load_checkpoint(path: str | os.PathLike, *, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """The payload this rank saved (or rank 0's for an unsharded checkpoint).

    Raises :class:`CheckpointUnreadable` when a file is damaged,
    :class:`OldCheckpoint` for a checkpoint of an older format, and
    ``ValueError`` when FSDP shards were saved for another world size."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("format", 1) != FORMAT:
        if meta.get("format", 1) > FORMAT:
            raise OldCheckpoint(f"{path} is a checkpoint of a newer gwt-optim (format {meta['format']}); "
                                "resume it with that version")
        raise OldCheckpoint(
            f"{path} is a checkpoint of an older gwt-optim, which only torch.load(weights_only=False) reads -- "
            "and that runs any code the file holds, so it is not loaded. Resume it with the gwt-optim that "
            "wrote it, or start a new run (another --out)"
        )
    if meta["sharded"] and meta["world_size"] != world_size:
        raise ValueError(
            f"{path} holds FSDP shards for {meta['world_size']} ranks; resume it with "
            f"--nproc-per-node {meta['world_size']} (this run has {world_size})"
        )
    file = path / f"rank{rank if meta['sharded'] else 0}.pt"
    # FSDP shards are DTensors tied to their device mesh; leave them where they were.
    try:
        payload = torch.load(file, map_location=None if meta["sharded"] else "cpu", weights_only=True)
    except Exception as exc:
        # A damaged file fails anywhere in the unpickler: ValueError, KeyError, IndexError, EOFError,
        # UnpicklingError, a RuntimeError from torch's zip reader; none of them is a bug here.
        raise CheckpointUnreadable(f"{file}: {_why_unreadable(exc)}") from exc
    if not isinstance(payload, dict):
        raise CheckpointUnreadable(f"{file}: holds a {type(payload).__name__}, not a checkpoint's payload")
    return _decode(payload, file)


def restore_training_state(state: dict[str, Any], *, model, optimizer, scheduler, data) -> int:
    """Put a training checkpoint's payload into the live ``model``,
    ``optimizer``, ``scheduler`` and ``data`` (its ``load_state_dict``) and the
    RNGs; its step.

    Raises :class:`CheckpointUnreadable` naming the part that is missing or
    does not fit (another model's shapes, a mangled state). Parts loaded before
    it are left in place: the caller loads an older checkpoint over them, or stops."""
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointUnreadable(f"its step is {step!r}, not a step number")
    parts = (("model", model.load_state_dict), ("optimizer", optimizer.load_state_dict),
             ("scheduler", scheduler.load_state_dict), ("data", data.load_state_dict), ("rng", set_rng_state))
    missing = [name for name, _ in parts if name not in state]
    if missing:
        raise CheckpointUnreadable(f"it holds no {' and no '.join(missing)} state")
    for name, load in parts:
        try:
            load(state[name])
        except Exception as exc:  # whatever a mangled state makes load_state_dict raise
            raise CheckpointUnreadable(f"its {name} state does not fit this run: {_why_unreadable(exc)}") from exc
    return step
