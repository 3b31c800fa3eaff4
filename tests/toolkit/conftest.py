"""Shared fixtures for the pre-training toolkit tests: a tiny LLaMA config, a
small local corpus with explicit train/validation files, a session-wide
cache for tokenizers and tokenized text, and free TCP ports."""

from __future__ import annotations

import json
import random
import socket

import pytest

TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

_WORDS = (
    "the king spake unto his servants and they went up to the city of david "
    "in those days there was a famine in the land and the people were afraid "
    "blessed are they that keep the word for they shall see light"
).split()


@pytest.fixture(scope="session", autouse=True)
def _shared_cache(tmp_path_factory):
    """Every worker shares one cache: tokenizers and token streams are written
    atomically, so concurrent xdist workers never see a partial file."""
    root = tmp_path_factory.getbasetemp()
    cache = (root.parent if root.name.startswith("popen-gw") else root) / "gwt-optim-cache"
    cache.mkdir(parents=True, exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("GWT_OPTIM_CACHE", str(cache))
    yield cache
    mp.undo()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path of a 2-layer, hidden-32 LLaMA config.json (vocab set by the tokenizer)."""
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def _document(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(3, 8)):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A folder with train.jsonl (400 documents) and valid.jsonl (40)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(1234)
    for name, n in (("train.jsonl", 400), ("valid.jsonl", 40)):
        with open(root / name, "w") as f:
            for _ in range(n):
                f.write(json.dumps({"text": _document(rng)}) + "\n")
    return str(root)


@pytest.fixture
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tiny_config(tiny_model, corpus, tmp_path):
    """A TrainConfig factory for a seconds-long CPU run on the tiny model and corpus."""
    from gwt_optim.toolkit.train import TrainConfig

    def make(**overrides):
        base = dict(
            out=str(tmp_path / "run"), model=tiny_model, data=corpus, tokenizer="bpe:320", seq_len=32,
            batch_size=4, steps=8, eval_every=4, val_tokens=512, eval_batch_size=8, lr=3e-3,
            progress=False, device="cpu", timing_warmup=1,
        )
        base.update(overrides)
        return TrainConfig(**base)

    return make


@pytest.fixture
def stop_at():
    """A callback factory: ``stop_at(6)`` interrupts before step 6 starts, as Ctrl-C would;
    ``stop_at(6, RuntimeError)`` crashes there instead, which saves nothing."""
    from gwt_optim.toolkit.train import Callback

    class StopAt(Callback):
        def __init__(self, step: int, exc: type[BaseException] = KeyboardInterrupt):
            self.step, self.exc = step, exc

        def on_step_start(self, step, model):
            if step == self.step:
                raise self.exc("stop")

    return StopAt
