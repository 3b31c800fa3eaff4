"""``finetune glue``'s settings, in a module of their own so that the data, training and report modules
that read them import none of each other's. Each field states its flag (:mod:`gwt_optim.toolkit.flags`);
the fields' order is ``results.json``'s, ``glue.add_arguments`` gives ``--help``'s."""

from __future__ import annotations

from dataclasses import dataclass

from gwt_optim.toolkit.finetune.common import (
    check_settings,
    device_setting,
    isolate_setting,
    progress_setting,
    scale_setting,
    seed_setting,
)
from gwt_optim.toolkit.flags import setting
from gwt_optim.toolkit.schedules import HF_SCHEDULES, check_schedule, decay_setting, decay_shape_setting, schedule_setting

__all__ = ["GlueSettings"]


@dataclass
class GlueSettings:
    model: str = setting("roberta-base", "hub id or local directory of a pretrained encoder")
    data_dir: str | None = setting(None, "local GLUE data: DIR/<task>/<split>.jsonl|.tsv (default: the Hub's "
                                   "nyu-mll/glue)")
    lr: float = setting(1e-5, "peak learning rate of every method (after the warm-up --schedule takes it)")
    scale: float | None = scale_setting()  # None: each method at the recipe's alpha (registry.recipe_scale)
    batch_size: int = setting(16, "training sequences per optimizer step")
    max_length: int = setting(512, "tokens per example; longer ones are cut")
    epochs: float = setting(3.0, "passes over each task's training set")
    # -1: --epochs decides (transformers' convention)
    max_steps: int = setting(-1, "stop after this many optimizer steps, whatever --epochs says; -1: --epochs decides")
    warmup: float = setting(0.06, "warm-up steps, or a fraction of them if < 1")
    schedule: str = schedule_setting("linear", tuple(HF_SCHEDULES))  # Hugging Face's (schedules.hf_scheduler_args)
    decay: float = decay_setting()
    decay_shape: str = decay_shape_setting()
    weight_decay: float = setting(0.0, "decoupled weight decay")
    max_train_samples: int | None = setting(None, "train on the first N examples of each task (default: all)")
    max_eval_samples: int | None = setting(None, "evaluate on the first N examples of each task (default: all)")
    seed: int = seed_setting(42)
    device: str = device_setting()
    # None: one process per run on CPU (so peak RSS is per run), in-process on CUDA.
    isolate: bool | None = isolate_setting("(method, task)")
    progress: bool = progress_setting()

    def __post_init__(self) -> None:
        check_settings(self, counts=("batch_size", "max_length", "max_train_samples", "max_eval_samples"),
                       positive=("lr", "scale", "epochs"), non_negative=("warmup", "decay", "weight_decay"))
        check_schedule(self.schedule, self.decay_shape, tuple(HF_SCHEDULES))
        if self.max_steps != -1:
            check_settings(self, counts=("max_steps",))
