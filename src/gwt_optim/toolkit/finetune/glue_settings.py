"""``finetune glue``'s settings, in a module of their own so that the data, training and report modules
that read them import none of each other's."""

from __future__ import annotations

from dataclasses import dataclass

from gwt_optim.toolkit.finetune.common import check_settings
from gwt_optim.toolkit.schedules import HF_SCHEDULES, check_schedule

__all__ = ["GlueSettings"]


@dataclass
class GlueSettings:
    model: str = "roberta-base"
    data_dir: str | None = None
    lr: float = 1e-5
    scale: float | None = None  # None: each method at the recipe's alpha (registry.recipe_scale)
    batch_size: int = 16
    max_length: int = 512
    epochs: float = 3.0
    max_steps: int = -1
    warmup: float = 0.06
    schedule: str = "linear"  # linear, cosine, wsd or constant: Hugging Face's (toolkit.schedules.hf_scheduler_args)
    decay: float = 0.2  # wsd: the decay's length, read as warmup is
    decay_shape: str = "1-sqrt"
    weight_decay: float = 0.0
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    seed: int = 42
    device: str = "auto"
    # None: one process per run on CPU (so peak RSS is per run), in-process on CUDA.
    isolate: bool | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        # max_steps -1: --epochs decides (transformers' convention)
        check_settings(self, counts=("batch_size", "max_length", "max_train_samples", "max_eval_samples"),
                       positive=("lr", "scale", "epochs"), non_negative=("warmup", "decay", "weight_decay"))
        check_schedule(self.schedule, self.decay_shape, tuple(HF_SCHEDULES))
        if self.max_steps != -1:
            check_settings(self, counts=("max_steps",))
