"""The machinery of one ``step()``: each parameter's backend
(:func:`~gwt_optim.optim._dispatch.choose`), its state created or checked, its
step counted, the family's eager halves around the limiter, and the batched
fused backends under a :class:`Plan` per scope (every parameter, key
:data:`STEP`, or one for ``step_param``, key ``id(param)``), repeated while
nothing it depends on has changed. It is given the groups, the state and
each group's :class:`~gwt_optim.optim._family.Rule` (its state, halves,
limiter, kernels and sharding hooks), never the optimizer, and returns what
it skipped, which the optimizer counts.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
from torch import Tensor

from gwt_optim.optim._backends import Bucket, all_finite, kernel_scalars, moment_dtype
from gwt_optim.optim._dispatch import choose, route_key
from gwt_optim.optim._family import Rule
from gwt_optim.optim._saved import approx_shape, describe, expected_state, state_problem
from gwt_optim.optim._sharded import (Sharding, check_sharding, distribute_state, finite_across_ranks, is_dtensor,
                                      local, reduce_limiter_norms)
from gwt_optim.optim.functional import LIMITER_EPS, compute_dtype, limiter_ratio, step_level

__all__ = ["ParamStep", "Plan", "Stepper", "STEP", "make_plan", "plannable"]

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
    """One parameter's step between its phases."""

    param: Tensor  # the (local) parameter tensor
    full_param: Tensor  # the parameter as the user holds it (maybe a DTensor)
    grad: Tensor  # the (local) gradient as the step reads it (choose's Route.grad)
    state: dict  # the (local) state
    group: dict
    rule: Rule  # the group's
    transformed: bool  # two or more dimensions: the wavelet step, scale and limiter apply
    level: int  # the level it steps at (functional.step_level's)
    limited: bool = False
    alpha: float = 1.0  # the alpha it steps at (functional.step_level's)
    # The options the family's eager halves read: the group itself, or for a weight capped to a lower level
    # (step_level) a copy at that level and alpha, made on each step (so that it reads the live lr).
    options: dict | None = None
    norm_sq: Tensor | float | None = None  # the limiter's ||U||^2 (a float from the native kernels)
    backend: Any = None  # the fused backend running this parameter; None: the family's eager halves
    # What phase 1 leaves for phase 2: the fused backend's carry, or the
    # eager path's functional.Moments (the family's first half).
    carry: Any = None
    step: int = 0  # the state's step count after this step's increment
    batched: bool = False  # the fused backend runs this whole step later, with others
    # A DTensor parameter's layout, which the family's halves reduce over (their reduce=); None: not sharded.
    sharding: Sharding | None = None


def plannable(ps: ParamStep) -> bool:
    """Whether a plan may repeat this batched ParamStep: not for a gradient
    cast to the compute dtype (a copy on every step), nor for a step count
    that is not a CPU float32 scalar."""
    st = ps.state.get("step")
    return (ps.grad is ps.full_param.grad and isinstance(st, Tensor) and st.ndim == 0
            and st.dtype == torch.float32 and st.device.type == "cpu"
            and all(isinstance(v, Tensor) for v in ps.state.values()))


def _buckets(batched: list[ParamStep]) -> list[tuple[Any, list[Bucket]]]:
    """The batched steps as each backend takes them: Buckets of one group,
    step count and alpha (alpha = 1 lets weights and vectors share launches;
    a weight capped to a lower level (functional.step_level) has its own alpha)."""
    buckets: dict[tuple, Bucket] = {}
    by_backend: dict[int, tuple[Any, list[Bucket]]] = {}
    for ps in batched:
        key = (id(ps.backend), id(ps.group), ps.step, ps.alpha)
        b = buckets.get(key)
        if b is None:
            b = buckets[key] = Bucket(ps.group, ps.step, ps.alpha)
            by_backend.setdefault(id(ps.backend), (ps.backend, []))[1].append(b)
        b.params.append(ps.param)
        b.grads.append(ps.grad)
        b.states.append(ps.state)
        b.levels.append(ps.level)
        b.limited.append(ps.limited)
    return list(by_backend.values())


