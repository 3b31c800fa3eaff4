"""What ``finetune glue`` loads from the hub or from disk: a task's data (the
hub's ``nyu-mll/glue`` or ``--data-dir``), capped and tokenized, the tokenizer
and the pretrained encoder with the task's classifier head."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gwt_optim.toolkit.finetune.common import from_hub
from gwt_optim.toolkit.finetune.glue_tasks import GlueTask

if TYPE_CHECKING:
    from gwt_optim.toolkit.finetune.glue_settings import GlueSettings

__all__ = ["load_glue"]

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


def _limit(data, task: GlueTask, settings: GlueSettings):
    def cap(ds, n):
        return ds.select(range(min(n, len(ds)))) if n is not None else ds

    out = {"train": cap(data["train"], settings.max_train_samples)}
    for split in task.eval_splits:
        out[split] = cap(data[split], settings.max_eval_samples)
    return type(data)(out)


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
