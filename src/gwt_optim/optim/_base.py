r"""The shared skeleton of every GWT optimizer.

A GWT step for a weight :math:`W \in \mathbb{R}^{m \times n}` of a group with
level :math:`l`, scale :math:`\alpha` and norm-growth limit :math:`\gamma` is
always the same (Wen et al., 2025, Alg. 1):

1. transform the gradient along the last axis,
   :math:`G \mapsto [A_l, D_l, \dots, D_1]`;
2. update the family's state on :math:`A_l` only and turn it into an
   approximation update :math:`U` and a per-coefficient normalizer
   :math:`\mathrm{den}` (Adam: :math:`U = M/\mathrm{den}`,
   :math:`\mathrm{den} = \sqrt{V} + \epsilon`);
3. limit norm growth (Fira): :math:`r = \max(\|U\|_F/(s + 10^{-8}), \gamma)/\gamma`,
   :math:`U \leftarrow U/r`, :math:`s \leftarrow \|U\|_F`;
4. normalize the details with the normalizer repeated to their length,
   :math:`\tilde D_j = D_j / (\mathrm{den}' \cdot r)`;
5. :math:`\Delta = \alpha \cdot \mathrm{inverse}([U, \tilde D_l, \dots, \tilde D_1])`,
   optionally post-processed (Muon orthogonalizes it);
6. decoupled weight decay and :math:`W \leftarrow W - \eta \cdot c_t \cdot \Delta`
   with the family's step factor :math:`c_t`.

A family (:class:`GWTOptimizer` subclass) supplies only its state (step 2),
its step factor and, optionally, a post-processing of :math:`\Delta`. The base
runs the transform, limiter, detail normalization, inverse and weight update,
in two implementations that are tested against each other:

``impl="reference"``
    Follows the notation above literally: :func:`gwt_optim.wavelets.wavedec`,
    per-level detail normalization, :func:`~gwt_optim.wavelets.waverec`. Works
    for every wavelet.
``impl="fast"`` (Haar only; other wavelets fall back to the reference)
    Uses that the Haar transform at level :math:`l` mixes only blocks of
    :math:`b = 2^l` adjacent entries: :math:`A_{l,k} = \sum \mathrm{block}_k / 2^{l/2}`
    and, by linearity of the inverse,

    .. math::

        \Delta_{\mathrm{block}\,k} = \frac{\alpha}{r}\Big(\frac{U_k}{2^{l/2}}
        + \frac{G_{\mathrm{block}\,k} - \overline{G}_{\mathrm{block}\,k}}{\mathrm{den}_k}\Big),

    so a step is one reduction pass over :math:`G` and one update pass over
    :math:`W` and :math:`G`. A family may run both as fused kernels
    (:meth:`GWTOptimizer._fused_kernel`; GWT-AdamW does, see
    :mod:`gwt_optim.optim._fused` and the ``compile`` argument); the eager
    tensor operations here are the fallback for everything else.

Only the limiter needs a whole-matrix reduction, so the step is split in two
phases around it. Under FSDP2, parameters are DTensors sharded along dim 0: the
transform along the last axis is local to each row shard and the limiter's
squared norms of all parameters are summed across ranks in one all-reduce, so
sharded and single-process training agree. Parameters that need no collective
run phase 2 right after their own phase 1, while their gradient is still in
cache; the results are the same.

Parameters with fewer than two dimensions are updated by the plain family
(no transform, :math:`\alpha = 1`, no limiter).

**Non-finite gradients.** A parameter whose gradient holds a NaN or an
infinity is skipped for that step on every path (fused kernels, fast and
reference): its weight and all its state, the limiter's norm included, stay
as they were, and only its step count advances. The first skip warns once;
:attr:`GWTOptimizer.nonfinite_skips` counts them all.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer

from gwt_optim import wavelets
from gwt_optim.optim import _fused

__all__ = ["GWTOptimizer", "ParamStep", "StepBatch", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("reference", "fast")
# "int8": blockwise 8-bit codes plus fp32 block scales (gwt_optim.optim._quant),
# for the families that set _INT8_MOMENTS; the moment tensors hold the codes.
_MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64, "int8": torch.uint8}
# Fira's limiter divides by the previous norm; this keeps it finite at s = 0.
_LIMITER_EPS = 1e-8


def _is_dtensor(t: Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t


@dataclass
class ParamStep:
    """What phase 1 of a step leaves for phase 2, for one parameter."""

    param: Tensor  # the (local) parameter tensor
    full_param: Tensor  # the parameter as the user holds it (maybe a DTensor)
    # The (local) gradient: in its own dtype when the fused backend reads that
    # dtype (GWTOptimizer._select_fused), else in the compute dtype.
    grad: Tensor
    state: dict
    group: dict
    transformed: bool
    level: int
    A: Tensor  # approximation coefficients A_l of this step's gradient
    U: Tensor  # approximation update (before the limiter)
    den: Tensor | None  # per-approximation-coefficient normalizer, None = 1
    coeffs: wavelets.Coefficients | None = None  # reference path only
    limited: bool = False
    norm_sq: Tensor | float | None = None  # a float from fused CPU kernels
    fused: Any = None  # the fused kernel backend running this parameter, if any
    carry: Any = None  # what the fused phase 1 leaves for its phase 2
    step: int = 0  # the state's step count after this step's increment
    batched: bool = False  # the fused backend runs this whole step later, with others


@dataclass
class StepBatch:
    """Whole steps a batched fused backend runs with one set of scalars: the
    ParamSteps of one group and one step count, whose step scale alpha is all
    the group's or all 1 (transformed parameters, or not, unless alpha = 1).

    While the optimizer's step plan holds (see :meth:`GWTOptimizer.step`), it
    hands a backend's ``step_batches`` the same list of the same StepBatch
    objects, with the same ``steps`` lists, on every step, updating only
    ``step``, ``scale`` and ``decay`` and each ParamStep's ``grad`` and
    ``step``; a backend may cache what it derives from them by identity. The
    optimizer has then checked that all but the gradients is as it was when
    the plan was made: the parameters (address, shape, strides, dtype, device)
    and their state (the same tensors at the same addresses). A gradient may be
    a new tensor, of the same dtype, shape, strides and device.
    """

    steps: list[ParamStep]
    group: dict
    step: int  # the step count after this step's increment
    scaled: bool  # alpha is the group's "scale" (else 1)
    scale: float = 0.0  # alpha * lr * step factor
    decay: float = 1.0  # 1 - lr * weight_decay


@dataclass
class _StepPlan:
    """The routing of the last step, repeated without re-deriving it while
    nothing it depends on has changed (:meth:`GWTOptimizer._plan_grads`)."""

    state: dict  # the optimizer's state mapping it was made with
    routes: list[tuple]  # _route_key of each group
    params: list[Tensor]  # every parameter, in group order
    rest: list[tuple[Tensor, dict]]  # (parameter, group) of the others: _phase1 on every step
    fast: list[ParamStep]  # the batched parameters' steps, reused
    fast_params: list[Tensor]
    fast_states: list[dict]
    states: list[dict]  # every state dict of the optimizer, in its order
    param_addresses: list[int]
    shapes: list[torch.Size]
    grad_specs: list[tuple]  # (dtype, contiguous) of each gradient
    # (weight's, gradient's) strides of each: p.data = p.data.t() keeps a square
    # weight's address and shape, and the kernels would read it as rows.
    strides: list[tuple]
    values: list[Tensor]  # every tensor of those states, in order
    addresses: list[int]  # and their addresses
    counter: Tensor  # their step counts (state["step"] are views of it), one add_ per step
    version: int  # counter._version after the last add_
    batches: list[tuple[Any, list[StepBatch]]]  # per backend


@dataclass
class _ParamPlan:
    """:meth:`GWTOptimizer.step_param`'s routing of one batched parameter,
    repeated while what it depends on holds (:meth:`GWTOptimizer._param_plan_grad`):
    the step plan's checks, for one parameter."""

    param: Tensor
    group: dict
    route: tuple  # _route_key of the group
    state: dict
    values: list[Tensor]  # the state's tensors, in order
    addresses: list[int]
    address: int  # the parameter's
    shape: torch.Size
    grad_spec: tuple  # (dtype, contiguous) of the gradient
    strides: tuple  # the parameter's and the gradient's (see _StepPlan.strides)
    count: Tensor  # state["step"]
    version: int  # its _version after the last step
    ps: ParamStep
    backend: Any
    batches: list[StepBatch]  # one StepBatch of ps, for the backend's step_batches


