"""The budget mode of ``benchmarks/quality.py``: quality at a real token budget.

The demo protocol (``_protocol.py``) trains about one epoch of a 956K-token
corpus, a regime where AdamW's best matrix lr barely moves its matrices. The
budget mode follows the published optimizer studies instead (Kaddour et al.
2023, Semenov et al. 2025, Wen et al. 2025): a large corpus (``--data pysrc``,
about 50M tokens), a fixed token budget of about 20 tokens per non-embedding
parameter or more, the AdamW baseline tuned on lr and beta2, comparison at
the end of training, and the speedup as the tokens a contender needs to reach
tuned AdamW's final loss.

Stages, all with matrix-only fairness (embeddings, head, norms and biases on
AdamW at ``--regular-lr``; only the attention and MLP matrices change
optimizer, alpha 1, the grid value is the matrix lr):

1. AdamW on its lr grid x ``--beta2s`` (tuning seeds, ``--tune-steps``).
2. Every other contender on its own grid, at AdamW's best beta2 (one beta2
   for every run keeps the regular parameters' optimizer identical). A
   one-lr grid without a weight-decay axis decides nothing, so it runs no
   tuning run: the contender reports at that lr ("one lr, not tuned here").
3. Each contender at its best lr on the reporting seeds at the full budget,
   and AdamW with frozen matrices (matrix lr 1e-9) for sanity gate (b).

Gates, printed with the report: (a) every contender's best lr lies inside its
grid; (b) AdamW's trained matrices beat frozen ones by ``--gate-nats``.

The default's bar, printed when a contender runs beside its own
``detail_clip=none`` variant (the paper's update): the clipped default stays
only if at the budget it is no worse than the paper's update and no worse than
tuned AdamW + ``DEFAULT_MARGIN`` nats, on the mean and not significantly (the
paired Δ's 95% t-interval must not lie wholly above the bar).

Runs save a checkpoint every ``--save-every`` steps and ``--resume`` resumes a
cut-short run from it, so the study can span several sessions.
"""
# (The docstring above is ``quality.py --budget --help``.) This module is the study's logic, which returns data;
# the study driver (_study.py) runs it and writes budget.json and budget.md, which _report.py lays out.

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import _protocol as P
import _report as R
from _runs import curve, run_folders
from _stats import t975
from _study import Driver, prepare_data, threads_for

from gwt_optim.toolkit.signals import abort_on_signals

# Grids around the short-horizon bests (docs/results/h200-263fb73, the 600-step
# probe of issue 18): three points each, as the CPU plan allows.
DEFAULT_GRIDS: dict[str, str] = {
    "adamw": "3e-4,1e-3,3e-3",
    "gwt-adamw:level=2": "1e-3,3e-3,1e-2",
    # The unclipped update is the larger one: its grid sits one step below the default's (the CPU runs use it).
    "gwt-adamw:level=2:detail_clip=none": "3e-4,1e-3,3e-3",
    # The probes liked 1e-2..3e-2, but over a 1,000-step schedule Muon at 1e-2 trailed 3e-3 by 0.5 nats
    # halfway, so both Muons started on the grid around 3e-3. GWT-Muon's best came out on its 1e-2 edge,
    # so its grid extends to 3e-2 (docs/results/budget-cpu.md).
    "muon": "1e-3,3e-3,1e-2",
    "gwt-muon:level=2": "1e-3,3e-3,1e-2,3e-2",
}
DEFAULT_BETA2S = "0.95,0.999"
DEFAULT_MARGIN = 0.02  # nats behind tuned AdamW the clipped default may end (docs/algorithm.md)
FROZEN_LR = 1e-9  # "matrix lr 0": TrainConfig wants lr > 0; 2,000 steps of 1e-9 move no weight measurably
PLOT_PATH = P.ROOT / "docs" / "images" / "loss-vs-tokens.png"


