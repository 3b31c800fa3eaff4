"""What runs a step's routed parameters, and the plan that lets it repeat.

:class:`GWTOptimizer` routes each parameter with a gradient
(:meth:`~gwt_optim.optim._base.GWTOptimizer.route`) and runs phase 1 of it
(:class:`ParamStep`). Those the route hands to a *batched* fused backend (all
GWT-AdamW weights on CUDA, most on CPU) then take their whole step in one call
per backend. :class:`Stepper` runs them, and keeps a :class:`Plan` of it: the
routing, checks and ParamSteps of the last step, repeated while nothing they
depend on has changed. A plan covers a *scope*: every parameter
(:meth:`Stepper.step`, key :data:`STEP`) or one (:meth:`Stepper.step_param`,
key ``id(param)``, for ``step_in_backward``). One plan type serves both.

This module sits below the optimizer: it knows the optimizer only through
:class:`Host`, the few methods listed there.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Hashable, Protocol

import torch
from torch import Tensor

from gwt_optim.optim._family import group_lr
from gwt_optim.optim.functional import LIMITER_EPS, adam_step_factor

__all__ = ["ParamStep", "StepBatch", "Plan", "Stepper", "Host", "STEP", "make_plan", "plannable",
           "run_unplanned"]

#: The key of the plan over every parameter (step_param's plans are keyed by id(param)).
STEP = "step"

_data_ptr = Tensor.data_ptr  # for map(): no Python frame per tensor
_grad = operator.attrgetter("grad")


def _layout(p: Tensor, g: Tensor) -> tuple:
    return g.dtype, g.is_contiguous(), p.data_ptr(), p.shape, p.stride(), g.stride()


def _same(a: list, b: list) -> bool:
    """The same objects, in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


@dataclass
class ParamStep:
    """What phase 1 of a step leaves for phase 2, for one parameter."""

    param: Tensor  # the (local) parameter tensor
    full_param: Tensor  # the parameter as the user holds it (maybe a DTensor)
    # The (local) gradient: in its own dtype when the fused backend reads that
    # dtype (GWTOptimizer.route), else in the compute dtype.
    grad: Tensor
    state: dict
    group: dict
    transformed: bool
    level: int
    limited: bool = False
    norm_sq: Tensor | float | None = None  # a float from fused CPU kernels
    fused: Any = None  # the fused kernel backend running this parameter, if any
    # What phase 1 leaves for phase 2: the fused backend's carry, or the
    # eager path's functional.Moments (the family's first half).
    carry: Any = None
    step: int = 0  # the state's step count after this step's increment
    batched: bool = False  # the fused backend runs this whole step later, with others


@dataclass
class StepBatch:
    """Whole steps a batched fused backend runs with one set of scalars: the
    ParamSteps of one group and one step count, whose step scale alpha is all
    the group's or all 1 (transformed parameters, or not, unless alpha = 1).

    While a plan holds, the stepper hands a backend's ``step_batches`` the
    same list of the same StepBatch objects, with the same ``steps`` lists, on
    every step, updating only ``step``, ``scale`` and ``decay`` and each
    ParamStep's ``grad`` and ``step``; a backend may cache what it derives
    from them by identity (and by the plan's ``key``). The plan has then
    checked that all but the gradients is as it was when it was made: the
    parameters (address, shape, strides, dtype, device) and their state (the
    same tensors at the same addresses). A gradient may be a new tensor, of
    the same dtype, shape, strides and device.
    """

    steps: list[ParamStep]
    group: dict
    step: int  # the step count after this step's increment
    scaled: bool  # alpha is the group's "scale" (else 1)
    scale: float = 0.0  # alpha * lr * step factor
    decay: float = 1.0  # 1 - lr * weight_decay


