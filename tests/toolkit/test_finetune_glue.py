"""GLUE: metric functions against hand-computed values and scipy, the offline
error, and the whole `finetune glue` path on a tiny random RoBERTa with the
local GLUE-format fixtures in tests/data/finetune/glue."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gwt_optim.toolkit.finetune import glue, glue_data
from gwt_optim.toolkit.finetune.common import HubUnavailable, prepare_hub_access

DATA = Path(__file__).resolve().parents[1] / "data" / "finetune" / "glue"

# preds vs labels: tp = 2 (0, 4), fp = 1 (1), tn = 2 (2, 3), fn = 1 (5).
PREDS = [1, 1, 0, 0, 1, 0]
LABELS = [1, 0, 0, 0, 1, 1]


def test_binary_metrics_by_hand():
    assert glue.accuracy(PREDS, LABELS) == pytest.approx(4 / 6)
    # F1 = 2tp / (2tp + fp + fn) = 4 / 6
    assert glue.f1_binary(PREDS, LABELS) == pytest.approx(2 / 3)
    # MCC = (tp*tn - fp*fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn)) = (4 - 1) / sqrt(3^4) = 1/3
    assert glue.matthews_corrcoef(PREDS, LABELS) == pytest.approx(1 / 3)
    assert glue.matthews_corrcoef(LABELS, LABELS) == pytest.approx(1.0)
    # A constant predictor has an empty confusion row: sklearn defines MCC = 0 there.
    assert glue.matthews_corrcoef([1] * 6, LABELS) == 0.0
    assert glue.f1_binary([0] * 4, [0] * 4) == 0.0


def test_correlations_by_hand():
    # x = [1,2,3], y = [1,2,4]: sum dx*dy = 3, sxx = 2, syy = 42/9 -> r = 9 / sqrt(84)
    assert glue.pearson([1, 2, 3], [1, 2, 4]) == pytest.approx(9 / math.sqrt(84))
    # Ties share the mean rank: ranks [1, 2.5, 2.5, 4] vs [1, 3, 2, 4] -> 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10)
    assert glue.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(3 / math.sqrt(10))
    assert glue.spearman([10, 20, 30], [0.1, 5, 7]) == pytest.approx(1.0)


def test_metrics_match_scipy_on_random_data():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, generator=g, dtype=torch.float64)
    y = x + torch.randn(200, generator=g, dtype=torch.float64)
    y[::7] = y[3]  # ties
    assert glue.pearson(x, y) == pytest.approx(stats.pearsonr(x.numpy(), y.numpy())[0], abs=1e-10)
    assert glue.spearman(x, y) == pytest.approx(stats.spearmanr(x.numpy(), y.numpy())[0], abs=1e-10)
    p = (x > 0).long()
    t = (y > 0.3).long()
    tp, tn = float(((p == 1) & (t == 1)).sum()), float(((p == 0) & (t == 0)).sum())
    fp, fn = float(((p == 1) & (t == 0)).sum()), float(((p == 0) & (t == 1)).sum())
    # MCC is the Pearson correlation of two binary vectors (the phi coefficient).
    assert glue.matthews_corrcoef(p, t) == pytest.approx(stats.pearsonr(p.numpy(), t.numpy())[0], abs=1e-10)
    assert glue.f1_binary(p, t) == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert glue.accuracy(p, t) == pytest.approx((tp + tn) / 200)


def test_task_table_covers_the_eight_tasks_and_mnli_has_two_splits():
    assert list(glue.GLUE_TASKS) == ["cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte"]
    mnli = glue.GLUE_TASKS["mnli"]
    scores = glue.score_task(
        mnli,
        {"validation_matched": [0, 1, 2, 2], "validation_mismatched": [0, 0, 0, 0]},
        {"validation_matched": [0, 1, 2, 1], "validation_mismatched": [0, 1, 2, 0]},
    )
    assert scores == {"validation_matched/acc": 0.75, "validation_mismatched/acc": 0.5}
    assert glue.task_cell(scores) == ("75.00/50.00", 62.5)


def test_hub_loading_offline_fails_with_the_fix(monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", "/nonexistent-gwt-test-cache")
    assert prepare_hub_access() is False
    with pytest.raises(HubUnavailable, match="--data-dir"):
        glue.load_glue(glue.GLUE_TASKS["cola"], None)
    with pytest.raises(HubUnavailable, match="--model DIR"):
        glue_data._load_glue_tokenizer("roberta-base-gwt-test-not-cached")


def test_local_data_in_glue_columns():
    ds = glue.load_glue(glue.GLUE_TASKS["mnli"], DATA)
    assert set(ds) == {"train", "validation_matched", "validation_mismatched"}
    assert {"premise", "hypothesis", "label"} <= set(ds["train"].column_names)
    with pytest.raises(FileNotFoundError, match="expected train.jsonl"):
        glue.load_glue(glue.GLUE_TASKS["cola"], DATA.parent)


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory):
    from gwt_optim.toolkit.finetune.tiny import save_tiny_roberta

    texts = [p.read_text() for p in DATA.rglob("*.jsonl")]
    return save_tiny_roberta(tmp_path_factory.mktemp("roberta"), texts)


def test_finetune_glue_end_to_end(tiny_roberta, tmp_path):
    """The real code path (Trainer + create_gwt_optimizer + metrics + report) on
    CoLA (MCC), STS-B (regression, two correlations) and MNLI (two splits).
    The optimizer-state saving of GWT is asserted in test_finetune_hf/lm."""
    settings = glue.GlueSettings(
        model=str(tiny_roberta), data_dir=str(DATA), lr=1e-3, batch_size=8, max_length=32, max_steps=2,
        isolate=False, progress=False,
    )
    records, report = glue.run_glue(["cola", "stsb", "mnli"], ["gwt-adamw:level=2"], settings, tmp_path)
    assert len(records) == 3
    by = {r["task"]: r for r in records}
    assert set(by["cola"]["scores"]) == {"validation/mcc"}
    assert set(by["stsb"]["scores"]) == {"validation/pearson", "validation/spearman"}
    assert set(by["mnli"]["scores"]) == {"validation_matched/acc", "validation_mismatched/acc"}
    for r in records:
        assert r["steps"] == 2 and math.isfinite(r["train_loss"]) and r["peak_memory_bytes"] > 0
        assert r["optimizer_state_bytes"] > 0
        assert all(-1.0 <= v <= 1.0 or math.isnan(v) for v in r["scores"].values())
    # The table cell is the scores in percent, in the task's metric order.
    cell, _ = glue.task_cell(by["stsb"]["scores"])
    assert cell == "/".join(f"{100 * by['stsb']['scores'][k]:.2f}" for k in ("validation/pearson", "validation/spearman"))
    header = report.splitlines()[4]
    assert [c.strip() for c in header.strip("|").split("|")] == ["Method", "CoLA", "STS-B", "MNLI", "Avg"]
    mnli_cell = report.splitlines()[6].split("|")[3].strip()
    assert mnli_cell.count("/") == 1  # matched/mismatched
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["runs"]) == 3 and (tmp_path / "results.md").read_text() == report
