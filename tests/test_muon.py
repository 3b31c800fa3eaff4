"""GWT-Muon against torch.optim.Muon (level 0) and a literal transform oracle (level >= 1).

Newton-Schulz in bf16 is slow on CPUs, so every matrix here is small.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz

from gwt_optim import wavelets
from gwt_optim.optim import GWTMuon
from gwt_optim.optim.muon import adjust_lr_ratio, zeropower_via_newtonschulz


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: with two pytest workers on two cores, intra-op threads
    only contend (a 32x32 matmul goes from microseconds to milliseconds)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _pair(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=g)
    return torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone()), g


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_newton_schulz_is_torchs_bit_for_bit(shape):
    X = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours = zeropower_via_newtonschulz(X, (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.bfloat16)
    assert torch.equal(ours, torch_newton_schulz(X, (3.4445, -4.7750, 2.0315), 5, 1e-7))


def test_fp32_newton_schulz_orthogonalizes_like_bf16():
    X = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    bf16 = zeropower_via_newtonschulz(X, dtype=torch.bfloat16).float()
    fp32 = zeropower_via_newtonschulz(X, dtype=torch.float32)
    # both push every singular value into Muon's band around 1 ...
    for O in (bf16, fp32):
        s = torch.linalg.svdvals(O)
        assert s.min() > 0.5 and s.max() < 1.3
    # ... and differ by bf16 rounding only
    assert (bf16 - fp32).norm() / fp32.norm() < 0.02


@pytest.mark.parametrize(
    "shape,nesterov,adjust",
    [((24, 40), True, None), ((40, 24), True, "original"), ((32, 32), False, "match_rms_adamw")],
)
def test_level0_equals_torch_muon_step_for_step(shape, nesterov, adjust):
    a, b, g = _pair(shape)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
    ref = torch.optim.Muon([a], **kw)
    ours = GWTMuon([b], level=0, scale=1.0, **kw)
    for _ in range(4):
        grad = torch.randn(shape, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
        assert torch.equal(a, b)
    assert torch.equal(ref.state[a]["momentum_buffer"], ours.state[b]["momentum_buffer"])


def _oracle_step(W, G, B, *, level, mu, nesterov, lr, wd, scale, ns_dtype):
    """GWT-Muon written out with the explicit transform (gwt_optim.wavelets)."""
    c = wavelets.wavedec(G, level)
    B = B.lerp(c.approx, 1 - mu)
    approx = c.approx.lerp(B, mu) if nesterov else B
    X = wavelets.waverec(c._replace(approx=approx))
    O = zeropower_via_newtonschulz(X, dtype=ns_dtype).float() * scale
    return W * (1 - lr * wd) - lr * adjust_lr_ratio(None, W.shape) * O, B


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("level,shape", [(1, (16, 30)), (2, (24, 37)), (3, (40, 16))])
def test_level_l_matches_the_literal_transform(impl, level, shape):
    a, b, g = _pair(shape, seed=level)
    kw = dict(lr=0.05, weight_decay=0.01, momentum=0.9, nesterov=True)
    ours = GWTMuon([b], level=level, scale=0.5, ns_dtype="float32", impl=impl, **kw)
    W, B = a.detach().clone(), torch.zeros(shape[0], wavelets.approx_length(shape[1], level))
    for _ in range(3):
        G = torch.randn(shape, generator=g)
        b.grad = G.clone()
        ours.step()
        W, B = _oracle_step(
            W, G, B, level=level, mu=0.9, nesterov=True, lr=0.05, wd=0.01, scale=0.5, ns_dtype=torch.float32
        )
        torch.testing.assert_close(b.detach(), W, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.state[b]["momentum_buffer"], B)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_momentum_is_2_pow_minus_l_of_muons(level):
    a, b, g = _pair((32, 64))
    ref, ours = torch.optim.Muon([a]), GWTMuon([b], level=level, ns_dtype="float32")
    a.grad = b.grad = torch.randn(32, 64, generator=g)
    ref.step()
    ours.step()
    assert ours.state[b]["momentum_buffer"].numel() * 2**level == ref.state[a]["momentum_buffer"].numel()


def test_adamw_groups_are_torch_adamw():
    a, b, g = _pair((8,))
    ref = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1)
    ours = GWTMuon([{"params": [b], "use_muon": False, "level": 0, "scale": 1.0}], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        a.grad = b.grad = torch.randn(8, generator=g)
        ref.step()
        ours.step()
    torch.testing.assert_close(a, b)


def test_the_limiter_runs_in_the_adamw_groups_only():
    # The rule of a group says whether Fira's limiter applies (_family.Rule.limiter): a Muon group's
    # Newton-Schulz would cancel it; an AdamW group's matrix steps as GWT-AdamW's, limiter included.
    from gwt_optim import GWTAdamW

    a, b, g = _pair((8, 16))
    m = torch.nn.Parameter(torch.randn(8, 16, generator=g))
    hp = dict(lr=1e-2, weight_decay=0.0, level=1, scale=0.5, norm_growth_limit=1.01)
    ref = GWTAdamW([a], betas=(0.9, 0.95), eps=1e-8, detail_clip=None, backend="eager", **hp)
    ours = GWTMuon([{"params": [m]}, {"params": [b], "use_muon": False, "betas": (0.9, 0.95), "eps": 1e-8}],
                   ns_dtype="float32", **hp)
    for _ in range(3):
        a.grad = b.grad = torch.randn(8, 16, generator=g)
        m.grad = torch.randn(8, 16, generator=g)
        ref.step()
        ours.step()
    assert "limiter_norm" in ours.state[b] and "limiter_norm" not in ours.state[m]
    assert torch.equal(ours.state[b]["limiter_norm"], ref.state[a]["limiter_norm"])
    assert torch.equal(a, b)


def test_non_matrix_in_muon_group_names_the_fix():
    with pytest.raises(ValueError, match="use_muon=False"):
        GWTMuon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="ns_dtype"):
        GWTMuon([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype="int8")
    # The clip bounds normalized details; a Muon group's are raw gradient coefficients.
    with pytest.raises(ValueError, match="detail_clip=0.5 does not apply to a use_muon group"):
        GWTMuon([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "level": 1, "detail_clip": 0.5}])
    GWTMuon([{"params": [torch.nn.Parameter(torch.zeros(4))], "use_muon": False, "level": 1, "detail_clip": 0.5}])


@pytest.mark.parametrize("level", [1, 2, 3])
def test_reduces_the_loss_of_a_small_llama(level, tiny_lm):
    model, batch, loss = tiny_lm
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer

    opt = build_optimizer(
        "gwt-muon", model, OptimizerConfig(lr=1e-2, scale=0.25, options={"level": level, "ns_dtype": "float32"})
    )
    assert {g["use_muon"] for g in opt.param_groups} == {True, False}
    first = loss()
    for _ in range(8):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss().item() < 0.8 * first.item()


@pytest.fixture
def tiny_lm():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=128, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, x, lambda: model(x, labels=x).loss