class Host(Protocol):
    """What the stepper needs of the optimizer."""

    state: Any  # param -> state dict
    param_groups: list[dict]

    def _route_key(self, group: dict) -> tuple:
        """The group options that choose paths and state shapes: a change makes a new plan."""

    def _step_params(self, params: list[tuple[Tensor, dict]], batched: list[ParamStep],
                     deferred: list[ParamStep]) -> None:
        """Phase 1 of each (parameter, group) with every check; phase 2 now,
        or the ParamStep queued in ``batched`` (batched backends) or
        ``deferred`` (the limiter's collective)."""

    def _finish(self, batched: list[ParamStep], deferred: list[ParamStep]) -> None:
        """Run what ``_step_params`` queued and no plan took."""

    def _count_skipped(self, skipped: tuple | list) -> None:
        """Record what a batched backend skipped for a non-finite gradient."""


def plannable(ps: ParamStep) -> bool:
    """Whether a plan may repeat this batched ParamStep: not for a gradient
    cast to the compute dtype (a copy on every step), nor for a step count
    that is not a CPU float32 scalar."""
    st = ps.state.get("step")
    return (ps.grad is ps.full_param.grad and isinstance(st, Tensor) and st.ndim == 0
            and st.dtype == torch.float32 and st.device.type == "cpu"
            and all(isinstance(v, Tensor) for v in ps.state.values()))


@dataclass
class Plan:
    """The batched part of the last step over a scope, repeated without
    re-deriving it while nothing it depends on has changed (:meth:`grads`)."""

    key: Hashable  # STEP, or id(param) for step_param's; the backends cache by it
    state: dict  # the optimizer's state mapping it was made with
    groups: list[dict]  # the scope's groups: the batches read their lr and weight decay
    routes: list[tuple]  # _route_key of each of them
    params: list[Tensor]  # every parameter of the scope, in group order
    states: list[dict]  # the scope's state dicts, in their order
    rest: list[tuple[Tensor, dict]]  # (parameter, group) of the scope's others: full path every step
    fast: list[ParamStep]  # the planned parameters' steps, reused
    fast_params: list[Tensor]
    fast_states: list[dict]
    # Of each planned parameter, _layout: its gradient's dtype and contiguity,
    # its address and shape, and the weight's and the gradient's strides
    # (p.data = p.data.t() keeps a square weight's address and shape, and the
    # kernels would read it as rows).
    layouts: list[tuple]
    values: list[Tensor]  # every tensor of the planned states, in order
    addresses: list[int]  # and their addresses
    counter: Tensor  # their step counts (state["step"] are views of it), one add_ per step
    version: int  # counter._version after the last add_
    batches: list[tuple[Any, list[StepBatch]]]  # per backend
    flat: list[StepBatch]  # the same StepBatches in one list

    @property
    def grad_specs(self) -> list[tuple]:
        """(dtype, contiguous) of each planned gradient."""
        return [layout[:2] for layout in self.layouts]

    def holds_scope(self, groups: list[dict], params: list[Tensor], states: list) -> bool:
        """Whether the scope is as it was: the same group dicts (the batches
        read their lr and weight decay), parameters and state dicts, in order
        (no hashing of parameters: one replaced, added or removed shows)."""
        return (_same(groups, self.groups) and _same(params, self.params) and _same(states, self.states))

    def grads(self, host: Host) -> list[Tensor] | None:
        """The planned parameters' gradients if this step may repeat the plan,
        else None, once its owner has found its scope as it was
        (:meth:`holds_scope` for every parameter; :meth:`Stepper.step_param`
        compares its one parameter, group and state dict directly). It may with the
        groups' routing options and the step counts as they were (nothing
        wrote them but the plan), the planned parameters and their state
        tensors as they were (see :class:`StepBatch`), and gradients the
        backends take the same way."""
        if (self.state is not host.state or self.counter._version != self.version
                or list(map(host._route_key, self.groups)) != self.routes):
            return None
        fast = self.fast_params
        grads = list(map(_grad, fast))
        try:
            # torch's grad setter keeps a gradient's shape and device the
            # parameter's; a sparse one is not contiguous.
            if list(map(_layout, fast, grads)) != self.layouts:
                return None
        except AttributeError:  # a gradient is None
            return None
        values = [v for st in self.fast_states for v in st.values()]
        if _same(values, self.values) and list(map(_data_ptr, values)) == self.addresses:
            return grads
        return None

    def run(self, host: Host, grads: list[Tensor] | None) -> None:
        """The planned parameters' whole steps, one call per backend. With
        ``grads`` (a repeated plan) their step counts advance here; otherwise
        phase 1 has advanced them and left the gradients."""
        if grads is not None:
            flat = self.flat
            if len(flat) == 1:  # one step count (step_param's plans): fill_ costs a seventh of add_(1)
                self.counter.fill_(flat[0].step + 1)
            else:
                self.counter.add_(1)
            for ps, g in zip(self.fast, grads):
                ps.grad = g
            for batch in flat:
                batch.step += 1
                for ps in batch.steps:
                    ps.step = batch.step
        self.version = self.counter._version
        try:
            for backend, batches in self.batches:
                for batch in batches:
                    batch_scalars(host, batch)
                if backend.capabilities.plans:
                    host._count_skipped(backend.step_batches(batches, LIMITER_EPS, key=self.key))
                else:
                    items = [(ps, b.scale, b.decay) for b in batches for ps in b.steps]
                    host._count_skipped(backend.step_many(items, LIMITER_EPS))
        finally:
            # The plan outlives the step; the gradients must not (zero_grad frees them).
            for ps in self.fast:
                ps.grad = None

    def backends(self) -> list[Any]:
        return [backend for backend, _ in self.batches]


