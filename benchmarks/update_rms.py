"""The size of a GWT step against AdamW's, per level: what the transfer rule (alpha = 2^(l/2)) corrects.

    python benchmarks/update_rms.py                     # the synthetic limits (seconds)
    python benchmarks/update_rms.py --real --steps 400   # and real gradients: llama_9m on pysrc under AdamW
    python benchmarks/update_rms.py --horizon            # the synthetic limits along a 2,000-step run (minutes)

Every number is RMS(GWT's step) / RMS(AdamW's step) for the same gradients, at lr 1 and alpha 1 (the step's
direction times its bias correction, before lr): 1.00 means AdamW's learning rate carries over as it is.

*Synthetic limits* (float64, a 64 x 256 matrix, 200 steps, the mean of the last 20): pure noise (a fresh
N(0, 1) gradient each step), a steady signal (one N(0, 1) gradient every step), a signal constant over each
block of 16 columns, and a steady signal of RMS 0.3 under unit noise; no limiter.

*Real gradients* (``--real``): llama_9m trained by AdamW at the budget study's setting (``--data pysrc``,
8,192 tokens per step in sequences of 256, matrix lr 2e-3, embeddings/head/norms 3e-3, gradient clip 1,
10% warm-up then cosine over the 1,953 steps of 16M tokens; ``--steps`` of them). Each attention and MLP
matrix also feeds its gradient to shadow GWT-AdamW states at levels 1-3 (the paper's update, the default
clip 0.5, and the clip at the rule's alpha; limiter 1.01 as in training), which never touch the weights. Per
recorded step: the median over matrices of the ratio, and its range.

The two candidate rules measured first and removed from the library (``match_rms``, ``adamw_units``) have
their rows in docs/results/transfer-cpu.md, from this script at f8761b7.

Prints markdown tables and logs versions, hardware and the commit.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from gwt_optim.groups import adamw_scale
from gwt_optim.optim import functional as F

VARIANTS = {  # name: keyword arguments of functional.gwt_adamw (alpha: a factor, or "rule": 2^(l/2))
    "paper": dict(detail_clip=None),
    "clip 0.5": dict(detail_clip=0.5),
    "clip 0.5, alpha 2^(l/2)": dict(detail_clip=0.5, alpha="rule"),
    # issue 54's candidate C1 at the lr's peak (its clip rises to 0.5 as the lr decays): the details' tails halved
    "clip 0.25, alpha 2^(l/2)": dict(detail_clip=0.25, alpha="rule"),
    # issue 54's candidate C2: the clip bounds the detail step, alpha c lr at every step (detail_clip_units)
    "clip 0.2 in step units, alpha 2^(l/2)": dict(detail_clip=0.2, detail_clip_units="step", alpha="rule"),
    # issue 54's candidate C4: C2 at half the clip
    "clip 0.1 in step units, alpha 2^(l/2)": dict(detail_clip=0.1, detail_clip_units="step", alpha="rule"),
}


class Shadow:
    """One matrix's GWT-AdamW state fed every gradient; ``step`` returns the step's RMS at lr 1."""

    def __init__(self, shape, level, variant, gamma, betas=(0.9, 0.999), eps=1e-8, dtype=torch.float32):
        n = shape[-1]
        approx = (*shape[:-1], -(-n // (1 << level)))
        self.M, self.V = torch.zeros(approx, dtype=dtype), torch.zeros(approx, dtype=dtype)
        self.s = torch.zeros((), dtype=dtype) if gamma else None
        self.W = torch.zeros(shape, dtype=dtype)
        self.kw = {**dict(lr=1.0, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=0.0, level=level, alpha=1.0,
                          gamma=gamma, detail_clip=None), **variant}
        if self.kw["alpha"] == "rule":
            self.kw["alpha"] = adamw_scale(level)
        self.t = 0

    def step(self, G) -> float:
        self.t += 1
        self.W.zero_()
        F.gwt_adamw(self.W, G.to(self.W.dtype), self.M, self.V, self.s, step=self.t, **self.kw)
        return self.W.square().mean().sqrt().item()

    def along(self, S) -> float:
        """The last step's component along the direction ``S`` (descent positive), per entry."""
        return (-(self.W * S).sum() / S.norm()).item() / self.W.numel() ** 0.5