_data_ptr = Tensor.data_ptr  # for map(): no Python frame per tensor

# Traced by torch.compile (its compiled-optimizer recipe, torch.compile(opt.step)),
# the step's Python (plans, .item() reads, ctypes and Triton calls) trained
# silently wrong; like torch's own untraceable optimizer methods, it opts out.
_UNTRACED_REASON = (
    "the gwt-optim optimizer step cannot be compiled (it runs native and Triton kernels through "
    "Python-side step plans): call opt.step() / opt.step_param() eagerly; compile the model, not the step"
)
_untraced_pending: list[tuple[Callable, list]] = []


def _untraced(fn: Callable) -> Callable:
    """``fn`` as ``torch.compiler.disable(fn, reason=...)`` makes it: a compiled
    caller runs it eagerly, and ``fullgraph=True`` fails with that reason.

    The disabled function is made by :func:`_make_untraced` when the first
    optimizer is made, not at import: importing ``torch._dynamo`` takes
    seconds (torch's ``Optimizer.add_param_group`` imports it on the first
    construction anyway), and under tracing it is too late to make it (Dynamo
    cannot trace ``torch.compiler.disable``)."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def untraced(*args, **kwargs):
        return disabled[0](*args, **kwargs)

    _untraced_pending.append((fn, disabled))
    return untraced


def _make_untraced() -> None:
    if _untraced_pending:
        for fn, disabled in _untraced_pending:
            if not disabled:
                disabled.append(torch.compiler.disable(fn, reason=_UNTRACED_REASON))
        # Cleared only once all are made: a constructor racing this one finds them all made.
        _untraced_pending.clear()


class GWTOptimizer(Optimizer):
    """Base class of the GWT optimizers. See the module docstring for the step.

    Subclasses implement :meth:`_init_family_state`, :meth:`_approx_update`
    and :meth:`_step_factor`, and may override :meth:`_postprocess`,
    :meth:`_validate_family`, :meth:`_validate_param` and
    :meth:`_fused_kernel` (fused kernels for the whole transformed step of
    some parameters). Hooks that need the parameter receive its
    :class:`ParamStep`.

    ``compile`` chooses fused kernels where a family has them: ``None`` (auto:
    where they can be built, else the eager path with one warning), ``True``
    (required: a build failure raises), ``False`` (never), or a backend name
    from :data:`gwt_optim.optim._fused.BACKENDS` to force one.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        impl: str = "fast",
        compile: bool | None = None,
    ) -> None:
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
        base = {
            "level": 2,
            "wavelet": wavelets.HAAR,
            "scale": 0.25,
            "norm_growth_limit": 1.01,
            "moment_dtype": None,
            # Opt-in small-batch remedy (docs/algorithm.md, "Detail clipping"):
            # None is the paper's update.
            "detail_clip": None,
        }
        base.update(defaults)
        self._validate_group(base)
        _fused.check_compile_option(compile)
        self._impl = impl
        self._compile = compile
        self._init_bookkeeping()
        super().__init__(params, base)

    #: The family's name in messages and in saved state dicts.
    _family = "GWTOptimizer"
    #: Whether the family stores ``moment_dtype="int8"`` moments (:mod:`._quant`).
    _INT8_MOMENTS = False

    def _init_bookkeeping(self) -> None:
        _make_untraced()
        self.__dict__.setdefault("_nonfinite_skips", 0)
        # The running skip counts that fused device kernels keep without a host
        # sync, by id (a backend hands the same tensors on every step).
        self.__dict__.setdefault("_nonfinite_counters", {})
        self.__dict__.setdefault("_warned_nonfinite", False)
        # Expected state shapes per (group, approximation shape, ...): see _state_problem.
        self.__dict__.setdefault("_state_specs", {})
        # The routing of the last step, reused while it holds (see step()),
        # and step_param's of each parameter, by id (see step_param()).
        self.__dict__.setdefault("_plan", None)
        self.__dict__.setdefault("_param_plans", {})

    @property
    def nonfinite_skips(self) -> int:
        """How many parameter updates were skipped because the gradient held
        a NaN or an infinity (one per parameter and step)."""
        return self._nonfinite_skips + sum(int(c.item()) for c in self._nonfinite_counters.values())

    # ------------------------------------------------------------ set-up --- #

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._validate_group(merged)
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch rejects sets itself, with its own message
            params = param_group["params"] = list(params)  # a generator can be read once
        if not isinstance(params, set):
            index = len(self.param_groups)
            for i, p in enumerate(params):
                if isinstance(p, Tensor):
                    self._validate_param(p, merged, f"parameter {i} of group {index} (shape {tuple(p.shape)})")
        self._state_specs.clear()
        self._drop_plans()
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Older checkpoints may lack keys added later; fill with the defaults.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self.__dict__.setdefault("_impl", "fast")
        self.__dict__.setdefault("_compile", None)
        self._init_bookkeeping()

    def _validate_group(self, g: dict[str, Any]) -> None:
        lr = g.get("lr")
        if isinstance(lr, Tensor):
            lr = lr.item()
        if not _is_real(lr) or not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr!r} (must be a number >= 0)")
        wd = g.get("weight_decay", 0.0)
        if not _is_real(wd) or not 0.0 <= wd:
            raise ValueError(f"Invalid weight_decay value: {wd!r} (must be a number >= 0)")
        level = g["level"]
        if not isinstance(level, int) or isinstance(level, bool) or level < 0:
            raise ValueError(f"Invalid level: {level!r} (must be an int >= 0)")
        if level > 16:
            raise ValueError(f"Invalid level: {level} (at most 16; each level halves the state)")
        wavelet = g["wavelet"]
        if not isinstance(wavelet, str):
            raise ValueError(f"Invalid wavelet: {wavelet!r} (a name such as 'haar')")
        wavelets.check_wavelet(wavelet)
        scale = g["scale"]
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"Invalid scale (alpha): {scale!r} (must be a finite number > 0)")
        gamma = g["norm_growth_limit"]
        if gamma is not None and not (isinstance(gamma, (int, float)) and gamma >= 1.0):
            raise ValueError(f"Invalid norm_growth_limit (gamma): {gamma!r} (must be >= 1, or None to turn it off)")
        clip = g["detail_clip"]
        if clip is not None and not (
            isinstance(clip, (int, float)) and not isinstance(clip, bool) and math.isfinite(clip) and clip > 0
        ):
            raise ValueError(f"Invalid detail_clip: {clip!r} (a finite number > 0, or None for the paper's update)")
        md = g["moment_dtype"]
        if md is not None and md not in _MOMENT_DTYPES:
            raise ValueError(f"Invalid moment_dtype: {md!r} (one of {sorted(_MOMENT_DTYPES)} or None)")
        if md == "int8" and not self._INT8_MOMENTS:
            raise ValueError(f"moment_dtype='int8' is not implemented for {self._family} (GWTAdamW has it)")
        self._validate_family(g)

    # ---------------------------------------------------- family hooks --- #

    def _validate_family(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for out-of-range family hyperparameters."""

    def _validate_param(self, p: Tensor, group: dict[str, Any], where: str) -> None:
        """Raise ``ValueError`` for a parameter this family cannot update.

        Runs for every parameter of every group, at construction and in
        :meth:`add_param_group`, before the group is added. ``group`` holds the
        group's options merged with the defaults; ``where`` names the
        parameter for messages. Families extend it (calling ``super()``).
        """
        if p.is_complex():
            raise ValueError(
                f"{self._family}: {where} is complex ({p.dtype}); GWT transforms real tensors. "
                "Optimize its real and imaginary parts as real parameters (e.g. torch.view_as_real)"
            )
        if not p.is_floating_point():
            raise ValueError(
                f"{self._family}: {where} is {p.dtype}; only floating-point parameters can be optimized"
            )

    def _init_family_state(
        self, group: dict, state: dict, approx: Tensor, moment_dtype: torch.dtype, transformed: bool
    ) -> None:
        """Create the family's state tensors for approximation coefficients
        shaped like ``approx`` (a tensor in the compute dtype)."""
        raise NotImplementedError

    def _approx_update(
        self, group: dict, state: dict, A: Tensor, step: int, transformed: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Update the state with :math:`A_l` and return ``(U, den)``.

        ``A`` is in the compute dtype (>= fp32); ``U`` must have its shape and
        ``den`` must broadcast against it (``None`` means no normalization of
        the details). Zero entries of ``den`` drop their details instead of
        dividing by zero.
        """
        raise NotImplementedError

    def _step_factor(self, ps: ParamStep) -> float:
        """The multiplier :math:`c_t` on ``lr`` (Adam: bias correction) for
        this parameter's step; ``ps.param`` is the weight before the update.
        For a :class:`StepBatch` it is evaluated once, on its first ParamStep:
        a family with batched fused kernels must not make it depend on more
        than the group and the step count."""
        return 1.0

    def _postprocess(self, ps: ParamStep, delta: Tensor) -> Tensor:
        """A hook on the full-size direction :math:`\\Delta` (Muon orthogonalizes)."""
        return delta

    def _limiter_enabled(self, group: dict, transformed: bool) -> bool:
        return transformed and group["norm_growth_limit"] is not None

    def _fused_kernel(self, group: dict, w: Tensor, G: Tensor, level: int) -> _fused.FusedBackend | None:
        """A fused kernel backend for the transformed Haar step of this
        parameter (level >= 1, fast path), or ``None`` for the generic path.

        A backend follows :class:`gwt_optim.optim._fused.FusedBackend`:
        ``phase1(group, state, G, level, step) -> (norm_sq, carry)`` updates
        the family state and returns the limiter's squared norm, and
        ``phase2(w, G, level, carry, r, scale, decay)`` applies
        ``w <- w * decay - scale / r * delta``; phase 2 may run right after its
        phase 1 or after other parameters' phase 1. A backend with
        ``batched = True`` also provides ``step_many(items, limiter_eps)``, the
        whole step of many parameters at once (with the limiter and the
        non-finite check), for every parameter that needs no collective;
        ``items`` are ``(ParamStep, alpha * lr * step_factor, 1 - lr * weight_decay)``.
        It may also provide ``step_batches(batches, limiter_eps, *, key)``, the
        same for a list of :class:`StepBatch` that stays the same from step to
        step (the optimizer's step plan, or one parameter's for
        :meth:`step_param`); without it, the plans call ``step_many``.

        ``G`` is first the gradient in its own dtype: a backend whose
        ``supports`` accepts that dtype reads it as it is (no copy); otherwise
        the optimizer casts it to the compute dtype and asks again. The state
        is checked with :func:`~gwt_optim.optim._fused.state_problem` before a
        backend sees it. Fused steps skip :meth:`_postprocess`. The default
        has none.
        """
        return None

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # Tag each group with the family, so that loading it into another
        # family fails with a message (torch's param groups are fresh dicts).
        for g in sd["param_groups"]:
            g["optimizer"] = self._family
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping each state tensor's saved dtype.

        ``torch.optim.Optimizer`` casts floating-point state to the parameter's
        dtype on load, which would silently turn the fp32 moments of bf16
        parameters into bf16 ones; GWT keeps the dtype it saved.

        Raises ``ValueError`` when the state dict comes from another optimizer
        or family, or when a saved state tensor's shape does not fit its
        parameter at its group's level; nothing is changed then.
        """
        saved_groups = state_dict["param_groups"]
        self._check_family(saved_groups)
        saved_ids = [i for g in saved_groups for i in g["params"]]
        if len(saved_ids) != sum(len(g["params"]) for g in self.param_groups):
            raise ValueError(
                "checkpoint does not match this optimizer: it holds "
                f"{len(saved_ids)} parameters, the optimizer {sum(len(g['params']) for g in self.param_groups)}"
            )
        state_dict = {
            **state_dict,
            # A group saved before detail_clip existed ran the paper's update:
            # it keeps doing so rather than taking today's default.
            "param_groups": [{"detail_clip": None, **{k: v for k, v in g.items() if k != "optimizer"}}
                             for g in saved_groups],
        }
        self._check_saved_state(state_dict)
        super().load_state_dict(state_dict)
        self._state_specs.clear()
        self._drop_plans()
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, saved in state_dict["state"].get(pid, {}).items():
                if isinstance(saved, Tensor) and key != "step" and saved.dtype != self.state[p][key].dtype:
                    # re-copy from the saved tensor: casting back would have lost bits
                    self.state[p][key] = saved.to(device=p.device, copy=True)

    def _check_family(self, saved_groups: list[dict[str, Any]]) -> None:
        """Refuse a state dict saved by another optimizer or GWT family."""
        mine = self._family
        tags = {g["optimizer"] for g in saved_groups if "optimizer" in g}
        if tags:
            if tags != {mine}:
                raise ValueError(
                    f"this state dict was saved by {', '.join(sorted(map(str, tags)))}; it cannot be loaded into {mine}"
                )
            return
        # Untagged: another library's optimizer, or a GWT state dict saved before the tag.
        keys = set().union(*(g.keys() for g in saved_groups)) if saved_groups else set()
        if saved_groups and not {"level", "scale"} <= keys:
            if "amsgrad" in keys:
                adam = saved_groups[0].get("decoupled_weight_decay") is False
                other = "torch.optim.Adam" if adam else "torch.optim.AdamW"
            else:
                other = "a non-GWT optimizer"
            raise ValueError(
                f"this state dict was saved by {other} (its param groups have no GWT 'level'); "
                f"it cannot be loaded into {mine}"
            )
        other = _guess_family(keys)
        if other is not None and other != mine and mine in _FAMILY_GROUP_KEYS:
            raise ValueError(f"this state dict was saved by {other}; it cannot be loaded into {mine}")

    def _check_saved_state(self, state_dict: dict[str, Any]) -> None:
        """Check every saved state tensor's shape against its parameter and
        its group's saved level, before anything is loaded."""
        for gi, (group, saved) in enumerate(zip(self.param_groups, state_dict["param_groups"])):
            if len(group["params"]) != len(saved["params"]):
                continue  # torch raises its own error for this
            options = {**self.defaults, **{k: v for k, v in saved.items() if k != "params"}}
            for pi, (p, pid) in enumerate(zip(group["params"], saved["params"])):
                st = state_dict["state"].get(pid)
                if not st:
                    continue
                transformed = p.ndim >= 2
                level = options["level"] if transformed else 0
                try:
                    approx = _approx_shape(tuple(p.shape), level, options["wavelet"])
                    spec = self._expected_state(options, approx, transformed)
                except Exception as exc:  # options a family cannot build state for
                    raise ValueError(
                        f"{self._family}: parameter {pi} of group {gi} (shape {tuple(p.shape)}): "
                        f"cannot check its saved state ({exc})"
                    ) from exc
                for key, shape in spec.items():
                    t = st.get(key)
                    if not isinstance(t, Tensor):
                        problem = f"the saved state has no tensor {key!r} (keys: {sorted(st)})"
                    elif tuple(t.shape) != shape:
                        problem = (
                            f"the saved state {key!r} has shape {tuple(t.shape)}, but level {level} needs {shape}: "
                            "the state dict belongs to another model, parameter order or level"
                        )
                    else:
                        continue
                    where = f"parameter {pi} of group {gi} (shape {tuple(p.shape)})"
                    raise ValueError(f"{self._family}: {where}: {problem}")

    def _expected_state(self, group: dict, approx_shape: tuple[int, ...], transformed: bool) -> dict[str, tuple]:
        """The shapes of the family's state tensors for approximation
        coefficients of ``approx_shape``: what :meth:`_init_family_state`
        creates, built on the meta device (no memory, no copy of the rule)."""
        state: dict[str, Any] = {}
        approx = torch.empty(approx_shape, device="meta")
        self._init_family_state(group, state, approx, approx.dtype, transformed)
        return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)}

    def _state_problem(self, group: dict, state: dict, approx: Tensor, moment_dtype, transformed: bool) -> str | None:
        """What makes an existing state unfit for this eager step, or None."""
        key = (id(group), tuple(approx.shape), transformed, moment_dtype)
        spec = self._state_specs.get(key)
        if spec is None:
            spec = self._state_specs[key] = self._expected_state(group, tuple(approx.shape), transformed)
        for name, shape in spec.items():
            problem = _fused.state_shape_problem(state, name, shape, group["level"] if transformed else 0)
            if problem is not None:
                return problem
            t = state[name]
            if t.device != approx.device or not (t.is_floating_point() or t.dtype == torch.uint8):  # uint8: int8 codes
                return (
                    f"state {name!r} is a {t.dtype} tensor on {t.device}, "
                    f"the step runs in {approx.dtype} on {approx.device}"
                )
        return None

    def _describe(self, p: Tensor) -> str:
        """``parameter i of group j (shape ...)``, for messages (a scan: errors only)."""
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    return f"parameter {pi} of group {gi} (shape {tuple(p.shape)})"
        return f"a parameter of shape {tuple(p.shape)}"

    def _record_nonfinite(self, p: Tensor) -> None:
        self._nonfinite_skips += 1
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"{self._family}: the gradient of {self._describe(p)} holds a NaN or an infinity; its update was "
                "skipped (weight and state unchanged, its step count advances). Further skips are counted in "
                ".nonfinite_skips without a warning",
                RuntimeWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------ step --- #

    @_untraced
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """One step of every parameter with a gradient.

        Parameters that batched fused kernels step (all GWT-AdamW weights on
        CUDA) follow a *step plan*: the routing, checks and ParamSteps of the
        last step, reused while the parameters with gradients, their addresses,
        shapes, strides and dtypes, the gradients' dtypes, shapes and strides,
        the state objects and the groups' routing options (:meth:`_route_key`)
        are as they were. Then a step costs a few list comparisons and one call
        per backend instead of the per-parameter checks, and the step counts of
        those parameters (``state["step"]``, CPU float32 tensors as always)
        advance together: they are views of one tensor, advanced by one
        in-place add. Anything else (``load_state_dict``,
        ``add_param_group``, a new level, a moved parameter, a gradient that
        appears or goes) makes a new plan on that step, after the full checks.
        Learning rates and other scalars are read on every step.

        ``step`` and :meth:`step_param` opt out of ``torch.compile`` tracing (a
        compiled caller runs them eagerly; ``fullgraph=True`` raises): compile
        the model, not the step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        deferred: list[ParamStep] = []
        batched: list[ParamStep] = []
        plan = self._plan
        grads = None if plan is None else self._plan_grads(plan)
        if grads is not None:
            if plan.rest:
                self._step_params(plan.rest, batched, deferred)
                # A parameter joined the batched kernels: plan again next time.
                # (One the plan cannot hold, a gradient cast on every step, stays out.)
                if any(map(self._plannable, batched)):
                    self._plan = None
            self._run_plan(plan, grads)
        else:
            self._plan = None
            self._step_params([(p, g) for g in self.param_groups for p in g["params"]], batched, deferred)
            plan, batched = self._make_plan(batched)
            if plan is not None:
                self._plan = plan
                self._run_plan(plan, None)
        self._finish(batched, deferred)
        return loss

    @_untraced
    @torch.no_grad()
    def step_param(self, p: Tensor, group: dict | None = None) -> None:
        """The step of parameter ``p`` alone (of ``group``, found if None),
        exactly as :meth:`step` takes it, without visiting the others.

        For stepping inside backward (:func:`gwt_optim.step_in_backward`): the
        limiter and every other statistic are per parameter, so stepping the
        parameters one at a time equals one :meth:`step` over all of them.

        A parameter that batched fused kernels step keeps a plan of its own,
        as :meth:`step` does for all of them: its routing and checks are
        reused, and the backend keeps its tables, while the parameter, its
        group's routing options, its state tensors and its gradient's dtype
        and layout are as they were.
        """
        if group is None:
            group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
            if group is None:
                raise ValueError(f"{self._family}: step_param got a parameter this optimizer does not hold")
        plan = self._param_plans.get(id(p))
        if plan is not None and plan.param is p and plan.group is group:
            grad = self._param_plan_grad(plan)
            if grad is not None:
                self._run_param_plan(plan, grad)
                return
        self._param_plans.pop(id(p), None)
        batched: list[ParamStep] = []
        deferred: list[ParamStep] = []
        self._step_params([(p, group)], batched, deferred)
        if len(batched) == 1 and self._plannable(batched[0]):
            plan = self._make_param_plan(batched.pop())
            self._param_plans[id(p)] = plan
            self._run_param_plan(plan, None)
        self._finish(batched, deferred)

    def _make_param_plan(self, ps: ParamStep) -> _ParamPlan:
        """A plan from this step's ParamStep of one batched parameter (made
        by :meth:`_phase1` with every check)."""
        values = list(ps.state.values())
        p = ps.full_param
        return _ParamPlan(
            param=p, group=ps.group, route=self._route_key(ps.group), state=ps.state, values=values,
            addresses=list(map(_data_ptr, values)), address=p.data_ptr(), shape=p.shape,
            grad_spec=(ps.grad.dtype, ps.grad.is_contiguous()), strides=(p.stride(), ps.grad.stride()),
            count=ps.state["step"],
            version=ps.state["step"]._version, ps=ps, backend=ps.fused,
            batches=[StepBatch([ps], ps.group, ps.step, ps.transformed and ps.group["scale"] != 1)],
        )

    def _param_plan_grad(self, plan: _ParamPlan) -> Tensor | None:
        """The parameter's gradient if this step_param may repeat its plan
        (see :meth:`_plan_grads`, which checks the same for every batched
        parameter at once), else None."""
        p, state = plan.param, plan.state
        grad = p.grad
        if (
            grad is None
            or self.state.get(p) is not state
            or plan.count._version != plan.version
            or (grad.dtype, grad.is_contiguous()) != plan.grad_spec
            or p.data_ptr() != plan.address
            or p.shape != plan.shape
            or (p.stride(), grad.stride()) != plan.strides
            or self._route_key(plan.group) != plan.route
        ):
            return None
        values = list(state.values())
        if (len(values) != len(plan.values) or not all(map(operator.is_, values, plan.values))
                or list(map(_data_ptr, values)) != plan.addresses):
            return None
        return grad

    def _run_param_plan(self, plan: _ParamPlan, grad: Tensor | None) -> None:
        """One parameter's whole step on its backend. With ``grad`` (a
        repeated plan) its step count advances here; otherwise :meth:`_phase1`
        has advanced it and left the gradient."""
        ps = plan.ps
        batch = plan.batches[0]
        if grad is not None:
            ps.step = batch.step = batch.step + 1
            plan.count.fill_(batch.step)
            ps.grad = grad
        plan.version = plan.count._version
        try:
            self._batch_scalars(batch)
            run = getattr(plan.backend, "step_batches", None)
            if run is not None:
                self._count_skipped(run(plan.batches, _LIMITER_EPS, key=id(plan.param)))
            else:
                self._count_skipped(plan.backend.step_many([(ps, batch.scale, batch.decay)], _LIMITER_EPS))
        finally:
            ps.grad = None  # the plan outlives the step; the gradient must not

    def _step_params(self, params: list[tuple[Tensor, dict]], batched: list[ParamStep],
                     deferred: list[ParamStep]) -> None:
        """Phase 1 of each ``(parameter, group)`` with a gradient, then phase 2
        now or queued (see :meth:`_route`)."""
        sharded = [p for p, _ in params if p.grad is not None and _is_dtensor(p)]
        finite = self._finite_across_ranks(sharded) if sharded else {}
        if len(params) > 1:
            # The eager path checks every gradient itself: where reading the
            # answer waits for the device, all of them at once.
            eager = [p for p, g in params if p.grad is not None and not _is_dtensor(p) and not p.grad.is_sparse
                     and p.numel() and self._eager_group(g) and self._check_waits(p.grad)]
            if eager:
                finite.update(self._finite_at_once(eager))
        for p, group in params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if p.numel() == 0:
                continue  # nothing to update, and no state to keep
            ps = self._phase1(p, group, finite.get(id(p)))
            if ps is not None:  # None: skipped, a non-finite gradient
                self._route(ps, batched, deferred)

    def _route(self, ps: ParamStep, batched: list[ParamStep], deferred: list[ParamStep]) -> None:
        """Phase 2 now, or queued for the batched kernels or the limiter's collective."""
        if ps.batched:
            batched.append(ps)
        elif self._needs_collective(ps):
            deferred.append(ps)
        else:
            self._phase2(ps)

    def _finish(self, batched: list[ParamStep], deferred: list[ParamStep]) -> None:
        self._run_batched(batched)
        self._reduce_limiter_norms(deferred)
        for ps in deferred:
            self._phase2(ps)

    # ------------------------------------------------------- step plan --- #

    def _drop_plans(self) -> None:
        """Forget the step plans, and the tables their backends keep for
        them: those reach the old state tensors, which a loaded state dict
        replaces (kept, they would hold a second copy of the moments until
        each parameter's next step)."""
        backends = [backend for backend, _ in self._plan.batches] if self._plan is not None else []
        backends += [plan.backend for plan in self._param_plans.values()]
        for backend in {id(b): b for b in backends}.values():
            forget = getattr(backend, "invalidate", None)
            if forget is not None:
                forget()
        self._plan = None
        self._param_plans = {}

    def _route_key(self, group: dict) -> tuple:
        """The group options that choose each parameter's path and state,
        rather than only a kernel's arguments: a change makes a new plan."""
        return (
            group["level"], group["wavelet"], group["moment_dtype"], group["scale"] == 1,
            group["norm_growth_limit"] is None, group["detail_clip"] is None,
        )

    def _make_plan(self, batched: list[ParamStep]) -> tuple[_StepPlan | None, list[ParamStep]]:
        """A plan from this step's batched ParamSteps (made by :meth:`_phase1`
        with every check), and those it leaves to :meth:`_run_batched`: a
        gradient cast to the compute dtype (a copy on every step) or a step
        count that is not a CPU float32 scalar."""
        fast, left = [], []
        for ps in batched:
            (fast if self._plannable(ps) else left).append(ps)
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
            key = (id(ps.fused), id(ps.group), ps.step, ps.transformed and ps.group["scale"] != 1)
            batch = batches.get(key)
            if batch is None:
                batch = batches[key] = StepBatch([], ps.group, ps.step, key[-1])
                by_backend.setdefault(id(ps.fused), (ps.fused, []))[1].append(batch)
            batch.steps.append(ps)
        params = [p for g in self.param_groups for p in g["params"]]
        fast_params = [ps.full_param for ps in fast]
        values = [v for ps in fast for v in ps.state.values()]
        plan = _StepPlan(
            state=self.state,
            routes=[self._route_key(g) for g in self.param_groups],
            params=params,
            rest=[(p, g) for g in self.param_groups for p in g["params"] if id(p) not in planned],
            fast=fast,
            fast_params=fast_params,
            fast_states=[ps.state for ps in fast],
            states=list(self.state.values()),
            param_addresses=list(map(_data_ptr, fast_params)),
            shapes=[p.shape for p in fast_params],
            grad_specs=[(ps.grad.dtype, ps.grad.is_contiguous()) for ps in fast],
            strides=[(ps.full_param.stride(), ps.grad.stride()) for ps in fast],
            values=values,
            addresses=list(map(_data_ptr, values)),
            counter=counter,
            version=counter._version,
            batches=list(by_backend.values()),
        )
        return plan, left

    @staticmethod
    def _plannable(ps: ParamStep) -> bool:
        """Whether a plan may repeat this batched ParamStep: not for a
        gradient cast to the compute dtype (a copy on every step), nor for a
        step count that is not a CPU float32 scalar."""
        st = ps.state.get("step")
        return (ps.grad is ps.full_param.grad and isinstance(st, Tensor) and st.ndim == 0
                and st.dtype == torch.float32 and st.device.type == "cpu"
                and all(isinstance(v, Tensor) for v in ps.state.values()))

    def _batch_scalars(self, batch: StepBatch) -> None:
        """This step's ``scale`` and ``decay`` of a StepBatch, from its group."""
        group = batch.group
        lr = group["lr"]
        lr = lr.item() if isinstance(lr, Tensor) else lr
        alpha = group["scale"] if batch.scaled else 1.0
        batch.scale = alpha * lr * self._step_factor(batch.steps[0])
        batch.decay = 1 - lr * group["weight_decay"]

    def _plan_grads(self, plan: _StepPlan) -> list[Tensor] | None:
        """The batched parameters' gradients if this step may repeat the
        plan's routing, else None. It may with the same parameters, groups'
        routing options and step counts (nothing wrote them but the plan), the
        batched parameters and their state tensors as they were (see
        :class:`StepBatch`), and gradients the backends take the same way."""
        if plan.state is not self.state or plan.counter._version != plan.version:
            return None
        groups = self.param_groups
        if [self._route_key(g) for g in groups] != plan.routes:
            return None
        params = [p for g in groups for p in g["params"]]
        if len(params) != len(plan.params) or not all(map(operator.is_, params, plan.params)):
            return None
        # Every state dict, in order (no hashing of parameters): one replaced,
        # added or removed shows here.
        states = self.state
        if len(states) != len(plan.states) or not all(map(operator.is_, states.values(), plan.states)):
            return None
        fast = plan.fast_params
        grads = [p.grad for p in fast]
        try:
            # torch's grad setter keeps a gradient's shape and device the
            # parameter's; a sparse one is not contiguous.
            specs = [(g.dtype, g.is_contiguous()) for g in grads]
        except AttributeError:  # a gradient is None
            return None
        values = [v for st in plan.fast_states for v in st.values()]
        holds = (
            specs == plan.grad_specs
            and list(map(_data_ptr, fast)) == plan.param_addresses
            and [p.shape for p in fast] == plan.shapes
            and [(p.stride(), g.stride()) for p, g in zip(fast, grads)] == plan.strides
            and len(values) == len(plan.values)
            and all(map(operator.is_, values, plan.values))
            and list(map(_data_ptr, values)) == plan.addresses
        )
        return grads if holds else None

    def _run_plan(self, plan: _StepPlan, grads: list[Tensor] | None) -> None:
        """The batched parameters' whole steps, one call per backend. With
        ``grads`` (a repeated plan) their step counts advance here; otherwise
        :meth:`_phase1` has advanced them and left the gradients."""
        if grads is not None:
            plan.counter.add_(1)
            plan.version = plan.counter._version
            for ps, g in zip(plan.fast, grads):
                ps.grad = g
            for _, batches in plan.batches:
                for batch in batches:
                    batch.step += 1
                    for ps in batch.steps:
                        ps.step = batch.step
        try:
            for backend, batches in plan.batches:
                for batch in batches:
                    self._batch_scalars(batch)
                run = getattr(backend, "step_batches", None)
                if run is not None:
                    self._count_skipped(run(batches, _LIMITER_EPS, key="step"))
                else:
                    items = [(ps, b.scale, b.decay) for b in batches for ps in b.steps]
                    self._count_skipped(backend.step_many(items, _LIMITER_EPS))
        finally:
            # The plan outlives the step; the gradients must not (zero_grad frees them).
            for ps in plan.fast:
                ps.grad = None

    def _run_batched(self, steps: list[ParamStep]) -> None:
        """Hand the whole steps a fused backend batches to it, with the
        family's step factor and the decoupled weight decay."""
        by_backend: dict[int, tuple[Any, list]] = {}
        for ps in steps:
            lr = ps.group["lr"]
            lr = lr.item() if isinstance(lr, Tensor) else lr
            scale = (ps.group["scale"] if ps.transformed else 1.0) * lr * self._step_factor(ps)
            entry = by_backend.setdefault(id(ps.fused), (ps.fused, []))
            entry[1].append((ps, scale, 1 - lr * ps.group["weight_decay"]))
        for backend, items in by_backend.values():
            self._count_skipped(backend.step_many(items, _LIMITER_EPS))

    def _count_skipped(self, skipped: tuple | list) -> None:
        """Record what a batched backend skipped for a non-finite gradient:
        a list of ParamSteps, or a tuple of the backend's running device
        counts, kept by identity (no host sync, nor any tensor op, here)."""
        if isinstance(skipped, tuple):
            for count in skipped:
                self._nonfinite_counters[id(count)] = count
        else:
            for ps in skipped or ():
                self._record_nonfinite(ps.full_param)

    def _finite_across_ranks(self, params: list[Tensor]) -> dict[int, bool]:
        """Whether each sharded parameter's whole gradient is finite, in one
        collective per device mesh: every rank must skip the same parameters,
        or the limiter's all-reduce and the shards would disagree."""
        import torch.distributed as dist

        by_mesh: dict[int, list[Tensor]] = {}
        for p in params:
            by_mesh.setdefault(id(p.device_mesh), []).append(p)
        finite: dict[int, bool] = {}
        for group in by_mesh.values():
            bad = torch.stack([(~torch.isfinite(_local(p.grad))).any() for p in group]).to(torch.int32)
            mesh = group[0].device_mesh
            if mesh.size() > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=mesh.get_group())
            for p, b in zip(group, bad.tolist()):
                finite[id(p)] = not b
        return finite

    def _eager_group(self, group: dict) -> bool:
        """Whether every parameter of ``group`` takes the eager path (no
        fused kernels), which checks each gradient's finiteness itself."""
        return self._impl != "fast" or type(self)._fused_kernel is GWTOptimizer._fused_kernel

    @staticmethod
    def _check_waits(grad: Tensor) -> bool:
        """Whether reading whether ``grad`` is finite waits for its device."""
        return grad.device.type != "cpu"

    @staticmethod
    def _finite_at_once(params: list[Tensor]) -> dict[int, bool]:
        """Whether each parameter's gradient is finite: one foreach norm and
        one read per device and dtype, instead of a host synchronization per parameter
        (the eager path's check, which on a GPU stalls the launches of every
        parameter behind the previous one's kernels)."""
        by_device: dict[tuple, list[Tensor]] = {}
        for p in params:
            by_device.setdefault((p.grad.device, p.grad.dtype), []).append(p)
        finite: dict[int, bool] = {}
        for group in by_device.values():
            finite.update(zip(map(id, group), _fused.all_finite([p.grad for p in group])))
        return finite

    @staticmethod
    def _needs_collective(ps: ParamStep) -> bool:
        """Whether phase 2 must wait for the all-reduce of the limiter's norms."""
        return ps.limited and _is_dtensor(ps.full_param)

    def _compute_dtype(self, p: Tensor) -> torch.dtype:
        # Math runs in at least fp32 whatever the parameter dtype.
        return torch.promote_types(p.dtype, torch.float32)

    def _moment_dtype(self, group: dict, cdt: torch.dtype) -> torch.dtype:
        md = group["moment_dtype"]
        return _MOMENT_DTYPES[md] if md is not None else cdt

    def _use_fast(self, group: dict, level: int) -> bool:
        return self._impl == "fast" and (group["wavelet"] == wavelets.HAAR or level == 0)

    def _phase1(self, p: Tensor, group: dict, finite: bool | None = None) -> ParamStep | None:
        """Transform, update the family state on A_l, and the limiter's norm.

        Returns None when the gradient is not finite (``finite``: known
        already, for sharded parameters); the state then only counts the step.
        """
        state = self.state[p]
        w = _local(p)
        g = _local(p.grad)
        if _is_dtensor(p):
            self._check_sharding(p)
        transformed = p.ndim >= 2
        level = group["level"] if transformed else 0
        cdt = self._compute_dtype(w)
        # Tensors with more than 2 dims transform along their last axis with
        # all leading dims kept, so state shapes keep the parameter's leading
        # dims and shard like it under FSDP2.
        fused, G = self._select_fused(group, p, w, g, cdt, level, transformed)

        coeffs = A = None
        if fused is None:
            if level == 0:
                A = G
            elif self._use_fast(group, level):
                A = _haar_approx(G, level)
            else:
                coeffs = wavelets.wavedec(G, level, group["wavelet"], dim=-1)
                A = coeffs.approx

        batched = fused is not None and getattr(fused, "batched", False) and not _is_dtensor(p)
        if finite is None and not batched:
            # Batched kernels check the gradient themselves, before they change anything.
            finite = bool(torch.isfinite(G).all())
        new = "step" not in state
        if new:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            # The fused kernels compute A themselves; the state only needs its shape.
            approx = A if A is not None else G.new_empty(
                (*G.shape[:-1], wavelets.approx_length(G.shape[-1], level)), dtype=cdt)
            self._init_family_state(group, state, approx, self._moment_dtype(group, cdt), transformed)
            if self._limiter_enabled(group, transformed):
                state["limiter_norm"] = torch.zeros((), dtype=cdt, device=w.device)
            if _is_dtensor(p):
                _distribute_state(p, w, state)
        # Families see (and update in place) the local shards of their state.
        lstate = {k: _local(v) for k, v in state.items()} if _is_dtensor(p) else state
        if not new:
            # A loaded state, or a level changed since: fused kernels would
            # index out of bounds, eager ones fail somewhere inside.
            md = self._moment_dtype(group, cdt)
            if fused is not None:
                problem = _fused.state_problem(w, G, lstate, level, md)
            else:
                problem = self._state_problem(group, lstate, A, md, transformed)
            if problem is not None:
                raise ValueError(f"{self._family}: {self._describe(p)}: {problem}")
        # fill_ from a Python int: a third of the dispatch cost of `+= 1`.
        step = int(state["step"].item()) + 1
        state["step"].fill_(step)
        if finite is False:
            self._record_nonfinite(p)
            return None

        if fused is not None:
            ps = ParamStep(w, p, G, lstate, group, transformed, level, None, None, None, fused=fused, step=step)
            ps.limited = self._limiter_enabled(group, transformed)
            if batched:
                ps.batched = True  # phase 1, limiter and phase 2 run in _run_plan or _run_batched
                return ps
            norm_sq, ps.carry = fused.phase1(group, lstate, G, level, step)
            if ps.limited:
                ps.norm_sq = norm_sq
            return ps
        U, den = self._approx_update(group, lstate, A, step, transformed)
        ps = ParamStep(w, p, G, lstate, group, transformed, level, A, U, den, coeffs, step=step)
        if self._limiter_enabled(group, transformed):
            ps.limited = True
            ps.norm_sq = U.square().sum()
        return ps

    def _select_fused(self, group: dict, p: Tensor, w: Tensor, g: Tensor, cdt: torch.dtype, level: int,
                      transformed: bool) -> tuple[Any | None, Tensor]:
        """The fused backend for this parameter (None: the generic path) and
        the gradient it gets. A backend whose ``supports`` accepts the
        gradient's own dtype reads it as it is (the Triton kernels read bf16
        and fp16): a bf16 gradient is not copied to fp32 first. Everything
        else gets it in the compute dtype."""

        def select(G: Tensor) -> Any | None:
            if level == 0:
                return self._plain_fused_kernel(group, p, w, G, transformed)
            return self._fused_kernel(group, w, G, level) if self._use_fast(group, level) else None

        fused = select(g)
        if fused is not None or g.dtype == cdt:
            return fused, g
        G = g.to(cdt)
        return select(G), G

    def _plain_fused_kernel(self, group: dict, p: Tensor, w: Tensor, G: Tensor, transformed: bool) -> Any | None:
        """A batched fused backend for a level-0 or 1-D parameter, or None.

        With no transform, no limiter and alpha = 1, the step is the plain
        family's, which a family may run for all such parameters at once
        (GWT-AdamW: ``torch._fused_adamw_`` on CPU, its Triton kernels on
        CUDA) instead of a dozen eager operations per parameter. Sharded
        parameters keep the eager path (it checks finiteness across ranks).
        """
        if (
            self._impl != "fast"
            or w.ndim == 0
            or _is_dtensor(p)
            or self._limiter_enabled(group, transformed)
            or (transformed and group["scale"] != 1)
        ):
            return None
        fused = self._fused_kernel(group, w, G, 0)
        return fused if fused is not None and getattr(fused, "batched", False) else None

    def _check_sharding(self, p: Tensor) -> None:
        from torch.distributed.tensor import Shard

        for pl in p.placements:
            if isinstance(pl, Shard) and pl.dim % p.ndim == p.ndim - 1 and p.ndim >= 2:
                raise ValueError(
                    "GWT transforms along the last axis, which this DTensor parameter is sharded "
                    f"on ({p.placements}); shard it along dim 0 (FSDP2's default) instead"
                )

    def _reduce_limiter_norms(self, pending: list[ParamStep]) -> None:
        """Sum the limiter's squared norms across ranks, all in one collective."""
        sharded = [ps for ps in pending if ps.limited and _is_dtensor(ps.full_param)]
        if not sharded:
            return
        import torch.distributed as dist

        # One collective per device mesh (normally exactly one: FSDP2's).
        by_mesh: dict[int, list[ParamStep]] = {}
        for ps in sharded:
            by_mesh.setdefault(id(ps.full_param.device_mesh), []).append(ps)
        for steps in by_mesh.values():
            mesh = steps[0].full_param.device_mesh
            if mesh.size() == 1:
                continue
            values = [ps.norm_sq for ps in steps]
            if all(isinstance(v, Tensor) for v in values):
                flat = torch.stack(values)
                dist.all_reduce(flat, group=mesh.get_group())
                summed = flat.unbind()
            else:  # fused CPU kernels return Python floats
                flat = torch.tensor([float(v) for v in values], dtype=torch.float64)
                dist.all_reduce(flat, group=mesh.get_group())
                summed = flat.tolist()
            for ps, v in zip(steps, summed):
                ps.norm_sq = v

    def _limit(self, ps: ParamStep) -> Tensor | float:
        """Fira's norm-growth limiter; returns r and updates s in the state."""
        if not ps.limited:
            return 1.0
        gamma = ps.group["norm_growth_limit"]
        s = ps.state["limiter_norm"]
        # No norm recorded yet (the first step, or only skipped non-finite
        # ones so far): record this one rather than limit against zero.
        if not isinstance(ps.norm_sq, Tensor):
            # A float from a fused CPU kernel: scalar math, no tiny tensor ops.
            norm = math.sqrt(ps.norm_sq)
            s_ = s.item()
            r_ = 1.0 if ps.step == 1 or not s_ > 0 else max(norm / (s_ + _LIMITER_EPS), gamma) / gamma
            s.fill_(norm / r_)
            return r_
        norm = ps.norm_sq.sqrt()
        if ps.step == 1:
            r = torch.ones((), dtype=norm.dtype, device=norm.device)
        else:
            limited = torch.clamp(norm / (s + _LIMITER_EPS), min=gamma) / gamma
            r = torch.where(s > 0, limited, torch.ones_like(limited))
        s.copy_(norm / r)
        return r

    def _phase2(self, ps: ParamStep) -> None:
        group, state, step = ps.group, ps.state, ps.step
        r = self._limit(ps)
        scale = group["scale"] if ps.transformed else 1.0
        w = ps.param
        lr = group["lr"]
        lr = lr.item() if isinstance(lr, Tensor) else lr
        if ps.fused is not None:
            step_size = lr * self._step_factor(ps)
            ps.fused.phase2(w, ps.grad, ps.level, ps.carry, r, scale * step_size, 1 - lr * group["weight_decay"])
            return
        clip = group["detail_clip"] if ps.transformed else None
        if ps.coeffs is not None:
            delta = _reference_inverse(ps.coeffs, ps.U, ps.den, r, clip) * scale
        else:
            coef = scale / r if isinstance(r, float) else (scale / r).to(ps.U.dtype)
            if ps.level == 0:
                delta = ps.U * coef
            else:
                delta = _haar_delta(ps.grad, ps.A, ps.U, ps.den, coef, ps.level, clip)
        delta = self._postprocess(ps, delta)

        wd = group["weight_decay"]
        step_size = lr * self._step_factor(ps)
        if w.dtype == delta.dtype:
            if wd != 0:
                w.mul_(1 - lr * wd)
            w.add_(delta, alpha=-step_size)
        else:
            # bf16/fp16 parameters: update in fp32, round once.
            w32 = w.to(delta.dtype)
            if wd != 0:
                w32.mul_(1 - lr * wd)
            w32.add_(delta, alpha=-step_size)
            w.copy_(w32)


