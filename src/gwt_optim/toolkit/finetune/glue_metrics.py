"""Metrics of ``finetune glue``, in plain torch (float64) so the harness needs
neither scikit-learn nor scipy. Each takes predictions first, references
second, like sklearn."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

__all__ = ["METRICS", "accuracy", "f1_binary", "matthews_corrcoef", "pearson", "spearman"]


def _as_float64(x: Sequence[float] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64).flatten()


def _confusion(preds, labels) -> tuple[float, float, float, float]:
    p = torch.as_tensor(preds).flatten().long()
    y = torch.as_tensor(labels).flatten().long()
    if p.shape != y.shape:
        raise ValueError(f"{p.numel()} predictions for {y.numel()} labels")
    tp = float(((p == 1) & (y == 1)).sum())
    tn = float(((p == 0) & (y == 0)).sum())
    fp = float(((p == 1) & (y == 0)).sum())
    fn = float(((p == 0) & (y == 1)).sum())
    return tp, tn, fp, fn


def accuracy(preds, labels) -> float:
    p, y = torch.as_tensor(preds).flatten(), torch.as_tensor(labels).flatten()
    if p.shape != y.shape:
        raise ValueError(f"{p.numel()} predictions for {y.numel()} labels")
    return float((p == y).double().mean()) if y.numel() else float("nan")


def f1_binary(preds, labels) -> float:
    """F1 of the positive class (label 1); 0 when there is nothing to score, as sklearn."""
    tp, _, fp, fn = _confusion(preds, labels)
    denom = 2 * tp + fp + fn
    return 2 * tp / denom if denom else 0.0


def matthews_corrcoef(preds, labels) -> float:
    """Binary MCC; 0 when a row or column of the confusion matrix is empty, as sklearn."""
    tp, tn, fp, fn = _confusion(preds, labels)
    denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / denom if denom else 0.0


def pearson(preds, labels) -> float:
    x, y = _as_float64(preds), _as_float64(labels)
    x, y = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    return float((x * y).sum()) / denom if denom else float("nan")


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks with ties sharing their mean rank (scipy's ``rankdata``)."""
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    ranks = torch.empty_like(x)
    i, n = 0, x.numel()
    while i < n:
        j = i
        while j + 1 < n and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(preds, labels) -> float:
    return pearson(_average_ranks(_as_float64(preds)), _average_ranks(_as_float64(labels)))


METRICS: dict[str, Callable[[Any, Any], float]] = {
    "mcc": matthews_corrcoef,
    "acc": accuracy,
    "f1": f1_binary,
    "pearson": pearson,
    "spearman": spearman,
}
