"""Tokenizers for pre-training: a hub or local tokenizer, or a byte-level BPE
trained on the training split and cached."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from gwt_optim.toolkit.data.cache import _digest, cache_dir
from gwt_optim.toolkit.data.sources import DataUnavailable, _hub_offline, load_texts

__all__ = ["BPE_SPECIAL_TOKENS", "bpe_tokenizer", "demo_tokenizer", "load_pretrain_tokenizer"]


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
    """The paper's t5-base for C4; a small BPE of their own, trained here and
    offline, for the offline corpora (the demo, ``pysrc``, ``pysrc-small``) and
    local text."""
    return "t5-base" if data == "c4" else "bpe"


def load_pretrain_tokenizer(spec: str | None, data: str, *, vocab_size: int = 4096, seed: int = 0,
                   train_texts: Sequence[str] | None = None):
    """The tokenizer named by ``spec`` for the data source ``data``.

    ``None``/``"auto"`` -> t5-base (the paper's) for C4, a BPE trained on the
    training split for everything else (the demo BPE for ``demo``). ``"bpe"`` or ``"bpe:8192"`` -> a byte-level BPE
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
