"""The quality protocol shared by ``benchmarks/quality.py`` and ``benchmarks/regime.py``.

A *study* is one (view, tokens per step) cell: a list of contenders, each
tuned on the same learning-rate grid with the tuning seeds and then reported
at its best lr on separate reporting seeds.

Views
    ``fair`` (matrix-only fairness): first AdamW is tuned over the whole model
    at one lr (alpha 1); its best lr becomes the *regular lr*. Every contender
    then keeps the embeddings, head, norms and biases on AdamW at that regular
    lr (the registry's ``regular_lr`` option) and only the attention and MLP
    matrices change optimizer, at an lr from the grid and ``scale=1``, so the
    grid value is the effective step of every contender.
    ``paper``: the paper's own setting, one lr from the grid for all
    parameters, alpha 0.25 on the matrices for the GWT families and GaLore,
    alpha 1 for the rest.

Budget
    ``batch_size = tokens_per_step / seq_len`` sequences per step and at most
    one epoch of the demo training split: ``steps = floor(epochs * windows /
    batch_size)`` with ``epochs <= 1`` (default 1), so no window is seen twice.
    The token budget is the same for every batch size: a larger batch takes
    fewer steps.

Each (spec, lr, seed) is one ``python -m gwt_optim pretrain`` process, run by
the toolkit's runner (``gwt_optim.toolkit.runner``, which ``compare`` uses
too; ``Runner`` here says where a job's run lives and what it trains);
identical runs of different studies are run once. Finished runs are reused
with ``--resume`` when their ``config.json`` is identical, and are never
deleted: a finished run whose configuration differs is moved aside to
``NAME.old<k>``. One process writes ``--out`` at a time (it is locked).

This module is the protocol's logic; the study driver (``_study.py``) runs it and writes its report, which
``_report.py`` lays out (tables, verdicts, the regime plot).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

if str(Path(__file__).resolve().parent) not in sys.path:  # its siblings, however it was loaded
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report as R  # noqa: E402
from _study import BASELINE, ROOT, Driver, finite, fmt_lr, prepare_data, threads_for  # noqa: E402

from gwt_optim.registry import format_spec  # noqa: E402
from gwt_optim.registry import split_spec as parse_spec  # noqa: E402
from gwt_optim.toolkit import runner as _runner  # noqa: E402
from gwt_optim.toolkit.runner import same_config  # noqa: E402,F401 - same_config: for callers
from gwt_optim.toolkit.signals import abort_on_signals  # noqa: E402

# Starts at 1e-4: on the demo at 8K tokens per step AdamW's matrices were
# still improving at 1e-4 with the regular lr at 3e-3 (docs/results/cpu-2k-8k.md).
DEFAULT_LRS = "1e-4,3e-4,1e-3,3e-3,1e-2,3e-2"
# gwt-adamw's own default is detail_clip=0.5; ``detail_clip=none`` is the paper's update.
DEFAULT_CONTENDERS = ["adamw", "gwt-adamw:level=2", "gwt-adamw:level=2:detail_clip=none", "galore:rank=32",
                      "adam8bit", "muon", "gwt-muon:level=2"]
PAPER = "detail_clip=none"
REGIME_TOKENS = "2048,8192,32768"
REGIME_LEVELS = "1,2,3"
REGIME_EPS = "1e-8,1e-6"
DEFAULT_EPS = 1e-8  # TrainConfig's
PAPER_ALPHA = 0.25
VIEWS = ("fair", "paper")
PLOT_PATH = ROOT / "docs" / "images" / "gap-vs-batch.png"


# --------------------------------------------------------------------------- #
# Specs
# --------------------------------------------------------------------------- #


def paper_alpha(name: str) -> float:
    """The paper's module-wise alpha: 0.25 for the GWT families and GaLore, 1 for the rest."""
    return PAPER_ALPHA if name.startswith("gwt-") or name == "galore" else 1.0


def contender_label(spec: str) -> str:
    """A contender as the user names it, without ``lr`` (the grid sets it)."""
    name, opts = parse_spec(spec)
    opts.pop("lr", None)
    return format_spec(name, opts)


def run_spec(label: str, view: str, *, lr: float, regular_lr: float | None = None, gwt_options: str = "") -> str:
    """The registry spec a run of ``label`` uses in ``view`` at matrix lr ``lr``.

    fair: ``scale=1`` (unless the label sets one) and ``regular_lr``; AdamW at
    ``lr == regular_lr`` is plain AdamW over the whole model, so it is written
    as the regular-lr tuning run itself (the same math, run once).
    paper: the paper's alpha (unless the label sets one), no ``regular_lr``.
    ``gwt_options`` (``key=value:...``) is appended to the GWT families' specs.
    """
    name, opts = parse_spec(label)
    opts.pop("lr", None)
    if view == "paper":
        opts.setdefault("scale", fmt_lr(paper_alpha(name)))
    elif view == "fair":
        opts.setdefault("scale", "1")
        plain_adamw = name == BASELINE and set(opts) == {"scale"} and float(opts["scale"]) == 1.0
        if regular_lr is not None and not (plain_adamw and lr == regular_lr):
            opts["regular_lr"] = fmt_lr(regular_lr)
    else:
        raise ValueError(f"unknown view {view!r}; choose one of {VIEWS}")
    if gwt_options and name.startswith("gwt-"):
        for key, value in parse_spec("x:" + gwt_options)[1].items():
            if accepts(name, key):
                opts.setdefault(key, value)
    return format_spec(name, opts)


