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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from gwt_optim.toolkit import runner as _runner  # noqa: E402
from gwt_optim.toolkit.signals import abort_on_signals  # noqa: E402
from gwt_optim.registry import format_spec  # noqa: E402
from gwt_optim.registry import split_spec as parse_spec  # noqa: E402
from gwt_optim.toolkit.runner import lock_out, same_config  # noqa: E402,F401 - same_config: for callers

BAR_NATS = 0.03
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
BASELINE = "adamw"
PLOT_PATH = ROOT / "docs" / "images" / "gap-vs-batch.png"


# --------------------------------------------------------------------------- #
# Specs
# --------------------------------------------------------------------------- #


def fmt_lr(lr: float) -> str:
    return f"{lr:g}"


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


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


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


def schedule_phrase(setting: dict[str, Any]) -> str:
    from gwt_optim.toolkit.schedules import describe

    return describe(setting.get("schedule", "cosine"), setting.get("warmup"),
                    min_ratio=setting.get("min_lr_ratio", 0.1), decay=setting.get("decay", 0.2),
                    decay_shape=setting.get("decay_shape", "1-sqrt"))


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
# Reporting (pure functions of the JSON, so tables and plots regenerate without training)
# --------------------------------------------------------------------------- #


def _f(x: Any, fmt: str = "{:.4f}", none: str = "-") -> str:
    return fmt.format(x) if finite(x) else none


def study_tables(s: dict[str, Any]) -> list[str]:
    lrs = s["lrs"]
    view, T = s["view"], s["tokens_per_step"]
    reg = s.get("regular_lr")
    head = (f"### {view} view, {T} tokens per step ({s.get('batch_size')} x {s.get('seq_len')}"
            + (f", micro-batch {s['micro_batch_size']}" if s.get("micro_batch_size") else "")
            + f"), {s.get('steps')} steps, {_f(s.get('epochs'), '{:.3f}')} epoch")
    lines = [head, ""]
    if view == "fair":
        lines += [f"Regular lr (embeddings, head, norms, biases; AdamW over the whole model, alpha 1, tuning seeds "
                  f"{s['tune_seeds']}): **{_f(reg, '{:g}')}**" + (" (at the edge of the grid)" if s.get(
                      "regular_edge") else ""), "",
                  "| AdamW, whole model | " + " | ".join(f"lr {fmt_lr(lr)}" for lr in lrs) + " |",
                  "|---|" + "---:|" * len(lrs),
                  "| val loss | " + " | ".join(_bold(_f(s.get("regular_grid", {}).get(fmt_lr(lr))),
                                                     lr == reg) for lr in lrs) + " |", ""]
    if s.get("error"):
        return lines + [f"**{s['error']}**", ""]
    what = "matrix lr" if view == "fair" else "lr"
    lines += [f"Tuning ({what}; validation loss, mean over tuning seeds {s['tune_seeds']}; best in bold):", "",
              "| optimizer | " + " | ".join(f"lr {fmt_lr(lr)}" for lr in lrs) + " |", "|---|" + "---:|" * len(lrs)]
    for c, t in s["contenders"].items():
        cells = []
        for lr in lrs:
            v = t.get("grid", {}).get(fmt_lr(lr))
            st = [x for x in t.get("grid_status", {}).get(fmt_lr(lr), []) if x != "ok"]
            cells.append(_bold(_f(v), lr == t.get("best_lr")) if finite(v) else (st[0] if st else "-"))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", f"Reported at the best lr, seeds {s['report_seeds']}:", "",
              "| optimizer | view | tokens/step | steps | α | matrix lr | regular lr | val loss (mean ± std) | "
              "Δ vs AdamW (paired, nats) | state MiB | per seed |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c, t in s["contenders"].items():
        runs = t.get("runs", [])
        loss = (f"{t['mean']:.4f} ± {t['std']:.4f}" + (f" (n={t['n']})" if t.get("n") != len(runs) else "")
                if finite(t.get("mean")) else t.get("status", "failed"))
        gap = t.get("gap")
        delta = "-" if not gap or not finite(gap.get("mean")) else f"{gap['mean']:+.4f} ± {gap['std']:.4f}"
        per_seed = ", ".join(f"{r['seed']}: " + (_f(r.get("val_loss")) if finite(r.get("val_loss"))
                                                 else str(r.get("status"))) for r in runs)
        state = _f(t["state_bytes"] / 2**20, "{:.2f}") if t.get("state_bytes") is not None else "-"
        reg_cell = _f(reg, "{:g}") if view == "fair" else "(= lr)"
        lines.append(f"| {c} | {view} | {T} | {s.get('steps')} | {t.get('alpha', 1):g} | "
                     f"{_f(t.get('best_lr'), '{:g}')} | {reg_cell} | {loss} | {delta} | {state} | {per_seed} |")
    return lines + [""]


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on and text != "-" else text


