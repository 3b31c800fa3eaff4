"""``gwt-optim memory``: the analytic weights + optimizer-state table, or the
training peak by part."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterable

from gwt_optim.memory.estimate import (DTYPE_NAMES, ESTIMATORS, STATE_DTYPE_NAMES, MemoryEstimate, estimate,
                                       estimator_key, training_estimate)

__all__ = ["memory_table", "training_table", "column_name", "register"]


TABLE_MODELS = ("60m", "130m", "350m", "1b", "3b", "7b")
# The default table's rows in their published order: a row for the estimator of
# every registry entry but torchao's 4-bit layout, and Adafactor, the plain form
# of GWT-Adafactor, which the registry does not build. An order is a choice the
# registry cannot make, so this is spelt out; tests/test_name_lists.py holds it
# to the registry.
TABLE_OPTIMIZERS = (
    "adamw",
    "adamw8bit",
    "galore",
    "apollo",
    "apollo-mini",
    "adam-mini",
    "muon",
    "adafactor",
    "gwt-adamw",
    "gwt-adam-mini",
    "gwt-muon",
    "gwt-adafactor",
)
# Ranks of the GaLore and APOLLO papers' LLaMA runs.
PAPER_RANKS = {"60m": 128, "130m": 256, "350m": 256, "1b": 512, "3b": 512, "7b": 1024}
_GB = 1e9


def column_name(model: str) -> str:
    """A table column's name for ``--models`` entry ``model``: a packaged size in
    capitals (``7B``), a JSON file by its name without ``.json`` (``my_shape``),
    or by its folder's name for a model folder's ``config.json``."""
    path = Path(model)
    if path.is_file() or path.suffix.lower() == ".json" or len(path.parts) > 1:
        if path.stem.lower() == "config" and path.parent.name:
            return path.parent.name
        return path.stem or model
    return model.removeprefix("llama_").upper()


def _state_dtype(name: str, dtype: str, state_dtype: str | None) -> str:
    """The state dtype a row uses: ``state_dtype`` (int8 for GWT-AdamW only), else ``dtype``."""
    if state_dtype and (state_dtype != "int8" or estimator_key(name) == "gwt-adamw"):
        return state_dtype
    return dtype


def _label(e: MemoryEstimate) -> str:
    if e.level is not None:
        return f"{e.optimizer} (l={e.level})"
    if e.rank is not None and ESTIMATORS[e.optimizer].uses_rank:
        return f"{e.optimizer} (rank r)"
    return e.optimizer


def memory_table(
    models: Iterable[str] = TABLE_MODELS,
    optimizers: Iterable[str] = TABLE_OPTIMIZERS,
    *,
    level: int = 2,
    rank: int | None = None,
    dtype: str = "bf16",
    state_dtype: str | None = None,
    recipe: str = "paper",
) -> str:
    """Markdown tables: weights + state per optimizer and model, the saving
    against AdamW, and where the paper's GWT figures come from. States are
    ``dtype`` (the papers' convention), or ``state_dtype`` for every optimizer."""
    models, optimizers = list(models), list(optimizers)
    rows: dict[str, list[str]] = {}
    base: dict[str, MemoryEstimate] = {}
    for m in models:
        r = rank if rank is not None else PAPER_RANKS.get(m.lower())
        base[m] = estimate(m, "adamw", dtype=dtype, state_dtype=_state_dtype("adamw", dtype, state_dtype),
                           recipe=recipe)
        for name in optimizers:
            e = estimate(m, name, level=level, rank=r, dtype=dtype, state_dtype=_state_dtype(name, dtype, state_dtype),
                         recipe=recipe)
            cell = f"{e.total_bytes / _GB:.2f}"
            if name != "adamw":
                cell += f" ({-100 * e.saving(base[m]):+.0f}%)"
            rows.setdefault(_label(e), []).append(cell)
    head = "| optimizer | " + " | ".join(column_name(m) for m in models) + " |"
    rule = "|---|" + "---:|" * len(models)
    states = f"{dtype} weights and states" if not state_dtype or state_dtype == dtype else (
        f"{dtype} weights, {state_dtype} states" + (" (GWT-AdamW; the others' " + dtype + ")"
                                                      if state_dtype == "int8" else ""))
    lines = [
        f"Weights + optimizer state, GB (10^9 bytes), {states}, "
        f"recipe {recipe!r}; (change against AdamW). Ranks: "
        + ", ".join(f"{column_name(m)} r={rank or PAPER_RANKS.get(m.lower(), 'd/4')}" for m in models)
        + ".",
        "",
        head,
        rule,
        "| parameters | " + " | ".join(f"{base[m].n_params / 1e6:,.0f}M" for m in models) + " |",
        "| share transformed | " + " | ".join(f"{100 * base[m].transformed_fraction:.1f}%" for m in models) + " |",
    ]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows.items()]

    # Where the paper's figures come from: GWT-AdamW against AdamW per level.
    lines += [
        "",
        "GWT-AdamW against AdamW by level: state saving on the transformed weights, "
        "on all weights, and weights + state saving.",
        "",
        "| model | level | transformed-weight state | all state | weights + state |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in models:
        for lv in (1, 2, 3):
            g = estimate(m, "gwt-adamw", level=lv, dtype=dtype,
                         state_dtype=_state_dtype("gwt-adamw", dtype, state_dtype), recipe=recipe)
            a = base[m]
            t_saving = 1 - g.transformed_state_bytes / a.transformed_state_bytes
            lines.append(
                f"| {column_name(m)} | {lv} | {-100 * t_saving:.1f}% | {-100 * g.state_saving(a):.1f}% | "
                f"{-100 * g.saving(a):.1f}% |"
            )
    return "\n".join(lines)


def training_table(
    models: Iterable[str],
    optimizers: Iterable[str],
    *,
    level: int = 2,
    dtype: str = "bf16",
    state_dtype: str | None = None,
    batch_size: int = 1,
    seq_len: int = 256,
    gradient_checkpointing: bool = False,
    step_in_backward: bool = False,
    recipe: str = "paper",
) -> str:
    """Markdown: the peak of one training step by part (:func:`training_estimate`)."""
    cols = []
    for m in models:
        for name in optimizers:
            key = estimator_key(name)
            # GWT keeps fp32 moments unless told; other optimizers keep the weights' dtype.
            sd = state_dtype if state_dtype and (state_dtype != "int8" or key == "gwt-adamw") else None
            sd = sd or ("fp32" if key.startswith("gwt-") else dtype)
            e = training_estimate(
                m, key, level=level, dtype=dtype, state_dtype=sd, batch_size=batch_size, seq_len=seq_len,
                gradient_checkpointing=gradient_checkpointing, step_in_backward=step_in_backward, recipe=recipe,
            )
            label = f"{column_name(m)} {key}" + (f" (l={level})" if ESTIMATORS[key].uses_level else "") + f", {sd} state"
            cols.append((label, e.parts()))
    mode = ("step in backward" if step_in_backward else "normal step") + (
        ", gradient checkpointing" if gradient_checkpointing else "")
    lines = [
        f"Peak of one training step, GB (10^9 bytes): {dtype} weights, batch {batch_size} x {seq_len}, {mode}. "
        "Add the process's own baseline (Python, torch, transformers: about 0.5 GB on CPU).",
        "",
        "| part | " + " | ".join(label for label, _ in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for part in cols[0][1]:
        lines.append(f"| {part} | " + " | ".join(f"{parts[part] / _GB:.2f}" for _, parts in cols) + " |")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    if args.peak:
        text = training_table(
            models, optimizers, level=args.level, dtype=args.dtype, state_dtype=args.state_dtype,
            batch_size=args.batch_size, seq_len=args.seq_len, gradient_checkpointing=args.checkpointing,
            step_in_backward=args.step_in_backward, recipe=args.recipe,
        )
    else:
        text = memory_table(models, optimizers, level=args.level, rank=args.rank, dtype=args.dtype,
                            state_dtype=args.state_dtype, recipe=args.recipe)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out)  # atomic: a reader never sees half a table
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``gwt-optim memory``: the analytic weights + state table."""
    p = subparsers.add_parser(
        "memory",
        help="print the analytic weights + optimizer-state memory table (torch only)",
        description=(
            "Analytic weights + optimizer-state memory of LLaMA 60M..7B under AdamW, 8-bit Adam, GaLore, "
            "APOLLO(-Mini), Adam-mini, Muon, Adafactor and the GWT families, with the saving against AdamW."
        ),
    )
    p.add_argument(
        "--models", default=",".join(TABLE_MODELS), help="packaged config names or JSON paths, comma-separated"
    )
    p.add_argument(
        "--optimizers", default=",".join(TABLE_OPTIMIZERS), help=f"comma-separated; known: {', '.join(ESTIMATORS)}"
    )
    p.add_argument("--level", type=int, default=2, help="GWT level l (default 2)")
    p.add_argument("--rank", type=int, default=None, help="GaLore/APOLLO rank (default: the papers' rank per size)")
    p.add_argument("--dtype", default="bf16", help=f"weight and state dtype: {', '.join(DTYPE_NAMES)} or a torch "
                   "dtype name (default bf16, the papers' convention)")
    p.add_argument("--recipe", default="paper", choices=("paper", "hidden"), help="which weights get the transform")
    p.add_argument("--state-dtype", default=None,
                   help=f"optimizer-state dtype, {', '.join(STATE_DTYPE_NAMES)} or a torch dtype name: the table's "
                   "default is --dtype for every optimizer (the papers' "
                   "convention); fp32 gives GWT's default moments (int8: GWT-AdamW's only). With --peak: fp32 for "
                   "GWT, the weights' for others, unless given")
    p.add_argument("--out", default=None, help="also write the markdown to this file")
    g = p.add_argument_group("training peak (--peak): weights, state, gradients, activations, step temporaries")
    g.add_argument("--peak", action="store_true", help="print the peak of a training step by part instead")
    g.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    g.add_argument("--checkpointing", action="store_true", help="with gradient checkpointing")
    g.add_argument("--step-in-backward", action="store_true", help="each parameter stepped inside backward")
    p.set_defaults(func=_run)