def _launch(by_backend: list[tuple[Any, list[Bucket]]], skipped: list, tables: list[dict] | None = None) -> None:
    """Each backend's buckets, one call each, with this step's scalars and,
    under a plan, the plan's table for that backend (see :class:`Plan`)."""
    for i, (backend, buckets) in enumerate(by_backend):
        for b in buckets:
            b.scalars = kernel_scalars(b.group, b.step, b.alpha)
        skipped.append(backend.step_buckets(buckets, LIMITER_EPS, tables[i] if tables is not None else None))


@dataclass
class Plan:
    """The batched part of the last step over a scope, repeated without
    re-deriving it while nothing it depends on has changed (:meth:`grads`)."""

    key: Hashable  # STEP, or id(param) for step_param's
    state: dict  # the optimizer's state mapping it was made with
    groups: list[dict]  # the scope's groups: the buckets read their lr and weight decay
    routes: list[tuple]  # route_key of each of them
    params: list[Tensor]  # every parameter of the scope, in group order
    states: list[dict]  # the scope's state dicts, in their order
    rest: list[tuple[Tensor, dict]]  # (parameter, group) of the scope's others: every check every step
    by_backend: list[tuple[Any, list[Bucket]]]  # the planned parameters' buckets, reused
    # What each of those backends prepared from its buckets (task arrays, pointer tables), in
    # by_backend's order: the plan's, dropped with it, filled by the backend on the first step.
    tables: list[dict]
    flat: list[Bucket]  # the same Buckets in one list
    step_params: list[Tensor]  # the planned parameters, in the buckets' order
    step_states: list[dict]
    # Of each planned parameter, _layout: its gradient's dtype and contiguity,
    # its address and shape, and the weight's and the gradient's strides
    # (p.data = p.data.t() keeps a square weight's address and shape, and the
    # kernels would read it as rows).
    layouts: list[tuple]
    values: list[Tensor]  # every tensor of the planned states, in order
    addresses: list[int]  # and their addresses
    counter: Tensor  # their step counts (state["step"] are views of it), one add_ per step
    version: int  # counter._version after the last add_

    def grads(self, state: dict, groups: list[dict], params: list[Tensor], states: Callable[[], list]) -> list | None:
        """The planned gradients if this step may repeat the plan: the scope as
        it was (the same group dicts, parameters and state dicts, in order:
        one replaced, added or removed shows), the groups' routing options and
        the step counts as they were (nothing wrote them but the plan), the
        planned parameters and state tensors too (see :class:`Bucket`), and
        gradients of the same layout."""
        if (self.state is not state or not (_same(groups, self.groups) and _same(params, self.params))
                or not _same(states(), self.states) or self.counter._version != self.version
                or list(map(route_key, self.groups)) != self.routes):
            return None
        params = self.step_params
        grads = list(map(_grad, params))
        try:
            # torch's grad setter keeps a gradient's shape and device the
            # parameter's; a sparse one is not contiguous.
            if list(map(_layout, params, grads)) != self.layouts:
                return None
        except AttributeError:  # a gradient is None
            return None
        values = [v for st in self.step_states for v in st.values()]
        if _same(values, self.values) and list(map(_data_ptr, values)) == self.addresses:
            return grads
        return None

    def run(self, grads: list[Tensor] | None, skipped: list) -> None:
        """The planned parameters' whole steps, one call per backend. With
        ``grads`` (a repeated plan) their step counts advance here; otherwise
        the checks have advanced them and left the gradients in the buckets."""
        if grads is not None:
            flat = self.flat
            if len(flat) == 1:  # one step count (step_param's plans): fill_ costs a seventh of add_(1)
                self.counter.fill_(flat[0].step + 1)
            else:
                self.counter.add_(1)
            i = 0
            for b in flat:
                b.step += 1
                b.grads = grads[i:i + len(b.params)]
                i += len(b.params)
        self.version = self.counter._version
        try:
            _launch(self.by_backend, skipped, self.tables)
        finally:
            # The plan outlives the step; the gradients must not (zero_grad frees them).
            for b in self.flat:
                b.grads = []


