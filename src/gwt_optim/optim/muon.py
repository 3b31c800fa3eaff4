r"""GWT-Muon: Muon whose momentum lives on Haar approximation coefficients.

Muon (Jordan et al., 2024; ``torch.optim.Muon``) keeps one momentum buffer per
hidden matrix and steps along its orthogonalization. For a weight
:math:`W \in \mathbb{R}^{m \times n}` at level :math:`l`, GWT-Muon keeps the
momentum on the approximation coefficients only,

.. math::

    B \leftarrow \mu B + (1-\mu) A_l \qquad (m \times \lceil n/2^l \rceil),

(torch's exponential-average form of :math:`B \leftarrow \mu B + G`, which
keeps :math:`B` on the scale of the gradient), and builds the full-size
direction from the momentum for the coarse part and this step's details,

.. math::

    X = \mathrm{IDWT}([\tilde B, D_l, \dots, D_1]), \qquad
    \tilde B = \begin{cases} (1-\mu) A_l + \mu B & \text{nesterov} \\ B & \text{otherwise,} \end{cases}

then steps along :math:`\alpha \cdot \mathrm{NS}(X)`, the same quintic
Newton--Schulz iteration, coefficients and shape-based learning-rate scaling
as ``torch.optim.Muon``. The momentum shrinks by :math:`2^l`. With level 0
this is ``torch.optim.Muon`` step for step (bit-exact with the default bf16
Newton--Schulz).

The details are not normalized (Muon has no second moment), and the
norm-growth limiter is not applied: Newton--Schulz starts by dividing
:math:`X` by its norm, so any rescaling of :math:`X` -- the limiter's, or
:math:`\alpha` applied before it -- would cancel; :math:`\alpha` is applied to
the orthogonalized direction instead.

As in the usual Muon recipe, parameters that are not hidden matrices
(embeddings, the output head, norms, biases) go in groups with
``use_muon=False``, which this optimizer updates as (GWT-)AdamW.

**Newton--Schulz precision.** ``torch.optim.Muon`` iterates in bfloat16, which
is fast on GPUs but slow on CPUs without bf16 matrix units. ``ns_dtype=
"float32"`` runs the same iteration in fp32; see ``docs/families.md`` for the
measured difference.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

from gwt_optim.optim._base import GWTOptimizer
from gwt_optim.optim import adamw
from gwt_optim.optim import functional as F
from gwt_optim.optim._family import check_adam_hyperparameters, group_lr, transform_defaults
from gwt_optim.optim.functional import _ADJUST_LR, NS_COEFFICIENTS, NS_DTYPES, adjust_lr_ratio, zeropower_via_newtonschulz

__all__ = ["GWTMuon", "zeropower_via_newtonschulz", "NS_COEFFICIENTS", "NS_DTYPES", "adjust_lr_ratio"]


class GWTMuon(GWTOptimizer):
    """Muon with Gradient Wavelet Transform state compression, plus AdamW
    for the parameters that are not hidden matrices.

    Args:
        params: param-group dicts. Groups with ``use_muon=True`` (the
            default) take 2-D weights and are updated by GWT-Muon; groups with
            ``use_muon=False`` take anything and are updated by GWT-AdamW
            (level 0: plain AdamW) with that group's ``betas``/``eps``.
            :func:`gwt_optim.groups.gwt_param_groups` with
            ``transformed_options={"use_muon": True}`` and
            ``regular_options={"use_muon": False}`` builds the usual split.
        lr: learning rate (default 1e-3, as torch's Muon; AdamW groups
            usually want their own, smaller ``lr``).
        weight_decay: decoupled weight decay (default 0.1, as torch's Muon).
        momentum: :math:`\\mu` (default 0.95).
        nesterov: Nesterov-style direction (default True).
        ns_coefficients, ns_steps: the Newton--Schulz iteration (torch's).
        ns_eps: the iteration's norm floor (torch Muon's ``eps``, 1e-7).
        ns_dtype: ``"bfloat16"`` (torch's; default) or ``"float32"`` (faster
            and more precise on CPUs).
        adjust_lr_fn: ``None``/``"original"`` (:math:`\\sqrt{\\max(1, m/n)}`) or
            ``"match_rms_adamw"`` (:math:`0.2\\sqrt{\\max(m, n)}`), as torch.
        betas, eps: AdamW hyperparameters of ``use_muon=False`` groups.
        level, wavelet, scale: as :class:`~gwt_optim.optim.GWTAdamW`
            (``scale`` multiplies the orthogonalized direction).
        norm_growth_limit: applies to ``use_muon=False`` groups only (default
            None); see the module docstring.
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
        compile: bool | str | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            **transform_defaults(level, wavelet, scale, norm_growth_limit),
            ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, ns_eps=ns_eps, ns_dtype=ns_dtype,
            adjust_lr_fn=adjust_lr_fn, betas=betas, eps=eps, use_muon=use_muon, moment_dtype=moment_dtype,
        )
        super().__init__(params, defaults, impl=impl, backend=backend, compile=compile)

    def _validate_param(self, p: Tensor, group: dict[str, Any], where: str) -> None:
        super()._validate_param(p, group, where)
        if group["use_muon"]:
            if type(p).__name__ == "DTensor":
                raise NotImplementedError(
                    "GWT-Muon orthogonalizes whole matrices; sharded (FSDP2/DTensor) parameters are not "
                    "supported in use_muon groups. Use GWTAdamW for sharded training"
                )
            if p.ndim != 2:
                raise ValueError(
                    f"Muon groups take 2-D weights, got {where}; put it in a "
                    "group with use_muon=False (AdamW), as gwt_optim.toolkit's 'gwt-muon' factory does"
                )

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
        if g["use_muon"] and g["match_rms"]:
            raise ValueError("match_rms does not apply to a use_muon group: Newton-Schulz fixes its update's size; "
                             "adjust_lr_fn='match_rms_adamw' is Muon's rule for carrying AdamW's lr")
        if g["use_muon"] and g["detail_clip"] is not None:
            # The clip bounds details normalized by Adam's denominators, a unitless bound. A Muon group has no
            # denominator, so it would clamp raw gradient coefficients at a bound in gradient units: a rule that
            # moves with the loss scale, and in a gradient-clipped LM a silent no-op (at the 16M budget a run with
            # it stayed within rounding of the unclipped one; the largest raw detail was 0.023).
            raise ValueError(
                f"detail_clip={g['detail_clip']!r} does not apply to a use_muon group: its details are raw gradient "
                "coefficients, not normalized ones (Newton-Schulz normalizes the whole step); leave it None"
            )
        check_adam_hyperparameters(g)  # the AdamW groups' betas and eps

    # Groups with use_muon=False run GWT-AdamW's halves (adamw.moments, adamw.apply).

    def _init_family_state(self, group, state, approx, moment_dtype, transformed) -> None:
        if group["use_muon"]:
            state["momentum_buffer"] = torch.zeros_like(approx, dtype=moment_dtype,
                                                        memory_format=torch.contiguous_format)
        else:
            state["exp_avg"] = torch.zeros_like(approx, dtype=moment_dtype, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(approx, dtype=moment_dtype, memory_format=torch.contiguous_format)

    def _limiter_enabled(self, group, transformed) -> bool:
        # Newton-Schulz divides by the norm first, so the limiter would cancel.
        return not group["use_muon"] and super()._limiter_enabled(group, transformed)

    def _moments(self, group, state, W, G, step):
        if not group["use_muon"]:
            return adamw.moments(group, state, W, G, step, self._impl)
        return F.gwt_muon_moments(W, G, state["momentum_buffer"], momentum=group["momentum"],
                                  nesterov=group["nesterov"], level=group["level"], impl=self._impl,
                                  wavelet=group["wavelet"])

    def _apply(self, group, W, m, r, step):
        if not group["use_muon"]:
            return adamw.apply(group, W, m, r, step)
        # alpha once, on the orthogonalized direction (r is 1: no limiter in a Muon group).
        F.gwt_muon_apply(W, m, lr=group_lr(group), weight_decay=group["weight_decay"], alpha=group["scale"],
                         ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"],
                         ns_eps=group["ns_eps"], ns_dtype=NS_DTYPES[group["ns_dtype"]],
                         adjust_lr_fn=group["adjust_lr_fn"])
