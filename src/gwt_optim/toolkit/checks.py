"""A flag's number checked before anything runs, by the registry's one rule for
numeric settings (``gwt_optim.registry.base.number_problem``, which an optimizer
spec's options follow too), as a :class:`~gwt_optim.toolkit.errors.UsageError`:
``pretrain``'s and ``compare``'s settings (``train.TrainConfig.validate``) and
``finetune``'s."""

from __future__ import annotations

from typing import Any

from gwt_optim.toolkit.errors import UsageError

__all__ = ["check_number", "check_spec_numbers"]


def check_number(flag: str, value: Any, *, minimum: float, integer: bool = False, strict: bool = False) -> None:
    """Raise ``UsageError("FLAG must be a number > 0, got V")`` for a value the rule refuses."""
    from gwt_optim.registry.base import number_problem

    problem = number_problem(flag, value, minimum=minimum, integer=integer, strict=strict)
    if problem:
        raise UsageError(problem)


def check_spec_numbers(spec: str) -> None:
    """Check ``spec``'s shared options (``gwt-adamw:lr=-1``) by the rule its flags follow
    (``--lr``), before anything is created, as a ``UsageError``."""
    from gwt_optim.registry.base import spec_number_problem

    problem = spec_number_problem(spec)
    if problem:
        raise UsageError(problem)