def accepts(name: str, key: str) -> bool:
    """Whether the registry entry ``name`` takes option ``key`` (True when the registry cannot tell)."""
    try:
        from gwt_optim.toolkit import registry

        spec = registry.REGISTRY[name]
        return key in getattr(registry, "SHARED_OPTIONS", ()) or key in spec.defaults
    except Exception:  # noqa: BLE001 - an older registry: let the preflight judge the spec
        return True


def regime_specs(levels: Sequence[int], eps_values: Sequence[str]) -> list[str]:
    """GWT-AdamW in the paper's mode at each level and eps, and in its default mode (detail_clip 0.5) at each
    level; the default eps is left out of the spec so the runs are shared."""
    specs = []
    for level in levels:
        specs.append(f"gwt-adamw:level={level}")
        for eps in eps_values:
            spec = f"gwt-adamw:level={level}:{PAPER}"
            specs.append(spec if float(eps) == DEFAULT_EPS else f"{spec}:eps={eps}")
    return specs


# --------------------------------------------------------------------------- #
# Pure logic: budget, statistics, selection
# --------------------------------------------------------------------------- #


def batch_for(tokens_per_step: int, seq_len: int) -> int:
    if tokens_per_step % seq_len or tokens_per_step < seq_len:
        raise ValueError(f"--tokens-per-step {tokens_per_step} is not a whole number of {seq_len}-token sequences")
    return tokens_per_step // seq_len


def micro_batch_for(batch_size: int, limit: int | None) -> int | None:
    """The largest micro-batch <= ``limit`` that divides ``batch_size`` (None: no accumulation)."""
    if not limit or limit >= batch_size:
        return None
    return max(d for d in range(1, limit + 1) if batch_size % d == 0)


def cap_steps(windows: int, batch_size: int, *, epochs: float = 1.0,
              steps: int | None = None) -> tuple[int, float, bool]:
    """Steps within ``epochs`` (<= 1) of ``windows`` training sequences: (steps, epochs used, capped).

    ``steps`` given: that many, capped at the budget (``capped`` says so).
    """
    if not 0 < epochs <= 1:
        raise ValueError(f"--epochs {epochs}: the protocol trains on at most one epoch (0 < epochs <= 1)")
    budget = int(epochs * windows) // batch_size
    if budget < 1:
        raise ValueError(f"{epochs:g} epoch of {windows} sequences is not one step of {batch_size} sequences")
    n = budget if steps is None else min(steps, budget)
    if n < 1:
        raise ValueError("--steps must be >= 1")
    return n, n * batch_size / windows, steps is not None and steps > budget


