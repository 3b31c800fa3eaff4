"""The learning-rate schedules of ``pretrain``, ``compare`` and the budget protocol.

Each is a multiplier of the peak lr, a function of the number of finished
optimizer steps alone, so that a resumed run recomputes it bit for bit:

``cosine``    linear warm-up to 1, then a cosine down to ``min_ratio`` at the
              last step (the paper's schedule, and the default).
``wsd``       warmup-stable-decay: linear warm-up to 1, 1 through a stable
              phase, then a decay to ``min_ratio`` over the last ``decay``
              steps (``1-sqrt`` by default, after Hägele et al. 2024, *Scaling
              Laws and Compute-Optimal Training Beyond Fixed Training
              Durations*, where a 20% 1-sqrt cool-down matched cosine; or
              ``linear``). The point of WSD: a stable-phase checkpoint at step k
              decays on demand, ``--resume --steps k+D --decay D``; the steps
              taken keep their lrs, the decay follows.
``constant``  linear warm-up to 1, then 1 (fine-tuning, continued pre-training).

``warmup`` and ``decay`` share one rule (:func:`steps_of`): below 1 a fraction
of the run's steps, else a number of steps. ``finetune`` trains through Hugging
Face's schedulers of the same names (:mod:`gwt_optim.toolkit.finetune`).
"""

from __future__ import annotations

import math
from typing import Any

from gwt_optim.toolkit.flags import setting

__all__ = ["SCHEDULES", "DECAY_SHAPES", "HF_SCHEDULES", "hf_scheduler_args", "WarmupCosine", "WarmupStableDecay", "WarmupConstant", "make_schedule",
           "steps_of", "warmup_steps", "describe", "check_schedule", "schedule_setting", "decay_setting",
           "decay_shape_setting"]

SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("1-sqrt", "linear")


def steps_of(value: float, total_steps: int) -> int:
    """Steps from ``--warmup`` or ``--decay``: a fraction of ``total_steps`` when
    below 1, else a number of steps. A fraction is rounded to the nearest step,
    halves to even (Python's ``round``), so the same flag gives the same
    schedule in every command."""
    return int(round(value * total_steps)) if value < 1 else int(value)


def warmup_steps(warmup: float, total_steps: int) -> int:
    """Warm-up length from ``--warmup`` (:func:`steps_of`)."""
    return steps_of(warmup, total_steps)


class _Warmup:
    """Linear warm-up to 1 over ``warmup_steps``. Schedules are callable objects,
    not lambdas, so that ``LambdaLR`` can checkpoint them."""

    def __init__(self, total_steps: int, warmup_steps: int):
        self.total_steps = max(1, total_steps)
        self.warmup_steps = max(0, min(warmup_steps, self.total_steps))

    def warm(self, step: int) -> float | None:
        # ``step`` counts finished optimizer steps: step 0 uses the first warm-up value.
        return (step + 1) / self.warmup_steps if step < self.warmup_steps else None


class WarmupCosine(_Warmup):
    """Linear warm-up to 1, then cosine down to ``min_ratio``."""

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float = 0.1):
        super().__init__(total_steps, warmup_steps)
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        warm = self.warm(step)
        if warm is not None:
            return warm
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupStableDecay(_Warmup):
    """Linear warm-up to 1, 1 until the last ``decay_steps``, then down to
    ``min_ratio`` by ``shape`` (``1-sqrt``: 1 - √p; ``linear``: 1 - p), with p the
    decay's progress, (steps into the decay + 1) / ``decay_steps``: the last step
    runs at ``min_ratio``, where a short 1-sqrt decay spends most of its steps."""

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float = 0.1, decay_steps: int = 0,
                 shape: str = "1-sqrt"):
        super().__init__(total_steps, warmup_steps)
        if shape not in DECAY_SHAPES:
            raise ValueError(f"decay shape {shape!r}: choose one of {', '.join(DECAY_SHAPES)}")
        self.min_ratio = min_ratio
        self.decay_steps = max(0, min(decay_steps, self.total_steps - self.warmup_steps))
        self.shape = shape

    @property
    def decay_start(self) -> int:
        return self.total_steps - self.decay_steps

    def __call__(self, step: int) -> float:
        warm = self.warm(step)
        if warm is not None:
            return warm
        if step < self.decay_start or not self.decay_steps:
            return 1.0
        progress = min(1.0, (step - self.decay_start + 1) / self.decay_steps)
        down = math.sqrt(progress) if self.shape == "1-sqrt" else progress
        return self.min_ratio + (1 - self.min_ratio) * (1 - down)


