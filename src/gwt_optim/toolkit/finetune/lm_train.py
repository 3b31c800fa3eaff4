"""Training of ``finetune lm``: one (method, learning rate) run on a fresh
copy of the model, and the whole comparison with its ``results.json``."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from gwt_optim.toolkit.finetune.common import (
    MethodSpec,
    PeakMemory,
    atomic_write_json,
    atomic_write_text,
    mib,
    optimizer_state_bytes,
    parse_methods,
    pick_device,
    previous_results,
    report_kept_on_stop,
    run_measured,
    settings_key,
)
from gwt_optim.toolkit.finetune.lm_data import LMData, prepare_data
from gwt_optim.toolkit.finetune.lm_model import (
    ModelSource,
    _wrap_lora,
    cache_base_model,
    load_lm_tokenizer,
    load_model,
    resolve_model,
)
from gwt_optim.toolkit.finetune.lm_report import lm_report
from gwt_optim.toolkit.finetune.lm_settings import LMSettings
from gwt_optim.toolkit.losses import IGNORE_INDEX, next_token_losses, perplexity_of
from gwt_optim.toolkit.run_folder import lock_run_dir

__all__ = ["LMSettings", "perplexity", "train_one", "run_lm"]


@torch.no_grad()
def perplexity(model: nn.Module, batches: Sequence[dict[str, torch.Tensor]], device: torch.device) -> float:
    """exp of the mean next-token loss over every unmasked target token, capped as every perplexity the
    toolkit reports is (a diverged run's figure stays a number, and exp never overflows)."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total += float(next_token_losses(logits, batch["labels"]).sum())
        count += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    model.train()
    if count == 0:  # e.g. Alpaca prompts longer than --seq-len: every response is cut off
        raise ValueError("no validation target token fits in a sequence (every response is cut off by its "
                         "prompt); raise --seq-len")
    return perplexity_of(total / count)


def train_one(
    spec: MethodSpec, lr: float, source: ModelSource, data: LMData, settings: LMSettings, device: torch.device
) -> dict[str, Any]:
    """Fine-tune a fresh copy of the model with one method at one learning rate."""
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    from gwt_optim.integrations.hf import default_target_modules
    from gwt_optim.toolkit.metrics import Throughput
    from gwt_optim.toolkit.models import count_parameters
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer
    from gwt_optim.toolkit.schedules import hf_scheduler_args, warmup_steps

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
    kind, kwargs = hf_scheduler_args(settings.schedule, settings.steps, decay=settings.decay,
                                     decay_shape=settings.decay_shape)
    scheduler = get_scheduler(kind, optimizer, num_warmup_steps=warmup_steps(settings.warmup, settings.steps),
                              num_training_steps=settings.steps, scheduler_specific_kwargs=kwargs)
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
        "trainable_params": count_parameters(model),
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

    ``cache_dir`` (default ``out_dir``) holds the de-quantized copy of a GGUF model. One process writes
    ``out_dir`` at a time (:func:`~gwt_optim.toolkit.run_folder.lock_run_dir`); a stop (Ctrl-C, or SIGTERM under
    the CLI) keeps the finished runs in both files, and ``resume`` goes on from them.
    """
    specs = parse_methods(methods)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with lock_run_dir(out_dir):
        results: dict = {}

        def write_report() -> str:
            report = lm_report(results, [s.label for s in specs])
            atomic_write_text(out_dir / "results.md", report)
            return report

        with report_kept_on_stop("lm", out_dir, lambda: len(results.get("runs", [])), write_report):
            _run_all(specs, settings, out_dir, results, resume=resume, cache_dir=cache_dir)
        report = write_report()
    return results, report


def _run_all(specs: Sequence[MethodSpec], settings: LMSettings, out_dir: Path, results: dict, *, resume: bool,
             cache_dir: str | Path | None) -> None:
    """Fill ``results`` (from ``results.json`` with ``resume``) run by run, writing the file after each."""
    from gwt_optim.toolkit.metrics import environment

    device = pick_device(settings.device)
    if settings.tf32:
        # TF32 tensor-core matmuls (fp32 storage and optimizer math): several
        # times faster on Ampere and later GPUs, the usual choice for fp32 training.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    source = resolve_model(settings.model)
    tokenizer = load_lm_tokenizer(source)
    source = cache_base_model(source, Path(cache_dir) if cache_dir else out_dir)
    data = prepare_data(settings, tokenizer)
    results_path = out_dir / "results.json"
    key = settings_key(asdict(settings))
    previous = previous_results(results_path, "lm") if resume and results_path.is_file() else None
    if previous is not None and previous.get("settings") != key:
        raise ValueError(f"--resume: {results_path} was written with other settings; use another --out")
    results.update(previous or {
        "settings": key,
        "model": source.description,
        "data": {"format": data.format, "train_tokens": data.train_tokens, "val_targets": data.val_targets},
        "environment": environment(("peft", "galore-torch", "apollo-torch")),
        "runs": [],
    })
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

