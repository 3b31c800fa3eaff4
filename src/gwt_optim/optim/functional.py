r"""One readable statement of each GWT update: a pure function per tensor.

Like torch's ``_single_tensor_adam`` and Keller Jordan's ``muon_update``, each
function takes its inputs explicitly -- the weight :math:`W`, its gradient
:math:`G`, its state tensors (updated in place) and the hyperparameters -- and
no optimizer object. The notation is the paper's (Wen et al., 2025, Alg. 1;
``docs/algorithm.md`` states it in full):

1. :math:`[A_l, D_l, \dots, D_1] = \mathrm{DWT}_l(G)` along the last axis;
2. the family's state on :math:`A_l` only gives the approximation update
   :math:`U` and the denominator :math:`\mathrm{den}` that normalizes the
   details (``None``: they are not normalized);
3. Fira's norm-growth limiter :math:`r = \max(\|U\|_F/(s + 10^{-8}), \gamma)/\gamma`;
4. :math:`\Delta = \alpha\,\mathrm{IDWT}([U, D_l/\mathrm{den}', \dots, D_1/\mathrm{den}'])/r`,
   with the normalized details clamped to :math:`[-c, c]` first where
   ``detail_clip`` is set (``None`` is the paper's update). The transfer
   rule is :math:`\alpha = 2^{l/2}` (:func:`adamw_scale`): the inverse
   returns :math:`U` to each entry at :math:`2^{-l/2}` of AdamW's per-entry
   update, so with it AdamW's lr and weight decay carry over (the paper's
   recipe is :math:`\alpha = 0.25` at its own lr);
5. :math:`W \leftarrow W(1 - \eta\lambda) - \eta\,c_t\,\Delta` with the
   family's step factor :math:`c_t`.

:func:`gwt_adamw`, :func:`gwt_muon`, :func:`gwt_adam_mini` and
:func:`gwt_adafactor` are each family's whole step: its two halves,
``gwt_*_moments`` (steps 1-2, returning :class:`Moments`) and ``gwt_*_apply``
(steps 4-5), with the limiter (step 3) between them. The halves are what the
optimizers' eager path runs, one call each, so the two agree bit for bit; the
split is where FSDP2 sums the limiter's norms across ranks. The fused
backends (native C, Triton) are tested against the ``gwt_*`` functions.

For Haar (``impl="fast"``) the transform and its inverse run in closed form:
level :math:`l` mixes only blocks of :math:`2^l` adjacent entries, with
:math:`A_{l,k} = \sum \mathrm{block}_k / 2^{l/2}` and the details of block
:math:`k` reconstructing :math:`G_k - \overline{G}_k`. ``impl="reference"``
runs :func:`~gwt_optim.wavelets.wavedec` and :func:`~gwt_optim.wavelets.waverec`
literally (any wavelet). Math runs in the compute dtype (at least fp32); a
non-finite gradient is the caller's concern (the optimizers skip the update
and only count the step).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from gwt_optim import wavelets

__all__ = [
    "gwt_adamw", "gwt_muon", "gwt_adam_mini", "gwt_adafactor", "Moments",
    "gwt_adamw_moments", "gwt_adamw_apply", "gwt_muon_moments", "gwt_muon_apply",
    "gwt_muon_apply_orthogonalized", "muon_input",
    "gwt_adam_mini_moments", "gwt_adam_mini_apply", "gwt_adafactor_moments", "gwt_adafactor_apply",
    "start", "finish", "transform", "haar_approx", "limiter_ratio", "direction", "apply_update",
    "adamw_moments", "adam_step_factor", "adam_eps", "AdamWScalars", "adamw_scalars", "muon_momentum",
    "muon_direction", "adam_mini_moments",
    "adafactor_moments", "max_level", "step_level",
    "adafactor_step_factor", "zeropower_via_newtonschulz", "adamw_scale", "adjust_lr_ratio", "compute_dtype",
    "BLOCKS", "DETAIL_NORMS", "NS_COEFFICIENTS", "NS_DTYPES", "LIMITER_EPS",
]  # fmt: skip


# ------------------------------------------------------ shared pieces --- #

# Fira's limiter divides by the previous norm; this keeps it finite at s = 0. The kernels take it from here.
LIMITER_EPS = 1e-8


def compute_dtype(W: Tensor) -> torch.dtype:
    """Math runs in at least fp32 whatever the parameter's dtype."""
    return torch.promote_types(W.dtype, torch.float32)


class Moments(NamedTuple):
    """What the first half of a step (steps 1-2) leaves for the second (4-5):
    the limiter's r comes between them, from :meth:`norm_sq` (summed across
    ranks under FSDP2)."""

    G: Tensor  # the gradient in the compute dtype
    A: Tensor  # A_l
    U: Tensor  # the approximation update (before the limiter)
    den: Tensor | None  # its normalizer of the details; None: raw details
    coeffs: wavelets.Coefficients | None  # the literal transform's, else None
    level: int  # the step's level (0 for a vector)

    def norm_sq(self) -> Tensor:
        """||U||_F^2, the limiter's input."""
        return self.U.square().sum()


