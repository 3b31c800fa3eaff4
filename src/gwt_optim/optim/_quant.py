r"""Blockwise 8-bit optimizer moments (``moment_dtype="int8"``): the scheme of
bitsandbytes' 8-bit optimizers (Dettmers et al., 2022) as torchao ships it.
Each block of :data:`BLOCK` = 256 values is scaled by its absolute maximum and
rounded to the nearest of 256 values of the *dynamic map* (signed moments the
signed map, non-negative ones the unsigned one); :class:`Quantized` shows the
codes to :func:`gwt_optim.optim.functional.adamw_moments` as a moment.

Blocks run along the last axis within each row (the last one zero-padded),
not over the flattened tensor as in torchao: the scales are row-aligned like
the moment, so they shard with a parameter's rows under FSDP2, and no shape
needs a multiple of 256. Plain torch ops rather than torchao's ``quant_utils``
(which assume flat blocks over a multiple of 256): checkpoints must not
depend on which torchao is installed. ``tests/test_quant.py`` checks the map
and the rounding against torchao's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BLOCK", "CHUNK", "Quantized", "dynamic_map", "blocks", "zeros", "quantize_", "dequantize", "moments"]

BLOCK = 256
# Values per chunk in callers that walk a large moment: the rounding makes an
# int64 code per value, so whole-tensor temporaries would be 16+ bytes per value.
CHUNK = 1 << 20


@functools.lru_cache(maxsize=2)
def dynamic_map(signed: bool) -> tuple[float, ...]:
    """The 256 values of bitsandbytes' dynamic map (7 exponent bits), sorted.

    Same construction as ``bitsandbytes.functional.create_dynamic_map`` and
    ``torchao.optim.quant_utils.create_dynamic_map`` (whose zero padding is
    dropped): in decade ``10^(i-6)`` the midpoints of ``2^(i+s)`` equal steps
    (``s = 0`` signed, mirrored; ``s = 1`` unsigned), plus 0 and 1.
    """
    data: list[float] = []
    for i in range(7):
        items = 2 ** (i + (0 if signed else 1)) + 1
        bounds = torch.linspace(0.1, 1, items)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        # float32 products, as theirs: the codes must be the very same values
        data += (10 ** (i - 6) * means).tolist()
        if signed:
            data += (-(10 ** (i - 6)) * means).tolist()
    data += [0.0, 1.0]
    if len(data) != 256:
        raise AssertionError(len(data))
    return tuple(sorted(data))


@functools.lru_cache(maxsize=8)
def _tables(signed: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    qmap = torch.tensor(dynamic_map(signed), dtype=torch.float32, device=device)
    # Round to nearest, ties up (torchao's rule): the code is the number of
    # midpoints at or below the value.
    return qmap, (qmap[:-1] + qmap[1:]) / 2


def blocks(n: int) -> int:
    """Scales per row of ``n`` values."""
    return -(-n // BLOCK)


def zeros(like: Tensor) -> tuple[Tensor, Tensor]:
    """``(codes, absmax)`` of an all-zero moment shaped like ``like``."""
    codes = torch.zeros(like.shape, dtype=torch.uint8, device=like.device)
    absmax = torch.zeros((*like.shape[:-1], blocks(like.shape[-1])), dtype=torch.float32, device=like.device)
    return codes, absmax


def quantize_(x: Tensor, codes: Tensor, absmax: Tensor, *, signed: bool) -> None:
    """Write ``x`` (..., n) into ``codes`` (..., n) and ``absmax`` (..., ceil(n/256))."""
    n = x.shape[-1]
    nb = absmax.shape[-1]
    x = x.float()
    padded = F.pad(x, (0, nb * BLOCK - n)) if nb * BLOCK != n else x
    scale = padded.reshape(*x.shape[:-1], nb, BLOCK).abs().amax(-1)
    absmax.copy_(scale)
    # A zero block has codes of 0 whatever the divisor; any positive one avoids 0/0.
    inv = scale.clamp_min_(torch.finfo(torch.float32).tiny).reciprocal_()
    scaled = x * inv.repeat_interleave(BLOCK, dim=-1)[..., :n]
    qmap, mids = _tables(signed, x.device)
    codes.copy_(torch.bucketize(scaled, mids, right=True))


def dequantize(codes: Tensor, absmax: Tensor, *, signed: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    """The moment ``codes`` and ``absmax`` hold, as a new ``dtype`` tensor."""
    qmap, _ = _tables(signed, codes.device)
    out = qmap[codes.int()]  # int32 indices: uint8 ones would be read as a mask
    out.mul_(absmax.repeat_interleave(BLOCK, dim=-1)[..., : codes.shape[-1]])
    return out if dtype == torch.float32 else out.to(dtype)


class Quantized:
    """An int8 moment as :func:`gwt_optim.optim.functional.adamw_moments`
    reads a low-precision one: ``.to(dtype)`` dequantizes, ``.copy_(x)``
    quantizes. The state keeps ``codes`` (uint8) and ``absmax`` (fp32) as plain
    tensors, so a state dict loads with ``weights_only=True`` and round trips
    bitwise; this wraps them for one step.

    ``root``: the codes hold :math:`\\sqrt V`, not :math:`V` (``exp_avg_sq``):
    the details are divided by :math:`\\sqrt V + \\epsilon'`, and a :math:`V`
    code that rounds to zero (below about :math:`10^{-7}` of its block's
    maximum) would amplify them by up to :math:`1/\\epsilon'`; in the root
    that takes a :math:`10^{-14}` ratio of :math:`V`, and the map's relative
    precision applies to den directly. The step uses the moments before
    rounding, as torchao's 8-bit Adam does.
    """

    dtype = torch.uint8

    def __init__(self, codes: Tensor, absmax: Tensor, *, signed: bool, root: bool = False) -> None:
        self.codes, self.absmax, self.signed, self.root = codes, absmax, signed, root

    def to(self, dtype: torch.dtype) -> Tensor:
        x = dequantize(self.codes, self.absmax, signed=self.signed, dtype=dtype)
        return x.square_() if self.root else x

    def copy_(self, x: Tensor) -> "Quantized":
        quantize_(x.sqrt() if self.root else x, self.codes, self.absmax, signed=self.signed)
        return self

    def _rows(self, rs: slice) -> "Quantized":
        n = self.codes.shape[-1]
        codes = self.codes.view(-1, n)
        return Quantized(codes[rs], self.absmax.view(len(codes), -1)[rs], signed=self.signed, root=self.root)

    def by_rows(self, A: Tensor, other: "Quantized", update) -> tuple[Tensor, Tensor]:
        """``update(a, m, v) -> (U, den)`` over chunks of rows of ``A`` with
        this moment and ``other``'s rows: chunks bound the temporaries to a
        few MB whatever the parameter's size (embeddings at level 0)."""
        n = A.shape[-1]
        A2 = A.reshape(-1, n)
        U, den = torch.empty_like(A2), torch.empty_like(A2)
        rows = max(1, CHUNK // max(n, 1))
        for i in range(0, len(A2), rows):
            rs = slice(i, i + rows)
            U[rs], den[rs] = update(A2[rs], self._rows(rs), other._rows(rs))
        return U.view(A.shape), den.view(A.shape)


def moments(state: dict) -> tuple[Tensor | Quantized, Tensor | Quantized]:
    """GWT-AdamW's ``(exp_avg, exp_avg_sq)`` as the step reads them: the
    tensors, or their codes behind :class:`Quantized` (``moment_dtype="int8"``)."""
    if "exp_avg_absmax" not in state:
        return state["exp_avg"], state["exp_avg_sq"]
    return (Quantized(state["exp_avg"], state["exp_avg_absmax"], signed=True),
            Quantized(state["exp_avg_sq"], state["exp_avg_sq_absmax"], signed=False, root=True))
