"""Data sources, splits, tokenizers and the resumable batch order."""

from __future__ import annotations

import json
import re

import pytest
import torch

from gwt_optim.toolkit import data


def test_demo_split_is_fixed_disjoint_and_clean():
    train = data.load_texts("demo", "train")
    val = data.load_texts("demo", "validation", seed=123)  # the seed never moves the split
    assert len(val) == len(data.load_texts("demo", "val")) == 59
    assert len(train) == 1130
    assert not set(train) & set(val)
    assert train[0].startswith("In the beginning God created the heaven")
    assert not any(re.search(r"\b\d+:\d+\b", doc) for doc in train[:50] + val)  # verse numbers stripped


def test_local_folder_uses_named_split_files(corpus):
    train = data.load_texts(corpus, "train")
    val = data.load_texts(corpus, "validation")
    assert (len(train), len(val)) == (400, 40)
    first = json.loads(open(f"{corpus}/train.jsonl").readline())["text"]
    assert train[0] == first


def test_local_hash_split_is_deterministic_and_disjoint(tmp_path):
    docs = [f"document number {i} about {'abc'[i % 3]}" for i in range(400)]
    (tmp_path / "notes.txt").write_text("\n\n".join(docs))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": ["parquet row one", "parquet row two"]}), tmp_path / "more.parquet")
    train = data.load_texts(str(tmp_path), "train")
    val = data.load_texts(str(tmp_path), "validation")
    assert set(train) | set(val) == set(docs) | {"parquet row one", "parquet row two"}
    assert not set(train) & set(val)
    # About 5% by hash: a fixed, content-defined share, identical on every call.
    assert 5 <= len(val) <= 40
    assert val == data.load_texts(str(tmp_path), "validation", seed=7)


def test_local_errors_name_the_fix(tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text(json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(ValueError, match="'text' field"):
        data.load_texts(str(bad), "train")
    with pytest.raises(FileNotFoundError) as missing:
        data.load_texts(str(tmp_path / "missing"), "train")
    assert all(f"'{name}'" in str(missing.value) for name in ("demo", "c4", "pysrc", "pysrc-small"))
    with pytest.raises(ValueError, match="unknown split"):
        data.load_texts("demo", "holdout")


def test_c4_offline_fails_fast_with_a_clear_message(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(data.DataUnavailable, match=r"allenai/c4.*--data demo"):
        data.load_texts("c4", "validation", limit=1)


def test_unreachable_tokenizer_fails_with_a_clear_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(data.DataUnavailable, match="--tokenizer bpe"):
        data.load_pretrain_tokenizer("gwt-optim-tests/no-such-tokenizer", "demo")


def test_bpe_trains_on_train_split_caches_and_round_trips(corpus, _shared_cache):
    tok = data.load_pretrain_tokenizer("bpe:320", corpus)
    assert len(tok) == 320
    assert tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    text = data.load_texts(corpus, "validation")[0]
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: lossless
    assert data.cache_dir() == _shared_cache / "data"  # the one cache rule: $GWT_OPTIM_CACHE/<kind>
    cached = list((data.cache_dir() / "tokenizers").glob("*-bpe320-*.json"))
    assert cached
    again = data.load_pretrain_tokenizer("bpe:320", corpus)
    assert again.get_vocab() == tok.get_vocab()


def test_tokenized_stream_separates_documents_with_eos(corpus):
    tok = data.load_pretrain_tokenizer("bpe:320", corpus)
    texts = data.load_texts(corpus, "validation")[:3]
    ids = data.tokenize_corpus(texts, tok, progress=False)
    assert ids.dtype == torch.int32
    assert int((ids == tok.eos_token_id).sum()) == 3
    assert ids[-1] == tok.eos_token_id
    assert torch.equal(ids, data.tokenize_corpus(texts, tok, progress=False))


def test_packed_batches_order_is_seeded_and_covers_each_epoch():
    tokens = torch.arange(10 * 4, dtype=torch.int32)  # 10 windows of 4
    a, b = data.PackedBatches(tokens, 4, seed=3), data.PackedBatches(tokens, 4, seed=3)
    first = a.next(10)
    assert torch.equal(first, b.next(10))
    assert sorted(first[:, 0].tolist()) == list(range(0, 40, 4))  # every window once per epoch
    assert not torch.equal(first, data.PackedBatches(tokens, 4, seed=4).next(10))
    assert a.epoch == 1 and a.cursor == 0


def test_packed_batches_resume_mid_epoch_exactly():
    tokens = torch.arange(13 * 8, dtype=torch.int32)
    ref = data.PackedBatches(tokens, 8, seed=0)
    expected = [ref.next(3) for _ in range(9)]  # crosses two epoch boundaries
    run = data.PackedBatches(tokens, 8, seed=0)
    for _ in range(4):
        run.next(3)
    state = json.loads(json.dumps(run.state_dict()))  # survives serialization
    resumed = data.PackedBatches(tokens, 8, seed=0)
    resumed.load_state_dict(state)
    for want in expected[4:]:
        assert torch.equal(resumed.next(3), want)
    with pytest.raises(ValueError, match="--seed"):
        data.PackedBatches(tokens, 8, seed=1).load_state_dict(state)


def test_streaming_batches_resume_exactly():
    class Tok:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    docs = [f"doc{i}-" * (i % 3 + 1) for i in range(200)]
    stream = lambda skip: iter(docs[skip:])  # noqa: E731
    ref = data.StreamingBatches(stream, Tok(), 7)
    expected = [ref.next(2) for _ in range(6)]
    run = data.StreamingBatches(stream, Tok(), 7)
    run.next(2), run.next(2)
    resumed = data.StreamingBatches(stream, Tok(), 7)
    resumed.load_state_dict(run.state_dict())
    for want in expected[2:]:
        assert torch.equal(resumed.next(2), want)


def test_validation_windows_are_a_fixed_budget_spread_over_the_stream():
    stream = torch.arange(100, dtype=torch.int32)
    w = data.validation_windows(stream, 8, 40)
    assert w.shape == (5, 8) and w.dtype == torch.long
    starts = w[:, 0].tolist()
    assert starts == [0, 16, 32, 56, 72]  # windows 0, 2, 4, 7, 9 of 12
    assert all(torch.equal(row, torch.arange(s, s + 8)) for row, s in zip(w, starts))
    # A budget past the stream takes every window, in order.
    assert torch.equal(data.validation_windows(stream, 8, 10_000).flatten(), torch.arange(96))


def test_validation_spans_a_corpus_grouped_by_source(tmp_path, _shared_cache):
    """A local corpus stored one source after another: the validation windows
    hold tokens of every source, not of the first one alone."""
    sources = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    rows = [{"text": f"{name} " * 60} for name in sources for _ in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bundle = data.build_data(str(tmp_path), seq_len=16, val_tokens=16 * 16, tokenizer="bpe", vocab_size=300,
                             progress=False)
    assert bundle.validation.shape == (16, 16)
    text = bundle.tokenizer.decode(bundle.validation.flatten().tolist())
    assert {name for name in sources if name in text} == set(sources)
    # The old reading, the first val_tokens of the stream, saw the first source alone.
    stream = data.tokenize_corpus(data.load_texts(str(tmp_path), "validation"), bundle.tokenizer, cache=False,
                                  progress=False)
    first = bundle.tokenizer.decode(stream[: 16 * 16].tolist())
    assert {name for name in sources if name in first} == {"alpha"}