def start(W: Tensor, G: Tensor, level: int, impl: str = "fast",
          wavelet: str = wavelets.HAAR) -> tuple[Tensor, Tensor, Any, int]:
    """Step 1 for W: ``(G, A_l, coeffs, level)`` with G in the compute dtype;
    a W with fewer than two dimensions takes the plain family's step (level 0)."""
    level = level if W.ndim >= 2 else 0
    G = G.to(compute_dtype(W))
    A, coeffs = transform(G, level, impl, wavelet)
    return G, A, coeffs, level


def haar_approx(G: Tensor, level: int) -> Tensor:
    """A_l of the Haar transform: block sums over 2^l columns, times 2^(-l/2).

    A matrix-vector product with a constant vector: on CPU it runs as one BLAS
    pass, several times faster than ``sum(-1)`` over a tiny inner dimension.
    """
    blocks, _ = wavelets.haar_block_split(G, level)
    h = torch.full((blocks.shape[-1],), 2.0 ** (-level / 2), dtype=G.dtype, device=G.device)
    return blocks @ h


def transform(G: Tensor, level: int, impl: str = "fast", wavelet: str = wavelets.HAAR):
    """Step 1: ``(A_l, coeffs)``; ``coeffs`` (all levels) only for the literal transform."""
    if level == 0:
        return G, None
    if impl == "fast" and wavelet == wavelets.HAAR:
        return haar_approx(G, level), None  # the details stay in G: the inverse is closed-form
    coeffs = wavelets.wavedec(G, level, wavelet, dim=-1)
    return coeffs.approx, coeffs


def limiter_ratio(norm_sq: Tensor | float, s: Tensor, step: int, gamma: float) -> Tensor | float:
    """Step 3, Fira's norm-growth limiter: r from ||U||_F^2, and s <- ||U||_F / r.

    No norm recorded yet (the first step, or only skipped non-finite ones so
    far): record this one rather than limit against zero. ``norm_sq`` may be
    a float (a fused CPU kernel's): then the math is scalar.
    """
    if not isinstance(norm_sq, Tensor):
        norm = math.sqrt(norm_sq)
        s_ = s.item()
        r_ = 1.0 if step == 1 or not s_ > 0 else max(norm / (s_ + LIMITER_EPS), gamma) / gamma
        s.fill_(norm / r_)
        return r_
    norm = norm_sq.sqrt()
    if step == 1:
        r = torch.ones((), dtype=norm.dtype, device=norm.device)
    else:
        limited = torch.clamp(norm / (s + LIMITER_EPS), min=gamma) / gamma
        r = torch.where(s > 0, limited, torch.ones_like(limited))
    s.copy_(norm / r)
    return r


def direction(G: Tensor, A: Tensor, U: Tensor, den: Tensor | None, r: Tensor | float, alpha: float, level: int,
              clip: float | None = None, coeffs: wavelets.Coefficients | None = None) -> Tensor:
    """Step 4: Delta = alpha * IDWT([U, D_l/den', ..., D_1/den']) / r, full size.

    ``coeffs`` from :func:`transform` selects the literal inverse; otherwise
    the Haar closed form over ``G``. ``den=None`` leaves the details raw.
    """
    coef = alpha / r if isinstance(r, float) else (alpha / r).to(U.dtype)
    if level == 0:
        return U * coef
    if coeffs is not None:
        return _reference_inverse(coeffs, U, den, r, clip) * alpha
    return _haar_delta(G, A, U, den, coef, level, clip)


def max_level(n: int) -> int:
    """The deepest level a row of ``n`` entries can use: ceil(log2 n), where one block of 2^level covers it.

    A deeper level only averages zero padding into the approximation (its update then shrinks and the
    details' grow) while :func:`adamw_scale` of it would scale the step as if the level were real:
    :func:`step_level` caps a weight's level here."""
    return max(n - 1, 0).bit_length()


def step_level(shape: tuple[int, ...] | torch.Size, level: int, alpha: float) -> tuple[int, float]:
    """The level and alpha at which a parameter of ``shape`` steps in a group of ``level`` and scale ``alpha``:
    the one rule, which the optimizers and the ``gwt_*`` whole steps all call.

    A parameter of fewer than two dimensions takes the plain family's step: ``(0, 1.0)``. A weight whose
    last axis has n entries steps at ``l_used = min(level, max_level(n))`` with
    ``alpha_used = alpha 2^((l_used - level)/2)``, the transfer rule's scaling: with the recipe's
    ``alpha = 2^(level/2)`` (:func:`adamw_scale`) that is ``2^(l_used/2)``, the rule's alpha at the level
    used. A capped weight steps exactly as it would in a group of level ``l_used`` and scale
    ``alpha_used`` (at ``l_used = 0``: a plain step at ``alpha_used``, still under the group's limiter,
    as a level-0 group's weights are); its state is shaped for ``l_used``. A weight the level fits (the
    usual case) gets ``(level, alpha)`` unchanged. Capping, not refusing, lets 1x1 convolutions and
    torch's own optimizer tests (1x1, 5x1, 1x2, 2x2 weights) run under any group level."""
    if len(shape) < 2:
        return 0, 1.0
    used = min(level, max_level(shape[-1]))
    return (level, alpha) if used == level else (used, alpha * 2.0 ** ((used - level) / 2))