def parse_tokens(text: str) -> int:
    """``16M``, ``64K``, ``16000000`` -> tokens."""
    t = str(text).strip().upper().replace("_", "")
    mult = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"--budget {text!r}: a token count such as 16M or 64K") from None


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", required=True, help="training tokens of each reported run (e.g. 16M)")
    g = p.add_argument_group("setting")
    g.add_argument("--data", default="pysrc", help="corpus (default pysrc: ~50M tokens built from pinned sdists)")
    g.add_argument("--model", default="llama_9m")
    g.add_argument("--tokens-per-step", type=int, default=8192)
    g.add_argument("--seq-len", type=int, default=256)
    g.add_argument("--vocab-size", type=int, default=4096)
    g.add_argument("--val-tokens", type=int, default=65536)
    g.add_argument("--regular-lr", type=float, default=3e-3,
                   help="lr of embeddings, head, norms, biases (AdamW) for every contender (default 3e-3)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip for every run (default 1.0)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay for every run (0)")
    g.add_argument("--warmup", type=float, default=0.1)
    g.add_argument("--schedule", default="cosine", help="cosine (default), wsd or constant, as pretrain's; a "
                   "schedule other than cosine names the runs' folders (tokensT-stepsN-wsd0.2-1-sqrt)")
    g.add_argument("--decay", type=float, default=0.2, help="wsd: the decay's length, as --warmup (0.2)")
    g.add_argument("--decay-shape", default="1-sqrt", help="wsd: 1-sqrt (default) or linear")
    g.add_argument("--evals", type=int, default=20, help="validations per run (the loss-vs-tokens curve)")
    g = p.add_argument_group("contenders and grids")
    g.add_argument("--contenders", default=",".join(DEFAULT_GRIDS), help="specs; AdamW is always the baseline")
    g.add_argument("--grid", action="append", default=[], metavar="SPEC=LR,LR,...",
                   help="a contender's matrix-lr grid; one lr: reported at it, untuned (defaults: " + "; ".join(
                       f"{k}={v}" for k, v in DEFAULT_GRIDS.items()) + ")")
    g.add_argument("--beta2s", default=DEFAULT_BETA2S, help=f"AdamW's beta2 grid (default {DEFAULT_BETA2S})")
    g.add_argument("--weight-decays", default="0", metavar="WD,WD,...",
                   help="decoupled weight decay, tuned by coordinate descent after the lr: the first value is the "
                        "lr grid's, each other one runs once at the contender's best lr on the tuning seeds, and "
                        "the contender reports at its best (lr, wd). Every group of a run gets it, as "
                        "--weight-decay does (default 0: no weight-decay axis)")
    g.add_argument("--extend-edges", type=int, default=0, metavar="N",
                   help="when a contender's best lr lands on its grid's edge, tune one more lr beyond that edge "
                        "(the grid's own ratio there), up to N times per contender, so that gate (a) can pass "
                        "without a new call (default 0: the grid as given)")
    g.add_argument("--prior-best", action="append", default=[], metavar="SPEC=LR[,WD]",
                   help="an earlier tuning's best (lr, weight decay) for SPEC, whose runs were lost: its reporting "
                        "runs start first, and the tuning that re-decides it runs after the first three reporting "
                        "seeds of every contender (before the match runs and further seeds), so a study started "
                        "over spends its time on new evidence first. The report uses the tuning's "
                        "best when the tuning is complete and says whether it agrees; until then it reports at the "
                        "prior best and says so. Needs --beta2 and one --beta2s value")
    g.add_argument("--beta2", type=float,
                   help="beta2 of every contender but AdamW, fixed now (default: AdamW's best, so they wait for it)")
    g.add_argument("--tune-steps", type=int, help="steps of a tuning run (default: the budget's)")
    g.add_argument("--tune-seeds", default="0")
    g.add_argument("--report-seeds", default="1,2")
    g.add_argument("--gate-nats", type=float, default=0.3, help="sanity gate (b): trained minus frozen (0.3)")
    g.add_argument("--gate-seeds", help="seeds of the frozen-matrix AdamW run of gate (b) (default: the first "
                   "reporting seed; 'none' leaves it for a later session)")
    g.add_argument("--match-budgets", default="", metavar="F,F,...",
                   help="the data-to-match ratio: AdamW at its best (lr, beta2, wd) also trains to these fractions "
                        "of the budget, each on its own schedule, on --match-seeds; the report gives the budget at "
                        "which AdamW's final loss equals each contender's at 1x (e.g. 0.75; default: none)")
    g.add_argument("--match-seeds", help="seeds of those runs (default: the first two reporting seeds)")
    g.add_argument("--tune-only", action="store_true",
                   help="run the tuning grids only (stages 1-2); the reporting seeds wait for a later call")
    g = p.add_argument_group("running")
    g.add_argument("--device", default="cpu")
    g.add_argument("--precision", default="fp32")
    g.add_argument("--jobs", type=int, default=1)
    g.add_argument("--threads", type=int)
    g.add_argument("--save-every", type=int, default=100, help="checkpoint interval, for --resume (100)")
    g.add_argument("--resume", action="store_true", help="reuse finished runs, resume cut-short ones")
    g.add_argument("--deadline", type=float, metavar="S",
                   help="start no run after S seconds; stop those still running S + --grace seconds in (they save)")
    g.add_argument("--grace", type=float, default=45.0)
    g.add_argument("--progress", action="store_true",
                   help="a table of every run folder under --out (finished or not) and its last validation, and "
                        "their curves in OUT/progress.png and budget-progress.png beside --plot")
    g.add_argument("--report-only", action="store_true", help="report the finished runs, start none")
    g.add_argument("--out", default="runs/budget")
    g.add_argument("--plot", default=str(PLOT_PATH), help="where the loss-vs-tokens plot also goes ('' for none)")
    g.add_argument("--commit", help="the git commit to report when git cannot tell")
    return p


def grids_of(args) -> dict[str, list[float]]:
    labels = P.with_baseline(P.specs_arg(args.contenders))
    grids = {c: P.floats(DEFAULT_GRIDS[c]) for c in labels if c in DEFAULT_GRIDS}
    for item in args.grid:
        spec, _, lrs = item.rpartition("=")
        if not spec or not lrs:
            raise ValueError(f"--grid {item!r}: expected SPEC=LR,LR,...")
        grids[P.contender_label(spec)] = P.floats(lrs)
    missing = [c for c in labels if c not in grids]
    if missing:
        raise ValueError(f"no lr grid for {', '.join(missing)}: give --grid SPEC=LR,LR,...")
    return {c: sorted(grids[c]) for c in labels}


def with_beta2(label: str, beta2: float) -> str:
    name, opts = P.parse_spec(label)
    opts.setdefault("beta2", f"{beta2:g}")
    return P.format_spec(name, opts)


def wd_spec(wd: float) -> float | None:
    """The weight decay a run's spec names: every run's config has weight decay 0, and a spec names any other
    value, whatever --weight-decay is. So a run's folder says its weight decay, and a run at (lr, 0.1) is the
    same folder, reused, whether 0.1 came from --weight-decay or from the --weight-decays axis."""
    return None if wd == 0 else wd


def with_weight_decay(label: str, wd: float | None) -> str:
    """``label`` at decoupled weight decay ``wd`` (a spec option, so every group of the run gets it); ``None``
    (weight decay 0, the runs' config's) leaves the spec as it is, so runs at 0 keep the folders they had
    before the axis existed."""
    if wd is None:
        return label
    name, opts = P.parse_spec(label)
    opts.setdefault("weight_decay", P.fmt_lr(wd))
    return P.format_spec(name, opts)


def t_interval(xs: Sequence[float]) -> dict[str, Any]:
    """Mean and the half-width of its 95% t-interval over ``xs`` (finite values only; no interval below n=2)."""
    xs = [x for x in xs if P.finite(x)]
    m, sd = P.mean_std(xs)
    n = len(xs)
    if n < 2:
        return {"mean": m, "half": None, "n": n}
    return {"mean": m, "half": t975(n - 1) * sd / n ** 0.5, "n": n}


def read_curve(run: Path, tokens_per_step: int) -> list[tuple[int, float]]:
    """(tokens, validation loss) of every validation of a run."""
    return [(step * tokens_per_step, v) for step, v in sorted(curve(run).items())]


def run_commits(run: Path) -> list[str | None]:
    """The commits a run's processes ran from, oldest first (its first process's, then each resume's),
    from its ``environment.json``; None where one was not recorded."""
    from gwt_optim.toolkit.metrics import process_environments

    return [e.get("git_commit") for e in process_environments(run / "environment.json")]


def _code_line(B: dict[str, Any]) -> str:
    """How many of the reported runs started from each commit (a run resumed under other code says so)."""
    runs = [r for t in B["contenders"].values() for r in t.get("runs", [])]
    runs += (B.get("frozen") or {}).get("runs", []) + [r for m in (B.get("match") or {}).get("budgets", [])
                                                        for r in m.get("runs", [])]
    started: dict[str, int] = {}
    resumed = 0
    for r in runs:
        commits = r.get("commits") or []
        if commits:
            key = (commits[0] or "not recorded")[:12]
            started[key] = started.get(key, 0) + 1
            resumed += len(set(commits)) > 1
    if not started:
        return "Code: -."
    return ("Code: reporting runs started from " + ", ".join(f"{k} ({n})" for k, n in started.items())
            + f"; {resumed} of them resumed under another commit (each run's environment.json has the list).")


