"""The markdown report of ``finetune glue``: the paper-style table (one column
per task, plus the average) and a memory table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from gwt_optim.toolkit.finetune.common import alpha_phrase, markdown_table, mib
from gwt_optim.toolkit.finetune.glue_tasks import GLUE_TASKS, task_cell

if TYPE_CHECKING:
    from gwt_optim.toolkit.finetune.glue_settings import GlueSettings

__all__ = ["glue_report"]


def glue_report(records: list[dict], tasks: Sequence[str], methods: Sequence[str], settings: GlueSettings) -> str:
    """The paper-style table (one column per task, plus the average) and a memory table."""
    by_key = {(r["method"], r["task"]): r for r in records}
    titles = [GLUE_TASKS[t].title for t in tasks]
    header = ["Method", *titles, "Avg"]
    rows, mem_rows = [], []
    for method in methods:
        cells, task_scores = [], []
        for t in tasks:
            rec = by_key.get((method, t))
            if rec is None:
                cells.append("-")
                continue
            cell, score = task_cell(rec["scores"])
            cells.append(cell)
            task_scores.append(score)
        avg = f"{sum(task_scores) / len(task_scores):.2f}" if len(task_scores) == len(tasks) else "-"
        rows.append([method, *cells, avg])
        runs = [by_key[(method, t)] for t in tasks if (method, t) in by_key]
        if runs:
            mem_rows.append(
                [
                    method,
                    mib(max(r["optimizer_state_bytes"] for r in runs)),
                    mib(max(r["peak_memory_bytes"] for r in runs)),
                    f"{sum(r['train_samples_per_second'] for r in runs) / len(runs):.1f}",
                ]
            )
    metric_note = ", ".join(f"{GLUE_TASKS[t].title}: {GLUE_TASKS[t].cell_label}" for t in tasks)
    kind = records[0]["peak_memory_kind"] if records else "Peak memory"
    return (
        f"## GLUE fine-tuning ({settings.model})\n\n"
        f"lr {settings.lr:g}, {alpha_phrase(settings.scale)}, batch {settings.batch_size}, "
        f"max length {settings.max_length}, "
        + (f"{settings.max_steps} steps" if settings.max_steps > 0 else f"{settings.epochs:g} epochs")
        + f", seed {settings.seed}. Scores in percent ({metric_note}); Avg is the mean of the per-task means.\n\n"
        + markdown_table(header, rows)
        + "\n"
        + markdown_table(
            ["Method", "Optimizer state (MiB)", f"{kind} (MiB)", "Train samples/s"], mem_rows
        )
    )
