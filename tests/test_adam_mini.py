"""GWT-Adam-mini against the adam-mini package (level 0) and a literal transform oracle."""

from __future__ import annotations

import math

import pytest
import torch

from gwt_optim import wavelets
from gwt_optim.optim import GWTAdamMini
from gwt_optim.optim.adam_mini import adam_mini_block, adam_mini_param_groups

transformers = pytest.importorskip("transformers")

DIM, HEADS, KV_HEADS = 64, 4, 2


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: with two pytest workers on two cores, intra-op threads
    only contend (a 32x32 matmul goes from microseconds to milliseconds)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_llama(hidden=DIM, heads=HEADS, kv=KV_HEADS, vocab=256):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=kv,
        num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def test_block_partition_follows_adam_mini():
    expected = {
        "model.embed_tokens.weight": "neuron",
        "model.layers.0.self_attn.q_proj.weight": "head",
        "model.layers.0.self_attn.k_proj.weight": "head",
        "model.layers.0.self_attn.v_proj.weight": "neuron",
        "model.layers.0.self_attn.o_proj.weight": "neuron",
        "model.layers.0.mlp.down_proj.weight": "neuron",
        "model.layers.0.input_layernorm.weight": "tensor",
        "model.norm.weight": "tensor",
        "lm_head.weight": "neuron",
        "encoder.layer.0.attention.self.query.bias": "element",
    }
    assert {name: adam_mini_block(name) for name in expected} == expected


def test_level0_matches_the_adam_mini_package_on_a_small_llama():
    adam_mini = pytest.importorskip("adam_mini")
    ref_model, model = tiny_llama(), tiny_llama()
    ref = adam_mini.Adam_mini(
        ref_model.named_parameters(), lr=1e-2, weight_decay=0.1,
        dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, verbose=False,
    )  # fmt: skip
    groups = adam_mini_param_groups(model.named_parameters(), dim=DIM, n_heads=HEADS, weight_decay=0.1)
    ours = GWTAdamMini(groups, lr=1e-2, level=0)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    for _ in range(4):
        for m, opt in ((ref_model, ref), (model, ours)):
            opt.zero_grad()
            m(x, labels=x).loss.backward()
            opt.step()
    for (name, p_ref), p in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6, msg=name)
        # the same blocks: one second-moment scalar per head / row / tensor
        torch.testing.assert_close(ours.state[p]["vmean"], ref.state[p_ref]["vmean"], rtol=1e-5, atol=1e-12, msg=name)


def _oracle(W, G, *, level, block_rows, lr, betas, eps, scale):
    """One GWT-Adam-mini step (t = 1) with the explicit transform."""
    c = wavelets.wavedec(G, level)
    A = c.approx
    b1, b2 = betas
    M = (1 - b1) * A
    v = (1 - b2) * (A * A).reshape(-1, block_rows * A.shape[-1]).mean(-1, keepdim=True)
    den = (v.sqrt() + eps * math.sqrt(1 - b2)).repeat_interleave(block_rows, 0)  # per row
    details = [D / den for D in c.details]  # each row's details over its block's den
    delta = scale * wavelets.waverec(c._replace(approx=M / den, details=tuple(details)))
    return W - lr * math.sqrt(1 - b2) / (1 - b1) * delta


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("level,block,head_dim", [(1, "neuron", None), (2, "head", 4), (3, "neuron", None)])
def test_level_l_matches_the_literal_transform(impl, level, block, head_dim):
    g = torch.Generator().manual_seed(level)
    W = torch.randn(16, 37, generator=g)
    G = torch.randn(16, 37, generator=g)
    p = torch.nn.Parameter(W.clone())
    opt = GWTAdamMini(
        [{"params": [p], "block": block, "head_dim": head_dim}], lr=0.1, level=level, scale=0.5, impl=impl
    )
    p.grad = G
    opt.step()
    expected = _oracle(W, G, level=level, block_rows=head_dim or 1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, scale=0.5)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_first_moment_is_2_pow_minus_l_and_blocks_unchanged(level):
    model = tiny_llama()
    q = model.model.layers[0].self_attn.q_proj.weight
    plain = GWTAdamMini([{"params": [q], "block": "head", "head_dim": DIM // HEADS}], level=0)
    gwt = GWTAdamMini([{"params": [q], "block": "head", "head_dim": DIM // HEADS}], level=level)
    q.grad = torch.randn_like(q)
    plain.step()
    gwt.step()
    assert gwt.state[q]["exp_avg"].numel() * 2**level == plain.state[q]["exp_avg"].numel()
    assert gwt.state[q]["vmean"].shape == plain.state[q]["vmean"].shape == (HEADS, 1)


def test_head_blocks_must_divide_rows():
    with pytest.raises(ValueError, match="head_dim"):
        GWTAdamMini([{"params": [torch.nn.Parameter(torch.zeros(10, 4))], "block": "head", "head_dim": 4}])
    with pytest.raises(ValueError, match="block"):
        GWTAdamMini([torch.nn.Parameter(torch.zeros(4, 4))], block="row")


@pytest.mark.parametrize("level", [1, 2, 3])
def test_reduces_the_loss_of_a_small_llama(level):
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer

    model = tiny_llama(hidden=32, vocab=128)
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    opt = build_optimizer("gwt-adam-mini", model, OptimizerConfig(lr=1e-2, scale=0.25, options={"level": level}))
    assert {g["level"] for g in opt.param_groups} == {0, level}
    first = model(x, labels=x).loss.item()
    for _ in range(8):
        opt.zero_grad()
        model(x, labels=x).loss.backward()
        opt.step()
    assert model(x, labels=x).loss.item() < 0.8 * first
