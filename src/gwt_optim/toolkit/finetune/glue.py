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
from dataclasses import dataclass

from gwt_optim.toolkit.finetune.common import resume_setting
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
from gwt_optim.toolkit.finetune.glue_settings import GlueSettings
from gwt_optim.toolkit.finetune.glue_train import run_glue
from gwt_optim.toolkit.flags import add_flags, from_flags, setting

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
    "GlueCommand",
    "run_glue",
    "glue_report",
    "add_arguments",
    "main",
]


@dataclass
class GlueCommand:
    """``finetune glue``'s flags that are not a run's settings (``results.json`` keeps none of them): which
    tasks and methods run, where their results go, whether earlier ones are kept."""

    tasks: str = setting("all", f"comma-separated GLUE tasks or 'all' ({','.join(GLUE_TASKS)}); --task is an alias",
                         alias="--task")
    methods: str = setting("adamw,gwt-adamw:level=2",
                           "comma-separated registry optimizers with options (name:key=value), or lora:r=8")
    out: str = setting("results/finetune-glue", "directory for results.json and results.md")
    resume: bool = resume_setting("(method, task)")


# --help's order: GlueSettings' (results.json's) with the command's flags among them.
FLAG_ORDER = (
    "tasks", "methods", "model", "data_dir", "lr", "scale", "batch_size", "max_length", "epochs", "max_steps",
    "warmup", "schedule", "decay", "decay_shape", "weight_decay", "max_train_samples", "max_eval_samples", "seed",
    "device", "isolate", "out", "progress", "resume",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, GlueSettings, GlueCommand, order=FLAG_ORDER)


def main(args: argparse.Namespace) -> int:
    command = from_flags(GlueCommand, args)
    tasks = (list(GLUE_TASKS) if command.tasks == "all"
             else [t.strip().lower() for t in command.tasks.split(",") if t.strip()])
    settings = from_flags(GlueSettings, args)
    _, report = run_glue(tasks, command.methods.split(","), settings, command.out, resume=command.resume)
    print(report)
    return 0
