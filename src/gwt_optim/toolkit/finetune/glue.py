"""``gwt-optim finetune glue``: full-parameter fine-tuning on the eight GLUE tasks.

The paper's recipe is RoBERTa-base, GWT level 2 with Haar, module-wise
``alpha = 2`` on query/key/value and the intermediate and output dense layers,
batch 16, maximum length 512. Each (method, task) pair trains a fresh copy of
the pretrained model with the Hugging Face ``Trainer`` and the optimizer from
:func:`gwt_optim.integrations.create_gwt_optimizer`, then scores the
validation split(s) with the task's standard metric:

=======  ==========================  ==================================
task     inputs                      metric (table cell)
=======  ==========================  ==================================
CoLA     sentence                    Matthews correlation
SST-2    sentence                    accuracy
MRPC     sentence1, sentence2        accuracy / F1
STS-B    sentence1, sentence2        Pearson / Spearman (regression)
QQP      question1, question2        accuracy / F1
MNLI     premise, hypothesis         accuracy, matched / mismatched
QNLI     question, sentence          accuracy
RTE      sentence1, sentence2        accuracy
=======  ==========================  ==================================

Data comes from the hub (``nyu-mll/glue``) or from ``--data-dir`` laid out as
``DIR/<task>/<split>.jsonl`` (or ``.tsv`` with a header row) in the hub's
column names; MNLI's evaluation splits are ``validation_matched`` and
``validation_mismatched``.

This module is the command line and re-exports the public names of the
modules that do the work: :mod:`.glue_metrics`, :mod:`.glue_tasks` (the task
table and its scoring), :mod:`.glue_data` (data, tokenizer and model
loading), :mod:`.glue_train` (the runs) and :mod:`.glue_report`.
"""

from __future__ import annotations

import argparse

from gwt_optim.toolkit.finetune.common import SCALE_HELP, add_run_arguments, isolate_choice, settings_from_args
from gwt_optim.toolkit.finetune.glue_data import load_glue
from gwt_optim.toolkit.finetune.glue_metrics import (
    METRICS,
    accuracy,
    f1_binary,
    matthews_corrcoef,
    pearson,
    spearman,
)
from gwt_optim.toolkit.finetune.glue_report import glue_report
from gwt_optim.toolkit.finetune.glue_tasks import GLUE_TASKS, GlueTask, score_task, task_cell
from gwt_optim.toolkit.schedules import HF_SCHEDULES, add_finetune_arguments
from gwt_optim.toolkit.finetune.glue_settings import GlueSettings
from gwt_optim.toolkit.finetune.glue_train import run_glue

__all__ = [
    "GlueTask",
    "GLUE_TASKS",
    "METRICS",
    "accuracy",
    "f1_binary",
    "matthews_corrcoef",
    "pearson",
    "spearman",
    "score_task",
    "task_cell",
    "load_glue",
    "GlueSettings",
    "run_glue",
    "glue_report",
    "add_arguments",
    "main",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = GlueSettings()
    p.add_argument(
        "--tasks",
        default="all",
        help=f"comma-separated GLUE tasks or 'all' ({','.join(GLUE_TASKS)}); --task is an alias",
    )
    p.add_argument("--task", dest="tasks", help=argparse.SUPPRESS)
    p.add_argument(
        "--methods",
        default="adamw,gwt-adamw:level=2",
        help="comma-separated registry optimizers with options (name:key=value), or lora:r=8",
    )
    p.add_argument("--model", default=d.model, help="hub id or local directory of a pretrained encoder")
    p.add_argument("--data-dir", default=None,
                   help="local GLUE data: DIR/<task>/<split>.jsonl|.tsv (default: the Hub's nyu-mll/glue)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate of every method (after the warm-up "
                   "--schedule takes it)")
    p.add_argument("--scale", type=float, default=d.scale, help=SCALE_HELP)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="training sequences per optimizer step")
    p.add_argument("--max-length", type=int, default=d.max_length, help="tokens per example; longer ones are cut")
    p.add_argument("--epochs", type=float, default=d.epochs, help="passes over each task's training set")
    p.add_argument("--max-steps", type=int, default=d.max_steps,
                   help="stop after this many optimizer steps, whatever --epochs says; -1: --epochs decides")
    p.add_argument("--warmup", type=float, default=d.warmup, help="warm-up steps, or a fraction of them if < 1")
    add_finetune_arguments(p, default=d.schedule, kinds=tuple(HF_SCHEDULES))
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="decoupled weight decay")
    p.add_argument("--max-train-samples", type=int, default=None,
                   help="train on the first N examples of each task (default: all)")
    p.add_argument("--max-eval-samples", type=int, default=None,
                   help="evaluate on the first N examples of each task (default: all)")
    add_run_arguments(
        p, d, runs="(method, task)", out="results/finetune-glue", out_help="directory for results.json and results.md"
    )


def main(args: argparse.Namespace) -> int:
    tasks = list(GLUE_TASKS) if args.tasks == "all" else [t.strip().lower() for t in args.tasks.split(",") if t.strip()]
    settings = settings_from_args(GlueSettings, args, isolate=isolate_choice(args.isolate),
                                  progress=not args.no_progress)
    _, report = run_glue(tasks, args.methods.split(","), settings, args.out, resume=args.resume)
    print(report)
    return 0