def make_plan(state: dict, key: Hashable, batched: list[ParamStep], pairs: list[tuple[Tensor, dict]],
              groups: list[dict], states: list[dict]) -> tuple[Plan | None, list[ParamStep]]:
    """A plan over the scope ``pairs`` (of ``groups``, with state dicts
    ``states``) from this step's batched ParamSteps (made with every check),
    and those it leaves to be run unplanned: see :func:`plannable`."""
    planned, left = [], []
    for ps in batched:
        (planned if plannable(ps) else left).append(ps)
    if not planned:
        return None, left
    ids = {id(ps.full_param) for ps in planned}
    counter = torch.stack([ps.state["step"] for ps in planned])
    for i, ps in enumerate(planned):
        ps.state["step"] = counter[i]
    by_backend = _buckets(planned)
    flat = [b for _, buckets in by_backend for b in buckets]
    step_params = [p for b in flat for p in b.params]
    step_states = [st for b in flat for st in b.states]
    values = [v for st in step_states for v in st.values()]
    plan = Plan(
        key=key, state=state, groups=list(groups), routes=[route_key(g) for g in groups],
        params=[p for p, _ in pairs], states=states, rest=[(p, g) for p, g in pairs if id(p) not in ids],
        by_backend=by_backend, tables=[{} for _ in by_backend], flat=flat, step_params=step_params, step_states=step_states,
        layouts=[_layout(p, g) for b in flat for p, g in zip(b.params, b.grads)], values=values,
        addresses=list(map(_data_ptr, values)), counter=counter, version=counter._version,
    )
    return plan, left


