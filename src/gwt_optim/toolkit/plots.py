"""PNG plots of finished runs (matplotlib, headless).

* :func:`plot_validation_loss` -- validation loss against steps, one line per run;
* :func:`plot_memory_vs_perplexity` -- optimizer-state memory against final
  validation perplexity, one point per run (lower left is better).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

__all__ = ["plot_validation_loss", "plot_memory_vs_perplexity"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe on servers and in CI
    import matplotlib.pyplot as plt

    return plt


def plot_validation_loss(runs: Sequence[tuple[str, list[dict[str, Any]]]], path: str | Path, *, title: str = "") -> Path:
    """``runs``: (label, metrics records) pairs; records with ``val_loss`` are plotted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, records in runs:
        points = sorted((r["step"], r["val_loss"]) for r in records if "val_loss" in r)
        if points:
            steps, losses = zip(*points)
            ax.plot(steps, losses, marker="o", markersize=3, linewidth=1.5, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title or "Validation loss", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_memory_vs_perplexity(summaries: Sequence[dict[str, Any]], labels: Sequence[str], path: str | Path,
                              *, title: str = "") -> Path:
    """Optimizer-state MiB (x) against final validation perplexity (y)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for s, label in zip(summaries, labels):
        x, y = s["state_bytes"] / 2**20, s["val_ppl"]
        ax.scatter([x], [y], s=40)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.margins(x=0.35, y=0.12)  # room for the point labels, which extend to the right
    ax.set_xlabel("optimizer state (MiB, measured)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title or "Memory vs quality (lower left is better)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
