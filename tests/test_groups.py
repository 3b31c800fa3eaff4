"""Parameter-group helpers on a real (tiny) LLaMA from transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gwt_optim import GWTAdamW, gwt_param_groups, lr_scaled_groups, split_params


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def test_paper_recipe_transforms_attention_and_mlp_linears_only(llama):
    split = split_params(llama, "paper")
    names = {n for n, _ in split.transformed}
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert names == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in per_layer}
    regular = {n for n, _ in split.regular}
    assert "model.embed_tokens.weight" in regular and "lm_head.weight" in regular
    assert all("norm" in n or n in ("model.embed_tokens.weight", "lm_head.weight") for n in regular)
    c = split.counts
    assert c["total_params"] == sum(p.numel() for p in llama.parameters())
    assert c["transformed_params"] == 2 * (4 * 32 * 32 + 3 * 32 * 48)
    assert "GWT: 14 tensors" in split.summary()


def test_hidden_recipe_takes_every_2d_hidden_weight(llama):
    split = split_params(llama, "hidden")
    names = {n for n, _ in split.transformed}
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names
    assert names == {n for n, _ in split_params(llama, "paper").transformed}  # same for LLaMA


def test_hidden_recipe_on_a_custom_model_excludes_embeddings_and_head():
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(10, 8),
        "block": torch.nn.Linear(8, 8),
        "conv": torch.nn.Conv1d(8, 8, 3),
        "lm_head": torch.nn.Linear(8, 10),
    })
    names = {n for n, _ in split_params(model, "hidden").transformed}
    assert names == {"block.weight", "conv.weight"}


def test_gwt_groups_carry_options_and_build_an_optimizer(llama):
    split = gwt_param_groups(llama, level=3, scale=0.5, transformed_options={"weight_decay": 0.1})
    gwt, plain = split.groups
    assert (gwt["level"], gwt["scale"], gwt["norm_growth_limit"], gwt["weight_decay"]) == (3, 0.5, 1.01, 0.1)
    assert (plain["level"], plain["scale"], plain["norm_growth_limit"]) == (0, 1.0, None)
    opt = GWTAdamW(split, lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    llama(ids, labels=ids).loss.backward()
    opt.step()
    q = llama.model.layers[0].self_attn.q_proj.weight
    assert opt.state[q]["exp_avg"].shape == (32, 4)
    emb = llama.model.embed_tokens.weight
    assert opt.state[emb]["exp_avg"].shape == emb.shape
    llama.zero_grad()


def test_lr_scaled_groups_give_peers_the_same_module_wise_lr(llama):
    split = lr_scaled_groups(llama, lr=1e-2, scale=0.25)
    assert [g["lr"] for g in split.groups] == [pytest.approx(2.5e-3), pytest.approx(1e-2)]
    opt = torch.optim.AdamW(split, lr=1e-2)
    assert len(opt.param_groups) == 2


def test_unknown_recipe_is_rejected(llama):
    with pytest.raises(ValueError, match="unknown recipe 'all'"):
        split_params(llama, "all")


def test_tied_parameters_are_listed_once():
    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "lm_head": head})
    split = split_params(model, "hidden")
    assert len(split.regular) == 1 and not split.transformed