def verdicts(s: dict[str, Any]) -> list[str]:
    """The bar (GWT-AdamW level 2 within AdamW + 0.03 nats; better than GaLore at <= state), remedies, grid edges."""
    if s.get("error"):
        return []
    C = s["contenders"]
    tag = f"{s['view']}, {s['tokens_per_step']} tokens/step"
    out = []
    gwt = C.get("gwt-adamw:level=2")
    if gwt and gwt.get("gap") and finite(gwt["gap"].get("mean")):
        g = gwt["gap"]
        out.append(f"- [{tag}] GWT-AdamW level 2 vs AdamW: {g['mean']:+.4f} ± {g['std']:.4f} nats over {g['n']} "
                   f"seeds ({'meets' if g['mean'] <= BAR_NATS else 'MISSES'} the bar of +{BAR_NATS}).")
    galore = next((t for c, t in C.items() if c.startswith("galore")), None)
    if gwt and galore and finite(gwt.get("mean")) and finite(galore.get("mean")) and gwt.get("state_bytes") \
            and galore.get("state_bytes"):
        ok = gwt["mean"] < galore["mean"] and gwt["state_bytes"] <= galore["state_bytes"]
        out.append(f"- [{tag}] GWT-AdamW level 2 vs GaLore: {gwt['mean'] - galore['mean']:+.4f} nats at "
                   f"{gwt['state_bytes'] / 2**20:.2f} vs {galore['state_bytes'] / 2**20:.2f} MiB of state "
                   f"({'meets' if ok else 'MISSES'} the bar: better at equal or lower memory).")
    for c, t in C.items():  # remedies: a GWT spec with options beyond its level, against that level's plain spec
        name, opts = parse_spec(c)
        # a remedy is measured against the paper's update at its level
        base = format_spec(name, {"level": opts["level"], "detail_clip": "none"}) if "level" in opts else None
        if base is not None and base not in C:
            base = format_spec(name, {"level": opts["level"]})
        if not name.startswith("gwt-") or base is None or base == c or base not in C:
            continue
        b, r = C[base].get("gap") or {}, t.get("gap") or {}
        if finite(b.get("mean")) and finite(r.get("mean")):
            closed = f"{(b['mean'] - r['mean']) / b['mean']:.0%} of" if b["mean"] > 0 else "n/a (no gap in)"
            out.append(f"- [{tag}] {c}: gap {r['mean']:+.4f} vs {b['mean']:+.4f} for {base}; closes {closed} "
                       f"{base}'s gap to AdamW.")
    edges = [c for c, t in C.items() if t.get("edge")] + (["regular lr"] if s.get("regular_edge") else [])
    if edges:
        out.append(f"- [{tag}] best lr at the edge of the grid for: {', '.join(edges)} (widen --lrs to be sure).")
    bad = [f"{c} ({t.get('status')}: {t.get('error', '')})" for c, t in C.items() if t.get("status") != "ok"]
    if bad:
        out.append(f"- [{tag}] incomplete: " + "; ".join(bad))
    return out


