"""Tiny randomly initialised models for offline smoke tests of ``finetune``.

``save_tiny_roberta(dir, texts)`` and ``save_tiny_llama(dir, texts)`` write a
model directory (config, weights, tokenizer) that ``--model dir`` loads
exactly like a downloaded checkpoint, so the whole GLUE and LM code paths run
in seconds with no network. The tokenizer is word-level over the words of
``texts`` (unknown words map to ``<unk>``); the RoBERTa one adds RoBERTa's
``<s> A </s></s> B </s>`` framing.

    python -m gwt_optim.toolkit.finetune.tiny roberta OUT_DIR TEXT_FILE...
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Iterable

import torch

__all__ = ["word_tokenizer", "save_tiny_roberta", "save_tiny_llama"]

_WORD = re.compile(r"\w+|[^\w\s]")


def word_tokenizer(texts: Iterable[str], *, roberta: bool):
    """A ``PreTrainedTokenizerFast`` whose vocabulary is the words of ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    words = sorted({w for t in texts for w in _WORD.findall(t)})
    vocab = {tok: i for i, tok in enumerate(special + words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece()  # joins words with spaces
    if roberta:
        core.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>",
            pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        model_max_length=512,
    )


def save_tiny_roberta(path: str | Path, texts: Iterable[str], *, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """A 2-layer RoBERTa encoder (no task head) with a word-level tokenizer."""
    from transformers import RobertaConfig, RobertaModel

    tok = word_tokenizer(texts, roberta=True)
    config = RobertaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=tok.model_max_length + 2,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    path = Path(path)
    RobertaModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_tiny_llama(path: str | Path, texts: Iterable[str], *, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """A 2-layer LLaMA causal LM with a word-level tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = word_tokenizer(texts, roberta=False)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    path = Path(path)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) < 4 or sys.argv[1] not in ("roberta", "llama"):
        sys.exit("usage: python -m gwt_optim.toolkit.finetune.tiny {roberta,llama} OUT_DIR TEXT_FILE...")
    corpus = [Path(f).read_text() for f in sys.argv[3:]]
    {"roberta": save_tiny_roberta, "llama": save_tiny_llama}[sys.argv[1]](sys.argv[2], corpus)
