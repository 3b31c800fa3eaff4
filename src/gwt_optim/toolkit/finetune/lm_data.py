"""Data of ``finetune lm``: plain text packed into blocks, or Alpaca
instructions with the prompt masked out of the loss; the same batches for
every method."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from gwt_optim.toolkit.data import pack_texts
from gwt_optim.toolkit.losses import IGNORE_INDEX

if TYPE_CHECKING:
    from gwt_optim.toolkit.finetune.lm_settings import LMSettings

__all__ = [
    "IGNORE_INDEX",
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "alpaca_prompt",
    "encode_alpaca",
    "collate_examples",
    "load_alpaca",
    "LMData",
    "prepare_data",
]

# The Stanford Alpaca templates, verbatim.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def load_alpaca(path: str | Path) -> list[dict[str, str]]:
    """Alpaca records from a JSON list or JSON lines; ``input`` is optional."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    records = json.loads(text) if stripped.startswith("[") else [json.loads(l) for l in text.splitlines() if l.strip()]
    for i, r in enumerate(records):
        missing = [k for k in ("instruction", "output") if k not in r]
        if missing:
            raise ValueError(f"{path}: record {i} lacks {missing}; Alpaca records need instruction and output")
    return records


def alpaca_prompt(example: dict[str, str]) -> str:
    """The Alpaca prompt for ``example``, up to and including ``### Response:\n``."""
    if example.get("input", "").strip():
        return ALPACA_PROMPT.format(instruction=example["instruction"], input=example["input"])
    return ALPACA_PROMPT_NO_INPUT.format(instruction=example["instruction"])


def encode_alpaca(example: dict[str, str], tokenizer, max_len: int) -> dict[str, list[int]]:
    """Token ids of prompt + response + EOS, with the prompt labelled ``-100``.

    Prompt and response are tokenized separately and concatenated, so the
    mask boundary is exact (joint tokenization could merge the last prompt
    character with the first response character into one token).
    """
    prompt = tokenizer(alpaca_prompt(example), add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False):
        prompt = [tokenizer.bos_token_id, *prompt]
    response = tokenizer(example["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt + response)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt) + response)[:max_len]
    return {"input_ids": input_ids, "labels": labels}


def collate_examples(examples: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked in attention and loss."""
    width = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.full((len(examples), width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(examples), width), dtype=torch.long),
        "labels": torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long),
    }
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(e["input_ids"])
        batch["attention_mask"][i, :n] = 1
        batch["labels"][i, :n] = torch.tensor(e["labels"])
    return batch


@dataclass
class LMData:
    """Training and validation batches, identical for every method."""

    format: str
    train: list[dict[str, torch.Tensor]]  # one epoch of batches; training cycles through it
    val: list[dict[str, torch.Tensor]]
    train_tokens: int
    val_targets: int  # tokens that count in the validation loss

    def train_batches(self, steps: int) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(steps):
            yield self.train[i % len(self.train)]


def _text_batches(blocks: torch.Tensor, batch_size: int) -> list[dict[str, torch.Tensor]]:
    return [
        {"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b.clone()}
        for b in blocks.split(batch_size)
    ]


def _detect_format(data: str) -> str:
    """Alpaca for a .json file or a .jsonl file whose records have an ``instruction``."""
    path = Path(data)
    if path.suffix == ".json":
        return "alpaca"
    if path.suffix == ".jsonl" and path.is_file():
        with open(path) as fh:
            first = next((line for line in fh if line.strip()), "{}")
        return "alpaca" if "instruction" in json.loads(first) else "text"
    return "text"


def _split_holdout(items: list, fraction: float, rng: random.Random) -> tuple[list, list]:
    items = list(items)
    rng.shuffle(items)
    n_val = max(1, int(round(len(items) * fraction)))
    if n_val >= len(items):
        raise ValueError(f"{len(items)} records are too few to hold out a validation split")
    return items[n_val:], items[:n_val]


def _read_texts(source: str, split: str, seed: int) -> list[str]:
    # The pre-training harness's reader: the demo corpus, C4, or local files
    # with a fixed train/validation split.
    from gwt_optim.toolkit.data import load_texts

    return list(load_texts(source, split, seed=seed))


def prepare_data(settings: "LMSettings", tokenizer) -> LMData:
    """Tokenized batches from ``settings.data`` (a corpus name, a .txt file or Alpaca JSON)."""
    fmt = _detect_format(settings.data) if settings.format == "auto" else settings.format
    rng = random.Random(settings.seed)
    if fmt == "alpaca":
        records = load_alpaca(settings.data)
        if settings.val_data:
            train_recs, val_recs = records, load_alpaca(settings.val_data)
            rng.shuffle(train_recs)
        else:
            train_recs, val_recs = _split_holdout(records, settings.val_fraction, rng)
        enc = [encode_alpaca(r, tokenizer, settings.seq_len) for r in train_recs]
        val_enc = [encode_alpaca(r, tokenizer, settings.seq_len) for r in val_recs][: settings.eval_batches * settings.batch_size]
        bs, pad = settings.batch_size, tokenizer.pad_token_id
        train = [collate_examples(enc[i : i + bs], pad) for i in range(0, len(enc), bs)]
        val = [collate_examples(val_enc[i : i + bs], pad) for i in range(0, len(val_enc), bs)]
    else:
        train_docs = _read_texts(settings.data, "train", settings.seed)
        if settings.val_data:  # all of it, whatever split its file name suggests
            val_docs = [d for split in ("train", "validation") for d in _read_texts(settings.val_data, split, settings.seed)]
        else:
            val_docs = _read_texts(settings.data, "validation", settings.seed)
        train_blocks = pack_texts(train_docs, tokenizer, settings.seq_len)
        # The same shuffled order for every method; cycling keeps it fixed.
        g = torch.Generator().manual_seed(settings.seed)
        train_blocks = train_blocks[torch.randperm(len(train_blocks), generator=g)]
        need = settings.steps * settings.batch_size
        train_blocks = train_blocks[:need]
        val_blocks = pack_texts(val_docs, tokenizer, settings.seq_len)[: settings.eval_batches * settings.batch_size]
        train, val = _text_batches(train_blocks, settings.batch_size), _text_batches(val_blocks, settings.batch_size)
    train_tokens = sum(int(b["attention_mask"].sum()) for b in train)
    val_targets = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in val)
    if not train or not val:
        raise ValueError(f"no training or validation batches from {settings.data!r}")
    return LMData(fmt, train, val, train_tokens, val_targets)
