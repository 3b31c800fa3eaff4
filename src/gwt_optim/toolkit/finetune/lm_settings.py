"""``finetune lm``'s settings, in a module of their own so that the data, training and report modules
that read them import none of each other's."""

from __future__ import annotations

from dataclasses import dataclass

from gwt_optim.toolkit.errors import UsageError
from gwt_optim.toolkit.finetune.common import check_settings
from gwt_optim.toolkit.schedules import SCHEDULES, check_schedule

__all__ = ["LMSettings"]


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
    scale: float | None = None  # None: each method at the recipe's alpha (registry.recipe_scale)
    # GWT's first steps have heavy-tailed detail updates (docs/finetuning.md):
    # short runs need a warm-up of several steps.
    warmup: float = 0.3
    schedule: str = "cosine"  # cosine, wsd or constant: Hugging Face's (toolkit.schedules.hf_scheduler_args)
    decay: float = 0.2  # wsd: the decay's length, read as warmup is
    decay_shape: str = "1-sqrt"
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    seed: int = 0
    device: str = "auto"
    tf32: bool = False
    # None: one process per run on CPU (so peak RSS is per run), in-process on CUDA.
    isolate: bool | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        check_settings(self, counts=("seq_len", "batch_size", "steps", "eval_batches"),
                       positive=("lrs", "scale", "max_grad_norm"), non_negative=("warmup", "decay", "weight_decay"))
        check_schedule(self.schedule, self.decay_shape, SCHEDULES)
        if not self.lrs:
            raise UsageError("--lrs needs at least one learning rate")
        if not 0 < self.val_fraction < 1:
            raise UsageError(f"--val-fraction must be a number between 0 and 1, got {self.val_fraction!r}")
