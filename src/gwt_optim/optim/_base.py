"""GWTOptimizer: what every GWT family shares of ``torch.optim``'s contract.

The update itself is stated once, per family and per tensor, in
:mod:`gwt_optim.optim.functional` (and ``docs/algorithm.md``); a family
creates its state and calls that statement's two halves (:meth:`_moments`,
:meth:`_apply`). This class holds the defaults and their validation,
``state_dict`` and ``load_state_dict``, the family hooks, the count of
updates skipped for a non-finite gradient, and ``step()``, which hands the
groups, the state and each group's rule (:class:`._family.Rule`, made from the
hooks) to the stepper (:mod:`gwt_optim.optim._stepper`).
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer

from gwt_optim import wavelets
from gwt_optim.optim._advice import say_what_a_flat_list_does, say_which_weights_are_capped
from gwt_optim.optim._backends import MOMENT_DTYPES, moment_dtype_name
from gwt_optim.optim._dispatch import backend_option
from gwt_optim.optim._family import Rule
from gwt_optim.optim._saved import check_family, check_saved_state, describe, saved_group, shipped_families
from gwt_optim.optim._sharded import check_sharding, is_dtensor
from gwt_optim.optim._stepper import Stepper
from gwt_optim.optim._tracing import caller_stacklevel, make_untraced, untraced
from gwt_optim.optim.functional import Moments

__all__ = ["GWTOptimizer", "IMPLEMENTATIONS", "TORCH_KEYWORDS"]

IMPLEMENTATIONS = ("reference", "fast")

#: ``torch.optim.AdamW``'s implementation keywords, each with the value that
#: asks for nothing. Every family takes them, as constructor keywords or as
#: group keys (torchtitan passes ``fused``/``foreach`` that way), keeps them in
#: its defaults and groups as torch does, and holds them to one rule:
#: :meth:`GWTOptimizer._check_torch_keywords` (docs/families.md, "torch's
#: implementation keywords").
TORCH_KEYWORDS: dict[str, bool | None] = {
    "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
}


class GWTOptimizer(Optimizer):
    """Base class of the GWT optimizers: a family sets :attr:`_family`,
    implements :meth:`_init_family_state`, :meth:`_moments` and
    :meth:`_apply`, and may override the other hooks below. ``impl``: the
    closed-form Haar transform (``"fast"``) or the literal one; ``backend``:
    see ``GWTAdamW``, which has kernels."""

    #: The family's name in messages and in saved state dicts.
    _family = "GWTOptimizer"
    #: A param-group key only this family has (GWT-AdamW's are all shared): it
    #: names the family of an untagged, pre-tag state dict (_saved.check_family).
    _GROUP_KEY: str | None = None
    #: Whether the family stores ``moment_dtype="int8"`` moments (:mod:`._quant`).
    _INT8_MOMENTS = False
    #: The family's fused kernels (:class:`._dispatch.Kernels`), or None: every step eager.
    _KERNELS: type | None = None

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any], *,
                 impl: str = "fast", backend: str = "auto",
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None) -> None:
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
        base = {
            "level": 2, "wavelet": wavelets.HAAR, "scale": 0.25, "norm_growth_limit": 1.01, "moment_dtype": None,
            "detail_clip": None,  # opt-in small-batch remedy (docs/algorithm.md): None is the paper's update
        }
        base.update(defaults)
        base.update(maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                    fused=fused)
        self._impl = impl
        self._backend, self._strict = backend_option(backend)
        # The hyperparameters before the parameters, as torch checks them (its tests pass params=None); the
        # torch keywords after the kernels are made, below.
        self._validate_group(base, keywords=False)
        params = params if isinstance(params, Tensor) else list(params)  # a generator can be read once
        # A request for the eager loop must be taken before the kernels are built (a request for the
        # kernels is taken as each group is checked); the first group that asks decides (the rest must agree).
        # (a bare Tensor is torch's to refuse, with its own message)
        groups = [] if isinstance(params, Tensor) else [g for g in params if isinstance(g, dict)]
        asked = [_kernel_request({**base, **g}) for g in groups] or [_kernel_request(base)]
        if next((r for r in asked if r is not None), None) == "loop" and self._backend == "auto" and not self._strict:
            self._backend = "eager"
        self._init_bookkeeping()
        self._check_torch_keywords(base)
        say_what_a_flat_list_does(self._family, params, base)
        super().__init__(params, base)
        # Said once per optimizer, over every group given here (a group added later is said about only while
        # nothing has been said yet).
        self._said_capped = say_which_weights_are_capped(self._family, self.param_groups)

    def _init_bookkeeping(self) -> None:
        make_untraced()
        # _nonfinite_counters: the running skip counts device kernels keep without a host sync, by id.
        # _kernels: the family's backends, built on first use (not copied or pickled: built again).
        for key, value in (("_nonfinite_skips", 0), ("_nonfinite_counters", {}), ("_warned_nonfinite", False),
                           ("_stepper", Stepper()), ("_kernels", self._KERNELS and self._KERNELS(
                               self._backend, self._strict, self._impl))):
            self.__dict__.setdefault(key, value)
        self._make_rules()

    def _make_rules(self) -> None:
        """The family's rule from its hooks (:meth:`_rule_of` returns it); a
        family with more than one kind of group makes one per kind."""
        self._rule = Rule(self._family, self._init_family_state, self._moments, self._apply, self._kernels)

    def _rule_of(self, group: dict) -> Rule:
        """The rule that steps ``group``'s parameters (its options merged with the defaults)."""
        return self._rule

    @property
    def nonfinite_skips(self) -> int:
        """How many parameter updates were skipped because the gradient held
        a NaN or an infinity (one per parameter and step)."""
        return self._nonfinite_skips + sum(int(c.item()) for c in self._nonfinite_counters.values())

    # ------------------------------------------------------------ set-up --- #

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._validate_group(merged)
        if "moment_dtype" in param_group:
            param_group["moment_dtype"] = merged["moment_dtype"]  # by name, as the validation put it
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch rejects sets itself, with its own message
            params = param_group["params"] = list(params)  # a generator can be read once
        if not isinstance(params, set):
            index = len(self.param_groups)
            for i, p in enumerate(params):
                name = None
                if isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], Tensor):  # torch's (name, tensor)
                    name, p = p
                if isinstance(p, Tensor):
                    what = f"parameter {i}" if name is None else f"parameter {i} ({name!r})"
                    self._validate_param(p, merged, f"{what} of group {index} (shape {tuple(p.shape)})")
        self._stepper.drop()
        super().add_param_group(param_group)
        if self.__dict__.get("_said_capped") is False:  # after the constructor: one group at a time
            self._said_capped = say_which_weights_are_capped(self._family, self.param_groups[-1:])

    def __getstate__(self) -> dict[str, Any]:
        # torch keeps only defaults, state and groups: a copy would take the kernels its original was told not to.
        return {**super().__getstate__(), "_impl": self._impl, "_backend": self._backend, "_strict": self._strict}

    def __setstate__(self, state: dict[str, Any]) -> None:
        compile = state.pop("_compile", None)  # pickled before backend= (issue 45)
        super().__setstate__(state)
        for key, off in TORCH_KEYWORDS.items():  # pickled before the torch keywords were taken
            self.defaults.setdefault(key, off)
        # Older checkpoints may lack keys added later; fill with the defaults.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self.__dict__.setdefault("_impl", "fast")
        if "_backend" not in self.__dict__:
            self._backend = "eager" if compile is False else "auto" if compile in (None, True) else compile
            self._strict = compile not in (None, False)
        self._init_bookkeeping()

    def _validate_group(self, g: dict[str, Any], keywords: bool = True) -> None:
        """``ValueError`` for a group's (or the defaults') out-of-range option;
        ``keywords``: the torch keywords too (:meth:`_check_torch_keywords`, which reads the kernels)."""
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
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 16:
            raise ValueError(f"Invalid level: {level!r} (an int from 0 to 16; each level halves the state)")
        if not isinstance(g["wavelet"], str):
            raise ValueError(f"Invalid wavelet: {g['wavelet']!r} (a name such as 'haar')")
        wavelets.check_wavelet(g["wavelet"])
        scale = g["scale"]
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"Invalid scale (alpha): {scale!r} (must be a finite number > 0)")
        gamma = g["norm_growth_limit"]
        if gamma is not None and not (isinstance(gamma, (int, float)) and gamma >= 1.0):
            raise ValueError(f"Invalid norm_growth_limit (gamma): {gamma!r} (must be >= 1, or None to turn it off)")
        clip = g["detail_clip"]
        if clip is not None and not (isinstance(clip, (int, float)) and not isinstance(clip, bool)
                                     and math.isfinite(clip) and clip > 0):
            raise ValueError(f"Invalid detail_clip: {clip!r} (a finite number > 0, or None for the paper's update)")
        md = g["moment_dtype"] = moment_dtype_name(g["moment_dtype"])  # torch.bfloat16 is kept as "bfloat16"
        if md is not None and md not in MOMENT_DTYPES:
            raise ValueError(f"Invalid moment_dtype: {md!r} (one of {sorted(MOMENT_DTYPES)}, the torch dtype of "
                             "one, or None)")
        if md == "int8" and not self._INT8_MOMENTS:
            raise ValueError(f"moment_dtype='int8' is not implemented for {self._family} (GWTAdamW has it)")
        if keywords:
            self._check_torch_keywords(g)
        self._validate_family(g)

    def _check_torch_keywords(self, g: dict[str, Any]) -> None:
        """The one rule for torch's implementation keywords (:data:`TORCH_KEYWORDS`)
        in a group (or the defaults): each holds, is mapped, or is a ``ValueError``.

        ``maximize``, ``capturable``, ``differentiable``: False only (no GWT
        step maximizes, runs under CUDA-graph capture or is differentiated).
        ``fused`` and ``foreach`` (None, False or True) ask for an
        implementation of the same update, as in torch; here ``backend=``
        chooses it, one choice per optimizer: ``fused=True`` asks for the fused
        kernels (GWT-AdamW's, impl "fast"): ``backend="auto"`` then makes a
        kernel that fails to build an error, as a named backend does;
        ``fused=False`` or ``foreach=False`` (without ``fused=True``) asks for
        the eager per-tensor step: ``backend="auto"`` becomes ``"eager"`` when
        the constructor or its first groups ask so; ``foreach=True`` asks for a
        multi-tensor step GWT does not have. A request the optimizer's choice
        cannot meet is refused, never run otherwise."""
        for key in ("maximize", "capturable", "differentiable"):
            if g.get(key, False):
                raise ValueError(f"{self._family}: {key}={g[key]!r} is not supported: {_REFUSED[key]}")
        request = _kernel_request(g)
        if request is None:
            return
        kernels = self.__dict__.get("_kernels")
        why_not = f"{self._family} has no fused kernels" if kernels is None else kernels.refusal(g)
        if request == "fused":
            if why_not is not None:
                raise ValueError(f"{self._family}: fused=True cannot hold: {why_not}; pass fused=None or False "
                                 "(torchtitan: implementation='for-loop')")
            self._strict = kernels.strict = True  # backend="auto": a kernel that fails to build is an error
        elif why_not is None:
            raise ValueError(f"{self._family}: {'fused' if g.get('fused') is False else 'foreach'}=False asks for "
                             f"the eager step, but this optimizer runs fused kernels (backend={self._backend!r}); "
                             "pass it to the constructor with backend='auto', or pass backend='eager'")

    # ---------------------------------------------------- family hooks --- #

    def _validate_family(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for out-of-range family hyperparameters."""

    def _validate_param(self, p: Tensor, group: dict[str, Any], where: str) -> None:
        """Raise ``ValueError`` for a parameter this family cannot update
        (``group``: its options merged with the defaults; ``where`` names it)."""
        if p.is_complex():
            raise ValueError(
                f"{self._family}: {where} is complex ({p.dtype}); GWT transforms real tensors. "
                "Optimize its real and imaginary parts as real parameters (e.g. torch.view_as_real)"
            )
        if not p.is_floating_point():
            raise ValueError(f"{self._family}: {where} is {p.dtype}; only floating-point parameters can be optimized")
        if is_dtensor(p):
            check_sharding(p)  # a layout the transform cannot take: refused here, the same on every rank
        # A last axis too short for the group's level is no refusal: the weight steps at a lower level
        # (functional.step_level), said once by _advice.say_which_weights_are_capped.

    def _init_family_state(self, group: dict, state: dict, approx: Tensor, moment_dtype: torch.dtype,
                           transformed: bool) -> None:
        """Create the family's state tensors for approximation coefficients
        shaped like ``approx`` (a tensor in the compute dtype)."""
        raise NotImplementedError

    def _moments(self, group: dict, state: dict, W: Tensor, G: Tensor, step: int, *,
                 reduce: Any = None) -> Moments:
        """The first half of the family's eager step: its
        ``functional.gwt_*_moments`` on the group's options (``W`` and the
        state local, ``G`` in the compute dtype, ``step`` counted from 1).
        ``reduce``: a sharded (DTensor) parameter's
        :class:`~gwt_optim.optim._sharded.Sharding`, passed only for one;
        every statistic the family takes over more than a row (a block's
        mean, a column's, the whole tensor's RMS) goes through it."""
        raise NotImplementedError

    def _apply(self, group: dict, W: Tensor, m: Moments, r: Tensor | float, step: int, *,
               reduce: Any = None) -> None:
        """The second half: its ``functional.gwt_*_apply`` with the limiter's
        ``r`` (``reduce``: as :meth:`_moments`)."""
        raise NotImplementedError

    # ------------------------------------------------------ state dicts --- #

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # Tag each group with the family, so that loading it into another
        # family fails with a message (torch's param groups are fresh dicts).
        for g in sd["param_groups"]:
            g["optimizer"] = self._family
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping each state tensor's saved dtype (torch
        would cast the fp32 moments of bf16 parameters to bf16). A state dict
        of another optimizer or family, or a saved state tensor that does not
        fit its parameter at its group's level, is a ``ValueError``, and
        nothing is changed then."""
        saved_groups = state_dict["param_groups"]
        check_family(self._family, saved_groups, shipped_families(GWTOptimizer))
        saved_ids = [i for g in saved_groups for i in g["params"]]
        if len(saved_ids) != sum(len(g["params"]) for g in self.param_groups):
            raise ValueError(
                "checkpoint does not match this optimizer: it holds "
                f"{len(saved_ids)} parameters, the optimizer {sum(len(g['params']) for g in self.param_groups)}"
            )
        # The torch keywords are this process's choice of implementation, not the checkpoint's: the live
        # values stay. Off while torch loads, so that a fused=True group does not move the CPU step counts
        # onto the parameters' device (torch's policy for its own fused kernels).
        live = [{k: g.get(k, off) for k, off in TORCH_KEYWORDS.items()} for g in self.param_groups]
        state_dict = {
            **state_dict,
            # torch's older state dicts hold the step as a number; the step reads a tensor.
            "state": {pid: {k: torch.tensor(float(v), dtype=torch.float32) if k == "step" and _is_real(v) else v
                            for k, v in st.items()} for pid, st in state_dict["state"].items()},
            # A group saved before detail_clip existed ran the paper's update: it keeps doing so rather than
            # taking today's default.
            "param_groups": [{"detail_clip": None, **saved_group(g), **TORCH_KEYWORDS} for g in saved_groups],
        }
        check_saved_state(self._family, self.param_groups, self.defaults, self._rule_of, state_dict)
        super().load_state_dict(state_dict)
        for group, keywords in zip(self.param_groups, live):
            group.update(keywords)
        self._stepper.drop()
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, saved in state_dict["state"].get(pid, {}).items():
                if isinstance(saved, Tensor) and key != "step" and saved.dtype != self.state[p][key].dtype:
                    # re-copy from the saved tensor: casting back would have lost bits
                    self.state[p][key] = saved.to(device=p.device, copy=True)

    # ------------------------------------------------------------ step --- #

    @untraced
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """One step of every parameter with a gradient (:mod:`._stepper`).
        ``step`` and :meth:`step_param` opt out of ``torch.compile`` tracing
        (a compiled caller runs them eagerly): compile the model, not the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skipped: list = []
        try:
            self._stepper.step(self.param_groups, self.state, self._rule_of, skipped)
        finally:
            self._count(skipped)
        return loss

    @untraced
    @torch.no_grad()
    def step_param(self, p: Tensor, group: dict | None = None) -> None:
        """The step of parameter ``p`` alone (of ``group``, found if None),
        exactly as :meth:`step` takes it, without visiting the others: for
        stepping inside backward (:func:`gwt_optim.step_in_backward`). Every
        statistic, the limiter's included, is per parameter, so stepping the
        parameters one at a time equals one :meth:`step` over all of them."""
        if group is None:
            group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
            if group is None:
                raise ValueError(f"{self._family}: step_param got a parameter this optimizer does not hold")
        skipped: list = []
        try:
            self._stepper.step_param(self.param_groups, self.state, self._rule_of, p, group, skipped)
        finally:
            self._count(skipped)

    def _count(self, skipped: list) -> None:
        """Record the updates a step skipped for a non-finite gradient: the
        parameters, the fused backends' lists of them, or their running
        device counts (kept by identity: no host sync here)."""
        for item in skipped:
            if isinstance(item, tuple):
                self._nonfinite_counters.update((id(count), count) for count in item)
                continue
            for p in [item] if isinstance(item, Tensor) else item:
                self._nonfinite_skips += 1
                if not self._warned_nonfinite:
                    self._warned_nonfinite = True
                    warnings.warn(
                        f"{self._family}: the gradient of {describe(self.param_groups, p)} holds a NaN or an "
                        "infinity; its update was skipped (weight and state unchanged, its step count advances). "
                        "Further skips are counted in .nonfinite_skips without a warning",
                        RuntimeWarning, stacklevel=caller_stacklevel(),
                    )


# Why each keyword cannot be True (one line each, in the ValueError).
_REFUSED = {
    "maximize": "GWT optimizers minimize; minimize the negated loss instead",
    "capturable": "the GWT step reads its step count and the limiter on the host, so it cannot be CUDA-graph captured",
    "differentiable": "the GWT step runs under torch.no_grad and cannot be differentiated",
}


def _kernel_request(g: dict[str, Any]) -> str | None:
    """What a group's ``fused``/``foreach`` ask for: "fused" (the fused
    kernels), "loop" (the eager per-tensor step) or None (``backend=``
    decides); ``ValueError`` for a value or pair that cannot hold."""
    fused, foreach = g.get("fused"), g.get("foreach")
    for key, value in (("fused", fused), ("foreach", foreach)):
        if value not in (None, False, True):
            raise ValueError(f"{key} must be None, False or True, got {value!r}")
    if fused and foreach:
        raise ValueError("`fused` and `foreach` cannot be `True` together.")  # torch's message
    if foreach:
        raise ValueError("foreach=True: GWT optimizers have no foreach (multi-tensor) step; fused=True asks for "
                         "GWT-AdamW's fused kernels, fused=False for the eager step (torchtitan: implementation="
                         "'fused' or 'for-loop')")
    if fused:
        return "fused"
    return "loop" if fused is False or foreach is False else None


def _is_real(x: Any) -> bool:
    # numbers.Real takes NumPy scalars; bool is an int but never a rate.
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
