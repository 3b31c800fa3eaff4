"""PNG plots of finished runs (matplotlib, headless).

* :func:`plot_validation_loss` -- validation loss against steps, one line per run;
* :func:`plot_memory_vs_perplexity` -- optimizer-state memory against final
  validation perplexity, one numbered point per run (lower left is better).

Run labels are long (an optimizer with its options), so neither plot writes
them inside the axes, where they would cover the data, overlap each other or
run off the figure: each goes to a legend below the axes, one run a line,
and the figure grows to hold it (``bbox_inches="tight"``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Sequence

__all__ = ["plot_validation_loss", "plot_memory_vs_perplexity", "validation_loss_figure", "memory_vs_perplexity_figure"]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_WRAP = 90  # characters of a legend line


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe on servers and in CI
    import matplotlib.pyplot as plt

    return plt


def _figure(plt):
    """Axes of a fixed size; the legend lines below them make the saved figure taller."""
    return plt.subplots(figsize=(7.5, 4.5), dpi=120)


def _legend_below(ax, handles, labels: Sequence[str]) -> None:
    wrapped = ["\n".join(textwrap.wrap(lab, _WRAP, subsequent_indent="    ")) or lab for lab in labels]
    ax.legend(handles, wrapped, loc="upper left", bbox_to_anchor=(0.0, -0.14), fontsize=8, frameon=False,
              borderaxespad=0.0, handlelength=1.6)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return path


def plot_validation_loss(runs: Sequence[tuple[str, list[dict[str, Any]]]], path: str | Path, *, title: str = "") -> Path:
    """``runs``: (label, metrics records) pairs; records with ``val_loss`` are plotted."""
    return _save(validation_loss_figure(runs, title=title), _pyplot(), path)


def validation_loss_figure(runs: Sequence[tuple[str, list[dict[str, Any]]]], *, title: str = ""):
    """The figure :func:`plot_validation_loss` saves (close it with ``plt.close``)."""
    plt = _pyplot()
    fig, ax = _figure(plt)
    handles, labels = [], []
    for i, (label, records) in enumerate(runs):
        points = sorted((r["step"], r["val_loss"]) for r in records if "val_loss" in r)
        if points:
            steps, losses = zip(*points)
            (line,) = ax.plot(steps, losses, marker=_MARKERS[i % len(_MARKERS)], markersize=3.5, linewidth=1.5)
            handles.append(line)
            labels.append(label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title or "Validation loss", fontsize=10)
    ax.grid(alpha=0.3)
    if handles:
        _legend_below(ax, handles, labels)
    return fig


def plot_memory_vs_perplexity(summaries: Sequence[dict[str, Any]], labels: Sequence[str], path: str | Path,
                              *, title: str = "") -> Path:
    """Optimizer-state MiB (x) against final validation perplexity (y): each run a
    point numbered as its legend line below the axes."""
    return _save(memory_vs_perplexity_figure(summaries, labels, title=title), _pyplot(), path)


def memory_vs_perplexity_figure(summaries: Sequence[dict[str, Any]], labels: Sequence[str], *, title: str = ""):
    """The figure :func:`plot_memory_vs_perplexity` saves (close it with ``plt.close``)."""
    plt = _pyplot()
    fig, ax = _figure(plt)
    handles = []
    for i, s in enumerate(summaries):
        x, y = s["state_bytes"] / 2**20, s["val_ppl"]
        handles.append(ax.scatter([x], [y], s=45, marker=_MARKERS[i % len(_MARKERS)], zorder=3))
        ax.annotate(str(i + 1), (x, y), textcoords="offset points", xytext=(6, 3), fontsize=8, fontweight="bold")
    ax.margins(x=0.12, y=0.12)  # the numbers stay inside the axes
    ax.set_xlabel("optimizer state (MiB, measured)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title or "Memory vs quality (lower left is better)", fontsize=10)
    ax.grid(alpha=0.3)
    _legend_below(ax, handles, [f"{i + 1}. {lab}" for i, lab in enumerate(labels)])
    return fig
