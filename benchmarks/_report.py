"""The studies' reports: markdown tables and plots from the figures the studies return.

The demo protocol (``_protocol.py``: ``protocol_markdown``, ``verdicts``, ``plot_regime``) and the budget
study (``_budget.py``: ``budget_markdown``, ``plot_budget``, ``progress_markdown``, ``plot_progress``) decide
what was measured; this module only lays it out, so that a report regenerates from its JSON without
training. It imports neither study: they hand its functions to the study driver (``_study.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from _study import BASELINE, finite, fmt_lr

from gwt_optim.registry import format_spec
from gwt_optim.registry import split_spec as parse_spec

BAR_NATS = 0.03  # the demo protocol's bar: GWT-AdamW level 2 within AdamW + 0.03 nats


# --------------------------------------------------------------------------- #
# The demo protocol (quality.md, regime.md)
# --------------------------------------------------------------------------- #


def schedule_phrase(setting: dict[str, Any]) -> str:
    from gwt_optim.toolkit.schedules import describe

    return describe(setting.get("schedule", "cosine"), setting.get("warmup"),
                    min_ratio=setting.get("min_lr_ratio", 0.1), decay=setting.get("decay", 0.2),
                    decay_shape=setting.get("decay_shape", "1-sqrt"))


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


def protocol_markdown(report: dict[str, Any], title: str) -> str:
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


# --------------------------------------------------------------------------- #
# The budget study (budget.md and its plots)
# --------------------------------------------------------------------------- #


def _reach_cells(reach: float | None, speedup: float | None, measured: bool) -> tuple[str, str]:
    """The tokens-to-target and speedup cells; a measured contender that never got there is "< 1x"."""
    return (f"{reach / 1e6:.2f}M" if finite(reach) else ("not reached" if measured else "-"),
            f"{speedup:.2f}x" if finite(speedup) else ("< 1x" if measured else "-"))


def _delta_cell(gap: dict[str, Any]) -> str:
    """The paired gap as mean ± half-width of its 95% t-interval (± std where n < 2)."""
    if not finite(gap.get("mean")):
        return "—"
    if finite(gap.get("ci")):
        return f"{gap['mean']:+.4f} ± {gap['ci']:.4f} (n={gap['n']})"
    return f"{gap['mean']:+.4f} (n={gap['n']})"


def _speedup_cell(sp: dict[str, Any] | None) -> str:
    """Per-seed speedups (budget over the tokens to the baseline's loss on the same seed): mean ± 95% t."""
    if not sp or not sp.get("of"):
        return "-"
    if sp.get("reached") != sp.get("of"):
        return f"reached on {sp.get('reached')} of {sp.get('of')} seeds"
    if finite(sp.get("half")):
        return f"{sp['mean']:.2f}× ± {sp['half']:.2f}"
    return f"{sp['mean']:.2f}×"


def _wd_phrase(base: float, wds: list[float] | None) -> str:
    """The header's weight decay: one value, or the axis it was tuned on (a run's own is in its row)."""
    if not wds or len(wds) < 2:
        return f"weight decay {base:g}"
    return f"weight decay {base:g} on the lr grid, then tuned on {', '.join(f'{w:g}' for w in wds)} at the best lr"


def budget_markdown(report: dict[str, Any], *, margin: float, frozen_lr: float, gate_words: dict[str, str],
                    code: str) -> str:
    """budget.md from the report (``_budget.render``): ``margin``, the default's bar against AdamW;
    ``frozen_lr``, gate (b)'s matrix lr; ``gate_words``, gate (a)'s word for each contender; ``code``, the
    line of the commits the runs started from."""
    s, B = report["setting"], report["budget"]
    C = B["contenders"]
    env = report.get("run_environment") or report.get("environment", {})
    f = _f
    lines = ["# Quality at a real budget", "",
             f"`{s['model']}` on `--data {s['data']}` ({report['train_tokens']:,} training tokens, "
             f"{s['vocab_size']}-token BPE, sequences of {s['seq_len']}), {B['tokens_per_step']:,} tokens per "
             f"step; budget **{B['budget_tokens']:,} tokens ({B['steps']} steps)**, tuning runs "
             f"{B['tune_steps']} steps. {schedule_phrase(s)}, gradient clip "
             f"{s['grad_clip']}, {_wd_phrase(s['weight_decay'], B.get('weight_decays'))}, precision "
             f"{s['precision']}, device {s['device']}. Matrix-only fairness: embeddings, head, norms and biases on AdamW at lr "
             f"{B['regular_lr']:g} for everyone; the attention and MLP matrices at each contender's matrix lr "
             f"(alpha 1). AdamW's beta2 tuned on {report['beta2s']} (best: {B.get('adamw_best_beta2')}); every "
             f"other contender runs at beta2 = {B.get('beta2')}"
             + (" (fixed beforehand, **not AdamW's best**)" if B.get("beta2") != B.get("adamw_best_beta2") else "")
             + f". Tuning seeds {B['tune_seeds']}, reporting seeds {B['report_seeds']}.",
             "", "## Tuning (validation loss at the end of a tuning run; best in bold)", ""]
    for c, t in C.items():
        lrs = t.get("lrs") or B["grids"].get(c, [])
        lines += [f"| {c} | " + " | ".join(f"lr {fmt_lr(x)}" for x in lrs) + " |",
                  "|---|" + "---:|" * len(lrs)]
        for b2, row in (t.get("grid") or {}).items():
            cells = []
            for lr in lrs:
                v = row.get(fmt_lr(lr))
                st = [x for x in (t.get("status") or {}).get(f"{b2}:{fmt_lr(lr)}", []) if x != "ok"]
                best = lr == t.get("best_lr") and float(b2) == t.get("best_beta2")
                cells.append(_bold(f(v), best) if finite(v) else (st[0] if st else "-"))
            lines.append(f"| beta2 {b2} | " + " | ".join(cells) + " |")
        if len(t.get("wd_grid") or {}) > 1:
            wd_cells = [_bold(f(v), float(k) == t.get("best_wd")) if finite(v) else "-"
                        for k, v in t["wd_grid"].items()]
            lines += ["", f"weight decay at lr {fmt_lr(t['best_lr'])}: " + ", ".join(
                f"{k}: {c}" for k, c in zip(t["wd_grid"], wd_cells))]
        if t.get("extended"):
            lines += ["", f"lr grid extended {t['extended']} time(s) beyond the edge its best sat on (--extend-edges)"]
        if pr := t.get("prior"):
            at = f"lr {fmt_lr(pr['lr'])}, weight decay {pr['wd']:g}"
            lines += ["", f"Reporting runs started first at an earlier tuning's best ({at}, `--prior-best`): " + (
                "the tuning here agrees." if pr["complete"] and pr["agrees"] else
                "**the tuning here chose another best: the report uses it.**" if pr["complete"] else
                "the tuning here has not finished, so it is **reported at that prior best**.")]
        lines.append("")
    lines += ["## At the budget (reporting seeds)", "",
              "| optimizer | matrix lr | weight decay | val loss (mean ± std) | Δ vs AdamW (paired, ± 95% t) | "
              "tokens to AdamW's loss (seed mean) | speedup (seed mean) | speedup per seed (± 95% t) | state MiB | "
              "per seed |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    target_mean = C.get(BASELINE, {}).get("mean")
    for c, t in C.items():
        runs = t.get("runs", [])
        loss = f"{t['mean']:.4f} ± {t['std']:.4f}" if finite(t.get("mean")) else "not run"
        if finite(t.get("mean")) and t.get("n") != len(runs):
            loss += f" (n={t['n']})"
        delta = _delta_cell(t.get("gap") or {})
        reach = t.get("tokens_to_target")
        reach_s, speed = _reach_cells(reach, t.get("speedup"), t.get("n", 0) > 0 and finite(target_mean))
        state = f(t["state_bytes"] / 2**20, "{:.2f}") if t.get("state_bytes") else "-"
        per_seed = ", ".join(f"{r['seed']}: {f(r.get('val_loss'))}" for r in runs)
        named = parse_spec(c)[1].get("weight_decay")  # a label may name its own (the transfer study's stage 5)
        wd = t.get("best_wd", float(named) if named is not None else s.get("weight_decay"))
        lines.append(f"| {c} | {f(t.get('best_lr'), '{:g}')} | {f(wd, '{:g}')} | {loss} | {delta} | {reach_s} | "
                     f"{speed} | {_speedup_cell(t.get('speedup_paired'))} | {state} | {per_seed} |")
    pairs = [(c, t["vs_family"]) for c, t in C.items() if t.get("vs_family")]
    if pairs:
        lines += ["", "## Each GWT family against the optimizer it transforms (reporting seeds)", "",
                  "| optimizer | against | Δ (paired, ± 95% t) | tokens to its loss (seed mean) | speedup | "
                  "speedup per seed (± 95% t) |", "|---|---|---:|---:|---:|---:|"]
        for c, v in pairs:
            gap, reach, speedup = v["gap"], v["tokens_to_target"], v["speedup"]
            reach_s, speed = _reach_cells(reach, speedup, bool(C[c].get("n")) and finite(C[v["base"]].get("mean")))
            lines.append(f"| {c} | {v['base']} | {_delta_cell(gap)} | {reach_s} | {speed} | "
                         f"{_speedup_cell(v.get('speedup_paired'))} |")
    M = B.get("match") or {}
    if M.get("points"):
        lines += ["", f"## Data to match: the budget at which AdamW's final loss equals each contender's (seeds "
                  f"{M.get('seeds')})", "",
                  "AdamW at its best (lr, beta2, wd), each budget on its own schedule: " + ", ".join(
                      f"{x / 1e6:.2f}M tokens: {f(l)}" for x, l in M["points"]) + ".", "",
                  "| optimizer | AdamW's budget to match | ratio to the budget | how |", "|---|---:|---:|---|"]
        for c, t in C.items():
            d = t.get("data_to_match") or {}
            lines.append(f"| {c} | " + (f"{d['tokens'] / 1e6:.2f}M | {d['ratio']:.2f}× | {d['how']} |"
                                        if d.get("tokens") else "- | - | - |"))
    defaults = [(c, t["default"]) for c, t in C.items() if t.get("default")]
    if defaults:
        lines += ["", "## The default (`detail_clip=0.5`) against its bar (reporting seeds)", "",
                  f"It stays only if at the budget it is no worse than the paper's update (Δ ≤ 0) and no worse than "
                  f"tuned AdamW + {margin} nats: on the mean, and not significantly (the paired Δ's 95% "
                  f"t-interval does not lie wholly above the bar). \"shown\": the whole interval lies at or below it.",
                  "", "| default | against | Δ (paired, ± 95% t) | bar | verdict |", "|---|---|---:|---:|---|"]
        for c, d in defaults:
            lines += [f"| {c} | {d['paper']} | {_delta_cell(d['vs_paper'])} | ≤ 0 | {d['bars']['paper'] or '-'} |",
                      f"| {c} | {BASELINE} | {_delta_cell(C[c].get('gap') or {})} | ≤ +{margin} | "
                      f"{d['bars']['adamw'] or '-'} |"]
            verdict = {True: "**the default stays**", False: "**the bar is not met: re-decide the default**",
                       None: f"not decided: the best lr of {' and '.join(d['edge'])} is on its grid's edge"
                       if d.get("edge") else "not decided yet (runs missing)"}[d["stays"]]
            lines += ["", f"{c}: {verdict}."]
    g = B.get("gates", {})
    ga, gb = g.get("a", {}), g.get("b", {})
    lines += ["", "## Sanity gates", "",
              "(a) best lr inside its grid: " + (", ".join(f"{c} {gate_words[c]}" for c in ga) or "-"),
              f"(b) AdamW's trained matrices beat frozen ones (matrix lr {frozen_lr:g}) by ≥ {gb.get('need')} nats: "
              f"trained {f(gb.get('trained'))}, frozen {f(gb.get('frozen'))}, margin {f(gb.get('margin'))} — "
              + ("pass" if gb.get("pass") else "not decided yet (a run has not finished)" if gb.get("waiting")
                 else "**FAIL**" if gb.get("ran") else "not run yet"),
              "", "A contender that fails gate (a) is reported as failing, not as a result: its grid needs "
              "extending.", "", code, "",
              f"Runs: {B.get('counts')}; wall {report.get('wall_s', 0):.0f} s, {report['jobs']} job(s) x "
              f"{report['threads']} thread(s). Environment: {env.get('gpu') or env.get('cpu')} "
              f"({env.get('cpu_count')} cores), python {env.get('python')}, torch {env.get('torch')}, gwt-optim "
              f"{env.get('gwt_optim')}, commit {env.get('git_commit')}.", f"Command: `{report['command']}`"]
    return "\n".join(lines) + "\n"


def _axes(width: float = 7, panels: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, panels, figsize=(width, 4.5))
    return plt, fig, ax


def _save(plt, fig, ax, *, lo: float | None, span: float, title: str, legend_size: int, paths: Sequence[Path],
          legend_outside: bool = False):
    """Loss against tokens, the y range from the lowest loss up ``span`` nats, written to every path."""
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("validation loss")
    if lo is not None:
        ax.set_ylim(lo - 0.05, lo + span)
    ax.set_title(title)
    if legend_outside:  # a whole study's runs: a legend inside would cover the curves
        ncol = 1 + len(ax.get_legend_handles_labels()[1]) // 24
        ax.legend(fontsize=legend_size, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, ncol=ncol)
    else:
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110, bbox_inches="tight" if legend_outside else None)
    plt.close(fig)


def plot_budget(series: dict[str, Any], paths: Sequence[Path]) -> None:
    """Left: each contender's seed-mean validation curve. Right: its paired Δ to AdamW along the run, the
    mean over seeds with its 95% t band (end-of-run gaps of hundredths of a nat are invisible on the left).
    ``series``: ``_budget.plot_series``."""
    plt, fig, (ax, dax) = _axes(13, panels=2)
    late: list[float] = []  # |Δ| + band over each run's second half, where the ranking settles
    for s in series["lines"]:
        c, curve, delta = s["label"], s["curve"], s["delta"]
        line, = ax.plot([x / 1e6 for x, _ in curve], [y for _, y in curve], label=f"{c} (lr {s['lr']:g})")
        if not delta:
            continue
        xs, m = [x / 1e6 for x, _ in delta], [d["mean"] for _, d in delta]
        h = [d["half"] or 0.0 for _, d in delta]
        dax.plot(xs, m, color=line.get_color(), label=f"{c} (n={delta[-1][1]['n']})")
        dax.fill_between(xs, [a - b for a, b in zip(m, h)], [a + b for a, b in zip(m, h)],
                         color=line.get_color(), alpha=0.15, lw=0)
        late += [abs(a) + b for a, b in zip(m[len(m) // 2:], h[len(h) // 2:])]
    dax.axhline(0.0, color="grey", lw=0.8, ls="--")
    dax.set_xlabel("training tokens (M)")
    dax.set_ylabel("val loss − AdamW's, same seed")
    dax.set_title("paired Δ vs AdamW (band: 95% t over seeds)")
    if late and max(late) > 0:  # early gaps (tenths of a nat) would flatten late ones (hundredths): off the panel
        dax.set_ylim(-1.2 * max(late), 1.2 * max(late))
        dax.legend(fontsize=8)
    for curve in series["frozen"]:
        ax.plot([x / 1e6 for x, _ in curve], [y for _, y in curve], "k:", label="adamw, frozen matrices")
    if series["baseline"] is not None:
        ax.axhline(series["baseline"], color="grey", lw=0.8, ls="--")
    _save(plt, fig, ax, lo=series["lo"], span=1.5, legend_size=8, paths=paths, title=series["title"])


def progress_markdown(rows: Sequence[tuple]) -> str:
    """The ``--progress`` table of ``rows`` (``_budget.progress_rows``)."""
    lines = ["| stage | spec | matrix lr | seed | steps done | last validation (step: loss) | finished |",
             "|---|---|---:|---:|---:|---:|---|"]
    for stage, spec, lr, seed, done, steps, last, fin in rows:
        v = f"{last['step']}: {last['val_loss']:.4f}" if last else "-"
        lines.append(f"| {stage} | `{spec}` | {lr:g} | {seed} | {done} / {steps} | {v} | {'yes' if fin else 'no'} |")
    return "\n".join(lines) + "\n"


def plot_progress(curves: Sequence[tuple[str, dict[str, Any], list[tuple[int, float]]]], paths: Sequence[Path]
                  ) -> None:
    """Every run's validation curve so far (tuning runs included): the interim picture. ``curves``: (stage,
    config, curve) of each run that has validated (``_budget.progress_curves``)."""
    plt, fig, ax = _axes(width=12)
    lo = None
    for stage, cfg, curve in curves:
        name, opts = parse_spec(cfg["optimizer"])
        name += (" (paper)" if opts.get("detail_clip") == "none" else "") + (
            f", β2 {opts['beta2']}" if "beta2" in opts else "")
        ax.plot([x / 1e6 for x, _ in curve], [y for _, y in curve], ls="-" if stage == "report" else "--",
                label=f"{name}, lr {cfg['lr']:g}, {stage} seed {cfg['seed']}")
        lo = min([y for _, y in curve] + ([lo] if lo is not None else []))
    _save(plt, fig, ax, lo=lo, span=1.0, legend_size=6, paths=paths, legend_outside=True,
          title="budget study so far: every run's validation loss")


