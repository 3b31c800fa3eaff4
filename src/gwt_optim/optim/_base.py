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
5. :math:`\Delta = \alpha \cdot \mathrm{inverse}([U, \tilde D_l, \dots, \tilde D_1])`
   (GWT-Muon has a direction of its own: :math:`\alpha` times the
   orthogonalized inverse of its raw details);
6. decoupled weight decay and :math:`W \leftarrow W - \eta \cdot c_t \cdot \Delta`
   with the family's step factor :math:`c_t`.

Each step is stated once, per tensor, in :mod:`gwt_optim.optim.functional`,
whose pieces the eager path here calls. A family (:class:`GWTOptimizer`
subclass) supplies only its state (step 2), its step factor and, optionally,
its own direction :math:`\Delta`. The base
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
    (:meth:`GWTOptimizer.select_backend`; GWT-AdamW has them, see
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
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer

from gwt_optim import wavelets
from gwt_optim.optim import _fused
from gwt_optim.optim._backends import CAPABILITIES, Choice, candidates
from gwt_optim.optim._sharded import (check_sharding, distribute_state, finite_across_ranks, is_dtensor, local,
                                      reduce_limiter_norms)
from gwt_optim.optim._saved import check_family, check_saved_state, eager_state_problem
from gwt_optim.optim._stepper import ParamStep, StepBatch, Stepper, run_unplanned
from gwt_optim.optim.functional import apply_update, direction, haar_approx, limiter_ratio

__all__ = ["GWTOptimizer", "ParamStep", "StepBatch", "Route", "PATHS", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("reference", "fast")
# "int8": blockwise 8-bit codes plus fp32 block scales (gwt_optim.optim._quant),
# for the families that set _INT8_MOMENTS; the moment tensors hold the codes.
_MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64, "int8": torch.uint8}

# The paths a parameter's step can take (GWTOptimizer.route), as the route table test lists them.
PATHS = {
    "batched": "a batched fused backend runs the whole step, with others, under the stepper's plan",
    "fused": "a fused backend's phase 1 and phase 2 around the limiter (sharded parameters, unbatched backends)",
    "plain": "the family's eager update with no transform (1-D parameters, level 0)",
    "haar": "the eager Haar closed form, one reduction and one update pass (impl='fast')",
    "reference": "wavedec, per-level normalization, waverec: the paper's notation (impl='reference', other wavelets)",
}


# Frames in these folders are the optimizer's own machinery (gwt_optim, and
# torch's optimizer hooks, no_grad wrappers and autograd for step_in_backward):
# a warning about the user's data should point past them, at the user's call.
_INTERNAL_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules["gwt_optim"], torch))


