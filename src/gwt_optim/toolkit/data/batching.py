"""Token streams and batches: tokenized corpora (cached), fixed-length
blocks, resumable training batches and validation windows."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from gwt_optim.toolkit.data.cache import _digest, cache_dir
from gwt_optim.toolkit.data import sources
from gwt_optim.toolkit.data.sources import load_texts
from gwt_optim.toolkit.data.tokenizers import _default_tokenizer, _tokenizer_digest, load_pretrain_tokenizer

__all__ = [
    "pack_texts",
    "tokenize_corpus",
    "PackedBatches",
    "StreamingBatches",
    "validation_windows",
    "DataBundle",
    "build_data",
]


def _encode(tokenizer, texts: Sequence[str], eos: int, progress: bool) -> list[int]:
    from tqdm.auto import tqdm

    ids: list[int] = []
    chunk = 512
    for start in tqdm(range(0, len(texts), chunk), desc="tokenizing", unit="chunk", disable=not progress, leave=False):
        for doc in tokenizer(list(texts[start : start + chunk]), add_special_tokens=False)["input_ids"]:
            ids.extend(doc)
            ids.append(eos)
    return ids


def pack_texts(texts: Sequence[str], tokenizer, seq_len: int, *, progress: bool = False) -> torch.Tensor:
    """Tokenize, join with EOS and cut into ``[n_blocks, seq_len]`` int64 (the tail is dropped)."""
    ids = _encode(tokenizer, texts, tokenizer.eos_token_id, progress)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"only {len(ids)} tokens of text, fewer than one block of --seq-len {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def tokenize_corpus(texts: Sequence[str], tokenizer, *, cache: bool = True, progress: bool = True) -> torch.Tensor:
    """One int32 stream of every document's tokens, each followed by EOS.

    Cached on disk by a hash of the texts and the tokenizer, so repeated runs
    (``compare`` runs one process per optimizer) tokenize once.
    """
    import numpy as np

    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to separate packed documents; pick another tokenizer")
    path = cache_dir() / "tokens" / f"{_digest([_tokenizer_digest(tokenizer), *texts])[:24]}.npy"
    if cache and path.is_file():
        return torch.from_numpy(np.load(path))
    arr = np.asarray(_encode(tokenizer, texts, eos, progress), dtype=np.int32)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, path)
    return torch.from_numpy(arr)


class PackedBatches:
    """Fixed-length windows of a token stream, in a seeded order, epoch after epoch.

    The stream is cut into ``len(tokens) // seq_len`` non-overlapping windows;
    epoch ``e`` visits them in ``torch.randperm`` order from a generator seeded
    with ``(seed, e)``. The position is two integers (epoch, cursor), so
    :meth:`state_dict` resumes exactly, even mid-epoch.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, seed: int = 0):
        self.windows = len(tokens) // seq_len
        if self.windows < 1:
            raise ValueError(f"{len(tokens)} training tokens cannot fill one sequence of {seq_len}")
        self.tokens = tokens[: self.windows * seq_len].view(self.windows, seq_len)
        self.seq_len = seq_len
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.windows, generator=g)

    def next(self, n: int) -> torch.Tensor:
        """The next ``n`` sequences, as an int64 tensor ``[n, seq_len]``."""
        picks = []
        while n > 0:
            take = min(n, self.windows - self.cursor)
            picks.append(self._order[self.cursor : self.cursor + take])
            self.cursor += take
            n -= take
            if self.cursor == self.windows:
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation(self.epoch)
        return self.tokens[torch.cat(picks)].long()

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.cursor / self.windows

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "packed", "epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "seq_len": self.seq_len, "windows": self.windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("kind", "seed", "seq_len", "windows"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"checkpoint data position does not match this data ({key}: {state.get(key)} vs {mine[key]}); "
                    "resume with the same --data, --tokenizer, --seq-len and --seed"
                )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)


