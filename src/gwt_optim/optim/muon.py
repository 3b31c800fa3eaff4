r"""GWT-Muon: Muon whose momentum lives on Haar approximation coefficients.

Its step is :func:`gwt_optim.optim.functional.gwt_muon` (the halves
``gwt_muon_moments`` and ``gwt_muon_apply``): the momentum on A_l, the
direction from it and this step's raw details, alpha times its Newton-Schulz
orthogonalization, no limiter (Newton-Schulz would cancel it). At level 0 it is
``torch.optim.Muon`` bit for bit. Groups with ``use_muon=False`` (embeddings,
the head, norms) take GWT-AdamW's halves. ``docs/families.md`` states it in
full, with ``ns_dtype``'s measured precision and speed.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import torch
from torch import Tensor

from gwt_optim.optim import adamw
from gwt_optim.optim import functional as F
from gwt_optim.optim._base import GWTOptimizer
from gwt_optim.optim._family import Rule, check_adam_hyperparameters, group_lr, transform_defaults
from gwt_optim.optim._sharded import check_sharding, is_dtensor, on_whole_matrices, row_mesh_dim
from gwt_optim.optim.functional import (_ADJUST_LR, NS_COEFFICIENTS, NS_DTYPES, adjust_lr_ratio,
                                        zeropower_via_newtonschulz)

__all__ = ["GWTMuon", "zeropower_via_newtonschulz", "NS_COEFFICIENTS", "NS_DTYPES", "adjust_lr_ratio"]


class GWTMuon(GWTOptimizer):
    """Muon with Gradient Wavelet Transform state compression, plus AdamW
    for the parameters that are not hidden matrices.

    Args:
        params: param-group dicts: ``use_muon=True`` (the default) takes 2-D
            weights, ``use_muon=False`` anything, updated by GWT-AdamW with the
            group's ``betas``/``eps`` (:func:`gwt_optim.groups.gwt_param_groups`
            with ``transformed_options={"use_muon": True}`` and
            ``regular_options={"use_muon": False}`` builds the usual split).
        lr: learning rate (default 1e-3, as torch's Muon; AdamW groups
            usually want their own, smaller ``lr``).
        weight_decay: decoupled weight decay (default 0.1, as torch's Muon).
        momentum, nesterov: :math:`\\mu` (default 0.95), a Nesterov-style direction (default True).
        ns_coefficients, ns_steps, ns_eps: the Newton--Schulz iteration (torch's; ``ns_eps`` is its ``eps``).
        ns_dtype: ``"bfloat16"`` (torch's; default) or ``"float32"`` (faster and more precise on CPUs).
        adjust_lr_fn: ``None``/``"original"`` (:math:`\\sqrt{\\max(1, m/n)}`) or
            ``"match_rms_adamw"`` (:math:`0.2\\sqrt{\\max(m, n)}`), as torch.
        betas, eps: AdamW hyperparameters of ``use_muon=False`` groups.
        level, wavelet, scale: as :class:`~gwt_optim.optim.GWTAdamW`
            (``scale`` multiplies the orthogonalized direction).
        norm_growth_limit: for ``use_muon=False`` groups only (default None).
    """

    _family = "GWTMuon"
    _GROUP_KEY = "use_muon"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        level: int = 2,
        wavelet: str = "haar",
        scale: float = 0.25,
        norm_growth_limit: float | None = None,
        *,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = 5,
        ns_eps: float = 1e-7,
        ns_dtype: str = "bfloat16",
        adjust_lr_fn: str | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        use_muon: bool = True,
        moment_dtype: str | None = None,
        impl: str = "fast",
        backend: str = "auto",
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            **transform_defaults(level, wavelet, scale, norm_growth_limit),
            ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, ns_eps=ns_eps, ns_dtype=ns_dtype,
            adjust_lr_fn=adjust_lr_fn, betas=betas, eps=eps, use_muon=use_muon, moment_dtype=moment_dtype,
        )
        super().__init__(params, defaults, impl=impl, backend=backend, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)

    def _validate_param(self, p: Tensor, group: dict[str, Any], where: str) -> None:
        super()._validate_param(p, group, where)
        if group["use_muon"]:
            if p.ndim != 2:
                raise ValueError(
                    f"Muon groups take 2-D weights, got {where}; put it in a "
                    "group with use_muon=False (AdamW), as gwt_optim.toolkit's 'gwt-muon' factory does"
                )
            if is_dtensor(p):  # the layouts whose row shards an owner can reassemble (_sharded)
                check_sharding(p)
                row_mesh_dim(p)

    def _validate_family(self, g: dict[str, Any]) -> None:
        if not 0.0 <= g["momentum"] < 1.0:
            raise ValueError(f"Invalid momentum: {g['momentum']} (must be in [0, 1))")
        if g["ns_dtype"] not in NS_DTYPES:
            raise ValueError(f"Invalid ns_dtype: {g['ns_dtype']!r} (one of {sorted(NS_DTYPES)})")
        if g["adjust_lr_fn"] not in _ADJUST_LR:
            raise ValueError(f"Adjust learning rate function {g['adjust_lr_fn']} is not supported "
                             "(None, 'original' or 'match_rms_adamw')")
        if len(g["ns_coefficients"]) != 3:
            raise ValueError(f"ns_coefficients must be three numbers (a, b, c), got {g['ns_coefficients']!r}")
        if not 0 < g["ns_steps"] < 100:
            raise ValueError(f"Invalid ns_steps: {g['ns_steps']} (must be in [1, 100))")
        if g["use_muon"] and g["detail_clip"] is not None:
            # A unitless bound on normalized details would clamp raw ones in gradient units (docs/families.md).
            raise ValueError(
                f"detail_clip={g['detail_clip']!r} does not apply to a use_muon group: its details are raw gradient "
                "coefficients, not normalized ones (Newton-Schulz normalizes the whole step); leave it None"
            )
        check_adam_hyperparameters(g)  # the AdamW groups' betas and eps

    # Two rules: Muon's (the hooks below) for use_muon groups, and GWT-AdamW's state and halves
    # (adamw.init_state, moments, apply) for the others, eager (this family has no kernels).

    def _make_rules(self) -> None:
        # Newton-Schulz divides by the norm first, so the limiter would cancel.
        self._rule = Rule(self._family, self._init_family_state, self._moments, self._apply, whole_matrix=True,
                          between_phases=self._between_phases, limiter=False)
        impl = self._impl
        self._adamw_rule = Rule(
            self._family, lambda group, state, approx, md, transformed: adamw.init_state(group, state, approx, md),
            lambda group, state, W, G, step, reduce=None: adamw.moments(group, state, W, G, step, impl),
            lambda group, W, m, r, step, reduce=None: adamw.apply(group, W, m, r, step))

    def _rule_of(self, group: dict) -> Rule:
        return self._rule if group["use_muon"] else self._adamw_rule

    def _init_family_state(self, group, state, approx, moment_dtype, transformed) -> None:
        state["momentum_buffer"] = torch.zeros_like(approx, dtype=moment_dtype, memory_format=torch.contiguous_format)

    # AdamW groups: every statistic is an entry's or a row's, as GWTAdamW's (nothing to reduce); Muon groups:
    # X is computed row by row, and the whole matrix meets in _between_phases.
    def _moments(self, group, state, W, G, step, *, reduce=None):
        return F.gwt_muon_moments(W, G, state["momentum_buffer"], momentum=group["momentum"],
                                  nesterov=group["nesterov"], level=group["level"], impl=self._impl,
                                  wavelet=group["wavelet"])

    def _between_phases(self, pending) -> None:
        """Each sharded Muon matrix's Newton-Schulz, once, on the whole matrix
        (:func:`~gwt_optim.optim._sharded.on_whole_matrices`): every rank
        computes its rows of X, an owner rank orthogonalizes the whole, each
        rank takes its rows back. Rows travel in the narrower of X's dtype and
        ``ns_dtype``: Newton-Schulz reads X in ``ns_dtype`` and its result is
        cast to X's, so either way the bits are one process's."""
        steps = pending
        items = []
        for ps in steps:
            m = ps.carry
            X = F.muon_input(m.G, m.A, m.U, m.level, m.coeffs)
            ns = NS_DTYPES[ps.group["ns_dtype"]]
            wire = ns if torch.finfo(ns).bits <= torch.finfo(X.dtype).bits else X.dtype
            items.append((ps.full_param, X.to(wire)))

        def orthogonalize(i: int, X: Tensor) -> Tensor:
            g = steps[i].group
            O = zeropower_via_newtonschulz(X, g["ns_coefficients"], g["ns_steps"], g["ns_eps"], NS_DTYPES[g["ns_dtype"]])
            return O.to(X.dtype)

        for ps, O in zip(steps, on_whole_matrices(items, orthogonalize)):
            ps.carry = _Orthogonalized(O.to(ps.carry.G.dtype), tuple(ps.full_param.shape))

    def _apply(self, group, W, m, r, step, *, reduce=None):
        if isinstance(m, _Orthogonalized):  # a sharded matrix (_between_phases)
            F.gwt_muon_apply_orthogonalized(W, m.O, lr=group_lr(group), weight_decay=group["weight_decay"],
                                            alpha=group["scale"], shape=m.shape, adjust_lr_fn=group["adjust_lr_fn"])
            return
        # alpha once, on the orthogonalized direction (r is 1: no limiter in a Muon group).
        F.gwt_muon_apply(W, m, lr=group_lr(group), weight_decay=group["weight_decay"], alpha=group["scale"],
                         ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"],
                         ns_eps=group["ns_eps"], ns_dtype=NS_DTYPES[group["ns_dtype"]],
                         adjust_lr_fn=group["adjust_lr_fn"])


class _Orthogonalized(NamedTuple):
    """A sharded Muon matrix's carry after :meth:`GWTMuon._between_phases`."""

    O: Tensor  # this shard's rows of NS(X), in the compute dtype
    shape: tuple[int, int]  # the whole matrix's