def _is_real(x: Any) -> bool:
    # numbers.Real takes NumPy scalars; bool is an int but never a rate.
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _approx_shape(shape: tuple[int, ...], level: int, wavelet: str) -> tuple[int, ...]:
    """The shape of A_l for a parameter of ``shape`` (the transform runs along the last axis)."""
    if level == 0 or not shape:
        return shape
    n = shape[-1]
    if wavelet == wavelets.HAAR:
        k = wavelets.approx_length(n, level)
    else:  # longer filters add boundary coefficients: ask the transform itself
        k = wavelets.wavedec(torch.zeros(1, n), level, wavelet, dim=-1).approx.shape[-1]
    return (*shape[:-1], k)


# A group key only one family has, to name the family of an untagged
# (pre-tag) GWT state dict; GWT-AdamW's keys are all shared.
_FAMILY_GROUP_KEYS = {"GWTAdamMini": "block", "GWTMuon": "use_muon", "GWTAdafactor": "beta2_decay", "GWTAdamW": None}


def _guess_family(keys: set[str]) -> str | None:
    for name, key in _FAMILY_GROUP_KEYS.items():
        if key is not None and key in keys:
            return name
    return "GWTAdamW" if "betas" in keys else None


def _distribute_state(p: Tensor, local_param: Tensor, state: dict) -> None:
    """Wrap state tensors that follow the parameter's row sharding as DTensors
    with the parameter's placements, so that distributed checkpointing
    (``torch.distributed.checkpoint``) saves and reshards them correctly.
    Scalars and statistics that are not row-aligned stay plain tensors."""
    from torch.distributed.tensor import DTensor

    rows = local_param.shape[0] if local_param.ndim else None
    for key, v in list(state.items()):
        if key == "step" or not isinstance(v, Tensor) or v.ndim != p.ndim or v.shape[0] != rows:
            continue
        shape = (p.shape[0], *v.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        state[key] = DTensor.from_local(v, p.device_mesh, p.placements, shape=shape, stride=stride)


def _safe_div(x: Tensor, den: Tensor) -> Tensor:
    """``x / den`` with entries over ``den == 0`` set to 0 (eps = 0 and V = 0)."""
    return torch.where(den > 0, x / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(x))


def _haar_approx(G: Tensor, level: int) -> Tensor:
    """A_l of the Haar transform: block sums over 2^l columns, times 2^(-l/2).

    A matrix-vector product with a constant vector: on CPU it runs as one BLAS
    pass, several times faster than ``sum(-1)`` over a tiny inner dimension.
    """
    blocks, _ = wavelets.haar_block_split(G, level)
    h = torch.full((blocks.shape[-1],), 2.0 ** (-level / 2), dtype=G.dtype, device=G.device)
    return blocks @ h


def _haar_delta(
    G: Tensor, A: Tensor, U: Tensor, den: Tensor | None, coef, level: int, clip: float | None = None
) -> Tensor:
    """Closed form of ``coef * inverse([U, D_l/den', ..., D_1/den'])`` for Haar.

    On block k the inverse of the details alone is ``G_k - mean(G_k)`` and
    ``mean(G_k) = A_k 2^(-l/2)``, so with ``q = coef/den`` the whole direction is
    ``G_k q_k + c_k`` where ``c_k = 2^(-l/2) (coef U_k - A_k q_k)``: one
    ``addcmul`` pass over G with per-block scalars.

    With ``clip`` the normalized detail ``(G_k - mean(G_k))/den_k`` is clamped
    to ``[-clip, clip]`` elementwise before ``coef`` scales it.
    """
    blocks, n = wavelets.haar_block_split(G, level)
    h = 2.0 ** (-level / 2)
    if den is None:
        d = torch.ones_like(A)
    else:
        d = torch.where(den > 0, 1.0 / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))
    if clip is None:
        q = d.mul_(coef)
        c = (U * coef).sub_(A * q).mul_(h)
        delta = torch.addcmul(c.unsqueeze(-1), blocks, q.unsqueeze(-1)).flatten(-2)
    else:
        detail = (blocks - (A * h).unsqueeze(-1)).mul_(d.unsqueeze(-1)).clamp_(-clip, clip)
        delta = detail.add_((U * h).unsqueeze(-1)).mul_(coef).flatten(-2)
    return delta[..., :n] if delta.shape[-1] != n else delta


