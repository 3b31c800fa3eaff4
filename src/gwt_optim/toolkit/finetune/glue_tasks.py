"""The eight GLUE tasks of ``finetune glue``: each one's hub config name,
inputs, label space, evaluation splits and metrics, and how its scores make a
table cell."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gwt_optim.toolkit.finetune.glue_metrics import METRICS

__all__ = ["GlueTask", "GLUE_TASKS", "score_task", "task_cell"]


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: its hub config name, inputs, label space and metrics."""

    name: str
    title: str
    text_keys: tuple[str, str | None]
    num_labels: int  # 1 means regression (STS-B)
    metrics: tuple[str, ...]
    eval_splits: tuple[str, ...] = ("validation",)

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1

    @property
    def cell_label(self) -> str:
        """What the table cell holds, e.g. ``"acc/f1"`` or ``"m/mm acc"``."""
        if len(self.eval_splits) > 1:
            return "m/mm " + "/".join(self.metrics)
        return "/".join(self.metrics)


GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask("cola", "CoLA", ("sentence", None), 2, ("mcc",)),
        GlueTask("sst2", "SST-2", ("sentence", None), 2, ("acc",)),
        GlueTask("mrpc", "MRPC", ("sentence1", "sentence2"), 2, ("acc", "f1")),
        GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), 1, ("pearson", "spearman")),
        GlueTask("qqp", "QQP", ("question1", "question2"), 2, ("acc", "f1")),
        GlueTask(
            "mnli",
            "MNLI",
            ("premise", "hypothesis"),
            3,
            ("acc",),
            ("validation_matched", "validation_mismatched"),
        ),
        GlueTask("qnli", "QNLI", ("question", "sentence"), 2, ("acc",)),
        GlueTask("rte", "RTE", ("sentence1", "sentence2"), 2, ("acc",)),
    )
}


def score_task(task: GlueTask, predictions: dict[str, Any], labels: dict[str, Any]) -> dict[str, float]:
    """Metrics per evaluation split: ``{"validation/acc": ..., ...}`` (fractions, not percent)."""
    out = {}
    for split in task.eval_splits:
        for metric in task.metrics:
            out[f"{split}/{metric}"] = METRICS[metric](predictions[split], labels[split])
    return out


def task_cell(scores: dict[str, float]) -> tuple[str, float]:
    """The table cell (percent, metrics joined by '/') and the task's single score (their mean)."""
    values = [100 * v for v in scores.values()]
    return "/".join(f"{v:.2f}" for v in values), sum(values) / len(values)