class WarmupConstant(_Warmup):
    """Linear warm-up to 1, then 1."""

    def __call__(self, step: int) -> float:
        warm = self.warm(step)
        return 1.0 if warm is None else warm


def make_schedule(kind: str, total_steps: int, warmup: float, *, min_ratio: float = 0.1, decay: float = 0.2,
                  decay_shape: str = "1-sqrt"):
    """The schedule named ``kind`` for a run of ``total_steps``, with ``warmup``
    and ``decay`` read by :func:`steps_of`."""
    w = steps_of(warmup, total_steps)
    if kind == "cosine":
        return WarmupCosine(total_steps, w, min_ratio)
    if kind == "wsd":
        return WarmupStableDecay(total_steps, w, min_ratio, steps_of(decay, total_steps), decay_shape)
    if kind == "constant":
        return WarmupConstant(total_steps, w)
    raise ValueError(f"schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")


def describe(kind: str, warmup: float, *, min_ratio: float = 0.1, decay: float = 0.2,
             decay_shape: str = "1-sqrt") -> str:
    """One phrase for reports: ``0.1 warm-up then cosine to 0.1``."""
    if kind == "cosine":
        return f"{warmup} warm-up then cosine to {min_ratio}"
    if kind == "wsd":
        return f"{warmup} warm-up, stable, then a {decay_shape} decay to {min_ratio} over the last {decay}"
    return f"{warmup} warm-up then constant"


HF_SCHEDULES = {"linear": "linear", "cosine": "cosine", "wsd": "warmup_stable_decay", "constant": "constant_with_warmup"}


def hf_scheduler_args(kind: str, total_steps: int, *, decay: float = 0.2, decay_shape: str = "1-sqrt",
                      min_ratio: float = 0.0) -> tuple[str, dict]:
    """``finetune``'s schedules, which train through Hugging Face's (``get_scheduler``, ``Trainer``): the
    ``lr_scheduler_type`` and ``lr_scheduler_kwargs`` for ``kind``. Their cosine, linear and WSD decay to
    ``min_ratio`` (Hugging Face's 0 by default) and their warm-up starts at 0, as fine-tuning recipes have it;
    ``decay`` is read by :func:`steps_of` on ``total_steps``."""
    if kind not in HF_SCHEDULES:
        raise ValueError(f"schedule {kind!r}: choose one of {', '.join(HF_SCHEDULES)}")
    if kind != "wsd":
        return HF_SCHEDULES[kind], {}
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(f"decay shape {decay_shape!r}: choose one of {', '.join(DECAY_SHAPES)}")
    return HF_SCHEDULES[kind], {"num_decay_steps": steps_of(decay, total_steps), "decay_type": decay_shape,
                                "min_lr_ratio": min_ratio}


def schedule_setting(default: str, kinds: tuple[str, ...]) -> Any:
    """``finetune lm`` and ``finetune glue``'s ``schedule`` field and its flag (Hugging Face's schedulers:
    :func:`hf_scheduler_args`). The help's ``(default: ...)`` comes from the parser's formatter."""
    return setting(default, "lr after the warm-up, by Hugging Face's scheduler of that name, to 0", choices=kinds)


def decay_setting() -> Any:
    """``finetune``'s ``decay`` field: wsd's decay, read as ``warmup`` is (:func:`steps_of`)."""
    return setting(0.2, "wsd: the decay's length, a fraction of the steps if < 1, else steps")


def decay_shape_setting() -> Any:
    """``finetune``'s ``decay_shape`` field."""
    return setting("1-sqrt", "wsd: 1-sqrt or linear", choices=DECAY_SHAPES)


def check_schedule(kind: str, decay_shape: str, kinds: tuple[str, ...]) -> None:
    """A settings object's schedule and decay shape, as a user's mistake (one line, exit 2)."""
    from gwt_optim.toolkit.errors import UsageError

    if kind not in kinds:
        raise UsageError(f"--schedule {kind!r}: choose one of {', '.join(kinds)}")
    if decay_shape not in DECAY_SHAPES:
        raise UsageError(f"--decay-shape {decay_shape!r}: choose one of {', '.join(DECAY_SHAPES)}")
