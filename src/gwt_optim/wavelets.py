r"""Multilevel discrete wavelet transforms along one axis, as pure functions.

Haar is built in and orthonormal. One level maps a signal :math:`x` of length
:math:`n` to

.. math::

    a_k = (x_{2k} + x_{2k+1}) / \sqrt{2}, \qquad d_k = (x_{2k} - x_{2k+1}) / \sqrt{2},

with one zero appended when :math:`n` is odd, so each level has
:math:`\lceil n/2 \rceil` coefficients (PyWavelets' ``mode="zero"``). Level
:math:`l` repeats this on the approximation and returns
:math:`[A_l, D_l, D_{l-1}, \dots, D_1]`; level 0 is the identity. The lengths
of the signal before each level are stored in the result, so the inverse crops
back exactly, never guessing.

Other orthogonal wavelets (``db2``, ``sym4``, ...) go through the optional
``ptwt`` package (``pip install 'gwt-optim[wavelets]'``).

A fact the fast optimizer path relies on: zero-padding the signal once to a
multiple of :math:`2^l` gives the same :math:`A_l` and the same leading
entries of every :math:`D_j` as padding level by level (the extra entries are
zeros), and the Haar transform at level :math:`l` mixes only blocks of
:math:`2^l` adjacent entries. See :func:`haar_block_split`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Coefficients",
    "HAAR",
    "wavedec",
    "waverec",
    "haar_dwt",
    "haar_idwt",
    "haar_block_split",
    "approx_length",
    "is_supported_wavelet",
    "check_wavelet",
]

HAAR = "haar"
_INV_SQRT2 = 1.0 / math.sqrt(2.0)


class Coefficients(NamedTuple):
    """A multilevel decomposition along ``dim``.

    ``approx`` is :math:`A_l`; ``details`` is :math:`(D_l, \\dots, D_1)`,
    coarsest first (PyWavelets' order); ``lengths[j]`` is the length of the
    signal that level ``j + 1`` transformed (finest first), so
    ``lengths[0]`` is the original length.
    """

    approx: Tensor
    details: tuple[Tensor, ...]
    lengths: tuple[int, ...]
    wavelet: str
    dim: int

    @property
    def level(self) -> int:
        return len(self.details)

    def as_list(self) -> list[Tensor]:
        """``[A_l, D_l, ..., D_1]``, the layout of ``pywt.wavedec``."""
        return [self.approx, *self.details]


def approx_length(n: int, level: int) -> int:
    """Length of :math:`A_l` for a Haar transform of ``n`` samples: ceil(n / 2^l)."""
    for _ in range(level):
        n = (n + 1) // 2
    return n


def is_supported_wavelet(name: str) -> bool:
    if name == HAAR:
        return True
    try:
        import pywt
    except ImportError:
        return False
    return name in pywt.wavelist(kind="discrete")


def check_wavelet(name: str) -> None:
    """Raise ``ValueError`` for an unknown wavelet and ``ImportError`` naming
    the extra when a non-Haar wavelet needs ``ptwt``/PyWavelets."""
    if name == HAAR:
        return
    try:
        import ptwt  # noqa: F401
        import pywt
    except ImportError as exc:
        raise ImportError(
            f"wavelet {name!r} needs the optional ptwt and PyWavelets packages: "
            "pip install 'gwt-optim[wavelets]' (Haar is built in and needs nothing)"
        ) from exc
    if name not in pywt.wavelist(kind="discrete"):
        raise ValueError(f"unknown wavelet {name!r}; use 'haar' or a discrete wavelet from pywt.wavelist()")
    if not pywt.Wavelet(name).orthogonal:
        raise ValueError(f"wavelet {name!r} is not orthogonal; GWT needs an orthogonal wavelet")


def _pad_to_even(x: Tensor, dim: int) -> Tensor:
    n = x.shape[dim]
    if n % 2 == 0:
        return x
    shape = list(x.shape)
    shape[dim] = 1
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def haar_dwt(x: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """One orthonormal Haar level along ``dim``: ``(a, d)``, each ceil(n/2) long."""
    dim = dim % x.ndim
    x = _pad_to_even(x, dim)
    even = x.narrow(dim, 0, x.shape[dim] // 2 * 2)
    pairs = even.unflatten(dim, (-1, 2))
    x0 = pairs.select(dim + 1, 0)
    x1 = pairs.select(dim + 1, 1)
    return (x0 + x1) * _INV_SQRT2, (x0 - x1) * _INV_SQRT2


def haar_idwt(a: Tensor, d: Tensor, length: int, dim: int = -1) -> Tensor:
    """Inverse of :func:`haar_dwt`, cropped to ``length`` along ``dim``."""
    dim = dim % a.ndim
    if a.shape != d.shape:
        raise ValueError(f"approximation {tuple(a.shape)} and detail {tuple(d.shape)} shapes differ")
    x0 = (a + d) * _INV_SQRT2
    x1 = (a - d) * _INV_SQRT2
    x = torch.stack([x0, x1], dim=dim + 1).flatten(dim, dim + 1)
    return x.narrow(dim, 0, length)


def wavedec(x: Tensor, level: int, wavelet: str = HAAR, dim: int = -1) -> Coefficients:
    """Multilevel forward transform of ``x`` along ``dim`` (default: last).

    Works on any leading/trailing batch shape and any length, odd lengths
    included; ``level`` 0 returns ``x`` itself as the approximation.
    """
    if level < 0:
        raise ValueError(f"level must be >= 0, got {level}")
    if x.ndim == 0:
        raise ValueError("wavedec needs at least one dimension")
    dim = dim % x.ndim
    if wavelet != HAAR:
        return _ptwt_wavedec(x, level, wavelet, dim)
    details: list[Tensor] = []
    lengths: list[int] = []
    a = x
    for _ in range(level):
        lengths.append(a.shape[dim])
        a, d = haar_dwt(a, dim)
        details.append(d)
    return Coefficients(a, tuple(reversed(details)), tuple(lengths), wavelet, dim)


def waverec(coeffs: Coefficients) -> Tensor:
    """Inverse of :func:`wavedec`, cropped to the stored original length."""
    if coeffs.wavelet != HAAR:
        return _ptwt_waverec(coeffs)
    a = coeffs.approx
    # details are coarsest first; lengths are finest first
    for d, n in zip(coeffs.details, reversed(coeffs.lengths)):
        a = haar_idwt(a, d, n, coeffs.dim)
    return a


def haar_block_split(x: Tensor, level: int) -> tuple[Tensor, int]:
    """View ``x`` (..., n) as blocks of ``2^level`` along the last axis.

    Returns ``(blocks, n)`` where ``blocks`` has shape (..., ceil(n/2^l), 2^l),
    zero-padded at the end when needed. Within a block the Haar transform at
    level ``l`` is the orthonormal Haar basis of size ``2^l``: the block's
    approximation coefficient is ``sum(block) / 2^(l/2)`` and its details
    reconstruct ``block - mean(block)``.
    """
    n = x.shape[-1]
    b = 1 << level
    k = -(-n // b)
    if k * b != n:
        x = torch.nn.functional.pad(x, (0, k * b - n))
    return x.unflatten(-1, (k, b)), n


# ------------------------------------------------------------------ ptwt --- #


def _ptwt():
    check_wavelet("db1")  # raises the install hint if ptwt/pywt are missing
    import ptwt

    return ptwt


def _ptwt_wavedec(x: Tensor, level: int, wavelet: str, dim: int) -> Coefficients:
    check_wavelet(wavelet)
    ptwt = _ptwt()
    if level == 0:
        return Coefficients(x, (), (), wavelet, dim)
    # ptwt works on the last axis; move ``dim`` there and back.
    xt = x.movedim(dim, -1)
    lengths = []
    n = xt.shape[-1]
    import pywt

    flen = pywt.Wavelet(wavelet).dec_len
    for _ in range(level):
        lengths.append(n)
        n = (n + flen - 1) // 2
    coeffs = ptwt.wavedec(xt, wavelet, mode="zero", level=level, axis=-1)
    coeffs = [c.movedim(-1, dim) for c in coeffs]
    return Coefficients(coeffs[0], tuple(coeffs[1:]), tuple(lengths), wavelet, dim)


def _ptwt_waverec(coeffs: Coefficients) -> Tensor:
    ptwt = _ptwt()
    if coeffs.level == 0:
        return coeffs.approx
    dim = coeffs.dim
    parts = [c.movedim(dim, -1) for c in coeffs.as_list()]
    # ptwt's inverse expects each approximation to match the next detail's
    # length; crop level by level with the stored lengths instead of guessing.
    a = parts[0]
    for d, n in zip(parts[1:], reversed(coeffs.lengths)):
        a = a[..., : d.shape[-1]]
        a = ptwt.waverec([a, d], coeffs.wavelet, axis=-1)[..., :n]
    return a.movedim(-1, dim)
