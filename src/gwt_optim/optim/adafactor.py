r"""GWT-Adafactor: Adafactor whose factored statistics describe the approximation.

Adafactor (Shazeer & Stern, 2018; ``torch.optim.Adafactor``) keeps, for a
matrix, only row and column means of the squared gradient and rebuilds the
second moment as their normalized outer product. For a weight
:math:`W \in \mathbb{R}^{m \times n}` at level :math:`l`, GWT-Adafactor keeps
them for :math:`A_l` (:math:`m \times k`, :math:`k = \lceil n/2^l \rceil`):

.. math::

    R \leftarrow \hat\beta_{2t} R + (1-\hat\beta_{2t})\,\mathrm{mean}_{\mathrm{cols}}(A_l^2),\quad
    C \leftarrow \hat\beta_{2t} C + (1-\hat\beta_{2t})\,\mathrm{mean}_{\mathrm{rows}}(A_l^2),\quad
    \hat V = \frac{R\,C}{\max(\mathrm{mean}(R), \epsilon_1)},

with :math:`1-\hat\beta_{2t} = t^{\tau}` (``beta2_decay`` :math:`\tau`), the
approximation update :math:`U = A_l / \max(\sqrt{\hat V}, \epsilon_1)`, update
clipping :math:`c = \max(1, \mathrm{RMS}(U)/d)` and :math:`U \leftarrow U/c`;
with ``beta1`` set, a first moment :math:`M \leftarrow \beta_1 M + (1-\beta_1) U`
on :math:`A_l` replaces :math:`U` (the first moment of the clipped update, as in
the original Adafactor). The step is relative, as torch's:
:math:`\eta_t = \max(\epsilon_2, \mathrm{RMS}(W))\min(\mathrm{lr}, 1/\sqrt t)`.

How the detail coefficients are scaled is ``detail_norm``:

``"clip"`` (default)
    :math:`\tilde D = D / c`: the details are divided by the clipping factor
    only, as in the authors' reference implementation.
``"second_moment"``
    :math:`\tilde D = D / (\sqrt{\hat V}' c)`: each detail is divided by the
    denominator of the approximation coefficient above it and by the clipping
    factor, the normalization GWT gives the details in the other families.

With ``"clip"`` the details keep the raw gradient's scale while the
approximation update is normalized to RMS about 1, so the transformed weights
take an (almost) low-pass Adafactor step. The default follows the reference
implementation and the measurement in ``docs/families.md``, where it trained
better than ``"second_moment"`` (and than plain Adafactor) at both learning
rates tried. A plausible reason: without a first moment, ``"second_moment"``
turns every detail coefficient into one step's noise at unit scale, normalized
by a rank-one estimate fitted to the coarse coefficients, which need not fit
the details.

State: :math:`R` (:math:`m`), :math:`C` (:math:`k` instead of :math:`n`) and,
with ``beta1``, :math:`M` (:math:`m k` instead of :math:`m n`). With level 0
this is ``torch.optim.Adafactor`` (to fp32 rounding).
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
        level, wavelet, scale, norm_growth_limit, moment_dtype, impl, backend, compile:
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
        match_rms: bool = False,
        moment_dtype: str | None = None,
        impl: str = "fast",
        backend: str = "auto",
        compile: bool | str | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d, weight_decay=weight_decay,
            **transform_defaults(level, wavelet, scale, norm_growth_limit),
            beta1=beta1, relative_step=relative_step, detail_norm=detail_norm, moment_dtype=moment_dtype,
            match_rms=match_rms,
        )
        super().__init__(params, defaults, impl=impl, backend=backend, compile=compile)

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

    def _moments(self, group, state, W, G, step):
        return F.gwt_adafactor_moments(
            W, G, step=step, row_var=state.get("row_var"), col_var=state.get("col_var"),
            variance=state.get("variance"), exp_avg=state.get("exp_avg"), beta2_decay=group["beta2_decay"],
            eps1=group["eps"][0], d=group["d"], beta1=group["beta1"], detail_norm=group["detail_norm"],
            level=group["level"], impl=self._impl, wavelet=group["wavelet"],
        )

    def _apply(self, group, W, m, r, step):
        F.gwt_adafactor_apply(W, m, r, step=step, lr=group_lr(group), eps2=group["eps"][1],
                              relative_step=group["relative_step"], weight_decay=group["weight_decay"],
                              alpha=group["scale"], detail_clip=group["detail_clip"], match_rms=group["match_rms"])