def _caller_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` made by this function's caller
    that names the first frame outside gwt_optim and torch (how deep that is
    depends on the route: step(), step_param, a backward hook, a compiled step)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


@dataclass
class Route:
    """Which path one parameter's step takes, and what it reads (:meth:`GWTOptimizer.route`)."""

    path: str  # a key of PATHS
    backend: Any  # the fused backend of paths "batched" and "fused", else None
    # The local gradient as the path reads it: in its own dtype where the
    # backend takes that dtype (the Triton kernels read bf16 and fp16), else
    # in the compute dtype.
    grad: Tensor
    level: int  # the group's level; 0 for parameters with fewer than two dimensions
    transformed: bool  # two or more dimensions: the wavelet step, scale and limiter apply


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
    and :meth:`_step_factor`, and may override :meth:`_direction`,
    :meth:`_validate_family` and :meth:`_validate_param`; a family with
    fused kernels names them in :attr:`_KERNELS`. Hooks that need the
    parameter receive its :class:`ParamStep`.

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
            # The transfer rule (functional.match_row_rms); False is the paper's step size.
            "match_rms": False,
        }
        base.update(defaults)
        self._validate_group(base)
        _fused.check_compile_option(compile)
        self._impl = impl
        self._compile = compile
        self._init_bookkeeping()
        if not isinstance(params, Tensor):
            params = list(params)  # a generator (model.parameters()) can be read once
            _say_what_a_flat_list_does(self._family, params, base)
        super().__init__(params, base)

    #: The family's name in messages and in saved state dicts.
    _family = "GWTOptimizer"
    #: A param-group key only this family has (GWT-AdamW's are all shared): it
    #: names the family of an untagged, pre-tag state dict (_saved.check_family).
    _GROUP_KEY: str | None = None
    #: Whether the family stores ``moment_dtype="int8"`` moments (:mod:`._quant`).
    _INT8_MOMENTS = False
    #: The family's fused kernels (a class like :class:`._fused.AdamWHaarKernels`,
    #: built with ``compile`` on the first step that may take one), or None:
    #: every step eager. The backends' capabilities (:mod:`._backends`) and
    #: :meth:`select_backend` decide which parameter takes which.
    _KERNELS: type | None = None

    def _init_bookkeeping(self) -> None:
        _make_untraced()
        self.__dict__.setdefault("_nonfinite_skips", 0)
        # The running skip counts that fused device kernels keep without a host
        # sync, by id (a backend hands the same tensors on every step).
        self.__dict__.setdefault("_nonfinite_counters", {})
        self.__dict__.setdefault("_warned_nonfinite", False)
        # Expected state shapes per (group, approximation shape, ...): see _saved.eager_state_problem.
        self.__dict__.setdefault("_state_specs", {})
        # Runs the batched parameters, under a plan per scope (see step()).
        self.__dict__.setdefault("_stepper", Stepper())
        # The built _KERNELS, made on first use (not copied or pickled: built again).
        self.__dict__.setdefault("_kernels", None)

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
        self._stepper.drop()
        super().add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        # torch keeps only defaults, state and groups: a copy or a pickle would
        # come back with impl="fast" and compile=None, and take the fused
        # kernels its original was told not to.
        return {**super().__getstate__(), "_impl": self._impl, "_compile": self._compile}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # torch adds its own optimizers' `differentiable` option to defaults
        # here; these optimizers have no such option, and the key would then
        # be copied into every group, so a reloaded state_dict() would differ.
        self.defaults.pop("differentiable", None)
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
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
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
        if not isinstance(g["match_rms"], bool):
            raise ValueError(f"Invalid match_rms: {g['match_rms']!r} (True or False)")
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
        if p.ndim >= 2 and p.shape[-1] and group["level"] > (p.shape[-1] - 1).bit_length():
            # ceil(log2 n) levels average a whole row; each further one only mixes in padding zeros, which
            # shrinks the approximation's share of the step and inflates the details'. Zero padding is
            # the documented rule for a short axis, so this is said, not refused.
            warnings.warn(
                f"{self._family}: {where} has {p.shape[-1]} columns, fewer than level {group['level']} can use "
                f"(at most level {(p.shape[-1] - 1).bit_length()}): its rows are zero-padded to "
                f"{1 << group['level']} and the step degenerates; give it a group of a lower level",
                UserWarning,
                stacklevel=_caller_stacklevel(),
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

    def _direction(self, ps: ParamStep, r: Tensor | float) -> Tensor:
        """The full-size direction :math:`\\Delta` of an eager step, from the
        approximation update, the denominators and the limiter's ``r``
        (:func:`~gwt_optim.optim.functional.direction`; GWT-Muon replaces it)."""
        scale = ps.group["scale"] if ps.transformed else 1.0
        clip = ps.group["detail_clip"] if ps.transformed else None
        return direction(ps.grad, ps.A, ps.U, ps.den, r, scale, ps.level, clip, ps.coeffs, ps.group["match_rms"])

    def _limiter_enabled(self, group: dict, transformed: bool) -> bool:
        return transformed and group["norm_growth_limit"] is not None

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
        check_family(self._family, saved_groups, _shipped_families())
        saved_ids = [i for g in saved_groups for i in g["params"]]
        if len(saved_ids) != sum(len(g["params"]) for g in self.param_groups):
            raise ValueError(
                "checkpoint does not match this optimizer: it holds "
                f"{len(saved_ids)} parameters, the optimizer {sum(len(g['params']) for g in self.param_groups)}"
            )
        state_dict = {
            **state_dict,
            # torch's older state dicts hold the step as a number; the step reads a tensor.
            "state": {pid: {k: torch.tensor(float(v), dtype=torch.float32) if k == "step" and _is_real(v) else v
                            for k, v in st.items()} for pid, st in state_dict["state"].items()},
            # A group saved before detail_clip or match_rms existed ran the
            # paper's update: it keeps doing so rather than taking today's default.
            "param_groups": [{"detail_clip": None, "match_rms": False, **{k: v for k, v in g.items() if k != "optimizer"}}
                             for g in saved_groups],
        }
        check_saved_state(self, state_dict)
        super().load_state_dict(state_dict)
        self._state_specs.clear()
        self._stepper.drop()
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, saved in state_dict["state"].get(pid, {}).items():
                if isinstance(saved, Tensor) and key != "step" and saved.dtype != self.state[p][key].dtype:
                    # re-copy from the saved tensor: casting back would have lost bits
                    self.state[p][key] = saved.to(device=p.device, copy=True)

    def _expected_state(self, group: dict, approx_shape: tuple[int, ...], transformed: bool) -> dict[str, tuple]:
        """The shapes of the family's state tensors for approximation
        coefficients of ``approx_shape``: what :meth:`_init_family_state`
        creates, built on the meta device (no memory, no copy of the rule)."""
        state: dict[str, Any] = {}
        approx = torch.empty(approx_shape, device="meta")
        self._init_family_state(group, state, approx, approx.dtype, transformed)
        return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)}

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
                stacklevel=_caller_stacklevel(),
            )

    # ------------------------------------------------------------ step --- #

    @_untraced
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """One step of every parameter with a gradient.

        Each parameter takes the path :meth:`route` gives it. Those that
        batched fused kernels step (all GWT-AdamW weights on CUDA, most on
        CPU) run under the stepper's plan (:mod:`gwt_optim.optim._stepper`):
        the last step's routing and checks, reused while the parameters, their
        gradients' dtype and layout, their state tensors and the groups'
        routing options (:meth:`_route_key`) are as they were; their step
        counts are then views of one tensor, advanced by one add. Anything
        else makes a new plan, after the full checks. Learning rates and other
        scalars are read on every step.

        ``step`` and :meth:`step_param` opt out of ``torch.compile`` tracing (a
        compiled caller runs them eagerly; ``fullgraph=True`` raises): compile
        the model, not the step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stepper.step(self)
        return loss

    @_untraced
    @torch.no_grad()
    def step_param(self, p: Tensor, group: dict | None = None) -> None:
        """The step of parameter ``p`` alone (of ``group``, found if None),
        exactly as :meth:`step` takes it, without visiting the others.

        For stepping inside backward (:func:`gwt_optim.step_in_backward`): the
        limiter and every other statistic are per parameter, so stepping the
        parameters one at a time equals one :meth:`step` over all of them.

        A parameter that batched fused kernels step keeps a plan of its own
        (the same kind as :meth:`step`'s, over one parameter): its routing and
        checks are reused, and the backend keeps its tables, while the
        parameter, its group, the group's routing options, its state tensors
        and its gradient's dtype and layout are as they were.
        """
        if group is None:
            group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
            if group is None:
                raise ValueError(f"{self._family}: step_param got a parameter this optimizer does not hold")
        self._stepper.step_param(self, p, group)

    # The stepper's host side (gwt_optim.optim._stepper.Host).

    def _step_params(self, params: list[tuple[Tensor, dict]], batched: list[ParamStep],
                     deferred: list[ParamStep]) -> None:
        """Phase 1 of each ``(parameter, group)`` with a gradient; then phase
        2 now, or queued for the batched kernels (``batched``) or the
        limiter's collective (``deferred``)."""
        sharded = [p for p, _ in params if p.grad is not None and is_dtensor(p)]
        finite = finite_across_ranks(sharded) if sharded else {}
        if len(params) > 1:
            # The eager path checks every gradient itself: where reading the
            # answer waits for the device, all of them at once.
            eager = [p for p, g in params if p.grad is not None and not is_dtensor(p) and not p.grad.is_sparse
                     and p.numel() and self._group_refusal(g) is not None and self._check_waits(p.grad)]
            if eager:
                finite.update(_finite_at_once(eager))
        for p, group in params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if p.numel() == 0:
                continue  # nothing to update, and no state to keep
            ps = self._phase1(p, group, finite.get(id(p)))
            if ps is None:  # skipped, a non-finite gradient
                continue
            if ps.batched:
                batched.append(ps)
            elif self._needs_collective(ps):
                deferred.append(ps)
            else:
                self._phase2(ps)

    def _finish(self, batched: list[ParamStep], deferred: list[ParamStep]) -> None:
        run_unplanned(self, batched)
        reduce_limiter_norms(deferred)
        for ps in deferred:
            self._phase2(ps)

    def _route_key(self, group: dict) -> tuple:
        """The group options that choose each parameter's path and state,
        rather than only a kernel's arguments: a change makes a new plan."""
        return (
            group["level"], group["wavelet"], group["moment_dtype"], group["scale"] == 1,
            group["norm_growth_limit"] is None, group["detail_clip"] is None, group["match_rms"],
        )

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

    @staticmethod
    def _check_waits(grad: Tensor) -> bool:
        """Whether reading whether ``grad`` is finite waits for its device."""
        return grad.device.type != "cpu"

    @staticmethod
    def _needs_collective(ps: ParamStep) -> bool:
        """Whether phase 2 must wait for the all-reduce of the limiter's norms."""
        return ps.limited and is_dtensor(ps.full_param)

    def _compute_dtype(self, p: Tensor) -> torch.dtype:
        # Math runs in at least fp32 whatever the parameter dtype.
        return torch.promote_types(p.dtype, torch.float32)

    def _moment_dtype(self, group: dict, cdt: torch.dtype) -> torch.dtype:
        md = group["moment_dtype"]
        return _MOMENT_DTYPES[md] if md is not None else cdt

    # ---------------------------------------------------------- routing --- #

    def route(self, group: dict, p: Tensor, grad: Tensor) -> Route:
        """The path of ``p``'s step (a key of :data:`PATHS`), its fused
        backend if any, and the gradient as that path reads it:
        :meth:`select_backend`'s answer as a path. ``tests/test_route.py``
        tables the cases.

        A backend that runs whole steps takes the step (``"batched"``), unless
        the parameter is sharded (``"fused"``: phase 1 and phase 2 around the
        limiter's all-reduce). Without a backend, the eager path: ``"plain"``
        at level 0, ``"haar"`` for a Haar transform under ``impl="fast"``,
        else ``"reference"``.
        """
        choice = self.select_backend(group, p, grad)
        if choice.backend is not None:
            path = "batched" if choice.backend.capabilities.batched and not is_dtensor(p) else "fused"
        elif choice.level == 0:
            path = "plain"
        elif self._impl == "fast" and group["wavelet"] == wavelets.HAAR:
            path = "haar"
        else:
            path = "reference"
        return Route(path, choice.backend, choice.grad, choice.level, choice.transformed)

    def select_backend(self, group: dict, p: Tensor, grad: Tensor) -> Choice:
        """The fused backend that runs ``p``'s step with gradient ``grad``, or
        why none does: the one place that decides it, from what each backend
        declares (:data:`gwt_optim.optim._backends.CAPABILITIES`).

        1. A parameter with fewer than two dimensions runs at level 0.
        2. The group must allow a backend at all (:meth:`_group_refusal`: the
           family has kernels, ``impl="fast"``, ``compile`` is not False, and
           its moment dtype is one they read), and the step must be one a
           kernel computes: a transformed Haar step, or at level 0 the plain
           family's (no limiter, alpha 1, an unsharded, non-scalar parameter),
           which only a backend that runs whole steps may take.
        3. The candidates for this ``compile``, device and level
           (:func:`~gwt_optim.optim._backends.candidates`), in order, first
           with the gradient in its own dtype (a backend that reads it takes
           it without a copy), then cast to the compute dtype (at least
           fp32). The first whose capabilities take the weight, gradient,
           moment dtype and level (:meth:`Capabilities.refusal
           <gwt_optim.optim._backends.Capabilities.refusal>`), the group's
           ``detail_clip`` and int8 moments, and a sharded parameter, and
           that builds and prepares (:class:`~gwt_optim.optim._fused.AdamWHaarKernels`),
           wins.

        The state is checked with :func:`~gwt_optim.optim._fused.state_problem`
        before a backend sees it; fused steps skip :meth:`_direction`.
        """
        w, g = local(p), local(grad)
        transformed = p.ndim >= 2
        level = group["level"] if transformed else 0
        cdt = self._compute_dtype(w)
        reason = self._group_refusal(group)
        if reason is None and level > 0 and group["wavelet"] != wavelets.HAAR:
            reason = f"the {group['wavelet']!r} wavelet has no closed form for the kernels"
        if reason is None and level == 0 and (w.ndim == 0 or is_dtensor(p) or self._limiter_enabled(group, transformed)
                                              or (transformed and group["scale"] != 1)):
            # With no transform, no limiter and alpha = 1 the step is the plain
            # family's, which a batched backend may run for all such parameters
            # at once (GWT-AdamW: torch._fused_adamw_ on CPU, its Triton kernels
            # on CUDA) instead of a dozen eager operations per parameter.
            reason = "at level 0 only the plain step (no limiter, alpha 1, an unsharded tensor) has kernels"
        if reason is not None:
            return Choice(None, g if g.dtype == cdt else g.to(cdt), level, transformed, reason)

        if self._kernels is None:
            # Built lazily: the C compiler or Triton runs on the first step only.
            self._kernels = self._KERNELS(self._compile)
        md = self._moment_dtype(group, cdt)
        names = candidates(self._compile, w.device.type, level)
        refusals = []
        while True:
            for name, strict in names:
                backend = self._kernels._backend(name, strict)
                if backend is None:
                    refusals.append(f"{name}: unavailable (it failed to build)")
                    continue
                caps = backend.capabilities
                why = caps.refusal(w, g, md, level)
                if why is None and group["detail_clip"] is not None and not caps.detail_clip:
                    why = "has no clipped form of the details (detail_clip)"
                if why is None and group["match_rms"] and level > 0 and not caps.match_rms:
                    why = "has no row-RMS match of the update (match_rms)"
                if why is None and group["moment_dtype"] == "int8" and not caps.int8_moments:
                    why = "does not read int8 moments"
                if why is None and level == 0 and not caps.batched:
                    why = "does not run whole plain steps"
                if why is None and is_dtensor(p) and not caps.dtensor:
                    why = "has no separate phases for a sharded parameter"
                if why is None:
                    if self._kernels.prepare(backend, w, g, md, level, strict):
                        return Choice(backend, g, level, transformed, None)
                    why = "failed to compile for this parameter"
                refusals.append(f"{name}: {why}")
            if g.dtype == cdt:
                break
            g = g.to(cdt)
        if not names:
            refusals.append(f"no backend for level {level} on {w.device.type} under compile={self._compile!r}")
        return Choice(None, g, level, transformed, "; ".join(refusals))

    def _group_refusal(self, group: dict) -> str | None:
        """Why no parameter of ``group`` can take a fused backend, or None
        (then :meth:`select_backend` looks at each). A group refused here
        takes the eager path everywhere, which checks each gradient's
        finiteness itself (``_step_params`` reads all of them at once)."""
        if self._KERNELS is None:
            return f"{self._family} has no fused kernels"
        if self._impl != "fast":
            return f"impl={self._impl!r} runs the eager path"
        if self._compile is False:
            return "compile=False runs the eager path"
        if group["moment_dtype"] == "int8" and not any(caps.int8_moments for caps in CAPABILITIES.values()):
            return "no backend reads int8 moments"
        return None

    # ----------------------------------------------------------- phases --- #

    def _phase1(self, p: Tensor, group: dict, finite: bool | None = None) -> ParamStep | None:
        """Route, transform, update the family state on A_l, and the limiter's norm.

        Returns None when the gradient is not finite (``finite``: known
        already, for sharded parameters); the state then only counts the step.
        """
        state = self.state[p]
        w = local(p)
        if is_dtensor(p):
            check_sharding(p)
        # Tensors with more than 2 dims transform along their last axis with
        # all leading dims kept, so state shapes keep the parameter's leading
        # dims and shard like it under FSDP2.
        route = self.route(group, p, p.grad)
        G, level, transformed, fused = route.grad, route.level, route.transformed, route.backend
        cdt = self._compute_dtype(w)

        coeffs = A = None
        if route.path == "plain":
            A = G
        elif route.path == "haar":
            A = haar_approx(G, level)
        elif route.path == "reference":
            coeffs = wavelets.wavedec(G, level, group["wavelet"], dim=-1)
            A = coeffs.approx

        batched = route.path == "batched"
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
            if is_dtensor(p):
                distribute_state(p, w, state)
        # Families see (and update in place) the local shards of their state.
        lstate = {k: local(v) for k, v in state.items()} if is_dtensor(p) else state
        if not new:
            # A loaded state, or a level changed since: fused kernels would
            # index out of bounds, eager ones fail somewhere inside.
            md = self._moment_dtype(group, cdt)
            if fused is not None:
                problem = _fused.state_problem(w, G, lstate, level, md)
            else:
                problem = eager_state_problem(self, group, lstate, A, md, transformed)
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
                ps.batched = True  # phase 1, limiter and phase 2 run in the stepper (its plan, or run_unplanned)
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

    def _limit(self, ps: ParamStep) -> Tensor | float:
        """Fira's norm-growth limiter (:func:`~gwt_optim.optim.functional.limiter_ratio`);
        returns r and updates s in the state."""
        if not ps.limited:
            return 1.0
        return limiter_ratio(ps.norm_sq, ps.state["limiter_norm"], ps.step, ps.group["norm_growth_limit"])

    def _phase2(self, ps: ParamStep) -> None:
        group = ps.group
        r = self._limit(ps)
        w = ps.param
        lr = group["lr"]
        lr = lr.item() if isinstance(lr, Tensor) else lr
        step_size = lr * self._step_factor(ps)
        if ps.fused is not None:
            scale = group["scale"] if ps.transformed else 1.0
            ps.fused.phase2(w, ps.grad, ps.level, ps.carry, r, scale * step_size, 1 - lr * group["weight_decay"])
            return
        delta = self._direction(ps, r)
        apply_update(w, delta, lr=lr, weight_decay=group["weight_decay"], step_size=step_size)


_said_flat = False


def _say_what_a_flat_list_does(family: str, params: list, group: dict) -> None:
    """Warn once per process when a plain list of tensors (``model.parameters()``,
    the torch habit) puts embeddings and the output head under the transform:
    every tensor of two or more dimensions is transformed, where the paper
    transforms only the attention and MLP weights. Param groups say what the
    user chose, and are never warned about."""
    global _said_flat
    if _said_flat or not params or not all(isinstance(p, Tensor) for p in params) or not group["level"]:
        return
    mats = [p for p in params if p.ndim >= 2]
    if not mats:
        return
    _said_flat = True
    warnings.warn(
        f"{family}: a plain list of parameters transforms all {len(mats)} tensors with two or more dimensions "
        f"({sum(p.numel() for p in mats):,} values) at level {group['level']}, embeddings and output head "
        f"included, each stepping at scale {group['scale']:g} x lr; the paper transforms only attention and MLP "
        "weights. For its split pass gwt_optim.gwt_param_groups(model), or param groups of your own (then this "
        "is not said)",
        UserWarning,
        stacklevel=_caller_stacklevel(),
    )


def _is_real(x: Any) -> bool:
    # numbers.Real takes NumPy scalars; bool is an int but never a rate.
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _shipped_families() -> dict[str, str | None]:
    """The families this package ships, with their group keys, from the classes themselves."""
    found, todo = {}, list(GWTOptimizer.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("gwt_optim.optim."):
            found[cls._family] = cls._GROUP_KEY
    return found


def _finite_at_once(params: list[Tensor]) -> dict[int, bool]:
    """Whether each parameter's gradient is finite, by id: one foreach norm
    and one read per device and dtype, instead of a host synchronization per
    parameter (the eager path's check, which on a GPU stalls the launches of
    every parameter behind the previous one's kernels)."""
    by_device: dict[tuple, list[Tensor]] = {}
    for p in params:
        by_device.setdefault((p.grad.device, p.grad.dtype), []).append(p)
    finite: dict[int, bool] = {}
    for group in by_device.values():
        finite.update(zip(map(id, group), _fused.all_finite([p.grad for p in group])))
    return finite
