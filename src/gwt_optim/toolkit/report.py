"""``gwt-optim report RUN_DIR...``: the comparison table and plots, rebuilt
from finished runs (their ``summary.json`` and ``metrics.jsonl``).

A ``RUN_DIR`` may be one run or a folder of runs (a ``compare --out``
directory); runs are listed in the order given, sub-runs sorted by name.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["register", "summary_table", "label", "shared_options", "find_runs", "load_run", "write_report"]


def _frozen(summary: dict[str, Any]) -> bool:
    from gwt_optim.toolkit.recipes import FROZEN_LR

    lr = summary.get("lr")
    return isinstance(lr, (int, float)) and 0 < lr <= FROZEN_LR


def label(summary: dict[str, Any], *, leave_out: Sequence[str] = ()) -> str:
    """``gwt-adamw (level=2)``: the optimizer and its options other than lr/alpha,
    which have their own columns (and those in ``leave_out``, said elsewhere). A run
    at a matrix lr of :data:`~gwt_optim.toolkit.recipes.FROZEN_LR` or less is named
    for what it is: ``adamw, frozen matrices (...)`` (``adamw, frozen`` without a
    ``regular_lr`` training the rest)."""
    options = summary.get("options") or {}
    opts = {k: v for k, v in options.items() if k not in ("lr", "scale", *leave_out)}
    name = summary.get("optimizer_name") or summary["optimizer"].split(":")[0]
    if _frozen(summary):
        name += ", frozen matrices" if options.get("regular_lr") else ", frozen"
    return f"{name} ({', '.join(f'{k}={v}' for k, v in opts.items())})" if opts else name


def shared_options(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The options (other than lr and alpha) every one of several runs sets alike."""
    if len(summaries) < 2:
        return {}
    first = {k: v for k, v in (summaries[0].get("options") or {}).items() if k not in ("lr", "scale")}
    return {k: v for k, v in first.items() if all((s.get("options") or {}).get(k, object()) == v
                                                   for s in summaries[1:])}


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def summary_table(summaries: Sequence[dict[str, Any]]) -> str:
    """One row per run: quality, measured memory and speed."""
    gpu = any(s.get("peak_gpu_bytes") for s in summaries)
    head = ["optimizer", "lr", "alpha", "val loss", "val ppl", "state MiB", "peak RSS MiB"]
    head += ["peak GPU MiB"] if gpu else []
    head += ["ms/step", "tokens/s", "steps"]
    rows = []
    for s in summaries:
        row = [
            label(s),
            _num(s.get("lr"), "g"),
            _num(s.get("scale"), "g"),
            _num(s.get("val_loss"), ".4f"),
            _num(s.get("val_ppl"), ".2f"),
            _mib(s.get("state_bytes")),
            _mib(s.get("peak_rss_bytes")),
        ]
        row += [_mib(s.get("peak_gpu_bytes"))] if gpu else []
        row += [_num(s.get("ms_per_step"), ".0f"), _num(s.get("tokens_per_s"), ",.0f"), str(s.get("steps", "-"))]
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories (holding ``summary.json``) named by or under ``paths``."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if (p / "summary.json").is_file():
            runs.append(p)
        elif p.is_dir():
            found = sorted(d for d in p.iterdir() if (d / "summary.json").is_file())
            if not found:
                raise FileNotFoundError(f"{p}: no summary.json in it or its sub-folders (is the run finished?)")
            runs.extend(found)
        else:
            raise FileNotFoundError(f"{p}: not a run directory")
    return runs


def _read_json(path: Path, what: str) -> Any:
    from gwt_optim.toolkit.errors import UsageError

    try:
        return json.loads(path.read_text())
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a readable {what} (binary data)") from None
    except ValueError as exc:
        raise UsageError(f"{path}: not a readable {what} ({exc})") from None


