r"""The optimizer step inside backward: each parameter is updated as soon as
its gradient is complete, and the gradient is freed at once.

.. code-block:: python

    opt = gwt_optim.GWTAdamW(groups, lr=1e-3, level=3, moment_dtype="int8")
    handle = gwt_optim.step_in_backward(opt)
    for x in batches:
        model(x).loss.backward()   # steps every parameter; no .grad is left
        opt.zero_grad()            # the next backward is a new step (see below)
        scheduler.step()           # LR schedulers work unchanged
    handle.remove()                # back to opt.step()

Only one gradient (plus those autograd is still summing) is alive at a time,
instead of all of them: for LLaMA-7B in bf16, the largest single gradient is
0.26 GB instead of 13.5 GB for all.

It works for every GWT family and for ``torch.optim`` optimizers. A GWT
optimizer steps one parameter through :meth:`GWTOptimizer.step_param`, the
same two phases :meth:`~GWTOptimizer.step` runs: GWT's statistics, its
norm-growth limiter included, are per parameter, so the result equals a normal
step (bitwise for GWT-AdamW in float32). Any other optimizer steps a
one-parameter copy of the parameter's group (same hyperparameters, same
``optimizer.state`` entry, so per-parameter ``step`` counters, ``foreach`` and
``fused`` behave as usual). ``state_dict``, ``load_state_dict`` and LR
schedulers see the optimizer as it always was.

What cannot work this way:

* **Gradient accumulation over micro-batches.** Every ``backward`` steps; a
  gradient is consumed before the next micro-batch could add to it. A
  backward that reaches a parameter already stepped since the last
  ``optimizer.zero_grad()`` raises before stepping it, so a training loop
  calls ``zero_grad()`` between steps, as any loop does that does not
  accumulate (backwards over disjoint parameters need none). Use one larger
  batch (with gradient checkpointing to afford it) instead.
* **Global-norm gradient clipping** (``clip_grad_norm_``) needs every gradient
  before any step. After backward there are no gradients left (it would
  report a norm of 0). ``max_grad_norm`` clips each parameter's gradient to
  that norm instead, a per-parameter clip that costs one norm per parameter.
* **DDP and FSDP.** Their gradient reduction runs after the hook that steps,
  so a rank would step on its local gradient: with ``torch.distributed``
  running more than one process, installing (or the first backward, if the
  group started later) raises, unless ``allow_distributed=True`` says that no
  gradient is reduced across processes (e.g. an independent model per rank).
  DTensor parameters are refused.
* **Optimizers whose step couples parameters** (e.g. one trust ratio over all
  of them) would step each parameter as if it were alone.

A ``.grad`` left over at install is refused (the first step would add it
in). Calling ``optimizer.step()`` while the handle is active raises: the
parameters were already stepped during backward, and a training loop that
still calls ``step()`` is almost certainly also accumulating or clipping.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import Tensor

__all__ = ["step_in_backward", "StepInBackward"]


def _is_dtensor(t: Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


class StepInBackward:
    """What :func:`step_in_backward` returns: ``remove()`` undoes it (also as
    a context manager). ``steps`` counts the parameter steps taken."""

    def __init__(
        self, optimizers: list[torch.optim.Optimizer], max_grad_norm: float | None, allow_distributed: bool = False
    ) -> None:
        self.optimizers = optimizers
        self.max_grad_norm = max_grad_norm
        self.allow_distributed = allow_distributed
        self.steps = 0
        self._internal = False
        self._groups: dict[int, tuple[Any, dict]] = {}
        self._groups_key: tuple | None = None
        self._handles: list[Any] = []
        # Per optimizer: the parameters stepped since its last zero_grad().
        self._stepped: dict[int, set[int]] = {id(opt): set() for opt in optimizers}
        self._zero_grads: list[tuple[torch.optim.Optimizer, Any]] = []
        # Every check before any hook, so that a refusal leaves nothing installed.
        self._check_world()
        seen: set[int] = set()
        for opt in optimizers:
            if getattr(opt.zero_grad, "_step_in_backward", None) is not None:
                raise RuntimeError(
                    "step_in_backward is already active on this optimizer; call remove() on its handle first"
                )
            for g, group in enumerate(opt.param_groups):
                for i, p in enumerate(group["params"]):
                    if id(p) in seen:
                        raise ValueError(
                            f"a parameter of shape {tuple(p.shape)} is in more than one group or optimizer"
                        )
                    seen.add(id(p))
                    if _is_dtensor(p):
                        raise ValueError(
                            "step_in_backward does not support DTensor (FSDP2) parameters: the gradient "
                            "reduction runs after the hook that would step; use optimizer.step()"
                        )
                    if p.requires_grad and p.grad is not None:
                        names = group.get("param_names")
                        name = repr(names[i]) if names else f"of shape {tuple(p.shape)} (group {g}, index {i})"
                        raise RuntimeError(
                            f"step_in_backward: parameter {name} already has a .grad, which its first step "
                            "would add in; call optimizer.zero_grad(set_to_none=True) first"
                        )
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(self._hook))
            self._handles.append(opt.register_step_pre_hook(self._refuse_step))
            self._wrap_zero_grad(opt)

    def _wrap_zero_grad(self, opt: torch.optim.Optimizer) -> None:
        # zero_grad() is what separates two steps in any training loop and what
        # gradient accumulation leaves out: the only signal, before a second
        # backward steps, that it is not a micro-batch of the same step. torch
        # has no zero_grad hook; LR schedulers wrap step() the same way.
        stepped = self._stepped[id(opt)]
        inner = opt.zero_grad

        def zero_grad(*args: Any, **kwargs: Any) -> None:
            stepped.clear()
            return inner(*args, **kwargs)

        zero_grad._step_in_backward = self  # type: ignore[attr-defined]
        prior = opt.__dict__.get("zero_grad")
        opt.zero_grad = zero_grad  # type: ignore[method-assign]
        self._zero_grads.append((opt, prior))

    def _check_world(self) -> None:
        if self.allow_distributed or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        world = torch.distributed.get_world_size()
        if world > 1:
            raise RuntimeError(
                f"step_in_backward: torch.distributed runs {world} processes, and a parameter's hook fires before "
                "DDP reduces its gradient, so each rank would step on its local gradient; use optimizer.step(), "
                "or pass allow_distributed=True if no gradient is reduced across processes"
            )

    # ------------------------------------------------------------------ #

    def _lookup(self, p: Tensor) -> tuple[Any, dict]:
        # load_state_dict replaces param_groups and add_param_group extends
        # them: look the group up afresh whenever they changed, so the
        # scheduler's lr (written into the current group dicts) is the one used.
        key = tuple((id(opt.param_groups), len(opt.param_groups)) for opt in self.optimizers)
        if key != self._groups_key:
            self._groups = {
                id(q): (opt, group) for opt in self.optimizers for group in opt.param_groups for q in group["params"]
            }
            self._groups_key = key
        try:
            return self._groups[id(p)]
        except KeyError:
            raise RuntimeError(
                f"step_in_backward: a parameter of shape {tuple(p.shape)} is no longer in the optimizer"
            ) from None

    def _hook(self, p: Tensor) -> None:
        opt, group = self._lookup(p)
        stepped = self._stepped[id(opt)]
        if not stepped:  # a new step: a process group may have started since install
            self._check_world()
        elif id(p) in stepped:
            raise RuntimeError(
                f"step_in_backward: a backward reached a parameter of shape {tuple(p.shape)} already stepped since "
                "the last optimizer.zero_grad(); every backward steps, so gradients cannot be accumulated over "
                "micro-batches: call optimizer.zero_grad() after each step, or handle.remove() and use "
                "optimizer.step()"
            )
        if self.max_grad_norm is not None:
            with torch.no_grad():
                norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
                # Only shrink, as clip_grad_norm_ does; 1e-6 keeps a zero gradient finite.
                p.grad.mul_(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0).to(p.grad.dtype))
        self._internal = True
        try:
            step_param = getattr(opt, "step_param", None)
            if step_param is not None:
                step_param(p, group)
                # What an LR scheduler's wrapper of step() records, so its
                # "scheduler.step() before optimizer.step()" check stays quiet.
                opt._opt_called = True  # type: ignore[attr-defined]
            else:
                _step_one(opt, p, group)
        finally:
            self._internal = False
        p.grad = None
        stepped.add(id(p))
        self.steps += 1

    def _refuse_step(self, opt, args, kwargs) -> None:
        if not self._internal:
            raise RuntimeError(
                "this optimizer steps inside backward (gwt_optim.step_in_backward): every parameter was already "
                "stepped when its gradient was ready, so optimizer.step() must not be called. Gradient "
                "accumulation and global-norm clipping cannot work this way; call handle.remove() to use step()"
            )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for opt, prior in self._zero_grads:
            if getattr(opt.__dict__.get("zero_grad"), "_step_in_backward", None) is self:
                if prior is None:
                    del opt.zero_grad
                else:
                    opt.zero_grad = prior  # type: ignore[method-assign]
        self._zero_grads.clear()

    def __enter__(self) -> "StepInBackward":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _step_one(opt: torch.optim.Optimizer, p: Tensor, group: dict) -> None:
    """``opt.step()`` on a copy of ``group`` that holds only ``p``."""
    view = {**group, "params": [p]}
    groups = opt.param_groups
    opt.param_groups = [view]
    try:
        opt.step()
    finally:
        opt.param_groups = groups
    # A step may write back into its group (e.g. a counter); keep what changed.
    for key, value in view.items():
        if key != "params" and group.get(key) is not value:
            group[key] = value


def step_in_backward(
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    max_grad_norm: float | None = None,
    allow_distributed: bool = False,
) -> StepInBackward:
    """Step every parameter of ``optimizer`` (or of several) inside backward.

    Registers a ``register_post_accumulate_grad_hook`` on every parameter
    that requires a gradient: when backward has finished summing a
    parameter's gradient, the hook (optionally clips it to ``max_grad_norm``,
    per parameter), steps that parameter with the optimizer's own group and
    state, and frees the gradient. Returns a handle; ``handle.remove()``
    restores the normal ``optimizer.step()`` workflow. Call
    ``optimizer.zero_grad()`` between steps: a backward reaching a parameter
    already stepped since then is taken for gradient accumulation and raises.
    ``allow_distributed=True`` permits a multi-process ``torch.distributed``
    group whose gradients are not reduced across processes. See the module
    docstring for what cannot work this way.
    """
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError("step_in_backward needs a torch.optim.Optimizer (or a list of them)")
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, (int, float)) and math.isfinite(max_grad_norm) and max_grad_norm > 0
    ):
        raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r} (a finite number > 0, or None)")
    return StepInBackward(optimizers, max_grad_norm, bool(allow_distributed))
