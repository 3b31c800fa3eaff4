r"""Blockwise 8-bit optimizer moments (``moment_dtype="int8"``).

The scheme of bitsandbytes' 8-bit optimizers (Dettmers et al., 2022,
arXiv 2110.02861) as torchao ships it: each block of :data:`BLOCK` = 256
values is scaled by its absolute maximum and every scaled value is rounded to
the nearest entry of the 256-value *dynamic map* (a dynamic-exponent code that
spends its resolution near zero: about 7 decades of range). Signed moments use
the signed map, non-negative ones the unsigned map.

State stays plain tensors, so ``torch.load(weights_only=True)`` reads it and a
``state_dict`` round trip is bitwise: ``codes`` (uint8, the moment's shape) and
``absmax`` (float32, shape ``(*leading, ceil(n / 256))``). Blocks run along
the last axis *within each row* (the last one zero-padded), not over the
flattened tensor as in torchao: the scales are then row-aligned like the
moment, so they shard and reshard with a parameter's rows under FSDP2, and no
shape needs a multiple of 256.

Written here on plain torch ops, rather than calling ``torchao.optim``'s
``quant_utils``, because its ``scale_tensor``/``dequant_with_qmap`` assume
flat blocks over a multiple of 256 values, importing torchao costs seconds and
is an optional extra, and checkpoints must not depend on which torchao is
installed. ``tests/test_quant.py`` checks that the map and the rounding equal
torchao's (``create_dynamic_map``, ``quantize_8bit_with_qmap``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BLOCK", "CHUNK", "dynamic_map", "blocks", "zeros", "quantize_", "dequantize"]

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