def load_run(run: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from gwt_optim.toolkit.errors import UsageError
    from gwt_optim.toolkit.metrics import read_jsonl

    summary = _read_json(run / "summary.json", "summary")
    if not isinstance(summary, dict):
        raise UsageError(f"{run / 'summary.json'}: not a run's summary (a JSON object)")
    metrics: list[dict[str, Any]] = []
    if (run / "metrics.jsonl").is_file():
        bad: list[tuple[int, str]] = []
        metrics = read_jsonl(run / "metrics.jsonl", bad=bad)
        if bad:  # a report reads and never rewrites: said, not set aside
            print(f"warning: {run / 'metrics.jsonl'}: skipped {len(bad)} unreadable line"
                  f"{'s' if len(bad) > 1 else ''} ({', '.join(str(n) for n, _ in bad[:5])}"
                  f"{', ...' if len(bad) > 5 else ''})", file=sys.stderr)
    return summary, metrics


def _environment_line(run: Path) -> str:
    path = run / "environment.json"
    if not path.is_file():
        return ""
    try:
        env = _read_json(path, "environment.json")
    except ValueError as exc:  # only the hardware line needs it
        print(f"warning: {exc}; the report leaves out the hardware line", file=sys.stderr)
        return ""
    if not isinstance(env, dict):
        return ""
    device = env.get("gpu") or f"{env.get('cpu')} ({env.get('cpu_count')} cores)"
    device += f", torch threads {env.get('torch_threads')}"
    return (
        f"Hardware: {device}, world size {env.get('world_size', 1)}. torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}, gwt-optim {env.get('gwt_optim')}, commit {env.get('git_commit')}."
    )


def write_report(runs: Sequence[Path], out: str | Path, *, title: str = "Optimizer comparison") -> dict[str, Path]:
    """Write ``compare.json``, ``compare.md`` and the two PNG plots under ``out``."""
    from gwt_optim.toolkit.metrics import atomic_write_json, atomic_write_text
    from gwt_optim.toolkit.plots import plot_memory_vs_perplexity, plot_validation_loss

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = [load_run(r) for r in runs]
    summaries = [s for s, _ in loaded]
    # The plots have room for short labels only: options every run shares go to the title.
    shared = shared_options(summaries)
    labels = [label(s, leave_out=tuple(shared)) for s in summaries]
    # The plots have no lr/alpha columns: name them when they differ between runs.
    for key, sym in (("lr", "lr"), ("scale", "α")):
        if len({s.get(key) for s in summaries}) > 1:
            labels = [f"{lab}, {sym}={s.get(key):g}" for lab, s in zip(labels, summaries)]
    first = summaries[0]
    setting = (
        f"{first.get('model')} ({first.get('params', 0) / 1e6:.2f}M params) on {first.get('data')}, "
        f"{first.get('steps')} steps, {first.get('tokens', 0):,} tokens, seed {first.get('seed')}"
    )
    every = f"every run: {', '.join(f'{k}={v}' for k, v in shared.items())}" if shared else ""
    loss_png = plot_validation_loss(list(zip(labels, [m for _, m in loaded])), out / "val_loss.png",
                                    title="Validation loss\n" + setting + (f"\n{every}" if every else ""))
    mem_png = plot_memory_vs_perplexity(summaries, labels, out / "memory_vs_ppl.png",
                                        title="Memory vs quality (lower left is better)"
                                        + (f"\n{every}" if every else ""))
    table = summary_table(summaries)
    md = "\n\n".join(
        part
        for part in (
            f"# {title}",
            f"Setting: {setting}. State MiB: bytes held by the optimizer state, measured; "
            "peak RSS: the training process's peak resident memory; ms/step and tokens/s leave out the "
            "first steps.",
            table,
            _environment_line(runs[0]),
            f"![validation loss]({loss_png.name})\n\n![state memory vs perplexity]({mem_png.name})",
        )
        if part
    )
    atomic_write_json(out / "compare.json", summaries)
    atomic_write_text(out / "compare.md", md + "\n")
    return {"table": out / "compare.md", "json": out / "compare.json", "val_loss": loss_png, "memory": mem_png,
            "markdown": table}


def _run(args: argparse.Namespace) -> int:
    from gwt_optim.toolkit.errors import UsageError

    runs = find_runs(args.runs)
    out = Path(args.out) if args.out else (Path(args.runs[0]) if len(args.runs) == 1 else Path("."))
    try:
        paths = write_report(runs, out)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC):
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        raise UsageError(f"cannot write the report in {out}{where}: {os.strerror(exc.errno).lower()}; "
                         "write it elsewhere with --out FOLDER") from None
    print(paths["markdown"])
    print(f"\ntable: {paths['table']}\nplots: {paths['val_loss']}, {paths['memory']}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="rebuild the comparison table and plots from finished runs",
        description="Read summary.json and metrics.jsonl of finished runs (or of every run under a compare "
        "--out folder) and write compare.md, compare.json, val_loss.png and memory_vs_ppl.png.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, or folders of them")
    p.add_argument("--out", help="where to write (default: the folder given, when there is one)")
    p.set_defaults(func=_run)
