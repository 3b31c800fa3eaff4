"""Optimizer step time and state size on the attention/MLP weights of LLaMA.

Times ``optimizer.step()`` alone (gradients are fixed random tensors) for
GWT-AdamW at levels 1-3 (fast and reference paths), ``torch.optim.AdamW``
fused and foreach, and the peers that are installed (GaLore rank 128 with
projection gap 200, amortized; 8-bit AdamW from bitsandbytes and torchao),
plus the other GWT families against their plain forms. The machines these run
on are noisy, so every optimizer is timed in interleaved rounds and reported as
the median, and as a ratio to fused AdamW measured in the same run.

    python benchmarks/step.py --config 60m            # one config
    python benchmarks/step.py --config 60m,130m --rounds 5
    python benchmarks/step.py --config 60m --threads 2 --warmup 8 --rounds 21 --steps 1 \
        --only "AdamW fused,GWT-AdamW l=2,GWT-AdamW l=2 (paper)"  # the CPU target
    python benchmarks/step.py --device cuda           # on a GPU
    python benchmarks/step.py --device cuda --config 130m,smollm2 \
        --only "AdamW fused,GWT-AdamW l=2 (triton)" --dtype bfloat16

``--config smollm2`` is the 210 attention/MLP matrices of SmolLM2-135M. On
CUDA each step is timed three ways: host time (``perf_counter`` around
``step()`` without a synchronization: the launch and Python overhead),
CUDA-event time of the GPU work alone (the steps are queued behind a
``torch.cuda._sleep`` so that host overhead does not show), and the achieved
bandwidth of that GPU time for the bytes the step must move (AdamW: read W, G,
M, V and write W, M, V; GWT-AdamW at level l: W and G twice, the 2^-l sized
moments six times; see docs/fast-step.md).

Prints a markdown table and the versions, hardware and git commit.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gwt_optim import GWTAdamW  # noqa: E402


# SmolLM2-135M: hidden 576, intermediate 1536, 30 layers, 9 query and 3
# key/value heads of 64: 7 matrices a layer, 210 in all (the tied embedding aside).
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, kv_size=192)


def llama_shapes(config: str) -> list[tuple[int, int]]:
    """(out, in) of every attention and MLP weight of a shipped LLaMA config,
    or of SmolLM2-135M (``smollm2``)."""
    if config == "smollm2":
        h, i, kv = SMOLLM2_135M["hidden_size"], SMOLLM2_135M["intermediate_size"], SMOLLM2_135M["kv_size"]
        return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)] * SMOLLM2_135M["num_hidden_layers"]
    path = ROOT / "src" / "gwt_optim" / "configs" / f"llama_{config}.json"
    cfg = json.loads(path.read_text())
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    per_layer = [(h, h)] * 4 + [(i, h), (i, h), (h, i)]
    return per_layer * layers


def state_bytes(opt: torch.optim.Optimizer) -> int:
    try:
        from gwt_optim.memory import optimizer_state_bytes

        return optimizer_state_bytes(opt)
    except ImportError:
        total = 0
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total


@dataclass
class Case:
    label: str
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    baseline: str = "AdamW fused"  # ratio against this case
    amortize_gap: int = 0  # GaLore: the first step recomputes the projection
    level: int | None = None  # GWT-AdamW's level (for the bytes a step moves); -1: AdamW


def _cases(device: str) -> list[Case]:
    cases = [
        Case("AdamW fused", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), level=-1),
        Case("AdamW foreach", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True), level=-1),
    ]
    for level in (1, 2, 3):
        cases.append(Case(f"GWT-AdamW l={level}", lambda p, lv=level: GWTAdamW(p, lr=1e-3, level=lv), level=level))
    if device.startswith("cuda"):
        # The default on CUDA when triton imports; named, so that a fallback shows as an error.
        for level in (1, 2, 3):
            cases.append(Case(f"GWT-AdamW l={level} (triton)",
                              lambda p, lv=level: GWTAdamW(p, lr=1e-3, level=lv, backend="triton"), level=level))
    # The default above uses the fused kernels (native C on CPU, Triton on CUDA);
    # "(eager)" is the same closed form as plain tensor operations.
    cases.append(Case("GWT-AdamW l=2 (eager)", lambda p: GWTAdamW(p, lr=1e-3, level=2, backend="eager"), level=2))
    # The paper's update: the default's detail clip off (a lighter phase 2).
    cases.append(Case("GWT-AdamW l=2 (paper)", lambda p: GWTAdamW(p, lr=1e-3, level=2, detail_clip=None), level=2))
    for level in (1, 2, 3):
        cases.append(
            Case(f"GWT-AdamW l={level} (reference)", lambda p, lv=level: GWTAdamW(p, lr=1e-3, level=lv, impl="reference"))
        )
    try:
        from galore_torch import GaLoreAdamW

        cases.append(
            Case(
                "GaLore r=128 (amortized, gap 200)",
                lambda p: GaLoreAdamW(
                    [{"params": p, "rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}], lr=1e-3
                ),
                amortize_gap=200,
            )
        )
    except ImportError:
        pass
    try:
        import bitsandbytes as bnb

        cases.append(Case("8-bit AdamW (bitsandbytes)", lambda p: bnb.optim.AdamW8bit(p, lr=1e-3, min_8bit_size=0)))
    except ImportError:
        pass
    try:
        from torchao.optim import AdamW8bit

        cases.append(Case("8-bit AdamW (torchao)", lambda p: AdamW8bit(p, lr=1e-3)))
    except ImportError:
        pass
    cases += _family_cases(device)
    return cases


def _family_cases(device: str) -> list[Case]:
    """The other GWT families at levels 1-3 against their plain (level 0) forms."""
    try:
        from gwt_optim.optim import GWTAdafactor, GWTAdamMini, GWTMuon
    except ImportError:
        return []
    # torch's Muon runs Newton-Schulz in bf16, 7-8x slower than fp32 on CPUs
    # (benchmarks/newton_schulz.py); compare like with like on each device.
    ns = "bfloat16" if device.startswith("cuda") else "float32"
    plain = {"level": 0, "scale": 1.0, "norm_growth_limit": None}
    out = [
        Case("Muon l=0", lambda p: GWTMuon(p, lr=1e-3, ns_dtype=ns, **plain)),
        Case("Adam-mini l=0", lambda p: GWTAdamMini(p, lr=1e-3, **plain)),
        Case("Adafactor (torch)", lambda p: torch.optim.Adafactor(p, lr=1e-3)),
    ]
    if device.startswith("cuda"):
        out.append(Case("Muon (torch)", lambda p: torch.optim.Muon(p, lr=1e-3), baseline="Muon l=0"))
    for lv in (1, 2, 3):
        out += [
            Case(f"GWT-Muon l={lv}", lambda p, lv=lv: GWTMuon(p, lr=1e-3, level=lv, ns_dtype=ns), baseline="Muon l=0"),
            Case(f"GWT-Adam-mini l={lv}", lambda p, lv=lv: GWTAdamMini(p, lr=1e-3, level=lv), baseline="Adam-mini l=0"),
            Case(f"GWT-Adafactor l={lv}", lambda p, lv=lv: GWTAdafactor(p, lr=1e-3, level=lv),
                 baseline="Adafactor (torch)"),
        ]
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_bytes(case: Case, shapes: list[tuple[int, int]], dtype: torch.dtype) -> float | None:
    """The bytes one step must move to and from memory (AdamW's moments in the
    parameter dtype, GWT-AdamW's in fp32)."""
    if case.level is None:
        return None
    w = torch.empty((), dtype=dtype).element_size()
    total = 0
    for rows, n in shapes:
        if case.level < 0:  # AdamW: read W, G, M, V; write W, M, V
            total += rows * n * 7 * w
        else:  # W, G twice (G read in both phases); M, V read in phase 1, read and written in phase 2
            b = 1 << case.level
            total += rows * n * 4 * w + rows * -(-n // b) * 6 * 4
    return float(total)


def _time_cuda(opt: torch.optim.Optimizer, steps: int, host_estimate: float) -> tuple[float, float]:
    """(host seconds per step, GPU seconds per step) of ``steps`` steps.

    The GPU first sleeps for longer than the host needs to queue all the
    steps, so the events time the queued GPU work alone, not the host.
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    # about 1.5 GHz on recent GPUs; generous, the sleep only has to outlast the host
    torch.cuda._sleep(int(min(2.0, max(0.01, 2 * host_estimate * steps)) * 1.5e9))
    start.record()
    host = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        host += time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return host / steps, start.elapsed_time(end) / 1e3 / steps


def run(config: str, device: str, rounds: int, steps: int, only: str | None, dtype: torch.dtype = torch.float32,
        warmup: int = 2) -> list[dict]:
    shapes = llama_shapes(config)
    n_params = sum(a * b for a, b in shapes)
    cases = _cases(device)
    if only:
        # A name that is a label picks that label alone; any other is a substring.
        labels = {c.label for c in cases}
        wanted = [w.strip() for w in only.split(",")]
        cases = [c for c in cases if any(c.label == w if w in labels else w in c.label for w in wanted)]
    gen = torch.Generator(device="cpu").manual_seed(0)
    cuda = device.startswith("cuda")
    setups = {}
    for case in cases:
        params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device=device, dtype=dtype)) for s in shapes]
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(device=device, dtype=dtype)
        try:
            opt = case.make(params)
            # The first step creates state (GaLore computes its first
            # projection); the last is what the GPU's sleep in _time_cuda must outlast.
            warmup_s = []
            for _ in range(max(2, warmup)):
                t0 = time.perf_counter()
                opt.step()
                _sync(device)
                warmup_s.append(time.perf_counter() - t0)
        except Exception as exc:  # a peer that cannot run here (no CUDA kernel, ...)
            print(f"skip {case.label}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        setups[case.label] = (case, params, opt, warmup_s[0], warmup_s)

    times: dict[str, list[float]] = {k: [] for k in setups}
    host: dict[str, list[float]] = {k: [] for k in setups}
    for _ in range(rounds):
        for label, (case, params, opt, first, warmup_s) in setups.items():
            if cuda:
                h, g = _time_cuda(opt, steps, warmup_s[-1])
                host[label].append(h)
                times[label].append(g)
                continue
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.step()
            _sync(device)
            times[label].append((time.perf_counter() - t0) / steps)

    rows = []
    for label, (case, params, opt, first, warmup_s) in setups.items():
        ms = statistics.median(times[label]) * 1e3
        if case.amortize_gap:
            ms = (first * 1e3 + (case.amortize_gap - 1) * ms) / case.amortize_gap
        nbytes = step_bytes(case, shapes, dtype)
        backends = sorted(getattr(getattr(opt, "_kernels", None), "_backends", {}) or ())
        rows.append({"config": config, "optimizer": label, "ms": ms, "baseline": case.baseline,
                     "state_bytes": state_bytes(opt), "n_params": n_params, "dtype": str(dtype).replace("torch.", ""),
                     "host_ms": statistics.median(host[label]) * 1e3 if host[label] else math.nan,
                     "gbps": nbytes / (ms / 1e3) / 1e9 if nbytes else math.nan,
                     "first_step_s": first, "warmup_ms": [t * 1e3 for t in warmup_s],
                     "backends": backends, "n_tensors": len(shapes)})
    by_label = {r["optimizer"]: r for r in rows}
    for r in rows:
        base = by_label.get(r["baseline"])
        r["ratio"] = r["ms"] / base["ms"] if base else math.nan
        r["bytes_per_param"] = r["state_bytes"] / r["n_params"]
    return rows


def environment() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        commit += "+dirty" if dirty else ""
    except OSError:
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return (
        f"torch {torch.__version__}, python {platform.python_version()}, CPU {cpu} "
        f"({torch.get_num_threads()} threads), GPU {gpu}, commit {commit}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="60m,130m", help="comma-separated LLaMA configs (default 60m,130m)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median is reported)")
    ap.add_argument("--steps", type=int, default=2, help="steps per optimizer per round")
    ap.add_argument("--only", default=None, help="comma-separated substrings of optimizer labels to run")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter and gradient dtype")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer before the rounds (at least 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cuda = args.device.startswith("cuda")

    all_rows = []
    print(f"<!-- {environment()} -->")
    if cuda:
        print("| config | dtype | optimizer | GPU ms/step | ratio | host ms/step | GB/s | state MB | backends |")
        print("|---|---|---|---:|---:|---:|---:|---:|---|")
    else:
        print("| config | dtype | optimizer | ms/step | ratio | state MB | state bytes/param | warm-up steps (ms) |")
        print("|---|---|---|---:|---:|---:|---:|---|")
    for config in args.config.split(","):
        rows = run(config, args.device, args.rounds, args.steps, args.only, dtype, args.warmup)
        for r in rows:
            if math.isnan(r["ratio"]):
                ratio = "-"  # its baseline was not run (--only)
            else:
                ratio = f"{r['ratio']:.2f}x {'' if r['baseline'] == 'AdamW fused' else '(vs ' + r['baseline'] + ')'}"
            if cuda:
                gbps = "-" if math.isnan(r["gbps"]) else f"{r['gbps']:.0f}"
                print(
                    f"| {config} ({r['n_tensors']} tensors) | {r['dtype']} | {r['optimizer']} | {r['ms']:.3f} | "
                    f"{ratio.strip()} | {r['host_ms']:.3f} | {gbps} | {r['state_bytes'] / 2**20:.1f} | "
                    f"{'+'.join(r['backends']) or '-'} |",
                    flush=True,
                )
            else:
                warm = " ".join(f"{t:.0f}" for t in r["warmup_ms"])
                print(
                    f"| {config} | {r['dtype']} | {r['optimizer']} | {r['ms']:.1f} | {ratio.strip()} | "
                    f"{r['state_bytes'] / 2**20:.1f} | {r['bytes_per_param']:.2f} | {warm} |",
                    flush=True,
                )
        all_rows += rows
    print(f"\n{environment()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": environment(), "rows": all_rows}, indent=2))


if __name__ == "__main__":
    main()