class StreamingBatches:
    """Packed windows from a document stream (C4), for corpora too large to hold.

    The position is the number of documents consumed plus the tokens left
    over from the last one, so a resumed run continues with the same windows.
    """

    def __init__(self, documents: Callable[[int], Iterator[str]], tokenizer, seq_len: int):
        self._documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.consumed = 0
        self.buffer: list[int] = []
        self._it: Iterator[str] | None = None

    def next(self, n: int) -> torch.Tensor:
        need = n * self.seq_len
        if self._it is None:
            self._it = self._documents(self.consumed)
        eos = self.tokenizer.eos_token_id
        while len(self.buffer) < need:
            doc = next(self._it)
            self.consumed += 1
            self.buffer.extend(self.tokenizer(doc, add_special_tokens=False)["input_ids"])
            self.buffer.append(eos)
        out, self.buffer = self.buffer[:need], self.buffer[need:]
        return torch.tensor(out, dtype=torch.long).view(n, self.seq_len)

    @property
    def epochs_done(self) -> float:
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "stream", "consumed": self.consumed, "buffer": list(self.buffer), "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "stream" or state.get("seq_len") != self.seq_len:
            raise ValueError("checkpoint data position is not from this streamed data; resume with the same flags")
        self.consumed, self.buffer, self._it = int(state["consumed"]), list(state["buffer"]), None


def validation_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """``max_tokens // seq_len`` windows spread evenly over the whole
    validation stream: a fixed token budget, the same for every run and seed.

    Window ``i`` of ``n`` is window ``i * N // n`` of the ``N`` the stream
    holds. Corpora are often stored grouped by source (``pysrc`` is one
    package after another), so the first ``max_tokens`` tokens would be one
    source's; an even stride reaches every part of the stream. When the
    budget covers the stream, every window is taken, in order.
    """
    total = len(tokens) // seq_len
    if total < 1:
        raise ValueError(f"{len(tokens)} validation tokens cannot fill one sequence of {seq_len}")
    n = min(total, max(1, max_tokens // seq_len))
    picks = torch.arange(n) * total // n
    return tokens[: total * seq_len].view(total, seq_len)[picks].long()


@dataclass
class DataBundle:
    """Everything a training run needs from the data side."""

    tokenizer: Any
    train: PackedBatches | StreamingBatches
    validation: torch.Tensor  # [windows, seq_len]
    info: dict[str, Any] = field(default_factory=dict)


def build_data(
    source: str,
    *,
    seq_len: int,
    val_tokens: int,
    seed: int = 0,
    tokenizer: str | None = None,
    vocab_size: int = 4096,
    progress: bool = True,
) -> DataBundle:
    """Tokenizer, training batches and validation windows for ``source``."""
    train_texts = val_texts = None
    if source != "c4":  # read the text first: a bad file fails before a tokenizer is fetched
        train_texts = load_texts(source, "train", seed=seed)
        val_texts = load_texts(source, "validation", seed=seed)
    tok = load_pretrain_tokenizer(tokenizer, source, vocab_size=vocab_size, seed=seed, train_texts=train_texts)
    info: dict[str, Any] = {"source": source, "tokenizer": tokenizer or _default_tokenizer(source),
                            "vocab_size": len(tok), "seq_len": seq_len}
    if source == "c4":
        ids: list[int] = []
        for doc in sources.c4_documents("validation"):  # stream just enough text for the budget
            ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
            ids.append(tok.eos_token_id)
            if len(ids) >= val_tokens + seq_len:
                break
        validation = validation_windows(torch.tensor(ids, dtype=torch.int32), seq_len, val_tokens)
        train: PackedBatches | StreamingBatches = StreamingBatches(
            lambda skip: sources.c4_documents("train", seed=seed, skip=skip), tok, seq_len
        )
    else:
        train_tokens = tokenize_corpus(train_texts, tok, progress=progress)
        val_stream = tokenize_corpus(val_texts, tok, progress=progress)
        if len(train_tokens) < seq_len:
            raise ValueError(
                f"--data {source}: its training split holds {len(train_tokens)} tokens, fewer than one sequence of "
                f"--seq-len {seq_len}; pass --seq-len {max(2, len(train_tokens) // 4)} (or at most "
                f"{len(train_tokens)}), or give more text"
            )
        if 2 <= len(val_stream) < seq_len:
            # A small corpus: validate on all the validation text there is, as one shorter window.
            print(f"note: the validation split of --data {source} holds {len(val_stream)} tokens, fewer than "
                  f"--seq-len {seq_len}: validating on them as one window of {len(val_stream)}", file=sys.stderr)
            validation = val_stream.long().view(1, -1)
        else:
            validation = validation_windows(val_stream, seq_len, val_tokens)
        train = PackedBatches(train_tokens, seq_len, seed=seed)
        info.update(train_tokens=int(len(train_tokens)), train_windows=train.windows)
    info["val_tokens"] = int(validation.numel())
    return DataBundle(tok, train, validation, info)
