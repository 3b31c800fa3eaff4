r"""GWT-Adafactor: Adafactor whose factored second moment lives on Haar
approximation coefficients.

Its step is :func:`gwt_optim.optim.functional.gwt_adafactor` (the halves
``gwt_adafactor_moments`` and ``gwt_adafactor_apply``): the row and column
statistics of A_l^2 (or, for a vector, its second moment), U clipped to RMS
d, an optional first moment, the details scaled by ``detail_norm``, and
torch's relative step. At level 0 it is ``torch.optim.Adafactor`` (to fp32
rounding). ``docs/families.md`` states it in full, and why ``detail_norm``
defaults to ``"clip"``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

from gwt_optim.optim._base import GWTOptimizer
from gwt_optim.optim import functional as F
from gwt_optim.optim._family import group_lr, transform_defaults
from gwt_optim.optim.functional import DETAIL_NORMS

__all__ = ["GWTAdafactor", "DETAIL_NORMS"]


class GWTAdafactor(GWTOptimizer):
    """Adafactor with Gradient Wavelet Transform state compression.

    Args:
        params: parameters or param-group dicts; groups may set every
            hyperparameter below.
        lr: caps the relative step size :math:`\\rho_t = \\min(\\mathrm{lr}, 1/\\sqrt t)`
            and scales weight decay, as in ``torch.optim.Adafactor`` (1e-2).
        beta2_decay: :math:`\\tau` in :math:`\\hat\\beta_{2t} = 1 - t^\\tau` (-0.8).
        eps: :math:`(\\epsilon_1, \\epsilon_2)`; :math:`\\epsilon_1` None means the
            compute dtype's machine epsilon (default (None, 1e-3)).
        d: clipping threshold on the update's RMS (1.0).
        weight_decay: decoupled weight decay (0).
        beta1: first-moment decay; None (default, as torch) keeps no first moment.
        relative_step: scale steps by the weight's RMS (True, as torch);
            False steps by ``lr`` directly.
        detail_norm: ``"clip"`` (default, the reference implementation's) or
            ``"second_moment"``; see the module docstring.
        level, wavelet, scale, norm_growth_limit, moment_dtype, impl, backend:
            as :class:`~gwt_optim.optim.GWTAdamW`. The limiter is off by
            default: update clipping already bounds the step.
    """

    _family = "GWTAdafactor"
    _GROUP_KEY = "beta2_decay"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        level: int = 2,
        wavelet: str = "haar",
        scale: float = 0.25,
        norm_growth_limit: float | None = None,
        *,
        beta1: float | None = None,
        relative_step: bool = True,
        detail_norm: str = "clip",
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
            lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d, weight_decay=weight_decay,
            **transform_defaults(level, wavelet, scale, norm_growth_limit),
            beta1=beta1, relative_step=relative_step, detail_norm=detail_norm, moment_dtype=moment_dtype,
        )
        super().__init__(params, defaults, impl=impl, backend=backend, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)

    def _validate_family(self, g: dict[str, Any]) -> None:
        if not g["beta2_decay"] <= 0.0:
            raise ValueError(f"beta2_decay should be <= 0 but is: {g['beta2_decay']}")
        eps1, eps2 = g["eps"]
        if eps1 is not None and not eps1 >= 0.0:
            raise ValueError(f"epsilon1 should be >= 0 but is: {eps1} (or None)")
        if not eps2 >= 0.0:
            raise ValueError(f"epsilon2 should be >= 0 but is: {eps2}")
        if not g["d"] >= 1.0:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {g['d']}")
        if g["beta1"] is not None and not 0.0 <= g["beta1"] < 1.0:
            raise ValueError(f"Invalid beta1: {g['beta1']} (must be in [0, 1), or None for no first moment)")
        if g["detail_norm"] not in DETAIL_NORMS:
            raise ValueError(f"Invalid detail_norm: {g['detail_norm']!r} (one of {sorted(DETAIL_NORMS)})")

    def _init_family_state(self, group, state, approx, moment_dtype, transformed) -> None:
        if approx.ndim >= 2:
            # Factored along the last two axes, as torch.optim.Adafactor.
            state["row_var"] = approx.new_zeros((*approx.shape[:-1], 1), dtype=moment_dtype)
            state["col_var"] = approx.new_zeros((*approx.shape[:-2], 1, approx.shape[-1]), dtype=moment_dtype)
        else:
            state["variance"] = torch.zeros_like(approx, dtype=moment_dtype)
        if group["beta1"] is not None:
            state["exp_avg"] = torch.zeros_like(approx, dtype=moment_dtype, memory_format=torch.contiguous_format)

    def _moments(self, group, state, W, G, step, *, reduce=None):
        return F.gwt_adafactor_moments(
            W, G, step=step, row_var=state.get("row_var"), col_var=state.get("col_var"),
            variance=state.get("variance"), exp_avg=state.get("exp_avg"), beta2_decay=group["beta2_decay"],
            eps1=group["eps"][0], d=group["d"], beta1=group["beta1"], detail_norm=group["detail_norm"],
            level=group["level"], impl=self._impl, wavelet=group["wavelet"], reduce=reduce,
        )

    def _apply(self, group, W, m, r, step, *, reduce=None):
        F.gwt_adafactor_apply(W, m, r, step=step, lr=group_lr(group), eps2=group["eps"][1],
                              relative_step=group["relative_step"], weight_decay=group["weight_decay"],
                              alpha=group["scale"], detail_clip=group["detail_clip"], reduce=reduce)
