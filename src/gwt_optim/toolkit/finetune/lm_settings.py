"""``finetune lm``'s settings, in a module of their own so that the data, training and report modules
that read them import none of each other's. Each field states its flag (:mod:`gwt_optim.toolkit.flags`);
the fields' order is ``results.json``'s, ``lm.add_arguments`` gives ``--help``'s."""

from __future__ import annotations

from dataclasses import dataclass

from gwt_optim.toolkit.errors import UsageError
from gwt_optim.toolkit.finetune.common import (
    check_settings,
    device_setting,
    isolate_setting,
    progress_setting,
    scale_setting,
    seed_setting,
)
from gwt_optim.toolkit.finetune.lm_model import BUILTIN_MODELS
from gwt_optim.toolkit.flags import setting
from gwt_optim.toolkit.schedules import SCHEDULES, check_schedule, decay_setting, decay_shape_setting, schedule_setting

__all__ = ["LMSettings"]


@dataclass
class LMSettings:
    model: str = setting("smollm2", f"{', '.join(BUILTIN_MODELS)} (offline, shipped by a package), a .gguf file, "
                         "a local model directory, or a hub id")
    data: str = setting("demo", "a corpus name of the toolkit (demo), a .txt file, or Alpaca .json/.jsonl")
    format: str = setting("auto", "how --data is read; auto: Alpaca for .json, and for .jsonl whose records have an "
                          "'instruction', plain text otherwise", choices=("auto", "text", "alpaca"))
    val_data: str | None = setting(None, "validation file (default: hold out --val-fraction of --data)")
    val_fraction: float = setting(0.1, "Alpaca records held out when there is no --val-data")
    # Sized for a 2-core CPU (about 100 s per 4 x 128-token SmolLM2 step there);
    # on a GPU use --seq-len 512 --batch-size 8 --steps 100 (docs/finetuning.md).
    seq_len: int = setting(128, "tokens per sequence")
    batch_size: int = setting(4, "sequences per optimizer step")
    steps: int = setting(10, "optimizer steps of each (method, lr) run")
    eval_batches: int = setting(8, "validation batches of --batch-size sequences each")
    lrs: tuple[float, ...] = setting((1e-4, 3e-4), "learning-rate grid, the same for every method",
                                     text=lambda lrs: ",".join(f"{x:g}" for x in lrs),
                                     value=lambda text: tuple(float(x) for x in text.split(",") if x.strip()))
    scale: float | None = scale_setting()  # None: each method at the recipe's alpha (registry.recipe_scale)
    # GWT's first steps have heavy-tailed detail updates (docs/finetuning.md):
    # short runs need a warm-up of several steps.
    warmup: float = setting(0.3, "warm-up steps, or a fraction of --steps if < 1")
    schedule: str = schedule_setting("cosine", SCHEDULES)  # Hugging Face's (toolkit.schedules.hf_scheduler_args)
    decay: float = decay_setting()
    decay_shape: str = decay_shape_setting()
    weight_decay: float = setting(0.0, "decoupled weight decay")
    # The flag's 0 is the setting's None.
    max_grad_norm: float | None = setting(1.0, "clip the gradient norm at this value; 0 disables clipping",
                                          value=lambda norm: norm or None)
    seed: int = seed_setting(0)
    device: str = device_setting()
    tf32: bool = setting(False, "allow TF32 matmuls on CUDA (recorded in the results)", action="store_true")
    # None: one process per run on CPU (so peak RSS is per run), in-process on CUDA.
    isolate: bool | None = isolate_setting("(method, lr)")
    progress: bool = progress_setting()

    def __post_init__(self) -> None:
        check_settings(self, counts=("seq_len", "batch_size", "steps", "eval_batches"),
                       positive=("lrs", "scale", "max_grad_norm"), non_negative=("warmup", "decay", "weight_decay"))
        check_schedule(self.schedule, self.decay_shape, SCHEDULES)
        if not self.lrs:
            raise UsageError("--lrs needs at least one learning rate")
        if not 0 < self.val_fraction < 1:
            raise UsageError(f"--val-fraction must be a number between 0 and 1, got {self.val_fraction!r}")