def adamw_scale(level: int) -> float:
    """alpha = 2^(level/2), the transfer rule: GWT's step at AdamW's size, so that AdamW's lr carries over.

    The orthonormal inverse returns the approximation's update to each entry
    of its 2^level-block at 2^(-level/2) of AdamW's per-entry update on the
    same gradients; this factor restores it (and scales the clipped details
    with it). Measured at level 2 (docs/results/transfer-cpu.md).
    """
    return 2.0 ** (level / 2)


def apply_update(W: Tensor, delta: Tensor, *, lr: float, weight_decay: float, step_size: float) -> None:
    """Step 5: W <- W (1 - lr wd) - step_size * Delta; bf16/fp16 weights update in fp32 and round once."""
    if W.dtype == delta.dtype:
        if weight_decay != 0:
            W.mul_(1 - lr * weight_decay)
        W.add_(delta, alpha=-step_size)
    else:
        w32 = W.to(delta.dtype)
        if weight_decay != 0:
            w32.mul_(1 - lr * weight_decay)
        w32.add_(delta, alpha=-step_size)
        W.copy_(w32)


def _safe_div(x: Tensor, den: Tensor) -> Tensor:
    """``x / den`` with entries over ``den == 0`` set to 0 (eps = 0 and V = 0)."""
    return torch.where(den > 0, x / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(x))