class Stepper:
    """Takes a step's parameters through their checks and phases, and runs the
    batched ones under a :class:`Plan` per scope: ``plans[STEP]`` for
    :meth:`step`, ``plans[id(p)]`` for :meth:`step_param`. ``skipped``
    collects the parameters skipped for a non-finite gradient and the fused
    backends' running device counts of them."""

    def __init__(self) -> None:
        self.plans: dict[Hashable, Plan] = {}
        # The family's state shapes per (group, gradient shape, level, ...), for state_problem.
        self.specs: dict[tuple, dict[str, tuple]] = {}

    def step(self, groups: list[dict], state: dict, rule_of: Callable[[dict], Rule], skipped: list) -> None:
        """One step of every parameter of ``groups`` with a gradient (``state``:
        the optimizer's state, by parameter; ``rule_of``: each group's rule)."""
        self._run((groups, state, rule_of), STEP, groups, [p for g in groups for p in g["params"]],
                  lambda: list(state.values()), lambda: [(p, g) for g in groups for p in g["params"]], skipped)

    def step_param(self, groups: list[dict], state: dict, rule_of: Callable[[dict], Rule], p: Tensor, group: dict,
                   skipped: list) -> None:
        """The step of ``p`` alone (of ``group``, one of ``groups``), as :meth:`step`
        takes it, under a plan of its own."""
        self._run((groups, state, rule_of), id(p), [group], [p], lambda: [state.get(p)], lambda: [(p, group)],
                  skipped)

    def _run(self, held: tuple, key: Hashable, groups: list[dict], params: list[Tensor], states: Callable[[], list],
             pairs: Callable[[], list[tuple[Tensor, dict]]], skipped: list) -> None:
        """The plan under ``key`` where it holds (and every check for the scope's
        other parameters), else every check for all of them and a new plan.
        ``held``: (every group, the state, the rule of a group), as given;
        ``states`` and ``pairs`` give the scope's state dicts (as they are when
        called) and ``(parameter, group)`` pairs."""
        batched: list[ParamStep] = []
        deferred: list[ParamStep] = []
        state = held[1]
        plan = self.plans.get(key)
        grads = plan.grads(state, groups, params, states) if plan is not None else None
        if grads is not None:
            if plan.rest:
                self._each(held, plan.rest, batched, deferred, skipped)
                # A parameter joined the batched kernels: plan again next time.
                # (One the plan cannot hold, a gradient cast on every step, stays out.)
                if any(map(plannable, batched)):
                    del self.plans[key]
            plan.run(grads, skipped)
        else:
            self.plans.pop(key, None)
            scope = pairs()
            self._each(held, scope, batched, deferred, skipped)
            plan, batched = make_plan(state, key, batched, scope, groups, states())
            if plan is not None:
                self.plans[key] = plan
                plan.run(None, skipped)
        # The batched steps no plan holds, then the limiter's all-reduce, the family's exchange
        # (GWT-Muon's whole matrices) and the deferred second halves.
        _launch(_buckets(batched), skipped)
        if deferred:
            reduce_limiter_norms(deferred)
            for rule in {id(ps.rule): ps.rule for ps in deferred}.values():
                if rule.between_phases is not None:
                    rule.between_phases([ps for ps in deferred if ps.rule is rule])
            for ps in deferred:
                _phase2(ps)

    def drop(self) -> None:
        """Forget every plan (with its backends' tables, which reach the state
        tensors a loaded state dict replaces) and state shape."""
        self.plans = {}
        self.specs = {}

    def _each(self, held: tuple, pairs: list[tuple[Tensor, dict]], batched: list[ParamStep],
              deferred: list[ParamStep], skipped: list) -> None:
        """Every check and phase 1 of each ``(parameter, group)`` with a
        gradient; then phase 2 now, or the ParamStep queued for the batched
        kernels (``batched``) or behind the limiter's collective (``deferred``)."""
        rule_of = held[2]
        sharded = [p for p, _ in pairs if p.grad is not None and is_dtensor(p)]
        finite = finite_across_ranks(sharded) if sharded else {}
        if len(pairs) > 1:
            # The eager path checks every gradient itself: where reading the
            # answer waits for the device, all of them at once.
            eager = [p for p, g in pairs if p.grad is not None and not is_dtensor(p) and not p.grad.is_sparse
                     and p.numel() and ((k := rule_of(g).kernels) is None or k.refusal(g) is not None)
                     and _check_waits(p.grad)]
            if eager:
                finite.update(_finite_at_once(eager))
        for p, group in pairs:
            if p.grad is None:
                continue
            rule = rule_of(group)
            if p.grad.is_sparse:
                raise RuntimeError(f"{rule.family} does not support sparse gradients")
            if p.numel() == 0:
                continue  # nothing to update, and no state to keep
            ps = self._phase1(held, rule, p, group, finite.get(id(p)), skipped)
            if ps is None:  # skipped, a non-finite gradient
                continue
            if ps.batched:
                batched.append(ps)
            elif _needs_collective(ps):
                deferred.append(ps)
            else:
                _phase2(ps)

    def _phase1(self, held: tuple, rule: Rule, p: Tensor, group: dict, finite: bool | None,
                skipped: list) -> ParamStep | None:
        """The backend, the state (created, or checked), the step count; then,
        with a finite gradient (``finite``: known already, else read here), the
        fused phase 1 or the rule's first half. A batched step runs later, whole."""
        state, w, sharded = held[1][p], local(p), is_dtensor(p)
        if sharded:
            check_sharding(p)  # before any collective: every rank refuses the same layout
        transformed = p.ndim >= 2
        limited = rule.limited(group, transformed)
        level, alpha = step_level(p.shape, group["level"], group["scale"])  # of the parameter, not its shard
        route = choose(rule.kernels, group, w, local(p.grad), sharded, limited, level, alpha)
        G, level, fused = route.grad, route.level, route.backend
        batched = fused is not None and fused.capabilities.batched and not sharded
        if finite is None and not batched:
            # Batched kernels check the gradient themselves, before they change anything.
            finite = bool(torch.isfinite(G).all())
        cdt = compute_dtype(w)
        md = moment_dtype(group, cdt)
        new = "step" not in state
        if new:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            # Only A_l's shape (an eager level-0 step: the gradient's own layout).
            approx = G if level == 0 and fused is None else G.new_empty(
                approx_shape(tuple(G.shape), level, group["wavelet"]), dtype=cdt)
            rule.init_state(group, state, approx, md, transformed)
            if limited:
                state["limiter_norm"] = torch.zeros((), dtype=cdt, device=w.device)
            if sharded:
                distribute_state(p, state, lambda shape: expected_state(
                    rule, group, approx_shape(shape, level, group["wavelet"]), transformed))
        # Families see (and update in place) the local shards of their state.
        lstate = {k: local(v) for k, v in state.items()} if sharded else state
        if not new:
            # A loaded state, or a level changed since: fused kernels would
            # index out of bounds, eager ones fail somewhere inside.
            key = (id(group), tuple(G.shape), level, group["wavelet"], transformed, md)
            spec = self.specs.get(key)
            if spec is None:
                shape = approx_shape(tuple(G.shape), level, group["wavelet"])
                spec = self.specs[key] = expected_state(rule, group, shape, transformed)
            problem = state_problem(lstate, spec, level, w, md if fused is not None else None)
            if problem is not None:
                raise ValueError(f"{rule.family}: {describe(held[0], p)}: {problem}")
        # fill_ from a Python int: a third of the dispatch cost of `+= 1`.
        step = int(state["step"].item()) + 1
        state["step"].fill_(step)
        if finite is False:
            skipped.append(p)
            return None
        ps = ParamStep(w, p, G, lstate, group, rule, transformed, level, limited, alpha, backend=fused, step=step,
                       batched=batched, sharding=Sharding(p) if sharded else None)
        if batched:
            return ps
        if fused is not None:
            scalars = kernel_scalars(group, step, alpha)
            norm_sq, ps.carry = fused.phase1(group, lstate, G, level, step, scalars)
        else:
            ps.options = group if not transformed or level == group["level"] else \
                {**group, "level": level, "scale": alpha}
            if sharded:  # the rule's first half, its reductions over the shards (_sharded's rule)
                ps.carry = rule.moments(ps.options, lstate, w, G, step, reduce=ps.sharding)
            else:  # the rule's first half (functional.gwt_*_moments)
                ps.carry = rule.moments(ps.options, lstate, w, G, step)
        if limited:
            ps.norm_sq = norm_sq if fused is not None else ps.carry.norm_sq()
        return ps