def batch_scalars(host: Host, batch: StepBatch) -> None:
    """This step's ``scale`` and ``decay`` of a StepBatch, from its group."""
    group = batch.group
    lr = group_lr(group)
    alpha = group["scale"] if batch.scaled else 1.0
    # The fused kernels are GWT-AdamW's: c_t is Adam's bias correction.
    batch.scale = alpha * lr * adam_step_factor(batch.step, *group["betas"])
    batch.decay = 1 - lr * group["weight_decay"]


def run_unplanned(host: Host, steps: list[ParamStep]) -> None:
    """Hand the batched whole steps no plan holds to their backends, with the
    family's step factor and the decoupled weight decay."""
    by_backend: dict[int, tuple[Any, list]] = {}
    for ps in steps:
        lr = group_lr(ps.group)
        scale = (ps.group["scale"] if ps.transformed else 1.0) * lr * adam_step_factor(ps.step, *ps.group["betas"])
        entry = by_backend.setdefault(id(ps.fused), (ps.fused, []))
        entry[1].append((ps, scale, 1 - lr * ps.group["weight_decay"]))
    for backend, items in by_backend.values():
        host._count_skipped(backend.step_many(items, LIMITER_EPS))


def make_plan(host: Host, key: Hashable, batched: list[ParamStep], pairs: list[tuple[Tensor, dict]],
              groups: list[dict], states: list[dict]) -> tuple[Plan | None, list[ParamStep]]:
    """A plan over the scope ``pairs`` (of ``groups``, with state dicts
    ``states``) from this step's batched ParamSteps (made by phase 1 with
    every check), and those it leaves to ``_finish``: see :func:`plannable`."""
    fast, left = [], []
    for ps in batched:
        (fast if plannable(ps) else left).append(ps)
    if not fast:
        return None, left
    planned = {id(ps.full_param) for ps in fast}
    counter = torch.stack([ps.state["step"] for ps in fast])
    for i, ps in enumerate(fast):
        ps.state["step"] = counter[i]
    batches: dict[tuple, StepBatch] = {}
    by_backend: dict[int, tuple[Any, list[StepBatch]]] = {}
    for ps in fast:
        # alpha = 1 (a _route_key option) lets weights and vectors share launches.
        bkey = (id(ps.fused), id(ps.group), ps.step, ps.transformed and ps.group["scale"] != 1)
        batch = batches.get(bkey)
        if batch is None:
            batch = batches[bkey] = StepBatch([], ps.group, ps.step, bkey[-1])
            by_backend.setdefault(id(ps.fused), (ps.fused, []))[1].append(batch)
        batch.steps.append(ps)
    fast_params = [ps.full_param for ps in fast]
    values = [v for ps in fast for v in ps.state.values()]
    plan = Plan(
        key=key,
        state=host.state,
        groups=list(groups),
        routes=[host._route_key(g) for g in groups],
        params=[p for p, _ in pairs],
        states=states,
        rest=[(p, g) for p, g in pairs if id(p) not in planned],
        fast=fast,
        fast_params=fast_params,
        fast_states=[ps.state for ps in fast],
        layouts=[_layout(ps.full_param, ps.grad) for ps in fast],
        values=values,
        addresses=list(map(_data_ptr, values)),
        counter=counter,
        version=counter._version,
        batches=list(by_backend.values()),
        flat=list(batches.values()),
    )
    return plan, left


