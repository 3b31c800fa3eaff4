"""The transform against PyWavelets, the oracle: coefficients, reconstruction, energy."""

from __future__ import annotations

import numpy as np
import pytest
import pywt
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gwt_optim import wavelets

SETTINGS = settings(max_examples=60, deadline=None)


def pywt_rows(x: torch.Tensor, wavelet: str, level: int) -> list[np.ndarray]:
    """pywt.wavedec applied row by row on the last axis, stacked back."""
    flat = x.reshape(-1, x.shape[-1]).numpy()
    rows = [pywt.wavedec(r, wavelet, mode="zero", level=level) for r in flat]
    return [np.stack([r[j] for r in rows]).reshape(*x.shape[:-1], -1) for j in range(level + 1)]


shapes = st.tuples(
    st.lists(st.integers(1, 4), min_size=0, max_size=2),  # leading batch dims
    st.integers(1, 70),  # transformed length, odd lengths included
)


@SETTINGS
@given(shape=shapes, level=st.integers(0, 7))
def test_haar_matches_pywt_row_by_row(shape, level):
    lead, n = shape
    x = torch.randn(*lead, n, dtype=torch.float64)
    c = wavelets.wavedec(x, level)
    ref = pywt_rows(x, "haar", level)
    assert c.level == level
    assert len(c.as_list()) == len(ref)
    for ours, theirs in zip(c.as_list(), ref):
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-12, atol=1e-12)
    assert c.approx.shape[-1] == wavelets.approx_length(n, level)


@SETTINGS
@given(shape=shapes, level=st.integers(0, 7), dim=st.integers(0, 2))
def test_perfect_reconstruction_along_any_axis(shape, level, dim):
    lead, n = shape
    x = torch.randn(*lead, n, dtype=torch.float64)
    dim = dim % x.ndim
    c = wavelets.wavedec(x, level, dim=dim)
    assert c.lengths[:1] == ((x.shape[dim],) if level else ())
    torch.testing.assert_close(wavelets.waverec(c), x, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(shape=shapes, level=st.integers(0, 7))
def test_energy_is_preserved(shape, level):
    lead, n = shape
    x = torch.randn(*lead, n, dtype=torch.float64)
    c = wavelets.wavedec(x, level)
    energy = c.approx.square().sum() + sum(d.square().sum() for d in c.details)
    torch.testing.assert_close(energy, x.square().sum(), rtol=1e-12, atol=1e-12)


def test_level_zero_is_identity():
    x = torch.randn(3, 5)
    c = wavelets.wavedec(x, 0)
    assert c.approx is x and c.details == ()
    assert wavelets.waverec(c) is x


def test_odd_length_pads_one_zero_per_level():
    # n = 5: level 1 sees [x0..x4, 0] -> 3 coefficients; level 2 sees 3 -> pads to 4 -> 2.
    x = torch.arange(1.0, 6.0, dtype=torch.float64)
    c = wavelets.wavedec(x, 2)
    assert [t.shape[-1] for t in c.as_list()] == [2, 2, 3]
    assert c.lengths == (5, 3)
    s = 2**-0.5
    np.testing.assert_allclose(c.details[1].numpy(), [(1 - 2) * s, (3 - 4) * s, 5 * s])


@SETTINGS
@given(shape=shapes, level=st.integers(0, 6))
def test_block_split_gives_the_same_approximation(shape, level):
    lead, n = shape
    x = torch.randn(*lead, n, dtype=torch.float64)
    blocks, n0 = wavelets.haar_block_split(x, level)
    assert n0 == n
    approx = blocks.sum(-1) * 2.0 ** (-level / 2)
    torch.testing.assert_close(approx, wavelets.wavedec(x, level).approx, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("wavelet", ["db2", "sym4", "coif1"])
@pytest.mark.parametrize("n", [1, 7, 16, 33])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_other_wavelets_match_pywt_and_reconstruct(wavelet, n, level):
    x = torch.randn(2, 3, n, dtype=torch.float64)
    c = wavelets.wavedec(x, level, wavelet)
    for ours, theirs in zip(c.as_list(), pywt_rows(x, wavelet, level)):
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(wavelets.waverec(c), x, rtol=1e-9, atol=1e-9)


def test_unknown_and_non_orthogonal_wavelets_are_rejected():
    with pytest.raises(ValueError, match="unknown wavelet 'nope'"):
        wavelets.check_wavelet("nope")
    with pytest.raises(ValueError, match="not orthogonal"):
        wavelets.check_wavelet("bior2.2")


def test_missing_ptwt_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "ptwt":
            raise ImportError("No module named 'ptwt'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"gwt-optim\[wavelets\]"):
        wavelets.wavedec(torch.randn(4, 8), 1, "db2")
    wavelets.wavedec(torch.randn(4, 8), 1, "haar")  # Haar needs nothing


def test_negative_level_is_rejected():
    with pytest.raises(ValueError, match="level must be >= 0, got -1"):
        wavelets.wavedec(torch.randn(4), -1)


def test_gradients_flow_through_the_transform():
    # The transform is plain torch ops: autograd works, e.g. for wavelet losses.
    x = torch.randn(3, 9, dtype=torch.float64, requires_grad=True)
    c = wavelets.wavedec(x, 2)
    (c.approx.sum() + sum(d.square().sum() for d in c.details)).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