def _haar_delta(G: Tensor, A: Tensor, U: Tensor, den: Tensor | None, coef, level: int,
                clip: float | None = None) -> Tensor:
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
    """The inverse in the paper's notation: normalize each detail level by den'
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


# ------------------------------------------------------------ GWT-AdamW --- #


def adamw_moments(A: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, beta1: float, beta2: float,
                  eps: float) -> tuple[Tensor, Tensor]:
    """Step 2 of GWT-AdamW: M, V on A_l; den = sqrt(V) + eps sqrt(1 - beta2^t) (torch's eps); U = M / den.

    The moments may be of a lower precision than A_l (bf16; int8 codes behind
    :class:`gwt_optim.optim._quant.Quantized`): they are read with ``.to``
    and written with ``.copy_``."""
    M, V = exp_avg, exp_avg_sq
    if M.dtype == A.dtype:
        M.lerp_(A, 1 - beta1)
        V.mul_(beta2).addcmul_(A, A, value=1 - beta2)
        m, den = M, V.sqrt()
    else:  # low-precision moments (bf16, or int8 codes): update in the compute dtype, store once
        m = M.to(A.dtype).lerp_(A, 1 - beta1)
        v = V.to(A.dtype).mul_(beta2).addcmul_(A, A, value=1 - beta2)
        M.copy_(m)
        V.copy_(v)
        den = v.sqrt_()  # v is this step's copy: no second temporary
    den.add_(adam_eps(eps, beta2, step))
    return _safe_div(m, den), den


def adam_step_factor(step: int, beta1: float, beta2: float) -> float:
    """c_t of Adam: the bias corrections, sqrt(1 - beta2^t) / (1 - beta1^t)."""
    return math.sqrt(1 - beta2**step) / (1 - beta1**step)


def adam_eps(eps: float, beta2: float, step: int) -> float:
    """eps' = eps sqrt(1 - beta2^t): torch's eps (added to the bias-corrected
    sqrt(V)) where sqrt(V) is not corrected, the correction being in c_t."""
    return eps * math.sqrt(1 - beta2**step)


DETAIL_CLIP_UNITS = ("stored", "step")


def stored_clip(detail_clip: float | None, units: str, step: int, beta1: float, beta2: float) -> float | None:
    """The clip ``c`` as step 4 applies it, to the details normalized by the stored denominator sqrt(V) + eps'.

    ``units="stored"``: ``c`` itself. The details are then multiplied by Adam's c_t, so the bound on an entry's
    detail step, alpha c lr c_t = alpha c lr sqrt(1 - beta2^t)/(1 - beta1^t), grows with t (at beta2 0.999
    from 0.32 alpha c lr at t = 1 to 0.93 at t = 2,000). ``units="step"``: the bound itself is alpha c lr at
    every step, so the stored clip is c (1 - beta1^t)/sqrt(1 - beta2^t) (issue 54's candidate C2)."""
    if detail_clip is None or units == "stored":
        return detail_clip
    return detail_clip * (1 - beta1**step) / math.sqrt(1 - beta2**step)


class AdamWScalars(NamedTuple):
    """The scalars of one GWT-AdamW step of a group at one alpha, as the fused
    kernels take them (each backend copies them into its launch arguments)."""

    w1: float  # 1 - beta1, the first moment's weight of A_l
    beta2: float
    w2: float  # 1 - beta2
    eps: float  # adam_eps: added to sqrt(V)
    step_size: float  # (alpha lr) c_t, before the division by the limiter's r
    decay: float  # 1 - lr wd
    clip: float | None = None  # stored_clip: the detail clip against the stored denominator; None: off


def adamw_scalars(step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  alpha: float, detail_clip: float | None = None, detail_clip_units: str = "stored") -> AdamWScalars:
    """:func:`gwt_adamw`'s scalars at ``step`` for the fused kernels, the one
    place they are computed. The eager halves take the same factors, but
    apply alpha in the direction and ``lr c_t`` in the update, where the
    kernels fold alpha into one step size, ``(alpha lr) c_t``."""
    return AdamWScalars(1.0 - beta1, beta2, 1.0 - beta2, adam_eps(eps, beta2, step),
                        alpha * lr * adam_step_factor(step, beta1, beta2), 1 - lr * weight_decay,
                        stored_clip(detail_clip, detail_clip_units, step, beta1, beta2))


def gwt_adamw_moments(W: Tensor, G: Tensor, exp_avg, exp_avg_sq, *, step: int, beta1: float, beta2: float,
                      eps: float, level: int, impl: str = "fast", wavelet: str = wavelets.HAAR) -> Moments:
    """The first half of :func:`gwt_adamw` (steps 1-2). The moments may be
    int8 codes behind :class:`gwt_optim.optim._quant.Quantized` (anything
    with ``.to(dtype)`` and ``.copy_()``), stepped a chunk of rows at a time."""
    G, A, coeffs, level = start(W, G, level, impl, wavelet)
    if isinstance(exp_avg, Tensor):
        U, den = adamw_moments(A, exp_avg, exp_avg_sq, step, beta1, beta2, eps)
    else:
        U, den = exp_avg.by_rows(A, exp_avg_sq, lambda a, m, v: adamw_moments(a, m, v, step, beta1, beta2, eps))
    return Moments(G, A, U, den, coeffs, level)


def gwt_adamw_apply(W: Tensor, m: Moments, r: Tensor | float, *, step: int, lr: float, beta1: float, beta2: float,
                    weight_decay: float, alpha: float, detail_clip: float | None,
                    detail_clip_units: str = "stored") -> None:
    """The second half of :func:`gwt_adamw` (steps 4-5), with the limiter's ``r``."""
    finish(W, m, r, lr=lr, weight_decay=weight_decay, step_size=lr * adam_step_factor(step, beta1, beta2), alpha=alpha,
           detail_clip=stored_clip(detail_clip, detail_clip_units, step, beta1, beta2))


def finish(W: Tensor, m: Moments, r: Tensor | float, *, lr: float, weight_decay: float, step_size: float,
           alpha: float, detail_clip: float | None = None) -> None:
    """Steps 4-5 of the families with a normalizer (AdamW, Adam-mini, Adafactor);
    a vector takes alpha 1 and no clip."""
    if W.ndim < 2:
        alpha, detail_clip = 1.0, None
    delta = direction(m.G, m.A, m.U, m.den, r, alpha, m.level, detail_clip, m.coeffs)
    apply_update(W, delta, lr=lr, weight_decay=weight_decay, step_size=step_size)


def _limit(W: Tensor, m: Moments, limiter_norm: Tensor | None, step: int, gamma: float | None) -> Tensor | float:
    """Step 3 between the halves; a vector takes no limiter."""
    return 1.0 if gamma is None or W.ndim < 2 else limiter_ratio(m.norm_sq(), limiter_norm, step, gamma)


def gwt_adamw(W: Tensor, G: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, limiter_norm: Tensor | None, *,
              step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, level: int,
              alpha: float, gamma: float | None, detail_clip: float | None, impl: str = "fast",
              wavelet: str = wavelets.HAAR, detail_clip_units: str = "stored") -> None:
    """One GWT-AdamW step of W (``step`` = t, counted from 1), in place.

    ``exp_avg``/``exp_avg_sq`` are shaped like A_l (fp32 or lower), and
    ``limiter_norm`` is s, a 0-d tensor (zero before the first step; None
    with ``gamma=None``). A W with fewer than two dimensions takes plain
    AdamW: level 0, alpha 1, no limiter; a weight too narrow for ``level``
    steps at :func:`step_level`'s.
    """
    level, alpha = step_level(W.shape, level, alpha)
    m = gwt_adamw_moments(W, G, exp_avg, exp_avg_sq, step=step, beta1=beta1, beta2=beta2, eps=eps, level=level,
                          impl=impl, wavelet=wavelet)
    r = _limit(W, m, limiter_norm, step, gamma)
    gwt_adamw_apply(W, m, r, step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, alpha=alpha,
                    detail_clip=detail_clip, detail_clip_units=detail_clip_units)


# ------------------------------------------------------------- GWT-Muon --- #

# Keller Jordan's quintic coefficients, as in torch.optim.Muon.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def zeropower_via_newtonschulz(
    X: Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximately orthogonalize a matrix with the quintic Newton--Schulz iteration.

    The operations (and their order) are those of ``torch.optim.Muon``, so with
    ``dtype=torch.bfloat16`` the result is bit-identical to it; ``dtype``
    chooses the iteration's precision. Returns a tensor of ``dtype``.
    """
    if X.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(X.shape)}")
    if steps >= 100:
        raise ValueError("ns_steps must be < 100")
    a, b, c = coefficients
    Y = X.to(dtype)
    tall = X.size(0) > X.size(1)
    if tall:  # iterate on the smaller Gram matrix
        Y = Y.T
    Y.div_(Y.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = Y @ Y.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        Y = torch.addmm(Y, poly, Y, beta=a)
    return Y.T if tall else Y


# torch.optim.Muon's adjust_lr_fn choices (None = "original").
_ADJUST_LR: dict[str | None, Callable[[int, int], float]] = {
    None: lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    "original": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
}


def adjust_lr_ratio(adjust_lr_fn: str | None, shape: torch.Size | tuple[int, ...]) -> float:
    """Muon's shape-based learning-rate multiplier for a (rows, cols) matrix."""
    return _ADJUST_LR[adjust_lr_fn](shape[0], shape[1])


def muon_momentum(A: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Step 2 of GWT-Muon: B <- mu B + (1 - mu) A_l; returns B~ (Nesterov: (1 - mu) A_l + mu B)."""
    B = momentum_buffer
    b = B.to(A.dtype).lerp_(A, 1 - momentum)
    if b is not B:  # low-precision buffer: update in the compute dtype, store once
        B.copy_(b)
    return A.lerp(b, momentum) if nesterov else b


def muon_direction(G: Tensor, A: Tensor, B: Tensor, alpha: float, level: int, *, ns_coefficients, ns_steps: int,
                   ns_eps: float, ns_dtype: torch.dtype, coeffs: wavelets.Coefficients | None = None) -> Tensor:
    """Delta = alpha * NS(IDWT([B~, D_l, ..., D_1])): the raw details, no limiter, alpha once.

    Newton-Schulz first divides X by its norm, so any scale of X (a limiter's
    r, or alpha) would cancel: alpha multiplies the orthogonalized direction.
    """
    X = muon_input(G, A, B, level, coeffs)
    O = zeropower_via_newtonschulz(X, ns_coefficients, ns_steps, ns_eps, ns_dtype).to(X.dtype)
    return O.mul_(alpha) if alpha != 1 else O


def muon_input(G: Tensor, A: Tensor, B: Tensor, level: int, coeffs: wavelets.Coefficients | None = None) -> Tensor:
    """X = IDWT([B~, D_l, ..., D_1]), Newton-Schulz's input, full size. The
    transform runs along the last axis, so each row of X needs only its own
    row of G, A and B~: a row shard computes its rows of X."""
    return direction(G, A, B, None, 1.0, 1.0, level, None, coeffs)


def gwt_muon_moments(W: Tensor, G: Tensor, momentum_buffer: Tensor, *, momentum: float, nesterov: bool,
                     level: int, impl: str = "fast", wavelet: str = wavelets.HAAR) -> Moments:
    """The first half of :func:`gwt_muon`: ``U`` is B~, no normalizer."""
    G, A, coeffs, level = start(W, G, level, impl, wavelet)
    return Moments(G, A, muon_momentum(A, momentum_buffer, momentum, nesterov), None, coeffs, level)


def gwt_muon_apply(W: Tensor, m: Moments, *, lr: float, weight_decay: float, alpha: float,
                   ns_coefficients=NS_COEFFICIENTS, ns_steps: int = 5, ns_eps: float = 1e-7,
                   ns_dtype: torch.dtype = torch.bfloat16, adjust_lr_fn: str | None = None) -> None:
    """The second half of :func:`gwt_muon` (no limiter: Newton-Schulz would cancel it)."""
    delta = muon_direction(m.G, m.A, m.U, alpha, m.level, ns_coefficients=ns_coefficients, ns_steps=ns_steps,
                           ns_eps=ns_eps, ns_dtype=ns_dtype, coeffs=m.coeffs)
    apply_update(W, delta, lr=lr, weight_decay=weight_decay, step_size=lr * adjust_lr_ratio(adjust_lr_fn, W.shape))


def gwt_muon_apply_orthogonalized(W: Tensor, O: Tensor, *, lr: float, weight_decay: float, alpha: float,
                                  shape: tuple[int, int], adjust_lr_fn: str | None = None) -> None:
    """The second half of :func:`gwt_muon` given ``O``, the Newton-Schulz
    orthogonalization of :func:`muon_input` computed elsewhere, in the compute
    dtype (updated in place): under FSDP2 ``W`` and ``O`` are a row shard and
    ``shape`` the whole matrix's, which Muon's learning-rate ratio reads. The
    same operations as :func:`gwt_muon_apply` on those rows."""
    apply_update(W, O.mul_(alpha) if alpha != 1 else O, lr=lr, weight_decay=weight_decay,
                 step_size=lr * adjust_lr_ratio(adjust_lr_fn, shape))


def gwt_muon(W: Tensor, G: Tensor, momentum_buffer: Tensor, *, lr: float, momentum: float, nesterov: bool,
             weight_decay: float, level: int, alpha: float, ns_coefficients=NS_COEFFICIENTS, ns_steps: int = 5,
             ns_eps: float = 1e-7, ns_dtype: torch.dtype = torch.bfloat16, adjust_lr_fn: str | None = None,
             impl: str = "fast", wavelet: str = wavelets.HAAR) -> None:
    """One GWT-Muon step of a matrix W, in place; ``momentum_buffer`` is shaped like A_l.

    At level 0 with alpha 1 this is ``torch.optim.Muon``'s step; a weight too
    narrow for ``level`` steps at :func:`step_level`'s level and alpha.
    """
    level, alpha = step_level(W.shape, level, alpha)
    m = gwt_muon_moments(W, G, momentum_buffer, momentum=momentum, nesterov=nesterov, level=level, impl=impl,
                         wavelet=wavelet)
    gwt_muon_apply(W, m, lr=lr, weight_decay=weight_decay, alpha=alpha, ns_coefficients=ns_coefficients,
                   ns_steps=ns_steps, ns_eps=ns_eps, ns_dtype=ns_dtype, adjust_lr_fn=adjust_lr_fn)


# -------------------------------------------------------- GWT-Adam-mini --- #


def _rows(x: Tensor) -> Tensor:
    """``x`` as (rows, entries-per-row): rows are the leading dims."""
    return x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(1, -1)


# Per-block mean of A^2, and its expansion back over A's shape, per block kind.
# "head" groups ``head_dim`` consecutive rows, as adam-mini's view(-1, dim*dim/n_heads)
# does for a (n_heads * head_dim, dim) projection.
def _expand_neuron(den: Tensor, A: Tensor, head_dim: int | None) -> Tensor:
    return den.reshape(*A.shape[:-1], 1).expand_as(A) if A.ndim >= 2 else den.reshape(1).expand_as(A)


BLOCKS: dict[str, tuple[Callable[[Tensor, int | None], Tensor], Callable[[Tensor, Tensor, int | None], Tensor]]] = {
    "element": (lambda sq, hd: sq, lambda den, A, hd: den),
    "head": (lambda sq, hd: _rows(sq).reshape(-1, hd * _rows(sq).shape[-1]).mean(-1, keepdim=True),
             lambda den, A, hd: _expand_neuron(den.repeat_interleave(hd, dim=0), A, hd)),
    "neuron": (lambda sq, hd: _rows(sq).mean(-1, keepdim=True), _expand_neuron),
    "tensor": (lambda sq, hd: sq.mean(), lambda den, A, hd: den.expand_as(A)),
}


def adam_mini_moments(A: Tensor, exp_avg: Tensor, vmean: Tensor, step: int, beta1: float, beta2: float, eps: float,
                      block: str, head_dim: int | None = None, reduce: Any = None) -> tuple[Tensor, Tensor]:
    """Step 2 of GWT-Adam-mini: M on A_l; one v_b per block b, the block's mean of A_l^2;
    den_b = sqrt(v_b) + eps sqrt(1 - beta2^t), expanded over the block; U = M / den.
    ``reduce``: a sharded parameter's :class:`~gwt_optim.optim._sharded.Sharding` (None: the whole tensor is here)."""
    mean, expand = BLOCKS[block]
    # Low-precision moments are updated in the compute dtype and stored once.
    m = exp_avg.to(A.dtype).lerp_(A, 1 - beta1)
    sq_mean = mean(A * A, head_dim) if reduce is None else _shard_block_mean(A, vmean, block, head_dim, reduce)
    vm = vmean.to(A.dtype).mul_(beta2).add_(sq_mean, alpha=1 - beta2)
    if m is not exp_avg:
        exp_avg.copy_(m)
        vmean.copy_(vm)
    den = expand(vm.sqrt().add_(adam_eps(eps, beta2, step)), A, head_dim)
    return _safe_div(m, den), den


def _shard_block_mean(A: Tensor, vmean: Tensor, block: str, head_dim: int | None, reduce: Any) -> Tensor:
    """A shard's block means of A_l^2. A block within a row, or of whole heads
    of rows (GWTAdamMini refuses shards that split a head), is the shard's
    own; a block over the whole tensor (``"tensor"``, a vector's ``"neuron"``
    or ``"head"``) is its shards' sums over its global size."""
    if block == "tensor" or A.ndim < 2 and block != "element":  # a vector's neuron or head: all of it
        axes = tuple(range(A.ndim))
        total = reduce.sum_((A * A).sum(), axes)
        return (total / reduce.size(A, axes)).reshape(vmean.shape)
    return BLOCKS[block][0](A * A, head_dim)


def gwt_adam_mini_moments(W: Tensor, G: Tensor, exp_avg: Tensor, vmean: Tensor, *, step: int, beta1: float,
                          beta2: float, eps: float, block: str, head_dim: int | None = None, level: int,
                          impl: str = "fast", wavelet: str = wavelets.HAAR, reduce: Any = None) -> Moments:
    """The first half of :func:`gwt_adam_mini` (steps 1-2); ``reduce`` as :func:`adam_mini_moments`."""
    G, A, coeffs, level = start(W, G, level, impl, wavelet)
    U, den = adam_mini_moments(A, exp_avg, vmean, step, beta1, beta2, eps, block, head_dim, reduce)
    return Moments(G, A, U, den, coeffs, level)


# Adam-mini's second half is Adam's: the bias corrections on the shared steps 4-5.
gwt_adam_mini_apply = gwt_adamw_apply


def gwt_adam_mini(W: Tensor, G: Tensor, exp_avg: Tensor, vmean: Tensor, limiter_norm: Tensor | None, *,
                  step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, level: int,
                  alpha: float, gamma: float | None, block: str, head_dim: int | None = None,
                  detail_clip: float | None = None, impl: str = "fast", wavelet: str = wavelets.HAAR) -> None:
    """One GWT-Adam-mini step of W, in place: GWT-AdamW's with one second moment per block.

    ``vmean`` holds the blocks' v (its shape is ``BLOCKS[block][0](A_l, head_dim)``'s); the level and alpha
    are :func:`step_level`'s.
    """
    level, alpha = step_level(W.shape, level, alpha)
    m = gwt_adam_mini_moments(W, G, exp_avg, vmean, step=step, beta1=beta1, beta2=beta2, eps=eps, block=block,
                              head_dim=head_dim, level=level, impl=impl, wavelet=wavelet)
    r = _limit(W, m, limiter_norm, step, gamma)
    gwt_adam_mini_apply(W, m, r, step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, alpha=alpha,
                        detail_clip=detail_clip)


# -------------------------------------------------------- GWT-Adafactor --- #

# The details' normalizer from 1/sqrt(V^) and the update-clipping factor c.
DETAIL_NORMS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "clip": lambda rsqrt_v, clip: rsqrt_v.new_full((), clip).expand_as(rsqrt_v),  # D / c
    "second_moment": lambda rsqrt_v, clip: rsqrt_v.reciprocal().mul_(clip),  # D / (sqrt(V^)' c)
}


def adafactor_moments(A: Tensor, step: int, *, row_var: Tensor | None = None, col_var: Tensor | None = None,
                      variance: Tensor | None = None, exp_avg: Tensor | None = None, beta2_decay: float,
                      eps1: float | None, d: float, beta1: float | None,
                      detail_norm: str = "clip", reduce: Any = None) -> tuple[Tensor, Tensor]:
    """Step 2 of GWT-Adafactor: the factored R, C (or, for a vector, V) of A_l^2 with
    1 - beta2_t = t^tau; U = A_l / sqrt(V^), clipped to RMS d; with beta1, M of U replaces U.
    ``reduce``: a sharded parameter's :class:`~gwt_optim.optim._sharded.Sharding`
    (None: the whole tensor is here); the column statistics, R's mean and U's RMS
    then sum over the shards."""
    if eps1 is None:
        eps1 = torch.finfo(A.dtype).eps
    one_minus_beta2_t = step**beta2_decay
    if row_var is not None:
        r = row_var.to(A.dtype).lerp_(_mean_sq(A, -1, reduce), one_minus_beta2_t)
        c = col_var.to(A.dtype).lerp_(_mean_sq(A, -2, reduce), one_minus_beta2_t)
        if r is not row_var:  # low-precision statistics: update in the compute dtype, store once
            row_var.copy_(r)
            col_var.copy_(c)
        r_mean = r.mean(dim=-2, keepdim=True) if reduce is None else \
            reduce.sum_(r.sum(dim=-2, keepdim=True), (-2,)).div_(reduce.size(r, (-2,)))
        var = (r @ c).div_(r_mean.clamp_(min=eps1))
    else:
        v = variance.to(A.dtype).lerp_(A * A, one_minus_beta2_t)
        if v is not variance:
            variance.copy_(v)
        var = v.clone()
    rsqrt_v = var.clamp_(min=eps1 * eps1).rsqrt_()
    U = rsqrt_v * A
    norm, numel = _norm(U, reduce)
    clip = max(1.0, norm / ((numel ** 0.5) * d))
    if clip != 1.0:
        U.div_(clip)
    if beta1 is not None:
        m = exp_avg.to(A.dtype).lerp_(U, 1 - beta1)
        if m is not exp_avg:
            exp_avg.copy_(m)
        U = m.clone()
    return U, DETAIL_NORMS[detail_norm](rsqrt_v, clip)


def _mean_sq(A: Tensor, dim: int, reduce: Any) -> Tensor:
    """(A * A).mean(dim, keepdim=True) without materializing A * A; under
    ``reduce``, the shards' sums over the axis's global length (the last axis
    is never sharded: that costs no collective)."""
    s = torch.norm(A, dim=dim, keepdim=True).square_()
    if reduce is None:
        return s.div_(A.size(dim))
    return reduce.sum_(s, (dim,)).div_(reduce.size(A, (dim,)))


def _norm(x: Tensor, reduce: Any) -> tuple[float, int]:
    """||x||_2 and x's number of entries, of the whole tensor across its shards under ``reduce``."""
    if reduce is None:
        return x.norm(2).item(), x.numel()
    axes = tuple(range(x.ndim))
    return math.sqrt(reduce.sum_(x.square().sum(), axes).item()), reduce.size(x, axes)


def adafactor_step_factor(W: Tensor, step: int, lr: float, eps2: float, relative_step: bool,
                          reduce: Any = None) -> float:
    """c_t of Adafactor's relative step, max(eps2, RMS(W)) min(lr, 1/sqrt t) / lr (W before the update;
    ``reduce``: a sharded W's :class:`~gwt_optim.optim._sharded.Sharding`)."""
    if not relative_step:
        return 1.0
    if lr == 0:
        return 0.0
    rho = min(lr, 1 / math.sqrt(step))
    norm, numel = _norm(W, reduce)
    return max(eps2, norm / (numel ** 0.5)) * rho / lr


def gwt_adafactor_moments(W: Tensor, G: Tensor, *, step: int, row_var: Tensor | None = None,
                          col_var: Tensor | None = None, variance: Tensor | None = None,
                          exp_avg: Tensor | None = None, beta2_decay: float = -0.8,
                          eps1: float | None = None, d: float = 1.0, beta1: float | None = None,
                          detail_norm: str = "clip", level: int, impl: str = "fast",
                          wavelet: str = wavelets.HAAR, reduce: Any = None) -> Moments:
    """The first half of :func:`gwt_adafactor` (steps 1-2); ``reduce`` as :func:`adafactor_moments`."""
    G, A, coeffs, level = start(W, G, level, impl, wavelet)
    U, den = adafactor_moments(A, step, row_var=row_var, col_var=col_var, variance=variance, exp_avg=exp_avg,
                               beta2_decay=beta2_decay, eps1=eps1, d=d, beta1=beta1, detail_norm=detail_norm,
                               reduce=reduce)
    return Moments(G, A, U, den, coeffs, level)


def gwt_adafactor_apply(W: Tensor, m: Moments, r: Tensor | float, *, step: int, lr: float, eps2: float = 1e-3,
                        relative_step: bool = True, weight_decay: float = 0.0, alpha: float,
                        detail_clip: float | None = None, reduce: Any = None) -> None:
    """The second half of :func:`gwt_adafactor`; the relative step reads W before the update
    (the whole W's RMS under ``reduce``, as :func:`adafactor_moments`)."""
    c_t = adafactor_step_factor(W, step, lr, eps2, relative_step, reduce)
    finish(W, m, r, lr=lr, weight_decay=weight_decay, step_size=lr * c_t, alpha=alpha, detail_clip=detail_clip)


def gwt_adafactor(W: Tensor, G: Tensor, *, step: int, lr: float, row_var: Tensor | None = None,
                  col_var: Tensor | None = None, variance: Tensor | None = None, exp_avg: Tensor | None = None,
                  limiter_norm: Tensor | None = None, beta2_decay: float = -0.8,
                  eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0,
                  beta1: float | None = None, relative_step: bool = True, detail_norm: str = "clip", level: int,
                  alpha: float, gamma: float | None = None, detail_clip: float | None = None, impl: str = "fast",
                  wavelet: str = wavelets.HAAR) -> None:
    """One GWT-Adafactor step of W, in place; ``row_var``/``col_var`` (m x 1, 1 x k) for a
    matrix, ``variance`` (A_l's shape) for a vector, ``exp_avg`` with ``beta1``; the level and alpha are
    :func:`step_level`'s."""
    level, alpha = step_level(W.shape, level, alpha)
    m = gwt_adafactor_moments(W, G, step=step, row_var=row_var, col_var=col_var, variance=variance, exp_avg=exp_avg,
                              beta2_decay=beta2_decay, eps1=eps[0], d=d, beta1=beta1, detail_norm=detail_norm,
                              level=level, impl=impl, wavelet=wavelet)
    r = _limit(W, m, limiter_norm, step, gamma)
    gwt_adafactor_apply(W, m, r, step=step, lr=lr, eps2=eps[1], relative_step=relative_step,
                        weight_decay=weight_decay, alpha=alpha, detail_clip=detail_clip)
