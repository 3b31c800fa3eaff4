"""Training of ``finetune glue``: one (method, task) run with the Hugging Face
``Trainer`` on a fresh copy of the encoder, and the whole comparison with its
``results.json`` and ``results.md``."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Sequence

import torch

from gwt_optim.toolkit.finetune.common import (
    MethodSpec,
    PeakMemory,
    atomic_write_json,
    atomic_write_text,
    optimizer_state_bytes,
    parse_methods,
    pick_device,
    prepare_hub_access,
    previous_results,
    report_kept_on_stop,
    run_measured,
    settings_key,
)
from gwt_optim.toolkit.finetune.glue_data import _limit, _load_glue_tokenizer, _load_model, _tokenize, load_glue
from gwt_optim.toolkit.finetune.glue_report import glue_report
from gwt_optim.toolkit.finetune.glue_settings import GlueSettings
from gwt_optim.toolkit.finetune.glue_tasks import GLUE_TASKS, GlueTask, score_task
from gwt_optim.toolkit.schedules import hf_scheduler_args
from gwt_optim.toolkit.run_folder import lock_run_dir

__all__ = ["GlueSettings", "run_glue"]


def _run_one(task: GlueTask, spec: MethodSpec, tokenizer, data, settings: GlueSettings, work_dir: Path) -> dict:
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments, set_seed

    from gwt_optim.integrations import create_gwt_optimizer

    device = pick_device(settings.device)
    set_seed(settings.seed)  # the same classifier head for every method
    model = _load_model(settings.model, task)
    # Trainer's own count of optimizer steps (one process, no accumulation), which WSD's decay is a fraction of
    total = settings.max_steps if settings.max_steps > 0 else math.ceil(
        settings.epochs * math.ceil(len(data["train"]) / settings.batch_size))
    schedule, schedule_kwargs = hf_scheduler_args(settings.schedule, total, decay=settings.decay,
                                                  decay_shape=settings.decay_shape)
    targs = TrainingArguments(
        output_dir=str(work_dir),
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size,
        learning_rate=settings.lr,
        weight_decay=settings.weight_decay,
        num_train_epochs=settings.epochs,
        max_steps=settings.max_steps,
        lr_scheduler_type=schedule,
        lr_scheduler_kwargs=schedule_kwargs,
        warmup_steps=settings.warmup,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to="none",
        seed=settings.seed,
        use_cpu=device.type == "cpu",
        disable_tqdm=not settings.progress,
        dataloader_num_workers=0,
    )
    optimizer, scheduler = create_gwt_optimizer(
        model, targs, optimizer=spec.optimizer, scale=settings.scale, options=dict(spec.options)
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=data["train"],
        data_collator=DataCollatorWithPadding(tokenizer),
        optimizers=(optimizer, scheduler),
    )
    memory = PeakMemory(device)
    memory.reset()
    start = time.perf_counter()
    train_out = trainer.train()
    train_seconds = time.perf_counter() - start
    peak = memory.peak_bytes()
    predictions, references = {}, {}
    for split in task.eval_splits:
        pred = trainer.predict(data[split])
        logits = torch.as_tensor(pred.predictions)
        predictions[split] = logits.squeeze(-1) if task.is_regression else logits.argmax(-1)
        references[split] = torch.as_tensor(pred.label_ids)
    scores = score_task(task, predictions, references)
    # Plain numbers only: with --isolate a spawned worker pickles this back.
    return {
        "task": task.name,
        "method": spec.label,
        "scores": scores,
        "train_loss": float(train_out.training_loss),
        "steps": int(train_out.global_step),
        "train_seconds": train_seconds,
        "train_samples_per_second": float(train_out.metrics.get("train_samples_per_second", float("nan"))),
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "peak_memory_bytes": peak,
        "peak_memory_kind": memory.kind,
    }


def run_glue(
    tasks: Sequence[str], methods: Sequence[str], settings: GlueSettings, out_dir: str | Path, *,
    resume: bool = False,
) -> tuple[list[dict], str]:
    """Fine-tune every method on every task; write ``results.json`` after every run and ``results.md``.

    Returns the per-run records and the markdown report. One process writes
    ``out_dir`` at a time (:func:`~gwt_optim.toolkit.run_folder.lock_run_dir`); a
    stop (Ctrl-C, or SIGTERM under the CLI) keeps the finished runs in both
    files, and ``resume`` goes on from them: a (task, method) run already in
    ``results.json`` is not trained again, provided the settings are the same.
    """
    unknown = [t for t in tasks if t not in GLUE_TASKS]
    if unknown:
        raise ValueError(f"unknown GLUE task(s) {unknown}; choose from {', '.join(GLUE_TASKS)}")
    specs = parse_methods(methods)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with lock_run_dir(out_dir):
        records: list[dict] = []

        def write_report() -> str:
            report = glue_report(records, tasks, [s.label for s in specs], settings)
            atomic_write_text(out_dir / "results.md", report)
            return report

        with report_kept_on_stop("glue", out_dir, lambda: len(records), write_report):
            _run_all(tasks, specs, settings, out_dir, records, resume=resume)
        report = write_report()
    return records, report


def _run_all(tasks: Sequence[str], specs: Sequence[MethodSpec], settings: GlueSettings, out_dir: Path,
             records: list[dict], *, resume: bool) -> None:
    """Train every (task, method) pair not yet in ``records`` (from ``results.json`` with ``resume``),
    adding each record to ``records`` and ``results.json`` as it finishes."""
    results_path = out_dir / "results.json"
    if resume and results_path.is_file():
        previous = previous_results(results_path, "glue")
        if settings_key(previous.get("settings") or {}) != settings_key(settings.__dict__):
            raise ValueError(f"--resume: {results_path} was written with other settings; use another --out")
        records.extend(previous["runs"])
    done = {(r.get("task"), r.get("method")) for r in records}
    todo = [(name, [s for s in specs if (name, s.label) not in done]) for name in tasks]
    if not any(left for _, left in todo):
        return
    if not Path(settings.model).exists() or settings.data_dir is None:
        prepare_hub_access()
    tokenizer = _load_glue_tokenizer(settings.model)
    isolate = pick_device(settings.device).type == "cpu" if settings.isolate is None else settings.isolate
    for name, left in todo:
        if not left:
            continue
        task = GLUE_TASKS[name]
        data = load_glue(task, settings.data_dir)
        data = _limit(data, task, settings)
        data = _tokenize(data, tokenizer, task, settings.max_length)
        for spec in left:
            print(f"[finetune glue] {task.title} with {spec.label}", flush=True)
            work_dir = out_dir / "runs" / f"{name}-{_slug(spec.label)}"
            record = run_measured(isolate, _run_one, task, spec, tokenizer, data, settings, work_dir)
            records.append(record)
            atomic_write_json(results_path, {"settings": settings.__dict__, "runs": records})


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
