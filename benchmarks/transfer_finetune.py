"""The fine-tuning part of the transfer study (docs/results/transfer-cpu.md, section 4): does GWT take AdamW's
fine-tuning lr? Reads ``gwt-optim finetune lm`` results (``results.json``, any number of calls: seeds and lr
grids may be split across them) and prints, as markdown, each method's validation perplexity per (seed, lr),
then per seed AdamW's best lr, GWT at that lr and GWT at its own best, with the paired differences in nats
(log perplexity) and their 95% t intervals: each method's lr is its best on the tuning seed's grid, and the
other seeds report at those lrs.

    gwt-optim finetune lm --methods adamw,gwt-adamw:level=2 --lrs 1e-5,3e-5,1e-4,3e-4,1e-3 --steps 30 \\
        --warmup 0.3 --seed 0 --out runs/ft-s0          # --scale left out: each method at the recipe's alpha
    gwt-optim finetune lm --methods adamw,gwt-adamw:level=2 --lrs 1e-4,3e-4 --steps 30 --warmup 0.3 --seed 1 \\
        --out runs/ft-s1                                # a reporting seed, at the lrs seed 0 picked
    python benchmarks/transfer_finetune.py runs/ft-s0/results.json runs/ft-s1/results.json ...

Only results.json is read: nothing trains here.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import t975  # noqa: E402

BASELINE = "adamw"


def load(paths: list[Path]) -> tuple[dict, list[dict]]:
    """{(method, seed, lr): val_ppl} over every file, and each file's settings and environment."""
    ppl: dict[tuple[str, int, float], float] = {}
    meta = []
    for path in paths:
        d = json.loads(path.read_text())
        s = d["settings"]
        meta.append({"file": str(path), "settings": s, "environment": d.get("environment", {}),
                     "model": d.get("model"), "before": d.get("val_ppl_before")})
        for r in d["runs"]:
            ppl[(r["method"], int(s["seed"]), float(r["lr"]))] = float(r["val_ppl"])
    return ppl, meta


def interval(xs: list[float]) -> str:
    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{m:+.4f} (n=1)"
    h = t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return f"{m:+.4f} ± {h:.4f} ({m - h:+.4f} to {m + h:+.4f}, n={len(xs)})"


def report(ppl: dict, meta: list[dict], tune_seed: int = 0) -> str:
    methods = sorted({m for m, _, _ in ppl}, key=lambda m: (m != BASELINE, m))
    seeds = sorted({s for _, s, _ in ppl})
    lrs = sorted({lr for _, _, lr in ppl})
    out = ["# Fine-tuning at AdamW's lr (issue 46)", ""]
    s0, env = meta[0]["settings"], meta[0]["environment"]
    alphas = sorted({m["settings"].get("scale") for m in meta}, key=str)
    out.append(f"{meta[0]['model']}; data `{s0['data']}`, {s0['steps']} steps of {s0['batch_size']} x "
               f"{s0['seq_len']} tokens, warm-up {s0['warmup']:g}, weight decay {s0['weight_decay']:g}; --scale per "
               f"call: {', '.join('the recipe' if a is None else f'{a:g}' for a in alphas)} (AdamW at 1, GWT at "
               f"2^(l/2)). {env.get('cpu', '?')}, {env.get('cpu_count', '?')} cores, torch {env.get('torch', '?')}, "
               f"gwt-optim commit {env.get('git_commit', '?')}; validation perplexity before training "
               f"{meta[0]['before']:.3f}.")
    out += ["", "| method | seed | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
            "|---|---:|" + "---:|" * len(lrs)]
    for m in methods:
        for s in seeds:
            cells = [f"{ppl[(m, s, lr)]:.3f}" if (m, s, lr) in ppl else "" for lr in lrs]
            if any(cells):
                out.append(f"| {m} | {s} | " + " | ".join(cells) + " |")
    def best(m: str, s: int) -> float | None:
        grid = {lr: v for (mm, ss, lr), v in ppl.items() if mm == m and ss == s}
        return min(grid, key=grid.get) if grid else None

    def edge(m: str, s: int, lr: float) -> str:
        grid = [x for (mm, ss, x) in ppl if mm == m and ss == s]
        return " (on the grid's edge)" if lr in (min(grid), max(grid)) else ""

    a_star = best(BASELINE, tune_seed)
    for m in methods:
        if m == BASELINE or a_star is None:
            continue
        g_star = best(m, tune_seed)
        if g_star is None:
            continue
        out += ["", f"## {m} against AdamW", "",
                f"Tuned on seed {tune_seed}: AdamW's best lr {a_star:g}{edge(BASELINE, tune_seed, a_star)}, "
                f"{m}'s {g_star:g}{edge(m, tune_seed, g_star)}. On each reporting seed, in nats (the log of the "
                "perplexity ratio):", "",
                f"| seed | AdamW at {a_star:g} | GWT at {a_star:g} | GWT at {g_star:g} | GWT at AdamW's lr − AdamW | "
                "GWT at AdamW's lr − GWT at its own |", "|---:|---:|---:|---:|---:|---:|"]
        vs_adamw, vs_own = [], []
        for s in seeds:
            keys = [(BASELINE, s, a_star), (m, s, a_star), (m, s, g_star)]
            if s == tune_seed or not all(k in ppl for k in keys):
                continue
            a, g, g_own = (ppl[k] for k in keys)
            vs_adamw.append(math.log(g / a))
            vs_own.append(math.log(g / g_own))
            out.append(f"| {s} | {a:.3f} | {g:.3f} | {g_own:.3f} | {vs_adamw[-1]:+.4f} | {vs_own[-1]:+.4f} |")
        if vs_adamw:
            out += ["", f"GWT at AdamW's lr − AdamW: {interval(vs_adamw)}; GWT at AdamW's lr − GWT at its own best "
                    f"lr: {interval(vs_own)}."]
    out += ["", "Files: " + ", ".join(f"`{m['file']}`" for m in meta)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="results.json of gwt-optim finetune lm calls")
    ap.add_argument("--tune-seed", type=int, default=0, help="the seed whose grid picks each method's lr (0); "
                    "the others report at those lrs")
    a = ap.parse_args(argv)
    missing = [p for p in a.results if not p.is_file()]
    if missing:
        print(f"transfer_finetune.py: error: no such file: {missing[0]}", file=sys.stderr)
        return 2
    ppl, meta = load(a.results)
    print(report(ppl, meta, a.tune_seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