def mean_std(xs: Sequence[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if finite(x)]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def best_lr(losses: dict[float, Sequence[float]]) -> tuple[float | None, float | None]:
    """The lr of the lowest mean loss over the tuning seeds (failed seeds ignored; ties: the smaller lr)."""
    means = {lr: mean_std(v)[0] for lr, v in losses.items()}
    ok = [(m, lr) for lr, m in means.items() if m is not None]
    if not ok:
        return None, None
    m, lr = min(ok)
    return lr, m


def paired_gap(runs: dict[int, float], base: dict[int, float]) -> dict[str, Any]:
    """Gap to the baseline over the seeds both finished: mean and std of the per-seed differences
    (the same seed means the same initial weights and data order)."""
    seeds = sorted(s for s in runs if s in base and finite(runs[s]) and finite(base[s]))
    diffs = [runs[s] - base[s] for s in seeds]
    m, sd = mean_std(diffs)
    return {"mean": m, "std": sd, "n": len(seeds), "seeds": seeds}


def split_seeds(tune: Sequence[int], report: Sequence[int]) -> None:
    overlap = sorted(set(tune) & set(report))
    if overlap:
        raise ValueError(f"tuning and reporting seeds must differ; both have {overlap}")
    if not tune or not report:
        raise ValueError("give at least one tuning seed and one reporting seed")


def ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


def specs_arg(text: str) -> list[str]:
    return [s.strip() for s in str(text).split(",") if s.strip()]


# --------------------------------------------------------------------------- #
# Running: one pretrain process per (spec, lr, seed), shared by all studies
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Job:
    tokens: int  # tokens per step
    spec: str  # the registry spec of the run (view options included)
    lr: float
    seed: int

    def describe(self) -> str:
        return f"T={self.tokens} {self.spec} lr={fmt_lr(self.lr)} seed={self.seed}"


@dataclass
class Setting:
    """Everything but (spec, lr, seed) that defines the runs of one tokens-per-step value."""

    base: dict[str, Any]  # TrainConfig fields shared by all runs
    windows: int  # training sequences in one epoch
    epochs: float = 1.0
    steps: int | None = None
    micro_batch_size: int | None = None
    home_data: str | None = None  # a study's own corpus; runs on another one name it in their folders

    def for_tokens(self, tokens: int) -> dict[str, Any]:
        batch = batch_for(tokens, self.base["seq_len"])
        steps, used, capped = cap_steps(self.windows, batch, epochs=self.epochs, steps=self.steps)
        return {"batch_size": batch, "micro_batch_size": micro_batch_for(batch, self.micro_batch_size),
                "steps": steps, "epochs": used, "capped": capped}


def folder_suffix(setting: Setting) -> str:
    """``""`` for the cosine on the study's own corpus (every run before the schedules keeps its folder's name);
    else ``-wsd0.2-1-sqrt``, ``-constant`` and ``-data-NAME``: runs under another schedule or on another corpus
    never share a folder with these."""
    base, kind = setting.base, setting.base.get("schedule", "cosine")
    suffix = {"cosine": "", "wsd": f"-wsd{base.get('decay', 0.2):g}-{base.get('decay_shape', '1-sqrt')}"}.get(
        kind, f"-{kind}")
    if setting.home_data is not None and base.get("data", setting.home_data) != setting.home_data:
        suffix += "-data-" + "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(base["data"]).name)
    return suffix



class Runner(_runner.Runner):
    """The toolkit's runner (:class:`gwt_optim.toolkit.runner.Runner`) on the protocol's jobs: a job's run
    lives at ``OUT/runs/tokensT-stepsN/seedS/SPEC-lrLR`` and trains the setting's config at its shape.

    ``deadline`` (seconds from ``start``, default now): no job starts after it, and a job still
    running ``grace`` seconds later is stopped. A failed, diverged or skipped run is a result with a
    ``status``, never an exception. ``pool``: another Runner's, so that runners of different stages
    share one limit of ``jobs``.
    """

    def __init__(self, out: Path, setting: Setting, *, jobs: int = 1, threads: int | None = None,
                 resume: bool = False, keep_checkpoints: bool = False, deadline: float | None = None,
                 grace: float = 45.0, quiet: bool = False, offline: bool = False, start: float | None = None,
                 pool: _runner.PriorityPool | None = None):
        pythonpath = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
        super().__init__(out, jobs=jobs, threads=threads, resume=resume, keep_checkpoints=keep_checkpoints,
                         deadline=deadline, grace=grace, quiet=quiet, offline=offline, start=start, pool=pool,
                         env={"PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}, cwd=ROOT)
        self.setting = setting
        self.unavailable: dict[str, str] = {}  # spec -> why (preflight)

    def run_dir(self, job: Job) -> Path:
        from gwt_optim.toolkit.compare import run_dir_name

        steps = self.setting.for_tokens(job.tokens)["steps"]
        slug = run_dir_name(0, f"{job.spec}:lr={fmt_lr(job.lr)}")[3:]
        return self.out / "runs" / f"tokens{job.tokens}-steps{steps}{folder_suffix(self.setting)}" \
            / f"seed{job.seed}" / slug

    def config(self, job: Job) -> dict[str, Any]:
        from gwt_optim.toolkit.train import TrainConfig

        shape = self.setting.for_tokens(job.tokens)
        cfg = {**self.setting.base, "batch_size": shape["batch_size"], "micro_batch_size": shape["micro_batch_size"],
               "steps": shape["steps"], "optimizer": job.spec, "lr": job.lr, "seed": job.seed,
               "out": str(self.run_dir(job)), "progress": False}
        return TrainConfig.from_dict(cfg).to_dict()

    def describe(self, job: Job) -> str:
        return job.describe()

    def job_fields(self, job: Job) -> dict[str, Any]:
        return {"tokens": job.tokens, "spec": job.spec, "lr": job.lr, "seed": job.seed}

    def unavailable_reason(self, job: Job) -> str | None:
        return self.unavailable[job.spec] if job.spec in self.unavailable else None


# --------------------------------------------------------------------------- #
# The protocol of one study
# --------------------------------------------------------------------------- #


@dataclass
class Study:
    view: str
    tokens: int
    contenders: list[str]  # labels; AdamW first
    shape: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.view}-{self.tokens}"


def with_baseline(contenders: Sequence[str]) -> list[str]:
    labels = []
    for c in [BASELINE, *contenders]:
        label = contender_label(c)
        if label not in labels:
            labels.append(label)
    return labels


def tuned_contender(label: str, spec_of, lrs, tune_seeds, results) -> dict[str, Any]:
    grid = {lr: [results[Job(*spec_of(lr), lr, s)]["val_loss"] for s in tune_seeds] for lr in lrs}
    lr, m = best_lr(grid)
    return {"label": label, "grid": {fmt_lr(k): mean_std(v)[0] for k, v in grid.items()}, "best_lr": lr,
            "best_tune_loss": m, "edge": lr is not None and len(lrs) > 1 and lr in (min(lrs), max(lrs)),
            "grid_status": {fmt_lr(k): [results[Job(*spec_of(k), k, s)]["status"] for s in tune_seeds] for k in lrs}}


def run_study(study: Study, runner: Runner, *, lrs: list[float], tune_seeds: list[int], report_seeds: list[int],
              gwt_options: str = "") -> dict[str, Any]:
    """Tune (tuning seeds) then report (reporting seeds) every contender of ``study``."""
    T, view = study.tokens, study.view
    out: dict[str, Any] = {"view": view, "tokens_per_step": T, **study.shape, "lrs": lrs,
                           "tune_seeds": tune_seeds, "report_seeds": report_seeds, "regular_lr": None}
    regular = None
    if view == "fair":
        base_spec = run_spec(BASELINE, "paper", lr=0.0)  # AdamW over the whole model, alpha 1
        stage1 = {Job(T, base_spec, lr, s) for lr in lrs for s in tune_seeds}
        res = runner.run_all(sorted(stage1, key=lambda j: (j.lr, j.seed)))
        reg = tuned_contender("adamw (whole model)", lambda lr: (T, base_spec), lrs, tune_seeds, res)
        regular = reg["best_lr"]
        out["regular_lr"], out["regular_grid"], out["regular_edge"] = regular, reg["grid"], reg["edge"]
        if regular is None:
            out["error"] = "every AdamW run of the regular-lr grid failed; no contender can be tuned"
            out["contenders"] = {c: {"label": c, "status": "failed", "error": out["error"]} for c in study.contenders}
            return out

    def spec_of(label: str):
        return lambda lr: (T, run_spec(label, view, lr=lr, regular_lr=regular, gwt_options=gwt_options))

    tune_jobs = [Job(*spec_of(c)(lr), lr, s) for c in study.contenders for lr in lrs for s in tune_seeds]
    tuned_res = runner.run_all(tune_jobs)
    contenders: dict[str, dict[str, Any]] = {}
    for c in study.contenders:
        contenders[c] = tuned_contender(c, spec_of(c), lrs, tune_seeds, tuned_res)
        name, opts = parse_spec(c)
        contenders[c]["alpha"] = float(opts.get("scale", 1.0 if view == "fair" else paper_alpha(name)))
    report_jobs = [Job(*spec_of(c)(t["best_lr"]), t["best_lr"], s)
                   for c, t in contenders.items() if t["best_lr"] is not None for s in report_seeds]
    rep = runner.run_all(report_jobs)
    for c, t in contenders.items():
        if t["best_lr"] is None:
            statuses = {x for v in t["grid_status"].values() for x in v}
            t.update(status="not run" if statuses <= {"skipped", "stopped", "missing"} else "failed", runs=[],
                     mean=None, std=None, n=0,
                     error=_first_error(tuned_res, [Job(*spec_of(c)(lr), lr, s) for lr in lrs for s in tune_seeds]))
            continue
        job_of = {s: Job(*spec_of(c)(t["best_lr"]), t["best_lr"], s) for s in report_seeds}
        runs = [{"seed": s, **{k: rep[j].get(k) for k in ("val_loss", "status", "state_bytes", "epochs", "wall_s")},
                 "spec": j.spec} for s, j in job_of.items()]
        m, sd = mean_std([r["val_loss"] for r in runs])
        n = sum(finite(r["val_loss"]) for r in runs)
        states = [r["state_bytes"] for r in runs if r.get("state_bytes") is not None]
        t.update(spec=job_of[report_seeds[0]].spec, runs=runs, mean=m, std=sd, n=n,
                 state_bytes=states[0] if states else None, status="ok" if n == len(runs) else
                 ("partial" if n else "failed"))
        if not n:
            t["error"] = _first_error(rep, list(job_of.values()))
    base = contenders.get(BASELINE)
    base_runs = {r["seed"]: r["val_loss"] for r in (base or {}).get("runs", [])}
    for c, t in contenders.items():
        t["gap"] = paired_gap({r["seed"]: r["val_loss"] for r in t.get("runs", [])}, base_runs) if c != BASELINE \
            else None
    out["contenders"] = contenders
    return out


def _first_error(results: dict[Job, dict], jobs: list[Job]) -> str:
    for j in jobs:
        r = results.get(j, {})
        if r.get("status") != "ok":
            last = (r.get("error") or "").strip().splitlines()
            return f"{r.get('status')}: {last[-1] if last else ''}"
    return ""


# --------------------------------------------------------------------------- #
# The regime plot
# --------------------------------------------------------------------------- #


def regime_points(reports: Sequence[dict[str, Any]], specs: Sequence[str] | None = None
                  ) -> dict[str, list[tuple[int, float, float]]]:
    """label -> [(tokens per step, gap mean, gap std)] from the fair studies of ``reports``; a later
    report wins for the same (label, tokens). ``specs`` None: every GWT contender."""
    pts: dict[str, dict[int, tuple[float, float]]] = {}
    for rep in reports:
        for s in rep.get("studies", []):
            if s.get("view") != "fair":
                continue
            for c, t in (s.get("contenders") or {}).items():
                if c == BASELINE or (specs is not None and c not in specs) or (specs is None and
                                                                                 not c.startswith("gwt-")):
                    continue
                g = t.get("gap") or {}
                if finite(g.get("mean")):
                    pts.setdefault(c, {})[int(s["tokens_per_step"])] = (g["mean"], g.get("std") or 0.0)
    return {c: sorted((T, m, sd) for T, (m, sd) in d.items()) for c, d in pts.items()}


def load_reports(paths: Iterable[Path]) -> list[dict[str, Any]]:
    reports = []
    for p in sorted(paths, key=lambda p: p.stat().st_mtime):
        try:
            reports.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"skipping {p}: {exc}", file=sys.stderr)
    return reports


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def build_parser(description: str, *, mode: str) -> argparse.ArgumentParser:
    regime = mode == "regime"
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to compare")
    g.add_argument("--view", default="fair", help="fair (matrix-only fairness), paper, or fair,paper")
    g.add_argument("--tokens-per-step", default="" if regime else "8192",
                   help="comma-separated tokens per optimizer step (batch = tokens / seq_len)"
                   + ("" if regime else " (default 8192)"))
    g.add_argument("--contenders", "--optimizers", dest="contenders", default="" if regime else ",".join(DEFAULT_CONTENDERS),
                   help="comma-separated registry specs (AdamW is always added)"
                   + ("" if regime else f" (default {','.join(DEFAULT_CONTENDERS)})"))
    g.add_argument("--extra", action="append", default=[], metavar="SPEC",
                   help="more contenders, e.g. remedies: gwt-adamw:level=2:detail_clip=0.5 (repeatable or "
                   "comma-separated); in the regime study they are also lines of the plot")
    g.add_argument("--regime", action="store_true", default=regime,
                   help="add the regime study: AdamW and GWT-AdamW at --levels x --eps (and --extra) at "
                   "--regime-tokens, fair view, and draw the gap-vs-batch plot")
    g.add_argument("--regime-tokens", default=REGIME_TOKENS, help=f"(default {REGIME_TOKENS})")
    g.add_argument("--levels", default=REGIME_LEVELS, help=f"regime GWT levels (default {REGIME_LEVELS})")
    g.add_argument("--eps", default=REGIME_EPS, help=f"regime eps values (default {REGIME_EPS})")
    g.add_argument("--gwt-options", default="", metavar="K=V:...",
                   help="options appended to the specs of the GWT families that take them, e.g. backend=eager "
                   "(no kernel build in every short run); not part of the labels")
    g = p.add_argument_group("protocol")
    g.add_argument("--lrs", default=DEFAULT_LRS, help=f"the lr grid, the same for all (default {DEFAULT_LRS})")
    g.add_argument("--tune-seeds", default="0", help="seeds of the grid search (default 0)")
    g.add_argument("--report-seeds", "--eval-seeds", dest="report_seeds", default="1,2,3",
                   help="seeds of the table, apart from the tuning seeds (default 1,2,3)")
    g.add_argument("--epochs", type=float, default=1.0,
                   help="token budget as a fraction of one epoch of the training split, <= 1 (default 1: "
                   "every training sequence once)")
    g.add_argument("--steps", type=int, help="a fixed step count instead (capped at one epoch), for smoke tests")
    g.add_argument("--micro-batch-size", type=int, help="sequences per forward pass (gradient accumulation)")
    g.add_argument("--precision", default="fp32", help="fp32 (default; as on CPU), bf16 or auto")
    g.add_argument("--grad-clip", type=float, help="gradient-norm clip for every run (default: off)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay for every run (0)")
    g = p.add_argument_group("running")
    g.add_argument("--device", default="cpu", help="cpu (default) or cuda (all runs share the GPU)")
    g.add_argument("--jobs", type=int, default=1, help="runs at a time, one process each")
    g.add_argument("--threads", type=int, help="OMP threads per run (default: CPU cores / jobs)")
    g.add_argument("--resume", action="store_true", help="reuse finished runs with an identical config")
    g.add_argument("--keep-checkpoints", action="store_true", help="keep each run's final checkpoint (bulky)")
    g.add_argument("--deadline", type=float, metavar="S",
                   help="start no run S seconds after the script started; stop runs still going at S + --grace; "
                   "then report what finished (set it under the machine's time limit)")
    g.add_argument("--grace", type=float, default=45.0)
    g.add_argument("--out", default="runs/regime" if regime else "runs/quality")
    g.add_argument("--commit", help="the git commit to report when git cannot tell (a copied tree)")
    g.add_argument("--report-only", action="store_true",
                   help="train nothing: rebuild the tables from the finished runs in OUT (e.g. a results folder "
                   "copied back from another machine; give the same flags, --device included)")
    g.add_argument("--plan", "--dry-run", dest="plan", action="store_true",
                   help="list every job and the count, check the specs, run nothing")
    g.add_argument("--no-preflight", dest="preflight", action="store_false",
                   help="skip building each spec's optimizer once before running")
    g.add_argument("--plot", default=str(PLOT_PATH), help="where the regime plot goes (also OUT/gap-vs-batch.png)")
    g.add_argument("--plot-only", action="store_true", help="redraw the plot from OUT/*.json, train nothing")
    return p


def make_studies(args) -> list[Study]:
    views = specs_arg(args.view)
    for v in views:
        if v not in VIEWS:
            raise SystemExit(f"--view {v!r}: choose from {VIEWS}")
    extras = [s for e in args.extra for s in specs_arg(e)]
    cells: dict[tuple[str, int], list[str]] = {}
    for v in views:
        for T in ints(args.tokens_per_step):
            cells.setdefault((v, T), []).extend(specs_arg(args.contenders) + extras)
    if args.regime:
        rs = regime_specs(ints(args.levels), specs_arg(args.eps)) + extras
        for T in ints(args.regime_tokens):
            cells.setdefault(("fair", T), []).extend(rs)
    # In the order given: the pool starts the first studies' runs first (put the headline batch first).
    return [Study(v, T, with_baseline(c)) for (v, T), c in cells.items()]



def preflight(specs: Iterable[str], base: dict[str, Any], tokenizer) -> dict[str, str]:
    """Build each spec's optimizer once on the model (CPU) so a typo, an option the registry does not know or a
    missing package shows before any run; returns spec -> error for the failing ones."""
    import torch

    from gwt_optim.toolkit.models import build_model
    from gwt_optim.toolkit.train import TrainConfig, build_optimizer_for

    torch.manual_seed(0)
    model = build_model(base["model"], tokenizer=tokenizer, max_seq_len=base["seq_len"])
    bad = {}
    for spec in sorted(set(specs)):
        try:
            build_optimizer_for(model, TrainConfig.from_dict({**base, "optimizer": spec, "lr": 1e-3}))
        except Exception as exc:  # noqa: BLE001 - any failure means the spec cannot run
            bad[spec] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return bad


def plan_jobs(studies: list[Study], runner: Runner, *, lrs, tune_seeds, report_seeds, gwt_options
              ) -> tuple[list[str], int, int]:
    """Every job (the later stages with their lrs still open) and the counts: (lines, known now, total at most).

    Known now: the regular-lr grid of the fair view and the whole grid of the paper view (runs shared by
    studies counted once). Open: the fair view's matrix-lr grid (its regular lr ``<R>`` comes from the
    first stage; AdamW at lr = R is the regular-lr run itself) and every reporting run (``<best>`` lr).
    """
    known: dict[Path, str] = {}
    lines, open_jobs = [], 0

    def add(stage: str, job: Job) -> None:
        path = runner.run_dir(job)
        tag = "reusable" if runner.resume and runner.finished(job) else ("shared" if path in known else "")
        tag += " UNAVAILABLE" if job.spec in runner.unavailable else ""
        lines.append(f"  {stage:7s} {job.spec} lr={fmt_lr(job.lr)} seed={job.seed} {tag}".rstrip())
        if job.spec not in runner.unavailable:
            known.setdefault(path, job.spec)

    for st in studies:
        T, shape = st.tokens, runner.setting.for_tokens(st.tokens)
        lines.append(f"## {st.view} view, {T} tokens/step: batch {shape['batch_size']}"
                     + (f" (micro-batch {shape['micro_batch_size']})" if shape["micro_batch_size"] else "")
                     + f", {shape['steps']} steps, {shape['epochs']:.3f} epoch"
                     + (" (--steps capped at one epoch)" if shape["capped"] else "")
                     + f"; contenders: {', '.join(st.contenders)}")
        if st.view == "fair":
            base_spec = run_spec(BASELINE, "paper", lr=0.0)
            for lr in lrs:
                for s in tune_seeds:
                    add("regular", Job(T, base_spec, lr, s))
        for c in st.contenders:
            for lr in lrs:
                for s in tune_seeds:
                    if st.view == "paper":
                        add("tune", Job(T, run_spec(c, "paper", lr=lr, gwt_options=gwt_options), lr, s))
                    elif c != BASELINE or lr != lrs[0]:  # AdamW: one of its lrs is R, the regular-lr run
                        spec = run_spec(c, "fair", lr=lr, regular_lr=-1.0, gwt_options=gwt_options)
                        bad = " UNAVAILABLE" if spec in runner.unavailable else ""
                        lines.append(f"  tune    {spec.replace('regular_lr=-1', 'regular_lr=<R>')} lr={fmt_lr(lr)} "
                                     f"seed={s}{bad}")
                        open_jobs += not bad
        for c in st.contenders:
            spec = run_spec(c, st.view, lr=-2.0, regular_lr=-1.0 if st.view == "fair" else None,
                            gwt_options=gwt_options)
            bad = " UNAVAILABLE" if spec in runner.unavailable else ""
            for s in report_seeds:
                lines.append(f"  report  {spec.replace('regular_lr=-1', 'regular_lr=<R>')} lr=<best> seed={s}{bad}")
                open_jobs += not bad
    return lines, len(known), len(known) + open_jobs


def main(argv: list[str] | None, *, mode: str, description: str) -> int:
    start = time.monotonic()
    args = build_parser(description, mode=mode).parse_args(argv)
    out = Path(args.out)
    name = "regime" if mode == "regime" else "quality"
    plot_paths = [out / "gap-vs-batch.png"] + ([Path(args.plot)] if args.plot else [])

    if args.plot_only:
        reports = load_reports(out.glob("*.json"))
        if not reports:
            print(f"--plot-only: no report JSON in {out}", file=sys.stderr)
            return 2
        specs = sorted({c for r in reports for c in (r.get("regime") or {}).get("specs", [])}) or None
        points = regime_points(reports, specs)
        for pp in plot_paths:
            R.plot_regime(points, pp)
        return 0 if points else 2

    from gwt_optim.toolkit.recipes import DEMO
    from gwt_optim.toolkit.train import TrainConfig

    lrs, tune_seeds, report_seeds = floats(args.lrs), ints(args.tune_seeds), ints(args.report_seeds)
    split_seeds(tune_seeds, report_seeds)
    studies = make_studies(args)
    if not studies:
        print("nothing to run: give --tokens-per-step or --regime", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not args.report_only:
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: torch sees no CUDA GPU here", file=sys.stderr)
            return 2
    driver = Driver(name, f"{name}.py", f"{name}.py", out, args.jobs, threads_for(args.jobs, args.threads),
                    commit=args.commit, report_only=args.report_only, packages=("bitsandbytes", "galore-torch"))
    known = set(TrainConfig().to_dict())
    base = {**{k: v for k, v in DEMO.items() if k in known}, "device": args.device, "precision": args.precision,
            "grad_clip": args.grad_clip, "weight_decay": args.weight_decay,
            "scale": 1.0}  # as every run folder has it: each spec names its alpha (run_spec)
    # The demo's tokenizer, named explicitly so reused runs match exactly.
    base["tokenizer"] = base.get("tokenizer") or ("bpe" if base.get("data", "demo") == "demo" else "t5-base")
    base = driver.setting(base)  # a bad --grad-clip or --weight-decay: before any data is prepared
    if base is None:
        return 2
    data = driver.data(base, prepare_data, lambda exc: f"cannot prepare the {base['data']} data, so no run could "
                                                       f"start: {type(exc).__name__}: {exc}")
    if data is None:
        return 2
    setting = Setting(base, data["train_windows"], epochs=args.epochs, steps=args.steps,
                      micro_batch_size=args.micro_batch_size)
    for st in studies:
        st.shape = {**setting.for_tokens(st.tokens), "seq_len": base["seq_len"]}
    runner = Runner(out, setting, jobs=args.jobs, threads=driver.threads, resume=args.resume,
                    keep_checkpoints=args.keep_checkpoints, deadline=args.deadline, grace=args.grace,
                    offline=args.report_only, start=start)
    print(f"training split: {data['train_tokens']} tokens, {data['train_windows']} sequences of "
          f"{base['seq_len']} (one epoch)", flush=True)

    if (args.preflight or args.plan) and not args.report_only:
        probe = {run_spec(c, st.view, lr=1e-3, regular_lr=(2e-3 if st.view == "fair" else None),
                          gwt_options=args.gwt_options): (st.view, c) for st in studies for c in st.contenders}
        bad = preflight(probe, base, data["tokenizer"])
        for spec, why in bad.items():
            print(f"preflight: {probe[spec][1]} ({probe[spec][0]} view) cannot run: {why}", flush=True)
        runner.unavailable = _unavailable_patterns(bad)
    if args.plan:
        lines, known, total = plan_jobs(studies, runner, lrs=lrs, tune_seeds=tune_seeds, report_seeds=report_seeds,
                                        gwt_options=args.gwt_options)
        print("\n".join(lines))
        print(f"\nplan: {len(studies)} studies; {total} runs at most ({known} known now, the rest once the lrs are "
              f"tuned; runs shared by studies are counted once among the known ones)."
              + (f" Not counted: the runs of {len(runner.unavailable)} spec(s) the preflight found unable to run."
                 if runner.unavailable else ""))
        return 0

    def runs() -> dict[str, Any]:
        print(f"{len(studies)} studies: " + "; ".join(f"{s.view} {s.tokens} tok/step ({len(s.contenders)} "
                                                      f"contenders, {s.shape['steps']} steps)" for s in studies),
              flush=True)
        results = run_studies(studies, runner, lrs=lrs, tune_seeds=tune_seeds, report_seeds=report_seeds,
                              gwt_options=args.gwt_options)
        return {"studies": results, "counts": dict(runner.counts)}

    def check(report: dict[str, Any]) -> int | None:
        """The runs' own environment into the report; 2 where --report-only found no finished run."""
        results = report["studies"]
        if runner.run_env is None:  # read one run's environment (versions and device of the runs themselves)
            for st in results:
                for t in (st.get("contenders") or {}).values():
                    for r in t.get("runs", []):
                        if runner.run_env is None and r.get("status") == "ok":
                            runner.finished(Job(st["tokens_per_step"], r["spec"], t["best_lr"], r["seed"]))
        if runner.run_env is not None:
            report["run_environment"] = {**runner.run_env, **({"git_commit": args.commit} if args.commit else {})}
        if args.report_only and not any(r.get("status") == "ok" for st in results
                                        for t in (st.get("contenders") or {}).values() for r in t.get("runs", [])):
            print(f"--report-only: no finished run in {out} matches these flags; nothing written", file=sys.stderr)
            return 2
        return None

    def draw(report: dict[str, Any]) -> None:
        if not args.regime:
            return
        points = regime_points([report], report["regime"]["specs"])
        for pp in plot_paths:
            try:
                R.plot_regime(points, pp)
            except Exception as exc:  # noqa: BLE001 - the tables are written; a plot can be redrawn
                print(f"regime plot {pp} failed ({type(exc).__name__}: {exc}); redraw with --plot-only")

    title = ("The regime study: GWT's gap to AdamW against tokens per step" if mode == "regime"
             else "Quality on the demo: the same lr grid and seeds for every optimizer")
    return driver.run(
        argv, base, runs=runs, check=check, draw=draw, render=lambda report: R.protocol_markdown(report, title),
        before={"train_tokens": data["train_tokens"], "train_windows": data["train_windows"], "epochs": args.epochs,
                "steps_override": args.steps, "lrs": lrs, "tune_seeds": tune_seeds, "report_seeds": report_seeds},
        after={"regime": ({"specs": regime_specs(ints(args.levels), specs_arg(args.eps))
                           + [contender_label(s) for e in args.extra for s in specs_arg(e)],
                           "tokens": ints(args.regime_tokens)} if args.regime else None), "studies": []})


def run_studies(studies: list[Study], runner: Runner, *, lrs: list[float], tune_seeds: list[int],
                report_seeds: list[int], gwt_options: str) -> list[dict[str, Any]]:
    """Every study at once on ``runner``'s pool (a signal stops the runs in flight; what finished is reported);
    a study that raises is a result with its ``error``, so one broken study loses none of the others."""
    with abort_on_signals([runner], "stopping the runs in flight; reporting what finished"):
        try:
            with ThreadPoolExecutor(max_workers=len(studies)) as pool:
                futures = [pool.submit(run_study, st, runner, lrs=lrs, tune_seeds=tune_seeds,
                                       report_seeds=report_seeds, gwt_options=gwt_options) for st in studies]
                results = []
                for st, fut in zip(studies, futures):
                    try:
                        results.append(fut.result())
                    except Exception as exc:  # noqa: BLE001 - one broken study must not lose the others
                        results.append({"view": st.view, "tokens_per_step": st.tokens, **st.shape, "lrs": lrs,
                                        "tune_seeds": tune_seeds, "report_seeds": report_seeds,
                                        "error": f"{type(exc).__name__}: {exc}", "contenders": {}})
        finally:
            runner.shutdown()
    return results


def _unavailable_patterns(bad: dict[str, str]) -> dict[str, str]:
    """Specs found broken by the preflight, as a matcher for the real run specs (which differ only in lrs)."""
    return _SpecMatcher({_strip_lrs(s): why for s, why in bad.items()})


class _SpecMatcher(dict):
    def __contains__(self, spec: object) -> bool:
        return isinstance(spec, str) and dict.__contains__(self, _strip_lrs(spec))

    def __getitem__(self, spec: str) -> str:
        return dict.__getitem__(self, _strip_lrs(spec))


def _strip_lrs(spec: str) -> str:
    name, opts = parse_spec(spec)
    if "regular_lr" in opts:
        opts["regular_lr"] = "R"
    return format_spec(name, opts)