def _repeat_to(den: Tensor, repeats: int, length: int) -> Tensor:
    """den' of the paper: each entry repeated over the details under it."""
    out = den.repeat_interleave(repeats, dim=-1)
    if out.shape[-1] < length:  # longer filters (db2, ...) can exceed it by a few
        out = torch.nn.functional.pad(out, (0, length - out.shape[-1]), mode="replicate")
    return out[..., :length]


def _reference_inverse(coeffs: wavelets.Coefficients, U: Tensor, den, r, clip: float | None = None) -> Tensor:
    """Steps 4-5 in the paper's notation: normalize each detail level by den'
    and r, then the inverse transform of [U/r, D~_l, ..., D~_1].

    With ``clip``, the normalized details' own reconstruction (the inverse of
    [0, D_l/den', ..., D_1/den']) is clamped to ``[-clip, clip]`` before the
    division by r; by linearity the approximation part is unchanged.
    """
    details = []
    for i, D in enumerate(coeffs.details):  # coarsest first: D_l covers 2^0 per coefficient
        Dt = D
        if den is not None:
            Dt = _safe_div(D, _repeat_to(den, 1 << i, D.shape[-1]))
        details.append(Dt if clip is not None else Dt / r)
    if clip is None:
        return wavelets.waverec(coeffs._replace(approx=U / r, details=tuple(details)))
    approx_part = wavelets.waverec(coeffs._replace(approx=U, details=tuple(torch.zeros_like(D) for D in details)))
    detail_part = wavelets.waverec(coeffs._replace(approx=torch.zeros_like(U), details=tuple(details)))
    return (approx_part + detail_part.clamp(-clip, clip)) / r
