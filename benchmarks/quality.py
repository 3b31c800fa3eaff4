"""The quality bar on the demo, with the same tuning budget for every optimizer.

    python benchmarks/quality.py                         # the defaults below
    python benchmarks/quality.py --tune-seeds 0 --eval-seeds 1,2 --lrs 1e-3,3e-3,1e-2
    python benchmarks/quality.py --jobs 2 --threads 1 --resume   # a busy 2-core machine; reuse finished runs

The protocol has two steps:

1. Tune: every optimizer trains at every learning rate of the grid (the same
   grid for all) with the tuning seeds. Each optimizer's best lr is the one
   with the lowest mean validation loss.
2. Confirm: each optimizer trains again at its best lr with fresh evaluation
   seeds. The table reports the mean and standard deviation over those seeds
   only, so the tuning's selection bias does not flatter anyone.

Each (optimizer, lr, seed) is one ``gwt-optim pretrain`` process on the demo
recipe (:data:`gwt_optim.toolkit.recipes.DEMO`). Every run has the same model,
data order for its seed, schedule and step count. Each optimizer keeps its
paper's alpha (1 for AdamW, 0.25 for GWT and GaLore). GaLore's rank is a
quarter of the hidden size, which gives it at least GWT level 2's state.

Prints the grid, the confirmed table with the measured optimizer-state memory,
the verdicts against the quality bar, and the versions, hardware and git
commit. All of it also goes to ``OUT/quality.md``, and the raw results to
``OUT/quality.json``. The bar: GWT-AdamW level 2 within AdamW + 0.03 nats, and
better than GaLore at equal or lower state memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gwt_optim.toolkit.compare import run_dir_name  # noqa: E402
from gwt_optim.toolkit.metrics import atomic_write_json, atomic_write_text, environment  # noqa: E402
from gwt_optim.toolkit.recipes import DEMO  # noqa: E402
from gwt_optim.toolkit.train import TrainConfig  # noqa: E402

OPTIMIZERS = ["adamw", "gwt-adamw:level=2:scale=0.25", "galore:rank=32:scale=0.25"]
BAR_NATS = 0.03


class Runner:
    """Runs (optimizer, lr, seed) as ``pretrain`` processes, reusing finished ones."""

    def __init__(self, out: Path, overrides: dict, *, resume: bool, threads: int | None):
        self.out, self.overrides, self.resume, self.threads = out, overrides, resume, threads

    def __call__(self, job: tuple[str, float, int]) -> dict:
        spec, lr, seed = job
        run = self.out / f"seed{seed}" / run_dir_name(0, f"{spec}:lr={lr:g}")[3:]
        config = TrainConfig.from_dict({**DEMO, **self.overrides, "optimizer": spec, "lr": lr, "seed": seed,
                                        "out": str(run), "progress": False}).to_dict()
        summary = run / "summary.json"
        if self.resume and summary.is_file() and self._same(run / "config.json", config):
            return json.loads(summary.read_text())
        run.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # a rerun starts afresh
        requested = run / "requested_config.json"
        requested.write_text(json.dumps(config, indent=2))
        env = {**os.environ, **({"OMP_NUM_THREADS": str(self.threads)} if self.threads else {})}
        t0 = time.perf_counter()
        with open(run / "log.txt", "w") as log:
            rc = subprocess.call([sys.executable, "-m", "gwt_optim", "pretrain", "--config", str(requested)],
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
        if rc != 0:
            print(f"  {spec} lr={lr:g} seed={seed}: FAILED (exit {rc}, see {run / 'log.txt'})", flush=True)
            return {"optimizer": spec, "lr": lr, "seed": seed, "val_loss": float("nan"), "failed": rc}
        result = json.loads(summary.read_text())
        print(f"  {spec} lr={lr:g} seed={seed}: val_loss {result['val_loss']:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        return result

    @staticmethod
    def _same(path: Path, config: dict) -> bool:
        try:
            return json.loads(path.read_text()) == json.loads(json.dumps(config))
        except (OSError, json.JSONDecodeError):  # a run folder left half-written
            return False

    def many(self, jobs: list[tuple[str, float, int]], parallel: int) -> list[dict]:
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            return list(pool.map(self, jobs))


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated registry entries")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="the learning-rate grid, the same for every optimizer")
    p.add_argument("--tune-seeds", default="0", help="seeds of the grid search")
    p.add_argument("--eval-seeds", default="1,2", help="fresh seeds for the best lr of each optimizer")
    p.add_argument("--steps", type=int, help="override the demo's step count")
    p.add_argument("--out", default="runs/quality")
    p.add_argument("--resume", action="store_true", help="reuse finished runs with identical settings")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each its own process")
    p.add_argument("--threads", type=int, help="torch threads per run (default: torch's; on a busy machine "
                   "1 avoids oversubscription)")
    args = p.parse_args(argv)

    specs = [s for s in args.optimizers.split(",") if s]
    lrs = [float(x) for x in args.lrs.split(",")]
    tune_seeds, eval_seeds = _ints(args.tune_seeds), _ints(args.eval_seeds)
    # The demo's tokenizer, named explicitly so reused runs match exactly.
    overrides = {"tokenizer": "bpe", **({"steps": args.steps} if args.steps else {})}
    out = Path(args.out)
    runner = Runner(out, overrides, resume=args.resume, threads=args.threads)

    print(f"tune: {len(specs)} optimizers x {len(lrs)} lrs x seeds {tune_seeds}; confirm: seeds {eval_seeds}",
          flush=True)
    grid_jobs = [(s, lr, seed) for seed in tune_seeds for s in specs for lr in lrs]
    grid = dict(zip(grid_jobs, runner.many(grid_jobs, args.jobs)))
    tuned: dict[str, tuple[float, float]] = {}
    grid_md = ["| optimizer | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|---|" + "---:|" * len(lrs)]
    for s in specs:
        means = {lr: statistics.fmean(grid[(s, lr, seed)]["val_loss"] for seed in tune_seeds) for lr in lrs}
        best_lr = min(lrs, key=lambda lr: means[lr] if math.isfinite(means[lr]) else math.inf)
        tuned[s] = (best_lr, means[best_lr])
        grid_md.append(f"| {s} | " + " | ".join(("**%.4f**" if lr == best_lr else "%.4f") % means[lr] for lr in lrs)
                       + " |")

    confirm_jobs = [(s, tuned[s][0], seed) for seed in eval_seeds for s in specs]
    confirmed = dict(zip(confirm_jobs, runner.many(confirm_jobs, args.jobs)))
    final: dict[str, dict] = {}
    for s in specs:
        runs = [confirmed[(s, tuned[s][0], seed)] for seed in eval_seeds]
        m, sd = _mean_std([r["val_loss"] for r in runs])
        final[s] = {"lr": tuned[s][0], "mean": m, "std": sd, "runs": runs, "state_bytes": runs[0].get("state_bytes")}

    base = final.get("adamw")
    table = ["| optimizer | best lr | val loss (mean ± std) | val ppl | Δ vs AdamW (nats) | state MiB | per seed |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for s, f in final.items():
        delta = f"{f['mean'] - base['mean']:+.4f}" if base else "-"
        per_seed = ", ".join(f"{r['val_loss']:.4f}" for r in f["runs"])
        table.append(f"| {s} | {f['lr']:g} | {f['mean']:.4f} ± {f['std']:.4f} | {math.exp(f['mean']):.2f} | "
                     f"{delta} | {f['state_bytes'] / 2**20:.2f} | {per_seed} |")

    verdicts = []
    gwt = next((k for k in final if k.startswith("gwt-adamw") and "level=2" in k), None)
    galore = next((k for k in final if k.startswith("galore")), None)
    for name in (k for k in final if k.split(":")[0] == "adamw"):  # AdamW, and AdamW with GWT's alpha
        if gwt:
            gap = final[gwt]["mean"] - final[name]["mean"]
            verdicts.append(f"- GWT-AdamW level 2 vs {name}: {gap:+.4f} nats "
                            f"({'meets' if gap <= BAR_NATS else 'MISSES'} the bar of +{BAR_NATS}).")
    if gwt and galore:
        g, l = final[gwt], final[galore]
        ok = g["mean"] < l["mean"] and g["state_bytes"] <= l["state_bytes"]
        verdicts.append(
            f"- GWT-AdamW level 2 vs GaLore: {g['mean'] - l['mean']:+.4f} nats at {g['state_bytes'] / 2**20:.2f} "
            f"vs {l['state_bytes'] / 2**20:.2f} MiB of state ({'meets' if ok else 'MISSES'} the bar: better at "
            "equal or lower memory)."
        )

    env = environment(packages=("bitsandbytes", "galore-torch"))
    setting = {**DEMO, **overrides}
    md = "\n".join([
        "# Quality on the demo: the same lr grid and seeds for every optimizer",
        "",
        f"Setting: `{setting['model']}` shape with a {setting['vocab_size']}-token BPE, the `{setting['data']}` "
        f"corpus, seq {setting['seq_len']}, batch {setting['batch_size']}, {setting['steps']} steps, "
        f"{setting['warmup']:.0%} warm-up then cosine to 10%. lr grid {lrs} on seed(s) {tune_seeds}; the best lr "
        f"of each optimizer confirmed on seeds {eval_seeds}.",
        "",
        f"Tuning: validation loss (nats/token) at each lr, mean over seed(s) {tune_seeds}; best in bold:",
        "",
        *grid_md,
        "",
        f"Confirmed at the best lr, seeds {eval_seeds}:",
        "",
        *table,
        "",
        *verdicts,
        "",
        f"Hardware: {env['cpu']} ({env['cpu_count']} cores); torch {env['torch']}, transformers "
        f"{env['transformers']}, commit {env['git_commit']}.",
    ])
    print("\n" + md)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "quality.md", md + "\n")
    atomic_write_json(out / "quality.json", {
        "environment": env, "setting": setting, "lrs": lrs, "tune_seeds": tune_seeds, "eval_seeds": eval_seeds,
        "grid": [{"optimizer": s, "lr": lr, "seed": seed, "val_loss": r["val_loss"]}
                 for (s, lr, seed), r in grid.items()],
        "final": {s: {k: v for k, v in f.items() if k != "runs"} | {"val_losses": [r["val_loss"] for r in f["runs"]]}
                  for s, f in final.items()},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