class Stepper:
    """Takes a step's parameters through phase 1 (the host's), and runs the
    batched ones under a :class:`Plan` per scope: ``plans[STEP]`` for
    :meth:`step`, ``plans[id(p)]`` for :meth:`step_param`."""

    def __init__(self) -> None:
        self.plans: dict[Hashable, Plan] = {}

    def step(self, host: Host) -> None:
        """One step of every parameter of ``host`` with a gradient."""
        groups = host.param_groups
        deferred: list[ParamStep] = []
        batched: list[ParamStep] = []
        plan = self.plans.get(STEP)
        grads = None
        if plan is not None and plan.holds_scope(groups, [p for g in groups for p in g["params"]],
                                                 list(host.state.values())):
            grads = plan.grads(host)
        if grads is not None:
            if plan.rest:
                host._step_params(plan.rest, batched, deferred)
                # A parameter joined the batched kernels: plan again next time.
                # (One the plan cannot hold, a gradient cast on every step, stays out.)
                if any(map(plannable, batched)):
                    del self.plans[STEP]
            plan.run(host, grads)
        else:
            self.plans.pop(STEP, None)
            pairs = [(p, g) for g in groups for p in g["params"]]
            host._step_params(pairs, batched, deferred)
            plan, batched = make_plan(host, STEP, batched, pairs, groups, list(host.state.values()))
            if plan is not None:
                self.plans[STEP] = plan
                plan.run(host, None)
        host._finish(batched, deferred)

    def step_param(self, host: Host, p: Tensor, group: dict) -> None:
        """The step of ``p`` alone, as :meth:`step` takes it, under a plan of its own."""
        key = id(p)
        plan = self.plans.get(key)
        if plan is not None:
            # Its scope, one parameter: the same parameter, group and state dict.
            same = plan.params[0] is p and plan.groups[0] is group and plan.states[0] is host.state.get(p)
            grads = plan.grads(host) if same else None
            if grads is not None:
                plan.run(host, grads)
                return
            del self.plans[key]
        batched: list[ParamStep] = []
        deferred: list[ParamStep] = []
        host._step_params([(p, group)], batched, deferred)
        plan, batched = make_plan(host, key, batched, [(p, group)], [group], [host.state.get(p)])
        if plan is not None:
            self.plans[key] = plan
            plan.run(host, None)
        host._finish(batched, deferred)

    def drop(self) -> None:
        """Forget every plan, and the tables their backends keep for them:
        those reach the old state tensors, which a loaded state dict replaces
        (kept, they would hold a second copy of the moments until each
        parameter's next step)."""
        backends = {id(b): b for plan in self.plans.values() for b in plan.backends()}
        for backend in backends.values():
            if backend.capabilities.plans:
                backend.invalidate()
        self.plans = {}
