r"""GWT-AdamW: AdamW whose moments live on Haar approximation coefficients.

Its step is :func:`gwt_optim.optim.functional.gwt_adamw` (the halves
``gwt_adamw_moments`` and ``gwt_adamw_apply``), stated in ``docs/algorithm.md``
with its relation to ``torch.optim.AdamW`` and to the authors' code, and how
epsilon governs the details. With level 0, alpha 1 and the limiter off it is
``torch.optim.AdamW`` (to fp32 rounding); parameters with fewer than two
dimensions take that plain step. Its fused kernels (:mod:`._dispatch`) run the
same step in two passes over memory.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

from gwt_optim.optim import _dispatch, _quant
from gwt_optim.optim import functional as F
from gwt_optim.optim._base import GWTOptimizer
from gwt_optim.optim._family import check_adam_hyperparameters, group_lr, transform_defaults

__all__ = ["GWTAdamW"]


class GWTAdamW(GWTOptimizer):
    r"""AdamW with Gradient Wavelet Transform state compression.

    Args:
        params: parameters or param-group dicts. Groups may set ``level``,
            ``wavelet``, ``scale``, ``norm_growth_limit`` and every AdamW
            hyperparameter; :func:`gwt_optim.gwt_param_groups` builds the
            paper's split, at the alpha with which AdamW's lr carries over.
        lr: learning rate :math:`\\eta` (default 1e-3).
        betas: :math:`(\\beta_1, \\beta_2)` (default (0.9, 0.999)).
        eps: :math:`\\epsilon` (default 1e-8, as torch; the paper used 1e-6).
        weight_decay: decoupled weight decay :math:`\\lambda` (default 0).
        level: number of Haar levels :math:`l` (default 2; 0 = plain AdamW).
        wavelet: ``"haar"`` (built in) or an orthogonal wavelet via ``ptwt``.
        scale: :math:`\\alpha`, the step scale of transformed weights (0.25).
        norm_growth_limit: :math:`\\gamma` of the limiter (1.01; ``None`` = off).
        detail_clip: clamp each normalized detail
            :math:`(G_i - \\bar G_k)/\\mathrm{den}_k` to ``[-c, c]`` before the
            inverse (default 0.5, chosen by the fair protocol of
            ``benchmarks/quality.py``; see ``docs/algorithm.md``).
            ``detail_clip=None`` is the paper's update exactly.
        detail_clip_units: what ``detail_clip`` bounds. ``"stored"``
            (default): the detail normalized by the stored denominator
            :math:`\sqrt{V} + \epsilon'`, so that an entry's detail step is
            at most :math:`\alpha c \eta \sqrt{1-\beta_2^t}/(1-\beta_1^t)`,
            a bound that grows over the first :math:`\sim 1/(1-\beta_2)`
            steps; ``"step"``: the detail step itself, at most
            :math:`\alpha c \eta` at every step (issue 54's candidate).
        moment_dtype: ``"float32"`` (default for fp32/bf16 parameters),
            ``"bfloat16"`` to halve moment memory again, ``"float64"``, or
            ``"int8"`` (blockwise 8-bit codes, :mod:`._quant`); or the torch
            dtype of one (``torch.bfloat16``, ``torch.int8``), kept by name.
        impl: ``"fast"`` (closed-form Haar, default) or ``"reference"`` (the
            literal transform-normalize-inverse path, any wavelet).
        backend: where the fast Haar step runs: ``"auto"`` (default) takes
            the fused kernels where they can be built -- a small C library on
            CPU (built once with the system C compiler, cached in
            ``~/.cache/gwt-optim/kernels``), Triton kernels on CUDA -- and
            otherwise the eager path, with one warning; ``"eager"`` always
            runs the family's functional halves; ``"native"`` or ``"triton"``
            forces that backend (a build failure is an error).
    """

    _family = "GWTAdamW"
    _INT8_MOMENTS = True
    # Which parameters they take: _dispatch.choose.
    _KERNELS = _dispatch.Kernels

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        level: int = 2,
        wavelet: str = "haar",
        scale: float = 0.25,
        norm_growth_limit: float | None = 1.01,
        *,
        detail_clip: float | None = 0.5,
        detail_clip_units: str = "stored",
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
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            **transform_defaults(level, wavelet, scale, norm_growth_limit),
            detail_clip=detail_clip, detail_clip_units=detail_clip_units, moment_dtype=moment_dtype,
        )
        super().__init__(params, defaults, impl=impl, backend=backend, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)

    def _validate_family(self, g: dict[str, Any]) -> None:
        check_adam_hyperparameters(g)
        units = g.get("detail_clip_units", "stored")
        if units not in F.DETAIL_CLIP_UNITS:
            raise ValueError(f"Invalid detail_clip_units: {units!r} (one of {', '.join(F.DETAIL_CLIP_UNITS)})")

    def _init_family_state(self, group, state, approx, moment_dtype, transformed) -> None:
        init_state(group, state, approx, moment_dtype)

    # Every statistic is an entry's or a row's (the limiter's norm is the stepper's): nothing to reduce.
    def _moments(self, group, state, W, G, step, *, reduce=None):
        return moments(group, state, W, G, step, self._impl)

    def _apply(self, group, W, m, r, step, *, reduce=None):
        apply(group, W, m, r, step)


# GWT-AdamW's state and halves on a group's options (GWT-Muon's AdamW groups use them too).


def init_state(group: dict, state: dict, approx: Tensor, moment_dtype: torch.dtype) -> None:
    if group["moment_dtype"] == "int8":
        if approx.ndim >= 2:
            # Codes of M and of sqrt(V), with fp32 scales per block of a row (_quant.Quantized).
            state["exp_avg"], state["exp_avg_absmax"] = _quant.zeros(approx)
            state["exp_avg_sq"], state["exp_avg_sq_absmax"] = _quant.zeros(approx)
            return
        moment_dtype = approx.dtype  # vectors are tiny: full-precision moments, as bitsandbytes
    state["exp_avg"] = torch.zeros_like(approx, dtype=moment_dtype, memory_format=torch.contiguous_format)
    state["exp_avg_sq"] = torch.zeros_like(approx, dtype=moment_dtype, memory_format=torch.contiguous_format)


def moments(group: dict, state: dict, W: Tensor, G: Tensor, step: int, impl: str) -> F.Moments:
    beta1, beta2 = group["betas"]
    return F.gwt_adamw_moments(W, G, *_quant.moments(state), step=step, beta1=beta1, beta2=beta2, eps=group["eps"],
                               level=group["level"], impl=impl, wavelet=group["wavelet"])


def apply(group: dict, W: Tensor, m: F.Moments, r, step: int) -> None:
    beta1, beta2 = group["betas"]
    # GWT-Muon's AdamW groups, and groups saved before the option existed, have no detail_clip_units: "stored".
    F.gwt_adamw_apply(W, m, r, step=step, lr=group_lr(group), beta1=beta1, beta2=beta2,
                      weight_decay=group["weight_decay"], alpha=group["scale"], detail_clip=group["detail_clip"],
                      detail_clip_units=group.get("detail_clip_units", "stored"))
