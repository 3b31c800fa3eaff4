"""GWT-Adafactor against torch.optim.Adafactor (level 0) and a literal transform oracle."""

from __future__ import annotations

import pytest
import torch

from gwt_optim import wavelets
from gwt_optim.optim import GWTAdafactor


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: with two pytest workers on two cores, intra-op threads
    only contend (a 32x32 matmul goes from microseconds to milliseconds)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 8, 12), (17,)])
def test_level0_matches_torch_adafactor(shape):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, generator=g)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ref = torch.optim.Adafactor([a], lr=1e-2, weight_decay=0.1)
    ours = GWTAdafactor([b], lr=1e-2, weight_decay=0.1, level=0, scale=1.0)
    for _ in range(5):
        a.grad = b.grad = torch.randn(shape, generator=g) * 3.0
        ref.step()
        ours.step()
        # the update-clipping factor is folded into U here and into the step
        # size in torch: one fp32 rounding apart
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for key in ("row_var", "col_var", "variance"):
        if key in ref.state[a]:
            torch.testing.assert_close(ours.state[b][key], ref.state[a][key])


def _oracle(W, G, *, level, detail_norm, lr, scale, d=1.0, eps2=1e-3):
    """One GWT-Adafactor step (t = 1) with the explicit transform."""
    c = wavelets.wavedec(G, level)
    A = c.approx
    eps1 = torch.finfo(A.dtype).eps
    R = (A * A).mean(-1, keepdim=True)  # 1 - beta2_1 = 1: the statistics are this step's
    C = (A * A).mean(-2, keepdim=True)
    V = (R @ C) / R.mean(-2, keepdim=True).clamp(min=eps1)
    root = V.clamp(min=eps1**2).sqrt()
    U = A / root
    clip = max(1.0, (U.square().mean().sqrt() / d).item())
    U = U / clip
    if detail_norm == "second_moment":
        details = [D / (root.repeat_interleave(2**i, -1)[..., : D.shape[-1]] * clip) for i, D in enumerate(c.details)]
    else:
        details = [D / clip for D in c.details]
    delta = scale * wavelets.waverec(c._replace(approx=U, details=tuple(details)))
    alpha = max(eps2, (W.square().mean().sqrt()).item()) * min(lr, 1.0)
    return W - alpha * delta


@pytest.mark.parametrize("detail_norm", ["second_moment", "clip"])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_level_l_matches_the_literal_transform(level, detail_norm):
    g = torch.Generator().manual_seed(level)
    W = torch.randn(12, 40, generator=g)
    # a gradient whose approximation is smooth but whose details are not
    G = torch.randn(12, 40, generator=g) * torch.linspace(0.1, 3.0, 40)
    p = torch.nn.Parameter(W.clone())
    opt = GWTAdafactor([p], lr=1e-2, level=level, scale=0.5, detail_norm=detail_norm, impl="reference")
    p.grad = G
    opt.step()
    torch.testing.assert_close(p.detach(), _oracle(W, G, level=level, detail_norm=detail_norm, lr=1e-2, scale=0.5))


def test_fast_and_reference_paths_agree():
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(10, 29, generator=g)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    fast = GWTAdafactor([a], level=2, beta1=0.9, impl="fast")
    ref = GWTAdafactor([b], level=2, beta1=0.9, impl="reference")
    for _ in range(3):
        a.grad = b.grad = torch.randn(10, 29, generator=g)
        fast.step()
        ref.step()
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_state_shrinks_on_the_transformed_axis(level):
    p, q = torch.nn.Parameter(torch.randn(16, 64)), torch.nn.Parameter(torch.randn(16, 64))
    plain = GWTAdafactor([p], level=0, beta1=0.9)
    gwt = GWTAdafactor([q], level=level, beta1=0.9)
    p.grad = q.grad = torch.randn(16, 64)
    plain.step()
    gwt.step()
    # first moment and column statistics shrink by 2^l; the row statistics,
    # one per row along which the transform runs, stay as they are
    assert gwt.state[q]["exp_avg"].numel() * 2**level == plain.state[p]["exp_avg"].numel()
    assert gwt.state[q]["col_var"].numel() * 2**level == plain.state[p]["col_var"].numel()
    assert gwt.state[q]["row_var"].shape == plain.state[p]["row_var"].shape


def test_bad_options_name_the_choices():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="second_moment"):
        GWTAdafactor([p], detail_norm="details")
    with pytest.raises(ValueError, match="beta1"):
        GWTAdafactor([p], beta1=1.5)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_reduces_the_loss_of_a_small_llama(level):
    transformers = pytest.importorskip("transformers")
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=128, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    # relative_step=False: a plain lr, as the comparison harness uses
    opts = {"level": level, "relative_step": False}
    opt = build_optimizer("gwt-adafactor", model, OptimizerConfig(lr=1e-2, scale=0.25, options=opts))
    first = model(x, labels=x).loss.item()
    for _ in range(8):
        opt.zero_grad()
        model(x, labels=x).loss.backward()
        opt.step()
    assert model(x, labels=x).loss.item() < 0.8 * first