def _phase2(ps: ParamStep) -> None:
    """Fira's limiter (``r``, and ``s`` in the state), then the step's second
    half: the rule's eager ``apply`` or the fused backend's phase 2."""
    group = ps.group
    r = limiter_ratio(ps.norm_sq, ps.state["limiter_norm"], ps.step, group["norm_growth_limit"]) if ps.limited \
        else 1.0
    if ps.backend is None:
        if ps.sharding is not None:
            ps.rule.apply(ps.options, ps.param, ps.carry, r, ps.step, reduce=ps.sharding)
        else:
            ps.rule.apply(ps.options, ps.param, ps.carry, r, ps.step)
        return
    ps.backend.phase2(ps.param, ps.grad, ps.level, ps.carry, r)


def _needs_collective(ps: ParamStep) -> bool:
    """Whether phase 2 must wait for the all-reduce of the limiter's norms or
    for the rule's exchange between the phases (FSDP2)."""
    return is_dtensor(ps.full_param) and (ps.limited or ps.rule.whole_matrix)


def _check_waits(grad: Tensor) -> bool:
    """Whether reading whether ``grad`` is finite waits for its device."""
    return grad.device.type != "cpu"


def _finite_at_once(params: list[Tensor]) -> dict[int, bool]:
    """Whether each parameter's gradient is finite, by id: one foreach norm
    and one read per device and dtype, instead of a host synchronization per
    parameter (which on a GPU stalls every parameter's launches behind the
    previous one's kernels)."""
    by_device: dict[tuple, list[Tensor]] = {}
    for p in params:
        by_device.setdefault((p.grad.device, p.grad.dtype), []).append(p)
    finite: dict[int, bool] = {}
    for group in by_device.values():
        finite.update(zip(map(id, group), all_finite([p.grad for p in group])))
    return finite
