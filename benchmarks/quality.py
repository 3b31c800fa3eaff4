"""The quality bar on the demo: every optimizer gets the same learning-rate
grid and the same seeds; the best learning rate of each (lowest mean
validation loss over the seeds) is compared.

    python benchmarks/quality.py                      # the defaults below
    python benchmarks/quality.py --seeds 0,1,2 --lrs 1e-3,3e-3,1e-2 --out runs/quality
    python benchmarks/quality.py --resume             # reuse finished runs

Each (optimizer, lr, seed) is one ``gwt-optim pretrain`` process on the demo
recipe (:data:`gwt_optim.toolkit.recipes.DEMO`), so every run has the same
model, data order, schedule and step count. Each optimizer keeps its paper's
alpha (1 for AdamW, 0.25 for GWT and GaLore); only ``lr`` is tuned, over the
same grid for all. The learning rate is selected on the same validation loss
it is reported on -- optimistic for every optimizer alike.

Prints (and writes to ``OUT/quality.md``, with ``OUT/quality.json``) the
grid, the best-lr table with the measured optimizer-state memory, the
verdicts against the quality bar (GWT-AdamW level 2 within AdamW + 0.03 nats;
better than GaLore at equal or lower state memory), and the versions,
hardware and git commit.
"""

from __future__ import annotations

import argparse
import json
import os
import math
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


def _run(spec: str, lr: float, seed: int, out: Path, resume: bool, overrides: dict, threads: int | None) -> dict:
    run = out / f"seed{seed}" / run_dir_name(0, f"{spec}:lr={lr:g}")[3:]
    config = TrainConfig.from_dict({**DEMO, **overrides, "optimizer": spec, "lr": lr, "seed": seed,
                                    "out": str(run), "progress": False}).to_dict()
    summary = run / "summary.json"
    if resume and summary.is_file() and json.loads((run / "config.json").read_text()) == json.loads(json.dumps(config)):
        return json.loads(summary.read_text())
    run.mkdir(parents=True, exist_ok=True)
    requested = run / "requested_config.json"
    requested.write_text(json.dumps(config, indent=2))
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # a rerun starts afresh
    t0 = time.perf_counter()
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    with open(run / "log.txt", "w") as log:
        rc = subprocess.call([sys.executable, "-m", "gwt_optim", "pretrain", "--config", str(requested)],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        print(f"  {spec} lr={lr:g} seed={seed}: FAILED (exit {rc}, see {run / 'log.txt'})", flush=True)
        return {"optimizer": spec, "lr": lr, "seed": seed, "val_loss": float("nan"), "failed": rc}
    result = json.loads(summary.read_text())
    print(f"  {spec} lr={lr:g} seed={seed}: val_loss {result['val_loss']:.4f} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    return result


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated registry entries")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="the learning-rate grid, the same for every optimizer")
    p.add_argument("--seeds", default="0,1", help="seeds (initial weights and data order)")
    p.add_argument("--steps", type=int, help="override the demo's step count")
    p.add_argument("--out", default="runs/quality")
    p.add_argument("--resume", action="store_true", help="reuse finished runs with identical settings")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each is its own process)")
    p.add_argument("--threads", type=int, help="torch threads per run (default: torch's; with --jobs N on a "
                   "busy machine, 1 avoids oversubscription)")
    args = p.parse_args(argv)

    specs = [s for s in args.optimizers.split(",") if s]
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    overrides = {"steps": args.steps} if args.steps else {}
    out = Path(args.out)
    print(f"{len(specs)} optimizers x {len(lrs)} learning rates x {len(seeds)} seeds = "
          f"{len(specs) * len(lrs) * len(seeds)} runs -> {out}", flush=True)

    # Seed-major: an interrupted benchmark already covers every optimizer and lr.
    jobs = [(spec, lr, seed) for seed in seeds for spec in specs for lr in lrs]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(lambda j: _run(*j, out, args.resume, overrides, args.threads), jobs))
    results: dict[str, dict[float, list[dict]]] = {s: {lr: [] for lr in lrs} for s in specs}
    for (spec, lr, _), summary in zip(jobs, done):
        results[spec][lr].append(summary)

    grid = ["| optimizer | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
            "|---|" + "---:|" * len(lrs)]
    best: dict[str, tuple[float, float, float, list[dict]]] = {}
    for spec in specs:
        cells = []
        for lr in lrs:
            m, s = _mean_std([r["val_loss"] for r in results[spec][lr]])
            cells.append(f"{m:.4f} ± {s:.4f}")
            if spec not in best or m < best[spec][1]:
                best[spec] = (lr, m, s, results[spec][lr])
        grid.append(f"| {spec} | " + " | ".join(cells) + " |")

    base = best.get("adamw")
    table = ["| optimizer | best lr | val loss (mean ± std) | val ppl | Δ vs AdamW (nats) | state MiB | per-seed |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for spec, (lr, m, s, runs) in best.items():
        state = runs[0].get("state_bytes", 0) / 2**20
        delta = f"{m - base[1]:+.4f}" if base else "-"
        seeds_txt = ", ".join(f"{r['val_loss']:.4f}" for r in runs)
        table.append(f"| {spec} | {lr:g} | {m:.4f} ± {s:.4f} | {math.exp(m):.2f} | {delta} | {state:.2f} | "
                     f"{seeds_txt} |")

    verdicts = []
    gwt = next((k for k in best if k.startswith("gwt-adamw") and "level=2" in k), None)
    galore = next((k for k in best if k.startswith("galore")), None)
    if gwt and base:
        gap = best[gwt][1] - base[1]
        verdicts.append(f"- GWT-AdamW level 2 vs AdamW: {gap:+.4f} nats "
                        f"({'meets' if gap <= BAR_NATS else 'MISSES'} the bar of +{BAR_NATS}).")
    if gwt and galore:
        g_state, l_state = (best[k][3][0].get("state_bytes", 0) for k in (gwt, galore))
        better = best[gwt][1] < best[galore][1]
        verdicts.append(
            f"- GWT-AdamW level 2 vs GaLore: {best[gwt][1] - best[galore][1]:+.4f} nats at "
            f"{g_state / 2**20:.2f} vs {l_state / 2**20:.2f} MiB of state "
            f"({'meets' if better and g_state <= l_state else 'MISSES'} the bar: better at equal or lower memory)."
        )

    env = environment(packages=("bitsandbytes", "galore-torch"))
    setting = {**DEMO, **overrides}
    md = "\n".join([
        "# Quality on the demo: same lr grid and seeds for every optimizer",
        "",
        f"Setting: {setting['model']} shape, {setting['data']} corpus, seq {setting['seq_len']}, batch "
        f"{setting['batch_size']}, {setting['steps']} steps, warm-up {setting['warmup']}, cosine to 0.1; "
        f"seeds {seeds}; lr grid {lrs}.",
        "",
        "Validation loss (nats/token), mean ± std over seeds:",
        "",
        *grid,
        "",
        "Best learning rate of each optimizer:",
        "",
        *table,
        "",
        *verdicts,
        "",
        f"Hardware: {env['cpu']} ({env['cpu_count']} cores, {env['torch_threads']} torch threads); "
        f"torch {env['torch']}, transformers {env['transformers']}, commit {env['git_commit']}.",
    ])
    print("\n" + md)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "quality.md", md + "\n")
    atomic_write_json(out / "quality.json", {"environment": env, "setting": setting, "seeds": seeds, "lrs": lrs,
                                             "results": {s: {str(lr): v for lr, v in r.items()}
                                                         for s, r in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
