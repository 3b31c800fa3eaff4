"""The markdown report of ``finetune lm``: the best run per method, then the
whole learning-rate grid."""

from __future__ import annotations

from typing import Sequence

from gwt_optim.toolkit.finetune.common import alpha_phrase, markdown_table, mib

__all__ = ["best_runs", "lm_report"]


def best_runs(results: dict, methods: Sequence[str]) -> dict[str, dict]:
    """Each method's run with the lowest validation perplexity over the learning-rate grid."""
    best = {}
    for r in results["runs"]:
        if r["method"] in methods and (r["method"] not in best or r["val_ppl"] < best[r["method"]]["val_ppl"]):
            best[r["method"]] = r
    return best


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def lm_report(results: dict, methods: Sequence[str]) -> str:
    """Markdown: the best run per method, then the whole learning-rate grid."""
    best = best_runs(results, methods)
    ref = best.get("adamw")
    s, env = results["settings"], results.get("environment", {})
    before = results["val_ppl_before"]
    rows = []
    for m in methods:
        r = best.get(m)
        if r is None:
            continue
        if r is ref:
            vs = state_vs = "ref"
        else:
            vs = f"{100 * (r['val_ppl'] / ref['val_ppl'] - 1):+.2f}%" if ref else "-"
            state_vs = (
                f"{100 * (1 - r['optimizer_state_bytes'] / ref['optimizer_state_bytes']):.0f}% less"
                if ref and ref["optimizer_state_bytes"]
                else "-"
            )
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        name = m + (f" (r={r['lora_r']})" if "lora_r" in r and "r=" not in m.replace("r=auto", "") else "")
        rows.append(
            [
                name,
                f"{r['lr']:g}",
                f"{before:.3f}",
                f"{r['val_ppl']:.3f}",
                vs,
                mib(r["optimizer_state_bytes"]),
                state_vs,
                _count(r["trainable_params"]),
                mib(r["peak_memory_bytes"]),
                tps,
            ]
        )
    kind = next(iter(best.values()))["peak_memory_kind"] if best else "Peak memory"
    header = [
        "Method",
        "best lr",
        "val ppl before",
        "val ppl after",
        "vs AdamW",
        "Optimizer state (MiB)",
        "state vs AdamW",
        "Trainable",
        f"{kind} (MiB)",
        "Tokens/s",
    ]
    lrs = s["lrs"]
    grid_rows = []
    for m in methods:
        by_lr = {r["lr"]: r["val_ppl"] for r in results["runs"] if r["method"] == m}
        grid_rows.append([m, *(f"{by_lr[lr]:.3f}" if lr in by_lr else "-" for lr in lrs)])
    hw = f"{env.get('cpu', '?')}, {env.get('cpu_count', '?')} cores, torch {env.get('torch', '?')}"
    if env.get("gpu"):
        hw = f"{env['gpu']}, torch {env.get('torch', '?')}"
    return (
        f"## Causal-LM fine-tuning: {results['model']}\n\n"
        f"Data `{s['data']}` ({results['data']['format']}), {s['steps']} steps of {s['batch_size']} x {s['seq_len']} "
        f"tokens, cosine schedule with {s['warmup']:g} warm-up, grad-norm clip {s['max_grad_norm']}, "
        f"{alpha_phrase(s.get('scale'))}, fp32{' with TF32 matmuls' if s.get('tf32') else ''}; validation: {results['data']['val_targets']:,} target "
        f"tokens. Learning rate chosen per method from {', '.join(f'{x:g}' for x in lrs)} by validation perplexity. "
        f"Hardware: {hw}; commit {env.get('git_commit') or 'unknown'}.\n\n"
        + markdown_table(header, rows)
        + "\nValidation perplexity for every learning rate:\n\n"
        + markdown_table(["Method", *(f"lr {x:g}" for x in lrs)], grid_rows)
    )