def tokens_to_reach(curve: Sequence[tuple[int, float]], target: float) -> float | None:
    """The first token count at which ``curve`` reaches ``target`` (linear between validations), else None."""
    prev = None
    for tokens, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(tokens)
            t0, l0 = prev
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        prev = (tokens, loss)
    return None


def mean_curve(runs: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """The validation curve averaged over seeds, at the token counts every seed validated at."""
    curves = [dict(r["curve"]) for r in runs if r.get("curve")]
    if not curves or len(curves) != len(runs):
        return []
    xs = sorted(set.intersection(*(set(c) for c in curves)))
    return [(x, sum(c[x] for c in curves) / len(curves)) for x in xs]


def paired_delta_curve(runs: Sequence[dict[str, Any]], base_runs: Sequence[dict[str, Any]]
                       ) -> list[tuple[int, dict[str, Any]]]:
    """(tokens, t_interval of the per-seed differences) at every validation of the seeds both sides finished:
    where along the run a contender leads or trails the baseline, which the final figure alone hides."""
    base = {r["seed"]: dict(r.get("curve") or []) for r in base_runs if P.finite(r.get("val_loss"))}
    mine = {r["seed"]: dict(r.get("curve") or []) for r in runs if P.finite(r.get("val_loss"))}
    seeds = [s for s in mine if base.get(s) and mine[s]]
    if not seeds:
        return []
    xs = sorted(set.intersection(*(set(mine[s]) & set(base[s]) for s in seeds)))
    return [(x, t_interval([mine[s][x] - base[s][x] for s in seeds])) for x in xs]


class Budget:
    """The three stages on one shared pool of ``jobs`` processes. Waiting runs start in order of
    :attr:`PRIOR` (reporting runs at a ``--prior-best``, by seed), :attr:`TUNE`, then reporting runs by seed
    up to :attr:`INTERVAL_SEEDS` (each seed's runs of every contender before the next seed's, so that an
    interim report has paired seeds), then :attr:`RETUNE`: the tuning runs that re-decide a ``--prior-best``,
    whose figures an earlier tuning already measured, then the data-to-match runs by seed, then the
    reporting seeds beyond :attr:`INTERVAL_SEEDS`. A queue that spans sessions so finishes the evidence a
    claim needs (every contender tuned, with an interval) before it narrows an interval further."""

    PRIOR, TUNE, REPORT, RETUNE, MATCH, LATE = -1, 0, 1, 2, 3, 4
    # the fewest seeds that give a t-interval worth reporting: at n = 2 (one degree of freedom) t is 12.7
    INTERVAL_SEEDS = 3

    def __init__(self, args, base: dict[str, Any], windows: int, start: float):
        self.args = args
        self.T = args.tokens_per_step
        self.steps = max(1, parse_tokens(args.budget) // self.T)
        self.tune_steps = args.tune_steps or self.steps
        self.R = args.regular_lr

        def runner(sub: str, steps: int, pool=None) -> P.Runner:
            b = {**base, "eval_every": max(1, steps // max(1, args.evals)),
                 "save_every": min(args.save_every, steps) if args.save_every else 0}
            r = P.Runner(Path(args.out) / sub, P.Setting(b, windows, steps=steps, home_data="pysrc"), jobs=args.jobs,
                         threads=args.threads, resume=args.resume, offline=args.report_only, start=start,
                         deadline=args.deadline, grace=args.grace, pool=pool)
            r.resume_partial = args.resume
            return r

        self.tuner = runner("tune", self.tune_steps)
        self.reporter = runner("report", self.steps, pool=self.tuner.pool)  # one queue: at most --jobs processes
        # AdamW at other budgets, each on its own schedule: one runner per step count, on the same queue.
        self.matchers = {f: runner("match", max(1, round(f * self.steps)), pool=self.tuner.pool)
                         for f in match_fractions_of(args.match_budgets)}

    @property
    def runners(self) -> list[P.Runner]:
        """Every stage's runner: a signal aborts them all, or a stage left out starts its queued runs on the
        slots the others free."""
        return [self.tuner, self.reporter, *self.matchers.values()]

    def spec(self, label: str, lr: float) -> str:
        return P.run_spec(label, "fair", lr=lr, regular_lr=self.R)

    def submit_tune(self, label: str, lrs: list[float], beta2s: list[float], seeds: list[int],
                    rank: int = TUNE) -> dict:
        wd = wd_spec(self.args.weight_decay)  # the lr grid's
        jobs = {(b2, lr, s): P.Job(self.T, self.spec(with_weight_decay(with_beta2(label, b2), wd), lr), lr, s)
                for b2 in beta2s for lr in lrs for s in seeds}
        return {k: self.tuner.submit(j, priority=(rank,)) for k, j in jobs.items()}

    def tune_weight_decay(self, label: str, t: dict[str, Any], wds: list[float], seeds: list[int],
                          rank: int = TUNE) -> dict:
        """The weight-decay coordinate at ``t``'s best (lr, beta2): ``wds[0]`` is the lr grid's own value,
        each other value one run per tuning seed. Returns the grid and the best value (ties: the grid's)."""
        lr, b2 = t["best_lr"], t["best_beta2"]
        grid: dict[str, float | None] = {P.fmt_lr(wds[0]): t["best_tune_loss"]}
        status: dict[str, list[str]] = {}
        def job(wd: float, s: int) -> P.Job:
            return P.Job(self.T, self.spec(with_weight_decay(with_beta2(label, b2), wd_spec(wd)), lr), lr, s)

        futs = {(wd, s): self.tuner.submit(job(wd, s), priority=(rank,)) for wd in wds[1:] for s in seeds}
        for wd in wds[1:]:
            res = [futs[(wd, s)].result() for s in seeds]
            grid[P.fmt_lr(wd)] = P.mean_std([r["val_loss"] for r in res])[0]
            status[P.fmt_lr(wd)] = [r["status"] for r in res]
        ok = [(m, i) for i, m in enumerate(grid.values()) if m is not None]
        best = wds[min(ok)[1]] if ok else wds[0]
        return {"wd_grid": grid, "wd_status": status, "best_wd": best}

    def tune(self, label: str, lrs: list[float], beta2s: list[float], seeds: list[int],
             futs: dict | None = None, rank: int = TUNE) -> dict[str, Any]:
        """The lr x beta2 grid on the tuning seeds, extended beyond an edge that wins (``--extend-edges``)."""
        futs = dict(futs if futs is not None else self.submit_tune(label, lrs, beta2s, seeds, rank))
        lrs, extended = sorted(lrs), 0
        while True:
            t = self._tuned(label, lrs, beta2s, seeds, {k: f.result() for k, f in futs.items()})
            if not t["edge"] or extended == self.args.extend_edges:
                return {**t, "extended": extended}
            new = beyond_edge(lrs, t["best_lr"])
            futs.update(self.submit_tune(label, [new], beta2s, seeds, rank))
            lrs, extended = sorted(lrs + [new]), extended + 1

    @staticmethod
    def given(label: str, lr: float, beta2: float) -> dict[str, Any]:
        """A one-point grid at one weight decay: the lr is given, and a tuning run would decide nothing, so none
        runs (on the CPU it costs as much as a reporting run)."""
        return {"label": label, "lrs": [lr], "beta2s": [beta2], "grid": {f"{beta2:g}": {P.fmt_lr(lr): None}},
                "status": {f"{beta2:g}:{P.fmt_lr(lr)}": ["not run"]}, "best_lr": lr, "best_beta2": beta2,
                "best_tune_loss": None, "edge": False, "extended": 0}

    @staticmethod
    def _tuned(label: str, lrs: list[float], beta2s: list[float], seeds: list[int], res: dict) -> dict[str, Any]:
        grid = {b2: {lr: P.mean_std([res[(b2, lr, s)]["val_loss"] for s in seeds])[0] for lr in lrs}
                for b2 in beta2s}
        ok = [(m, lr, b2) for b2, row in grid.items() for lr, m in row.items() if m is not None]
        best = min(ok) if ok else None
        return {"label": label, "lrs": lrs, "beta2s": beta2s,
                "grid": {f"{b2:g}": {P.fmt_lr(lr): m for lr, m in row.items()} for b2, row in grid.items()},
                "status": {f"{b2:g}:{P.fmt_lr(lr)}": [res[(b2, lr, s)]["status"] for s in seeds]
                           for b2 in beta2s for lr in lrs},
                "best_lr": best[1] if best else None, "best_beta2": best[2] if best else None,
                "best_tune_loss": best[0] if best else None,
                "edge": bool(best) and len(lrs) > 1 and best[1] in (lrs[0], lrs[-1])}

    def submit_report(self, label: str, lr: float, beta2: float, seeds: list[int], wd: float | None = None,
                      runner: P.Runner | None = None, rank: int | None = None) -> tuple[dict, dict]:
        """Queue the runs of :meth:`report` (a run already queued keeps its place): (jobs, futures) by seed."""
        early = P.ints(self.args.report_seeds)[:self.INTERVAL_SEEDS]

        def priority(s: int) -> tuple[int, int]:
            if rank is not None:
                return rank, s
            return (self.MATCH if runner is not None else self.REPORT if s in early else self.LATE), s
        jobs = {s: P.Job(self.T, self.spec(with_weight_decay(with_beta2(label, beta2), wd), lr), lr, s) for s in seeds}
        stage = runner or self.reporter
        return jobs, {s: stage.submit(j, priority=priority(s)) for s, j in jobs.items()}

    def report(self, label: str, lr: float, beta2: float, seeds: list[int], wd: float | None = None,
               runner: P.Runner | None = None) -> dict[str, Any]:
        jobs, futs = self.submit_report(label, lr, beta2, seeds, wd, runner)
        runner = runner or self.reporter
        runs = []
        for s, f in futs.items():
            r = f.result()
            runs.append({"seed": s, "val_loss": r.get("val_loss"), "status": r.get("status"),
                         "state_bytes": r.get("state_bytes"), "wall_s": r.get("wall_s"),
                         "ms_per_step": r.get("ms_per_step"), "spec": jobs[s].spec,
                         "curve": read_curve(runner.run_dir(jobs[s]), self.T),
                         "commits": run_commits(runner.run_dir(jobs[s]))})
        m, sd = P.mean_std([r["val_loss"] for r in runs])
        states = [r["state_bytes"] for r in runs if r.get("state_bytes")]
        return {"lr": lr, "beta2": beta2, "weight_decay": wd, "runs": runs, "mean": m, "std": sd,
                "n": sum(P.finite(r["val_loss"]) for r in runs), "state_bytes": states[0] if states else None}


def beyond_edge(lrs: list[float], edge: float) -> float:
    """The next lr past ``edge`` (the sorted grid's first or last) at the grid's own ratio there, to 2
    significant digits: 1e-3,2e-3,4e-3 -> 8e-3 above, 5e-4 below; 1e-3,3e-3,1e-2 -> 3.3e-2 above."""
    if edge == lrs[-1]:
        return float(f"{lrs[-1] * lrs[-1] / lrs[-2]:.2g}")
    return float(f"{lrs[0] * lrs[0] / lrs[1]:.2g}")


def _tuned(t: dict[str, Any]) -> bool:
    """Whether ``t``'s lr was chosen on a grid: a one-lr "grid" has no edge to fail and no tuning to pass."""
    return len(t.get("lrs") or []) > 1


def _gate_a_word(ok: bool | None, t: dict[str, Any]) -> str:
    if ok is None:
        return "one lr, not tuned here" if not _tuned(t) and t.get("best_lr") else "not tuned yet"
    return "pass" if ok else "**FAIL** (edge)"


def gate_seeds_of(text: str | None, report_seeds: list[int]) -> list[int]:
    """``--gate-seeds``: None -> the first reporting seed; 'none' -> no frozen run this call."""
    if text is None:
        return report_seeds[:1]
    if text.strip().lower() == "none":
        return []
    seeds = P.ints(text)
    if not set(seeds) <= set(report_seeds):
        raise ValueError(f"--gate-seeds {text!r}: gate (b) pairs the frozen run with AdamW's reporting run, "
                         f"so its seeds must be reporting seeds ({report_seeds})")
    return seeds


def match_fractions_of(text: str) -> list[float]:
    """``--match-budgets``: fractions of the budget in (0, 1) or above 1, never 1 itself (that run exists)."""
    fs = P.floats(text)
    if any(not P.finite(f) or f <= 0 or f == 1 for f in fs) or len(set(fs)) != len(fs):
        raise ValueError(f"--match-budgets {text!r}: distinct fractions of the budget, > 0 and not 1 (e.g. 0.75)")
    return fs


def match_seeds_of(text: str | None, report_seeds: list[int]) -> list[int]:
    seeds = report_seeds[:2] if text is None else P.ints(text)
    if not seeds or not set(seeds) <= set(report_seeds):
        raise ValueError(f"--match-seeds {text!r}: reporting seeds ({report_seeds}), so that the 1x point is "
                         "AdamW's reporting runs on the same seeds")
    return seeds


def budget_to_match(points: Sequence[tuple[float, float]], loss: float) -> tuple[float | None, str]:
    """The token budget at which AdamW's final loss equals ``loss``, from its (tokens, final loss) points:
    linear in log(tokens) between the two points that bracket it ("interpolated"), else along the line
    through the two nearest points ("extrapolated"); None where the points do not fall with the budget."""
    import math

    pts = sorted((t, l) for t, l in points if P.finite(l) and t > 0)
    if len(pts) < 2 or not P.finite(loss):
        return None, ""
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if min(l0, l1) <= loss <= max(l0, l1) and l0 != l1:
            how = "interpolated"
            break
    else:
        (t0, l0), (t1, l1) = pts[-2:] if loss < pts[-1][1] else pts[:2]
        how = "extrapolated"
    if l1 >= l0:  # more data did not lower AdamW's loss: no budget answers
        return None, ""
    x = math.log(t0) + (math.log(t1) - math.log(t0)) * (l0 - loss) / (l0 - l1)
    return math.exp(x), how


def run(args, base: dict[str, Any], windows: int, start: float) -> dict[str, Any]:
    grids = grids_of(args)
    beta2s = P.floats(args.beta2s)
    wds = weight_decays_of(args.weight_decays, args.weight_decay)
    tune_seeds, report_seeds = P.ints(args.tune_seeds), P.ints(args.report_seeds)
    P.split_seeds(tune_seeds, report_seeds)
    gate_seeds = gate_seeds_of(args.gate_seeds, report_seeds)
    match_seeds = match_seeds_of(args.match_seeds, report_seeds)
    b = Budget(args, base, windows, start)
    out: dict[str, Any] = {"steps": b.steps, "tune_steps": b.tune_steps, "tokens_per_step": b.T,
                           "budget_tokens": b.steps * b.T, "regular_lr": b.R, "tune_seeds": tune_seeds,
                           "report_seeds": report_seeds, "grids": {c: g for c, g in grids.items()},
                           "weight_decays": wds,
                           "contenders": {}}

    with abort_on_signals(b.runners, "stopping the runs in flight (they resume with --resume)"):
        _stages(args, b, out, grids, beta2s, wds, tune_seeds, report_seeds, gate_seeds, match_seeds)
    analyse(out, args.gate_nats)
    out["counts"] = {k: sum(r.counts[k] for r in b.runners) for k in b.tuner.counts}
    return out


def weight_decays_of(text: str, base: float = 0.0) -> list[float]:
    """``--weight-decays``: distinct values >= 0, the first of which is ``--weight-decay`` (the lr grid's)."""
    wds = P.floats(text)
    if not wds or any(not P.finite(w) or w < 0 for w in wds) or len(set(wds)) != len(wds) or wds[0] != base:
        raise ValueError(f"--weight-decays {text!r}: distinct values >= 0, the first being --weight-decay "
                         f"({base:g}), at which the lr grid runs (e.g. {base:g},0.1)")
    return wds


def priors_of(args, grids: dict[str, list[float]], beta2s: list[float], wds: list[float]
              ) -> dict[str, tuple[float, float, float]]:
    """``--prior-best SPEC=LR[,WD]`` -> {label: (lr, wd, beta2)}."""
    priors: dict[str, tuple[float, float, float]] = {}
    for item in args.prior_best:
        spec, _, value = item.rpartition("=")
        label = P.contender_label(spec) if spec else ""
        vals = P.floats(value) if value else []
        if label not in grids or len(vals) not in (1, 2):
            raise ValueError(f"--prior-best {item!r}: expected SPEC=LR[,WD] for one of the contenders")
        lr, wd = vals[0], vals[1] if len(vals) == 2 else wds[0]
        if not (P.finite(lr) and lr > 0) or wd not in wds:
            raise ValueError(f"--prior-best {item!r}: the lr must be > 0 and the weight decay one of "
                             f"--weight-decays ({','.join(f'{w:g}' for w in wds)})")
        if args.beta2 is None or len(beta2s) != 1:
            raise ValueError("--prior-best: give --beta2 and one --beta2s value, so that the prior's beta2 is known")
        priors[label] = (lr, wd, beta2s[0] if label == P.BASELINE else args.beta2)
    return priors


_UNFINISHED = ("missing", "skipped", "stopped")


def _unfinished(t: dict[str, Any]) -> bool:
    """Some tuning run of ``t`` (lr grid or weight decay) has not finished (an interim ``--report-only``): the
    best so far may not be the best."""
    return any(x in _UNFINISHED for d in (t.get("status") or {}, t.get("wd_status") or {}) for xs in d.values()
               for x in xs)


def _stages(args, b: Budget, out: dict[str, Any], grids: dict[str, list[float]], beta2s: list[float],
            wds: list[float], tune_seeds: list[int], report_seeds: list[int], gate_seeds: list[int],
            match_seeds: list[int]) -> None:
    """Stages 1-3 on ``b``'s shared pool, into ``out``."""
    priors = priors_of(args, grids, beta2s, wds)
    try:
        # before any tuning run, so that they take the first slots; seed by seed, because idle workers take
        # the first submissions at once, before any ordering by priority
        for s in report_seeds if priors and not args.tune_only else []:
            for c, (lr, wd, b2) in priors.items():
                b.submit_report(c, lr, b2, [s], wd_spec(wd), rank=b.PRIOR)

        def rank(label: str) -> int:
            return b.RETUNE if label in priors else b.TUNE
        # A contender given one lr (and no weight-decay axis) is not tuned; AdamW, the baseline, is unless its
        # beta2 is given too: a one-point grid decides nothing, and on the CPU a tuning run costs a reporting run's
        given = {c for c in grids if len(grids[c]) == 1 and len(wds) < 2 and (c != P.BASELINE or len(beta2s) == 1)}
        if args.tune_only and given:  # else they run nothing at all, without a word
            print(f"--tune-only: nothing to tune for {', '.join(sorted(given))} (one lr, no weight-decay axis); "
                  "they run with the reporting seeds, in a call without --tune-only", flush=True)
        others = [c for c in grids if c != P.BASELINE and c not in given]
        if P.BASELINE in given:
            base_t = b.given(P.BASELINE, grids[P.BASELINE][0], beta2s[0])
            beta2 = beta2s[0] if args.beta2 is None else args.beta2
            pending = {c: b.submit_tune(c, grids[c], [beta2], tune_seeds, rank(c)) for c in others}
        elif args.beta2 is None:  # every other contender waits for AdamW's best beta2
            base_t = b.tune(P.BASELINE, grids[P.BASELINE], beta2s, tune_seeds, rank=rank(P.BASELINE))
            beta2 = base_t["best_beta2"] if base_t["best_beta2"] is not None else beta2s[0]
            pending = {}
        else:  # beta2 fixed for the others: interleave, so each contender meets AdamW early
            beta2 = args.beta2
            first = [beta2] if beta2 in beta2s else []
            futs = b.submit_tune(P.BASELINE, grids[P.BASELINE], first, tune_seeds, rank(P.BASELINE))
            pending = {c: b.submit_tune(c, grids[c], [beta2], tune_seeds, rank(c)) for c in others[:1]}
            futs.update(b.submit_tune(P.BASELINE, grids[P.BASELINE], [x for x in beta2s if x not in first],
                                      tune_seeds, rank(P.BASELINE)))
            pending.update({c: b.submit_tune(c, grids[c], [beta2], tune_seeds, rank(c)) for c in others[1:]})
            pending[P.BASELINE], base_t = futs, None  # decided in its own thread: nothing else waits for it
        out["beta2"] = beta2

        def tuned(label: str) -> dict[str, Any]:
            if label in given and label == P.BASELINE:
                return {**base_t, "best_wd": wds[0]}
            if label in given:
                return {**b.given(label, grids[label][0], beta2), "best_wd": wds[0]}
            if label == P.BASELINE:
                t = base_t or b.tune(label, grids[label], beta2s, tune_seeds, pending[label], rank(label))
            else:
                t = b.tune(label, grids[label], [beta2], tune_seeds, pending.get(label), rank(label))
            if t["best_lr"] is not None and len(wds) > 1:
                t = {**t, **b.tune_weight_decay(label, t, wds, tune_seeds, rank(label))}
            else:
                t = {**t, "best_wd": wds[0]}
            if label not in priors:
                return t
            # a tuning not finished yet (a report between sessions) decides nothing: report at the prior best
            lr, wd, b2 = priors[label]
            prior = {"lr": lr, "wd": wd, "complete": not _unfinished(t),
                     "agrees": (t["best_lr"], t["best_wd"], t["best_beta2"]) == (lr, wd, b2)}
            if prior["complete"]:
                return {**t, "prior": prior}
            return {**t, "prior": prior, "best_lr": lr, "best_wd": wd, "best_beta2": b2, "edge": False}

        def contender(label: str, t: dict[str, Any]) -> dict[str, Any]:
            if t["best_lr"] is None or args.tune_only:
                return {**t, "runs": [], "mean": None, "std": None, "n": 0}
            b2 = t["best_beta2"] if label == P.BASELINE else beta2
            return {**t, **b.report(label, t["best_lr"], b2, report_seeds, wd_spec(t["best_wd"]))}

        with ThreadPoolExecutor(max_workers=2 * len(grids) + 1 + len(b.matchers)) as pool:
            tunes = {c: pool.submit(tuned, c) for c in grids}

            def at_prior(seeds: list[int], lr: float | None = None, runner: P.Runner | None = None) -> None:
                """Queue AdamW's runs at its prior best, not waiting for its tuning (last in the queue): the
                same runs at the tuning's best, if it agrees, are these; if not, they are wasted."""
                if P.BASELINE in priors:
                    plr, wd, b2 = priors[P.BASELINE]
                    b.submit_report(P.BASELINE, lr or plr, b2, seeds, wd_spec(wd), runner)

            def frozen_run() -> dict[str, Any]:  # at AdamW's own (beta2, wd), so that gate (b) pairs like with like
                at_prior(gate_seeds, FROZEN_LR)
                bt = tunes[P.BASELINE].result()
                return b.report(P.BASELINE, FROZEN_LR, bt["best_beta2"] or beta2, gate_seeds,
                                wd_spec(bt["best_wd"]))

            frozen = pool.submit(frozen_run) if gate_seeds and not args.tune_only else None
            futs = {c: pool.submit(lambda c=c: contender(c, tunes[c].result())) for c in grids}

            def match_run(f: float, runner: P.Runner) -> dict[str, Any]:  # AdamW at its best, another budget
                at_prior(match_seeds, runner=runner)
                bt = tunes[P.BASELINE].result()
                if bt["best_lr"] is None:
                    return {"fraction": f, "runs": [], "mean": None}
                r = b.report(P.BASELINE, bt["best_lr"], bt["best_beta2"] or beta2, match_seeds,
                             wd_spec(bt["best_wd"]), runner=runner)
                return {"fraction": f, "tokens": runner.setting.steps * b.T, **r}

            matches = [pool.submit(match_run, f, r) for f, r in b.matchers.items()] if not args.tune_only else []
            for c, f in futs.items():
                out["contenders"][c] = f.result()
            out["adamw_best_beta2"] = tunes[P.BASELINE].result()["best_beta2"]
            out["frozen"] = frozen.result() if frozen else {}
            out["match"] = {"seeds": match_seeds, "budgets": [m.result() for m in matches]}
    finally:
        b.tuner.shutdown()


def family_base(label: str, labels: Sequence[str]) -> str | None:
    """The plain optimizer a GWT contender transforms (``gwt-muon:level=2`` -> ``muon``), when it is a
    contender too, at its own defaults."""
    name, _ = P.parse_spec(label)
    plain = name.removeprefix("gwt-")
    return next((c for c in labels if plain != name and P.parse_spec(c) == (plain, {})), None)


def _against(t: dict[str, Any], base: dict[str, Any], budget: int) -> dict[str, Any]:
    """``t`` against ``base``: the paired gap over the seeds both finished, and the tokens ``t``'s
    seed-mean curve needs to reach ``base``'s mean final loss on the same seeds (the speedup is the budget
    over them). An interim report has seeds one side has not finished; a diverged seed counts (its nan
    leaves the seed-mean speedup unreached)."""
    theirs = {r["seed"]: r for r in base.get("runs", [])}
    mine = {r["seed"]: r for r in t.get("runs", [])}
    seeds = {s: r["val_loss"] for s, r in theirs.items()}
    gap = P.paired_gap({s: r["val_loss"] for s, r in mine.items()}, seeds)
    gap["ci"] = t_interval([mine[s]["val_loss"] - seeds[s] for s in gap["seeds"]])["half"]
    done = [s for s, r in mine.items() if s in theirs and r.get("status") not in _UNFINISHED
            and theirs[s].get("status") not in _UNFINISHED]
    target = sum(seeds[s] for s in done) / len(done) if done else None
    curve = mean_curve([mine[s] for s in done])
    reach = tokens_to_reach(curve, target) if P.finite(target) and curve else None
    # Per seed: the tokens this seed's curve needs to reach the baseline's final loss on the same seed.
    per_seed = {s: tokens_to_reach(mine[s].get("curve") or [], seeds[s]) for s in gap["seeds"]}
    speedups = [budget / x for x in per_seed.values() if x]
    paired = t_interval(speedups) if speedups and len(speedups) == len(per_seed) else \
        {"mean": None, "half": None, "n": len(speedups)}
    return {"gap": gap, "tokens_to_target": reach, "speedup": budget / reach if reach else None,
            "speedup_paired": {**paired, "reached": len(speedups), "of": len(per_seed)}}


def analyse(out: dict[str, Any], gate_nats: float) -> None:
    """Gaps, token ratios and gates, in place (pure: the report can be rebuilt from the JSON)."""
    C = out["contenders"]
    base = C.get(P.BASELINE, {})
    base_runs = {r["seed"]: r["val_loss"] for r in base.get("runs", [])}
    budget = out["budget_tokens"]
    for c, t in C.items():
        # On the seed-mean curve: AdamW's own then reaches its (mean) final loss exactly at the budget.
        vs = _against(t, base, budget)
        t["gap"] = vs["gap"] if c != P.BASELINE else None
        t["tokens_to_target"], t["speedup"] = vs["tokens_to_target"], vs["speedup"]
        t["speedup_paired"] = vs["speedup_paired"] if c != P.BASELINE else None
        # A GWT family is also measured against the optimizer it transforms (GWT-Muon against Muon).
        fb = family_base(c, list(C))
        t["vs_family"] = {"base": fb, **_against(t, C[fb], budget)} if fb and fb != P.BASELINE else None
    _data_to_match(out)
    _default_bars(out)
    fr = out.get("frozen") or {}
    trained = base_runs.get(fr["runs"][0]["seed"]) if fr.get("runs") else None
    # An unfinished side is no verdict yet (a diverged one is: its loss is nan, its status "diverged")
    unfinished = {r["seed"] for r in base.get("runs", []) + fr.get("runs", [])
                  if r.get("status") in _UNFINISHED}
    frozen = fr["runs"][0]["val_loss"] if fr.get("runs") else None
    margin = frozen - trained if P.finite(frozen) and P.finite(trained) else None
    out["gates"] = {
        "a": {c: None if t.get("best_lr") is None or _unfinished(t) or not _tuned(t)
              else not t.get("edge") for c, t in C.items()},
        "b": {"trained": trained, "frozen": frozen, "margin": margin, "need": gate_nats,
              "ran": bool(fr.get("runs")) and fr["runs"][0].get("status") != "missing",
              "waiting": bool(fr.get("runs")) and fr["runs"][0]["seed"] in unfinished,
              "pass": margin is not None and margin >= gate_nats},
    }


def bar_verdict(gap: dict[str, Any], margin: float) -> str | None:
    """A paired Δ against a bar of ``margin`` nats: "failed" when its 95% t-interval lies wholly above the
    bar, "not met" when its mean does, "shown" when the whole interval lies at or below it, else "met"
    (met on the mean, the interval reaching past the bar); None without a finished pair."""
    m, h = gap.get("mean"), gap.get("ci")
    if not P.finite(m):
        return None
    if P.finite(h) and m - h > margin:
        return "failed"
    if m > margin:
        return "not met"
    return "shown" if P.finite(h) and m + h <= margin else "met"


def _default_bars(out: dict[str, Any]) -> None:
    """In place, on each contender that runs beside its own ``detail_clip=none`` variant: the default's bar
    against that variant (Δ ≤ 0) and against AdamW (Δ ≤ DEFAULT_MARGIN), and whether the default stays."""
    C = out["contenders"]
    for c, t in C.items():
        name, opts = P.parse_spec(c)
        paper = next((x for x in C if "detail_clip" not in opts
                      and P.parse_spec(x) == (name, {**opts, "detail_clip": "none"})), None)
        if paper is None:
            continue
        vs_paper = _against(t, C[paper], out["budget_tokens"])["gap"]
        bars = {"paper": bar_verdict(vs_paper, 0.0), "adamw": bar_verdict(t.get("gap") or {}, DEFAULT_MARGIN)}
        stays = None if None in bars.values() else all(v in ("met", "shown") for v in bars.values())
        # an lr still on its grid's edge may be the loser's lr, not its update: no verdict on it
        edge = [x for x in (c, paper) if C[x].get("edge") and _tuned(C[x])]
        t["default"] = {"paper": paper, "vs_paper": vs_paper, "bars": bars, "stays": None if edge else stays,
                        "edge": edge}


def _data_to_match(out: dict[str, Any]) -> None:
    """Each contender's data-to-match ratio, in place: the budget at which AdamW's final loss (its runs at the
    other budgets, and at 1x, on the match seeds) equals the contender's at 1x on the same seeds, over 1x."""
    M = out.get("match") or {}
    seeds = M.get("seeds") or []
    if not M.get("budgets"):
        return
    C, budget = out["contenders"], out["budget_tokens"]

    def mean_on(runs: Sequence[dict[str, Any]]) -> float | None:
        by = {r["seed"]: r.get("val_loss") for r in runs}
        vals = [by.get(s) for s in seeds]
        return P.mean_std(vals)[0] if all(P.finite(v) for v in vals) else None

    points = [(m["tokens"], mean_on(m.get("runs", []))) for m in M["budgets"] if m.get("tokens")]
    points.append((budget, mean_on(C.get(P.BASELINE, {}).get("runs", []))))
    M["points"] = sorted(points)
    for t in C.values():
        tokens, how = budget_to_match(M["points"], mean_on(t.get("runs", [])))
        t["data_to_match"] = {"tokens": tokens, "ratio": tokens / budget if tokens else None, "how": how}


def render(report: dict[str, Any]) -> str:
    """budget.md (``_report.budget_markdown``), with this study's bars and gate (a)'s words."""
    B = report["budget"]
    C = B["contenders"]
    return R.budget_markdown(report, margin=DEFAULT_MARGIN, frozen_lr=FROZEN_LR, code=_code_line(B),
                             gate_words={c: _gate_a_word(ok, C.get(c, {}))
                                         for c, ok in B.get("gates", {}).get("a", {}).items()})


def plot_series(report: dict[str, Any]) -> dict[str, Any]:
    """What ``_report.plot_budget`` draws: each contender's seed-mean validation curve over its finished runs
    and its paired Δ to AdamW along the run, the frozen-matrix runs' curves, AdamW's mean final loss and the
    lowest validation loss of any run."""
    B = report["budget"]
    C = B["contenders"]
    base_runs = C.get(P.BASELINE, {}).get("runs", [])
    lines = []
    for c, t in C.items():
        curve = mean_curve([r for r in t.get("runs", []) if r.get("status") not in _UNFINISHED])
        if curve:
            lines.append({"label": c, "lr": t.get("best_lr"), "curve": curve,
                          "delta": paired_delta_curve(t.get("runs", []), base_runs) if c != P.BASELINE else []})
    base = C.get(P.BASELINE, {})
    return {"lines": lines,
            "frozen": [r["curve"] for r in (B.get("frozen") or {}).get("runs", []) if r.get("curve")],
            "baseline": base["mean"] if P.finite(base.get("mean")) else None,
            "lo": min((y for t in C.values() for r in t.get("runs", []) for _, y in r.get("curve") or []),
                      default=None),
            "title": f"{report['setting']['model']} on {report['setting']['data']}, mean of seeds "
                     f"{B['report_seeds']}"}

def progress_rows(out: Path) -> list[tuple]:
    """Every run under ``out`` with its steps and last validation, finished or cut short: the interim
    record of a grid that spans sessions (runs still in flight included). Each row: (stage, spec, matrix lr,
    seed, steps done, steps, the last validation's record or None, finished)."""
    from gwt_optim.toolkit.metrics import read_jsonl

    rows = []
    for stage, run, cfg in run_folders(out):
        recs = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
        vals = [r for r in recs if "val_loss" in r]
        done = max((int(r["step"]) for r in recs if "step" in r), default=0)
        rows.append((stage, cfg["optimizer"], cfg["lr"], cfg["seed"], done, cfg["steps"],
                     vals[-1] if vals else None, (run / "summary.json").is_file()))
    return rows


def progress_table(out: Path) -> str:
    """``--progress``'s table (``_report.progress_markdown``) of :func:`progress_rows`."""
    return R.progress_markdown(progress_rows(out))


def progress_curves(out: Path, tokens_per_step: int) -> list[tuple[str, dict[str, Any], list[tuple[int, float]]]]:
    """(stage, config, validation curve) of every run under ``out`` that has validated."""
    return [(stage, cfg, points) for stage, run, cfg in run_folders(out) if (points := read_curve(run, tokens_per_step))]


def main(argv: list[str] | None, description: str) -> int:
    start = time.monotonic()
    args = build_parser(description).parse_args(argv)
    out = Path(args.out)
    if args.progress:  # the interim record: a table, and the curves in OUT/progress.png and beside --plot
        print(progress_table(out), end="")
        # Beside the results plot, never over it: --progress runs mid-study, when that plot is the last result.
        beside = [Path(args.plot).with_name("budget-progress.png")] if args.plot else []
        R.plot_progress(progress_curves(out, args.tokens_per_step), [out / "progress.png"] + beside)
        return 0
    driver = Driver("budget", "quality.py --budget", "quality.py", out, args.jobs,
                    threads_for(args.jobs, args.threads), commit=args.commit, report_only=args.report_only)
    try:
        parse_tokens(args.budget)
        grids_of(args)
        if args.extend_edges < 0:
            raise ValueError(f"--extend-edges {args.extend_edges}: how many lrs to add past a winning edge, >= 0")
        gate_seeds_of(args.gate_seeds, P.ints(args.report_seeds))
        weight_decays_of(args.weight_decays, args.weight_decay)
        match_fractions_of(args.match_budgets)
        match_seeds_of(args.match_seeds, P.ints(args.report_seeds))
    except ValueError as exc:
        driver.error(exc)
        return 2
    base = driver.setting({
        "model": args.model, "data": args.data, "tokenizer": "bpe", "vocab_size": args.vocab_size,
        "seq_len": args.seq_len, "val_tokens": args.val_tokens, "warmup": args.warmup,
        "schedule": args.schedule, "decay": args.decay, "decay_shape": args.decay_shape,
        "grad_clip": args.grad_clip, "weight_decay": 0.0, "scale": 1.0,  # weight decay: in the specs (wd_spec)
        "device": args.device, "precision": args.precision, "keep_last": 1})
    if base is None:
        return 2
    data = driver.data(base, prepare_data, lambda exc: f"quality.py --budget: error: cannot prepare --data "
                                                       f"{args.data}: {exc}")
    if data is None:
        return 2
    need = parse_tokens(args.budget) // args.tokens_per_step * args.tokens_per_step
    if need > data["train_tokens"]:
        driver.error(f"{need:,} tokens is more than one epoch of {args.data} ({data['train_tokens']:,})")
        return 2
    args.threads = driver.threads  # each stage's runner reads it
    paths = [out / "loss-vs-tokens.png"] + ([Path(args.plot)] if args.plot else [])

    def draw(report: dict[str, Any]) -> None:
        try:
            R.plot_budget(plot_series(report), paths)
        except Exception as exc:  # noqa: BLE001 - the tables are written
            print(f"plot failed ({type(exc).__name__}: {exc})")

    def done(report: dict[str, Any]) -> int:
        C = report["budget"]["contenders"]
        return 0 if all(t.get("n") == len(t.get("runs", [])) and t.get("runs") for t in C.values()) else 1

    return driver.run(argv, base, before={"train_tokens": data["train_tokens"], "beta2s": P.floats(args.beta2s)},
                      runs=lambda: {"budget": run(args, base, data["train_windows"], start)}, render=render,
                      draw=draw, also=paths[:1], outcome=done)
