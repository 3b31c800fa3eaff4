"""``gwt-optim compare``: the main job. Several optimizers, one setting.

Every optimizer trains the same model from the same initial weights on the
same data in the same order, with the same schedule and step count; only
the optimizer (and, per entry, its learning rate and alpha) differ. Each run
is a separate ``pretrain`` process, one after another, so its peak memory
and speed are its own. Then the table (``compare.md``, printed) and the plots
(``val_loss.png``, ``memory_vs_ppl.png``) are written under ``--out`` with
``compare.json`` (the list of every run's ``summary.json``).

With no flags it is the CPU demo (:data:`~gwt_optim.toolkit.recipes.DEMO`):
AdamW, GWT-AdamW at levels 1-3, GaLore and 8-bit Adam on a 1.9M-parameter
LLaMA over the bundled corpus, about ten minutes on two cores. ``--paper
SIZE`` is the paper's C4 comparison, for GPUs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["register", "run_compare", "run_dir_name"]


def run_dir_name(index: int, spec: str) -> str:
    """``03-gwt-adamw-level2-lr1e-2-scale0.25`` for the 4th entry."""
    slug = re.sub(r"[^A-Za-z0-9.+-]+", "-", spec.replace("=", "")).strip("-")
    return f"{index:02d}-{slug}"


def _list_optimizers() -> int:
    from gwt_optim.toolkit.registry import REGISTRY

    print("| optimizer | extra | description |\n|---|---|---|")
    for name in sorted(REGISTRY):
        spec = REGISTRY[name]
        print(f"| {name} | {spec.extra or '-'} | {spec.help} |")
    return 0


def _launcher(nproc: int) -> list[str]:
    if nproc <= 1:
        return [sys.executable, "-m", "gwt_optim"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "gwt_optim"]


def _same_config(run: Path, config: dict[str, Any]) -> bool:
    try:
        done = json.loads((run / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    ignore = {"resume", "progress"}
    return {k: v for k, v in done.items() if k not in ignore} == {
        k: v for k, v in json.loads(json.dumps(config)).items() if k not in ignore
    }


def run_compare(args: argparse.Namespace) -> int:
    from gwt_optim.toolkit.pretrain import resolve_config
    from gwt_optim.toolkit.recipes import DEMO_OPTIMIZERS, paper_optimizers
    from gwt_optim.toolkit.registry import parse_optimizer_arg
    from gwt_optim.toolkit.report import write_report

    if args.list:
        return _list_optimizers()
    base = resolve_config(args)
    if args.optimizers:
        specs = [s.strip() for s in args.optimizers.split(",") if s.strip()]
    else:
        specs = paper_optimizers(args.paper) if args.paper else list(DEMO_OPTIMIZERS)
    for spec in specs:  # fail on a typo now, not after an hour of training
        parse_optimizer_arg(spec)

    out = Path(base.out if "out" in vars(args) else "runs/compare")
    out.mkdir(parents=True, exist_ok=True)
    finished, failed = [], []
    for i, spec in enumerate(specs):
        run = out / run_dir_name(i, spec)
        config = {**base.to_dict(), "optimizer": spec, "out": str(run), "resume": args.resume}
        if run.exists():
            reusable = args.resume and _same_config(run, config)
            if reusable and (run / "summary.json").is_file():
                print(f"[{i + 1}/{len(specs)}] {spec}: finished earlier, reusing {run}")
                finished.append(run)
                continue
            if not reusable:  # compare owns its run folders; other settings start afresh
                shutil.rmtree(run)
        run.mkdir(parents=True, exist_ok=True)
        cfg_path = run / "requested_config.json"
        cfg_path.write_text(json.dumps(config, indent=2))
        print(f"[{i + 1}/{len(specs)}] {spec} -> {run}", flush=True)
        rc = subprocess.call([*_launcher(args.nproc_per_node), "pretrain", "--config", str(cfg_path)])
        if rc == 0 and (run / "summary.json").is_file():
            finished.append(run)
        else:
            failed.append((spec, rc))
            print(f"[{i + 1}/{len(specs)}] {spec}: failed (exit code {rc}); continuing", file=sys.stderr)
    if not finished:
        print("compare: no run finished", file=sys.stderr)
        return 1
    paths = write_report(finished, out)
    print()
    print(paths["markdown"])
    print(f"\ntable: {paths['table']}\nplots: {paths['val_loss']}\n       {paths['memory']}")
    if failed:
        print("failed: " + ", ".join(f"{s} (exit {rc})" for s, rc in failed), file=sys.stderr)
        return 1
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from gwt_optim.toolkit.pretrain import add_training_arguments

    p = subparsers.add_parser(
        "compare",
        help="the main job: train several optimizers in the same setting, print the table, plot",
        description=(
            "Train each optimizer of --optimizers in turn with the same model, data, seed, schedule and step "
            "count (one pretrain process each), then print a markdown table of validation loss and "
            "perplexity, measured optimizer-state memory, peak process memory, ms/step and tokens/s, and "
            "write compare.md, compare.json, val_loss.png and memory_vs_ppl.png under --out. Without flags: "
            "the CPU demo (a small LLaMA on the bundled corpus; AdamW, GWT-AdamW levels 1-3, GaLore, "
            "8-bit Adam; about 10 minutes on 2 cores). --paper SIZE: the paper's C4 comparison (GPUs)."
        ),
    )
    p.add_argument("--optimizers", help="comma-separated entries 'name' or 'name:key=value:...', e.g. "
                   "'adamw,gwt-adamw:level=2:lr=1e-2:scale=0.25,galore:rank=32' (default: the recipe's list)")
    p.add_argument("--out", default=argparse.SUPPRESS, help="output folder, one sub-folder per run "
                   "(default runs/compare)")
    p.add_argument("--resume", action="store_true",
                   help="reuse finished runs with the same settings and resume interrupted ones")
    p.add_argument("--nproc-per-node", type=int, default=1, help="run each optimizer under torchrun with N "
                   "processes (DDP; add --fsdp for FSDP2)")
    p.add_argument("--list", action="store_true", help="list the registered optimizers and exit")
    add_training_arguments(p, single_optimizer=False)
    p.set_defaults(func=run_compare)