def render(report: dict[str, Any], title: str) -> str:
    env, setting = report.get("run_environment") or report.get("environment", {}), report.get("setting", {})
    lines = [f"# {title}", "",
             f"Setting: `{setting.get('model')}` with a {setting.get('vocab_size')}-token BPE on the "
             f"`{setting.get('data')}` corpus ({report.get('train_tokens')} training tokens, "
             f"{report.get('train_windows')} sequences of {setting.get('seq_len')} = one epoch), "
             f"{schedule_phrase(setting)}, precision "
             f"{setting.get('precision')}, device {setting.get('device')}. Token budget: "
             + (f"{report.get('epochs'):g} epoch" if report.get("steps_override") is None
                else f"{report['steps_override']} steps, capped at one epoch")
             + ", the same for every batch size, so a larger batch takes fewer steps. "
             f"lr grid {report.get('lrs')} for every contender; tuning seeds {report.get('tune_seeds')}, "
             f"reporting seeds {report.get('report_seeds')} (mean ± sample std).", "",
             "Views: **fair** = matrix-only fairness (embeddings, head, norms and biases on AdamW at one regular lr, "
             "tuned once for AdamW; only the attention and MLP matrices change optimizer, at a matrix lr from the "
             "grid with alpha 1). **paper** = one lr for all parameters, alpha 0.25 on the matrices for the GWT "
             "families and GaLore, 1 for the rest. Δ vs AdamW is the mean ± std of the per-seed differences to "
             "AdamW of the same view and batch (same seed: same initial weights and data order).", ""]
    studies = report.get("studies", [])
    for s in studies:
        lines += study_tables(s)
    v = [line for s in studies for line in verdicts(s)]
    if v:
        lines += ["## Verdicts", "", *v, ""]
    lines += [f"Runs: {report.get('counts')}; wall {report.get('wall_s', 0):.0f} s with {report.get('jobs')} "
              f"job(s) x {report.get('threads')} thread(s).", "",
              f"Environment of the runs: {env.get('gpu') or env.get('cpu')} ({env.get('cpu_count')} CPU cores, "
              f"device {env.get('device', setting.get('device'))}, {env.get('autocast', '')}); python "
              f"{env.get('python')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), transformers "
              f"{env.get('transformers')}, bitsandbytes {env.get('bitsandbytes')}, galore-torch "
              f"{env.get('galore-torch')}, gwt-optim {env.get('gwt_optim')}; commit {env.get('git_commit')}.",
              f"Command: `{report.get('command')}`"]
    return "\n".join(lines) + "\n"


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


def _plot_label(spec: str) -> str:
    name, opts = parse_spec(spec)
    if name == "gwt-adamw" and set(opts) <= {"level", "eps", "detail_clip"}:
        mode = "paper" if opts.get("detail_clip") == "none" else f"clip {opts.get('detail_clip', '0.5')}"
        return f"GWT-AdamW level {opts.get('level', 2)}, {mode}, ε {opts.get('eps', '1e-8')}"
    return spec