def synthetic(levels=(1, 2, 3, 4), steps=200, seed=0) -> str:
    gen = torch.Generator().manual_seed(seed)
    m, n = 64, 256

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    G0, block = randn(m, n), randn(m, n // 16).repeat_interleave(16, -1)
    limits = {
        "pure noise": lambda t: randn(m, n),
        "steady signal": lambda t: G0,
        "signal constant per 16-block": lambda t: block,
        "signal 0.3 under unit noise": lambda t: 0.3 * G0 + randn(m, n),
    }
    lines = ["| gradients | AdamW step RMS | variant | " + " | ".join(f"l={lv}" for lv in levels) + " |",
             "|---|---:|---|" + "---:|" * len(levels)]
    for name, make in limits.items():
        grads = [make(t) for t in range(steps)]

        def mean_rms(level, variant):
            sh = Shadow((m, n), level, variant, None, dtype=torch.float64)
            rms = [sh.step(G) for G in grads]
            return sum(rms[-20:]) / 20

        adamw = mean_rms(0, {})
        for i, (variant, kw) in enumerate(VARIANTS.items()):
            cells = [f"{mean_rms(lv, kw) / adamw:.2f}" for lv in levels]
            lines.append(f"| {name if i == 0 else ''} | {f'{adamw:.3f}' if i == 0 else ''} | {variant} | "
                         + " | ".join(cells) + " |")
    # Size is not the signal (match_rms matched it and lost): under noise, how much of each step goes along the
    # signal G0, against AdamW's, and how much goes elsewhere.
    lines += ["", "Signal 0.3 under unit noise: the step's component along the signal, then its RMS across it, "
              "each over AdamW's (mean of the last 20 steps):", "",
              "| variant | " + " | ".join(f"l={lv} along / across" for lv in levels) + " |",
              "|---|" + "---:|" * len(levels)]
    grads = [0.3 * G0 + randn(m, n) for _ in range(steps)]

    def split(level, variant):
        sh = Shadow((m, n), level, variant, None, dtype=torch.float64)
        along, across = [], []
        for t, G in enumerate(grads):
            rms = sh.step(G)
            if t >= steps - 20:
                a = sh.along(G0)
                along.append(a)
                across.append(max(rms ** 2 - a ** 2, 0.0) ** 0.5)
        return sum(along) / 20, sum(across) / 20

    base_along, base_across = split(0, {})
    for variant, kw in VARIANTS.items():
        cells = []
        for lv in levels:
            a, x = split(lv, kw)
            cells.append(f"{a / base_along:.2f} / {x / base_across:.2f}")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def horizon(level=2, marks=(20, 200, 600, 1000, 2000), seed=0) -> str:
    """Along / across (signal 0.3 under unit noise) and the pure-noise ratio at the given steps: the shipped
    clip's bound in the step grows as sqrt(1 - beta2^t), which the 200-step limits above do not see."""
    gen = torch.Generator().manual_seed(seed)
    m, n = 32, 256

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    G0 = randn(m, n)
    cases = {"pure noise": [randn(m, n) for _ in range(max(marks))],
             "signal 0.3 under unit noise": [0.3 * G0 + randn(m, n) for _ in range(max(marks))]}

    def trace(grads, lv, variant):
        sh = Shadow((m, n), lv, variant, None, dtype=torch.float64)
        along, across, out = [], [], {}
        for t, G in enumerate(grads, 1):
            rms = sh.step(G)
            a = sh.along(G0)
            along.append(a)
            across.append(max(rms ** 2 - a ** 2, 0.0) ** 0.5)
            if t in marks:
                k = min(t, 20)
                out[t] = (sum(along[-k:]) / k, sum(across[-k:]) / k)
        return out

    lines = [f"Level {level}, over AdamW's on the same gradients (mean of the 20 steps up to each):", "",
             "| gradients | variant | " + " | ".join(f"t={t}" for t in marks) + " |",
             "|---|---|" + "---:|" * len(marks)]
    for name, grads in cases.items():
        base = trace(grads, 0, {})
        for i, (variant, kw) in enumerate(VARIANTS.items()):
            got = trace(grads, level, kw)
            if name == "pure noise":  # nothing to go along: the step's RMS
                cells = [f"{got[t][1] / base[t][1]:.2f}" for t in marks]
            else:
                cells = [f"{got[t][0] / base[t][0]:.2f} / {got[t][1] / base[t][1]:.2f}" for t in marks]
            lines.append(f"| {name + (' (along / across)' if name != 'pure noise' else ' (RMS)') if i == 0 else ''} "
                         f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def real(steps: int, record: list[int], levels=(1, 2, 3), seed=0) -> str:
    from gwt_optim.groups import split_params
    from gwt_optim.toolkit.data import build_data
    from gwt_optim.toolkit.models import build_model
    from gwt_optim.toolkit.schedules import WarmupCosine, warmup_steps

    total, seq_len, tokens_per_step = 1953, 256, 8192
    data = build_data("pysrc", seq_len=seq_len, val_tokens=seq_len, seed=seed, vocab_size=4096)
    torch.manual_seed(seed)
    model = build_model("llama_9m", tokenizer=data.tokenizer, max_seq_len=seq_len)
    split = split_params(model, "paper")
    mats = [(name, p) for name, p in split.transformed if p.ndim >= 2]
    opt = torch.optim.AdamW([{"params": [p for _, p in mats], "lr": 2e-3},
                             {"params": [p for _, p in split.regular], "lr": 3e-3}], weight_decay=0.0)
    schedule = WarmupCosine(total, warmup_steps(0.1, total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    shadows = {(lv, v): [Shadow(p.shape, lv, kw, 1.01) for _, p in mats]
               for lv in levels for v, kw in VARIANTS.items()}
    batch = tokens_per_step // seq_len
    rows = []
    t0 = time.time()
    for step in range(1, steps + 1):
        x = data.train.next(batch)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads = [p.grad.detach().clone() for _, p in mats]
        ratios = {}
        before = [p.detach().clone() for _, p in mats]
        used = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        # AdamW's step at lr 1: its change of the weight over the lr it used (weight decay 0).
        adamw = [((b - p.detach()).square().mean().sqrt() / used).item() for b, (_, p) in zip(before, mats)]
        for key, shs in shadows.items():
            ratios[key] = [sh.step(g) / a for sh, g, a in zip(shs, grads, adamw) if a > 0]
        if step in record:
            for key, rs in ratios.items():
                rs = sorted(rs)
                rows.append((step, key, rs[len(rs) // 2], rs[0], rs[-1], loss.item()))
            print(f"step {step}: loss {loss.item():.3f} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    lines = ["| step | loss | level | variant | median ratio | range over matrices |", "|---:|---:|---:|---|---:|---|"]
    for step, (lv, v), med, lo, hi, loss in rows:
        lines.append(f"| {step} | {loss:.3f} | {lv} | {v} | {med:.2f} | {lo:.2f}-{hi:.2f} |")
    return f"{len(mats)} matrices, {steps} steps of AdamW at the budget setting\n\n" + "\n".join(lines)


def environment() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return (f"commit {commit}, python {platform.python_version()}, torch {torch.__version__}, "
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real", action="store_true", help="also real gradients: llama_9m on pysrc under AdamW")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--record", default="1,10,50,100,200,300,400", help="steps to tabulate")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--horizon", action="store_true",
                    help="only the synthetic limits along a 2,000-step run at level 2 (a few minutes)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.horizon:
        print(f"# GWT's step against AdamW's along a run\n\n{environment()}\n\n{horizon()}\n", flush=True)
        return 0
    print(f"# GWT's step size against AdamW's\n\n{environment()}\n\n## Synthetic limits\n\n{synthetic()}\n",
          flush=True)
    if a.real:
        record = [int(s) for s in a.record.split(",") if int(s) <= a.steps]
        print(f"## Real gradients\n\n{real(a.steps, record)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
