"""``gwt-optim finetune glue``: full-parameter fine-tuning on the eight GLUE tasks.

The paper's recipe is RoBERTa-base, GWT level 2 with Haar, module-wise
``alpha = 2`` on query/key/value and the intermediate and output dense layers,
batch 16, maximum length 512. Each (method, task) pair trains a fresh copy of
the pretrained model with the Hugging Face ``Trainer`` and the optimizer from
:func:`gwt_optim.integrations.create_gwt_optimizer`, then scores the
validation split(s) with the task's standard metric:

=======  ==========================  ==================================
task     inputs                      metric (table cell)
=======  ==========================  ==================================
CoLA     sentence                    Matthews correlation
SST-2    sentence                    accuracy
MRPC     sentence1, sentence2        accuracy / F1
STS-B    sentence1, sentence2        Pearson / Spearman (regression)
QQP      question1, question2        accuracy / F1
MNLI     premise, hypothesis         accuracy, matched / mismatched
QNLI     question, sentence          accuracy
RTE      sentence1, sentence2        accuracy
=======  ==========================  ==================================

Data comes from the hub (``nyu-mll/glue``) or from ``--data-dir`` laid out as
``DIR/<task>/<split>.jsonl`` (or ``.tsv`` with a header row) in the hub's
column names; MNLI's evaluation splits are ``validation_matched`` and
``validation_mismatched``.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from gwt_optim.toolkit.finetune.common import (
    MethodSpec,
    PeakMemory,
    add_run_arguments,
    atomic_write_json,
    atomic_write_text,
    from_hub,
    isolate_choice,
    markdown_table,
    mib,
    optimizer_state_bytes,
    parse_methods,
    pick_device,
    prepare_hub_access,
    run_measured,
)

__all__ = [
    "GlueTask",
    "GLUE_TASKS",
    "METRICS",
    "accuracy",
    "f1_binary",
    "matthews_corrcoef",
    "pearson",
    "spearman",
    "score_task",
    "load_glue",
    "run_glue",
    "add_arguments",
]

# --------------------------------------------------------------------------- #
# Metrics, in plain torch (float64) so the harness needs neither scikit-learn
# nor scipy. Each takes predictions first, references second, like sklearn.
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# Tasks
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# Data and model
# --------------------------------------------------------------------------- #

_LOCAL_FORMATS = {".jsonl": ("json", {}), ".json": ("json", {}), ".tsv": ("csv", {"delimiter": "\t", "quoting": 3})}


def load_glue(task: GlueTask, data_dir: str | Path | None = None):
    """A ``DatasetDict`` with ``train`` and the task's evaluation splits.

    From ``data_dir/<task>/<split>.{jsonl,json,tsv}`` when given, otherwise
    from the hub's ``nyu-mll/glue``.
    """
    import datasets

    splits = ("train", *task.eval_splits)
    if data_dir is None:
        ds = from_hub(
            "GLUE task",
            f"nyu-mll/glue/{task.name}",
            lambda: datasets.load_dataset("nyu-mll/glue", task.name),
            fix=f"pass --data-dir DIR with DIR/{task.name}/train.jsonl and "
            + ", ".join(f"{s}.jsonl" for s in task.eval_splits)
            + " in GLUE's columns",
        )
        return datasets.DatasetDict({s: ds[s] for s in splits})
    root = Path(data_dir) / task.name
    out = {}
    for split in splits:
        found = [root / f"{split}{ext}" for ext in _LOCAL_FORMATS if (root / f"{split}{ext}").is_file()]
        if not found:
            raise FileNotFoundError(
                f"no {split} file for GLUE task {task.name!r} in {root}; expected {split}.jsonl or {split}.tsv"
            )
        builder, kwargs = _LOCAL_FORMATS[found[0].suffix]
        out[split] = datasets.load_dataset(builder, data_files=str(found[0]), split="train", **kwargs)
    return datasets.DatasetDict(out)


def _tokenize(ds, tokenizer, task: GlueTask, max_length: int):
    first, second = task.text_keys

    def encode(batch):
        texts = (batch[first],) if second is None else (batch[first], batch[second])
        enc = tokenizer(*texts, truncation=True, max_length=max_length)
        label = batch["label"]
        enc["labels"] = [float(v) for v in label] if task.is_regression else [int(v) for v in label]
        return enc

    return ds.map(encode, batched=True, remove_columns=ds["train"].column_names, desc=f"tokenize {task.name}")


def _load_glue_tokenizer(model_name: str):
    from transformers import AutoTokenizer

    return from_hub(
        "tokenizer",
        model_name,
        lambda: AutoTokenizer.from_pretrained(model_name),
        fix="pass --model DIR with a local copy (save_pretrained output)",
    )


def _load_model(model_name: str, task: GlueTask):
    from transformers import AutoModelForSequenceClassification

    kwargs = {"num_labels": task.num_labels}
    if task.is_regression:
        kwargs["problem_type"] = "regression"
    return from_hub(
        "model",
        model_name,
        lambda: AutoModelForSequenceClassification.from_pretrained(model_name, **kwargs),
        fix="pass --model DIR with a local copy (save_pretrained output)",
    )


# --------------------------------------------------------------------------- #
# Running
# --------------------------------------------------------------------------- #


@dataclass
class GlueSettings:
    model: str = "roberta-base"
    data_dir: str | None = None
    lr: float = 1e-5
    scale: float = 2.0
    batch_size: int = 16
    max_length: int = 512
    epochs: float = 3.0
    max_steps: int = -1
    warmup: float = 0.06
    weight_decay: float = 0.0
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    seed: int = 42
    device: str = "auto"
    # None: one process per run on CPU (so peak RSS is per run), in-process on CUDA.
    isolate: bool | None = None
    progress: bool = True


def _run_one(task: GlueTask, spec: MethodSpec, tokenizer, data, settings: GlueSettings, work_dir: Path) -> dict:
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments, set_seed

    from gwt_optim.integrations import create_gwt_optimizer

    device = pick_device(settings.device)
    set_seed(settings.seed)  # the same classifier head for every method
    model = _load_model(settings.model, task)
    targs = TrainingArguments(
        output_dir=str(work_dir),
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size,
        learning_rate=settings.lr,
        weight_decay=settings.weight_decay,
        num_train_epochs=settings.epochs,
        max_steps=settings.max_steps,
        lr_scheduler_type="linear",
        warmup_steps=settings.warmup,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to="none",
        seed=settings.seed,
        use_cpu=device.type == "cpu",
        disable_tqdm=not settings.progress,
        dataloader_num_workers=0,
    )
    optimizer, scheduler = create_gwt_optimizer(
        model, targs, optimizer=spec.optimizer, scale=settings.scale, options=dict(spec.options)
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=data["train"],
        data_collator=DataCollatorWithPadding(tokenizer),
        optimizers=(optimizer, scheduler),
    )
    memory = PeakMemory(device)
    memory.reset()
    start = time.perf_counter()
    train_out = trainer.train()
    train_seconds = time.perf_counter() - start
    peak = memory.peak_bytes()
    predictions, references = {}, {}
    for split in task.eval_splits:
        pred = trainer.predict(data[split])
        logits = torch.as_tensor(pred.predictions)
        predictions[split] = logits.squeeze(-1) if task.is_regression else logits.argmax(-1)
        references[split] = torch.as_tensor(pred.label_ids)
    scores = score_task(task, predictions, references)
    # Plain numbers only: with --isolate a spawned worker pickles this back.
    return {
        "task": task.name,
        "method": spec.label,
        "scores": scores,
        "train_loss": float(train_out.training_loss),
        "steps": int(train_out.global_step),
        "train_seconds": train_seconds,
        "train_samples_per_second": float(train_out.metrics.get("train_samples_per_second", float("nan"))),
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "peak_memory_bytes": peak,
        "peak_memory_kind": memory.kind,
    }


def run_glue(
    tasks: Sequence[str], methods: Sequence[str], settings: GlueSettings, out_dir: str | Path
) -> tuple[list[dict], str]:
    """Fine-tune every method on every task; write ``results.json`` and ``results.md``.

    Returns the per-run records and the markdown report.
    """
    unknown = [t for t in tasks if t not in GLUE_TASKS]
    if unknown:
        raise ValueError(f"unknown GLUE task(s) {unknown}; choose from {', '.join(GLUE_TASKS)}")
    specs = parse_methods(methods)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not Path(settings.model).exists() or settings.data_dir is None:
        prepare_hub_access()
    tokenizer = _load_glue_tokenizer(settings.model)
    isolate = pick_device(settings.device).type == "cpu" if settings.isolate is None else settings.isolate
    records: list[dict] = []
    for name in tasks:
        task = GLUE_TASKS[name]
        data = load_glue(task, settings.data_dir)
        data = _limit(data, task, settings)
        data = _tokenize(data, tokenizer, task, settings.max_length)
        for spec in specs:
            print(f"[finetune glue] {task.title} with {spec.label}", flush=True)
            work_dir = out_dir / "runs" / f"{name}-{_slug(spec.label)}"
            record = run_measured(isolate, _run_one, task, spec, tokenizer, data, settings, work_dir)
            records.append(record)
            atomic_write_json(out_dir / "results.json", {"settings": settings.__dict__, "runs": records})
    report = glue_report(records, tasks, [s.label for s in specs], settings)
    atomic_write_text(out_dir / "results.md", report)
    return records, report


def _limit(data, task: GlueTask, settings: GlueSettings):
    def cap(ds, n):
        return ds.select(range(min(n, len(ds)))) if n is not None else ds

    out = {"train": cap(data["train"], settings.max_train_samples)}
    for split in task.eval_splits:
        out[split] = cap(data[split], settings.max_eval_samples)
    return type(data)(out)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


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
        f"lr {settings.lr:g}, module-wise alpha {settings.scale:g}, batch {settings.batch_size}, "
        f"max length {settings.max_length}, "
        + (f"{settings.max_steps} steps" if settings.max_steps > 0 else f"{settings.epochs:g} epochs")
        + f", seed {settings.seed}. Scores in percent ({metric_note}); Avg is the mean of the per-task means.\n\n"
        + markdown_table(header, rows)
        + "\n"
        + markdown_table(
            ["Method", "Optimizer state (MiB)", f"{kind} (MiB)", "Train samples/s"], mem_rows
        )
    )


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = GlueSettings()
    p.add_argument(
        "--tasks",
        default="all",
        help=f"comma-separated GLUE tasks or 'all' ({','.join(GLUE_TASKS)}); --task is an alias",
    )
    p.add_argument("--task", dest="tasks", help=argparse.SUPPRESS)
    p.add_argument(
        "--methods",
        default="adamw:scale=1,gwt-adamw:level=2",
        help="comma-separated registry optimizers with options (name:key=value), or lora:r=8",
    )
    p.add_argument("--model", default=d.model, help="hub id or local directory of a pretrained encoder")
    p.add_argument("--data-dir", default=None, help="local GLUE data: DIR/<task>/<split>.jsonl|.tsv (else the hub)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--scale", type=float, default=d.scale, help="module-wise alpha on the target layers")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--max-length", type=int, default=d.max_length)
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="stop after this many steps (overrides epochs)")
    p.add_argument("--warmup", type=float, default=d.warmup, help="warm-up steps, or a fraction if < 1")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--max-train-samples", type=int, default=None)
    p.add_argument("--max-eval-samples", type=int, default=None)
    add_run_arguments(
        p, d, runs="(method, task)", out="results/finetune-glue", out_help="directory for results.json and results.md"
    )


def main(args: argparse.Namespace) -> int:
    tasks = list(GLUE_TASKS) if args.tasks == "all" else [t.strip().lower() for t in args.tasks.split(",") if t.strip()]
    settings = GlueSettings(
        model=args.model,
        data_dir=args.data_dir,
        lr=args.lr,
        scale=args.scale,
        batch_size=args.batch_size,
        max_length=args.max_length,
        epochs=args.epochs,
        max_steps=args.max_steps,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        max_train_samples=args.max_train_samples,
        max_eval_samples=args.max_eval_samples,
        seed=args.seed,
        device=args.device,
        isolate=isolate_choice(args.isolate),
        progress=not args.no_progress,
    )
    _, report = run_glue(tasks, args.methods.split(","), settings, args.out)
    print(report)
    return 0