def plot_regime(points: dict[str, list[tuple[int, float, float]]], path: Path, *, title: str = "") -> Path | None:
    """Gap to AdamW (nats) against tokens per step (log2), one line per spec, the bar at +0.03."""
    if not points:
        print("regime plot: no fair-view gaps to plot", flush=True)
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("regime plot skipped: matplotlib is not installed; regenerate it with --plot-only", flush=True)
        return None
    colors = {"1": "tab:blue", "2": "tab:orange", "3": "tab:green"}
    extra_colors = iter(["tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"] * 4)
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=130)
    all_T = sorted({T for pts in points.values() for T, _, _ in pts})
    n = len(points)
    for i, (spec, pts) in enumerate(sorted(points.items())):
        name, opts = parse_spec(spec)
        paper = name == "gwt-adamw" and opts.get("detail_clip") == "none" and set(opts) <= {"level", "eps",
                                                                                             "detail_clip"}
        default = name == "gwt-adamw" and set(opts) <= {"level"}  # the library default: detail_clip 0.5
        plain = paper or default
        color = colors.get(opts.get("level", "2"), "black") if plain else next(extra_colors)
        style = ("--" if "eps" in opts else "-") if paper else ":"
        # a small horizontal offset keeps overlapping error bars apart
        xs = [T * 2 ** (0.04 * (i - (n - 1) / 2)) for T, _, _ in pts]
        ax.errorbar(xs, [m for _, m, _ in pts], yerr=[sd for _, _, sd in pts], color=color, linestyle=style,
                    marker="o" if plain else "s", markersize=4, capsize=3, linewidth=1.4, label=_plot_label(spec))
    ax.axhline(BAR_NATS, color="black", linewidth=1, linestyle="-.", label=f"bar: AdamW + {BAR_NATS}")
    ax.axhline(0.0, color="gray", linewidth=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_T)
    ax.set_xticklabels([f"{T // 1024}K" if T % 1024 == 0 else str(T) for T in all_T])
    ax.set_xlabel("tokens per optimizer step (log2)")
    ax.set_ylabel("val loss − AdamW's (nats), mean ± std over seeds")
    ax.set_title(title or "GWT's gap to AdamW against batch size (fair view)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"regime plot: {path}", flush=True)
    return path


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


def prepare_data(base: dict[str, Any]) -> dict[str, Any]:
    """Train the tokenizer and tokenize the corpus once (cached for every run); the epoch's size."""
    from gwt_optim.toolkit.data import build_data

    data = build_data(base["data"], seq_len=base["seq_len"], val_tokens=base["val_tokens"], seed=0,
                      tokenizer=base["tokenizer"], vocab_size=base["vocab_size"], progress=False)
    return {"train_tokens": data.info["train_tokens"], "train_windows": data.info["train_windows"],
            "tokenizer": data.tokenizer}


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
    with contextlib.ExitStack() as held:  # the lock of --out, once runs may start
        return _main(args, argv, mode=mode, start=start, held=held)


def _main(args: argparse.Namespace, argv: list[str] | None, *, mode: str, start: float,
          held: contextlib.ExitStack) -> int:
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
            plot_regime(points, pp)
        return 0 if points else 2

    from gwt_optim.toolkit.metrics import atomic_write_json, atomic_write_text, environment
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
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    known = set(TrainConfig().to_dict())
    base = {**{k: v for k, v in DEMO.items() if k in known}, "device": args.device, "precision": args.precision,
            "grad_clip": args.grad_clip, "weight_decay": args.weight_decay,
            "scale": 1.0}  # as every run folder has it: each spec names its alpha (run_spec)
    # The demo's tokenizer, named explicitly so reused runs match exactly.
    base["tokenizer"] = base.get("tokenizer") or ("bpe" if base.get("data", "demo") == "demo" else "t5-base")
    try:
        TrainConfig.from_dict(base).validate()
    except ValueError as exc:  # a bad --grad-clip or --weight-decay: before any data is prepared
        print(f"{name}.py: error: {exc}", file=sys.stderr)
        return 2
    base = {k: v for k, v in TrainConfig.from_dict(base).to_dict().items()
            if k not in ("optimizer", "lr", "seed", "out", "progress", "batch_size", "micro_batch_size", "steps")}
    print(f"preparing the {base['data']} data (tokenizer, token cache) ...", flush=True)
    try:
        data = prepare_data(base)
    except Exception as exc:  # noqa: BLE001 - e.g. DataUnavailable: the corpus package is missing
        print(f"cannot prepare the {base['data']} data, so no run could start: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    setting = Setting(base, data["train_windows"], epochs=args.epochs, steps=args.steps,
                      micro_batch_size=args.micro_batch_size)
    for st in studies:
        st.shape = {**setting.for_tokens(st.tokens), "seq_len": base["seq_len"]}
    runner = Runner(out, setting, jobs=args.jobs, threads=threads, resume=args.resume,
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

    if not args.report_only and not lock_out(held, out, f"{name}.py"):  # one writer of --out at a time
        return 2
    env = environment(packages=("bitsandbytes", "galore-torch"))
    if args.commit:
        env["git_commit"] = args.commit
    command = shlex.join(["python", f"benchmarks/{name}.py", *(sys.argv[1:] if argv is None else argv)])
    report: dict[str, Any] = {
        "command": command, "environment": env, "setting": base, "train_tokens": data["train_tokens"],
        "train_windows": data["train_windows"], "epochs": args.epochs, "steps_override": args.steps, "lrs": lrs,
        "tune_seeds": tune_seeds, "report_seeds": report_seeds, "jobs": args.jobs, "threads": threads,
        "regime": ({"specs": regime_specs(ints(args.levels), specs_arg(args.eps))
                    + [contender_label(s) for e in args.extra for s in specs_arg(e)],
                    "tokens": ints(args.regime_tokens)} if args.regime else None),
        "studies": [],
    }
    print(f"{len(studies)} studies: " + "; ".join(f"{s.view} {s.tokens} tok/step ({len(s.contenders)} contenders, "
                                                  f"{s.shape['steps']} steps)" for s in studies), flush=True)

    t0 = time.monotonic()
    with abort_on_signals([runner], "stopping the runs in flight; reporting what finished"):
        try:
            with ThreadPoolExecutor(max_workers=len(studies)) as pool:
                futures = [pool.submit(run_study, st, runner, lrs=lrs, tune_seeds=tune_seeds,
                                       report_seeds=report_seeds, gwt_options=args.gwt_options) for st in studies]
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
    report.update(studies=results, counts=dict(runner.counts), wall_s=time.monotonic() - t0)
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
    title = ("The regime study: GWT's gap to AdamW against tokens per step" if mode == "regime"
             else "Quality on the demo: the same lr grid and seeds for every optimizer")
    md = render(report, title)
    print("\n" + md)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{name}.json", report)
    atomic_write_text(out / f"{name}.md", md)
    if args.regime:
        points = regime_points([report], report["regime"]["specs"])
        for pp in plot_paths:
            try:
                plot_regime(points, pp)
            except Exception as exc:  # noqa: BLE001 - the tables are written; a plot can be redrawn
                print(f"regime plot {pp} failed ({type(exc).__name__}: {exc}); redraw with --plot-only")
    print(f"wrote {out / (name + '.md')} and {out / (name + '.json')}")
    return 0


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
