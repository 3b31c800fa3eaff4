"""Every registered peer: builds with the module-wise alpha, trains, and its
state round-trips through a checkpoint; missing packages name the extra."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from gwt_optim.groups import split_params
from gwt_optim.toolkit.registry import REGISTRY, MissingDependency, OptimizerConfig, build_optimizer, parse_optimizer_arg

ALPHA, LR = 0.25, 1e-3
# torchao compiles its step with torch.compile: minutes on a small CPU, so only built here.
STEPPED = ["adamw", "adam8bit", "galore:rank=8", "apollo:rank=8", "apollo-mini", "adam-mini", "muon",
           "gwt-adamw:level=2"]


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                      vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _build(spec: str, model):
    name, opts = parse_optimizer_arg(spec)
    return build_optimizer(name, model, OptimizerConfig(lr=LR, scale=ALPHA, options=opts))


def _step(model, opt, x):
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def test_registry_holds_the_issue_list():
    wanted = {"adamw", "gwt-adamw", "adam8bit", "torchao-adamw8bit", "torchao-adamw4bit", "galore", "apollo",
              "apollo-mini", "adam-mini", "muon"}
    assert wanted <= set(REGISTRY)
    assert all(REGISTRY[n].help for n in wanted)


@pytest.mark.parametrize("spec", STEPPED)
def test_peer_trains_and_its_state_round_trips(spec):
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model = _model()
    opt = _build(spec, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    losses = []
    for _ in range(4):
        losses.append(_step(model, opt, x))
        scheduler.step()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": scheduler.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    twin = _model()
    twin.load_state_dict(saved["model"])
    twin_opt = _build(spec, twin)
    twin_sched = torch.optim.lr_scheduler.LambdaLR(twin_opt, lambda s: 1.0 / (s + 1))
    twin_opt.load_state_dict(saved["opt"])
    twin_sched.load_state_dict(saved["sched"])
    assert _step(model, opt, x) == _step(twin, twin_opt, x)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b), spec  # the resumed optimizer takes the very same step


def _lr_of(opt, param) -> float:
    return next(float(g["lr"]) for g in opt.param_groups if any(p is param for p in g["params"]))


@pytest.mark.parametrize("spec", ["adamw", "adam8bit", "adam-mini", "muon", "apollo", "torchao-adamw8bit",
                                  "torchao-adamw4bit"])
def test_module_wise_alpha_scales_the_chosen_weights(spec):
    if spec.startswith("torchao"):
        pytest.importorskip("torchao")
    model = _model()
    opt = _build(spec, model)
    split = split_params(model, "paper")
    chosen = [_lr_of(opt, p) for _, p in split.transformed]
    rest = [_lr_of(opt, p) for _, p in split.regular]
    assert chosen == pytest.approx([LR * ALPHA] * len(chosen), rel=1e-6)  # torchao keeps lr in float32
    assert rest == pytest.approx([LR] * len(rest), rel=1e-6)


def test_galore_takes_alpha_as_its_own_scale_on_the_projected_weights():
    model = _model()
    opt = _build("galore:rank=8:update_proj_gap=50", model)
    projected = next(g for g in opt.param_groups if "rank" in g)
    assert projected["scale"] == ALPHA and projected["rank"] == 8 and projected["update_proj_gap"] == 50
    chosen = {id(p) for _, p in split_params(model, "paper").transformed}
    assert {id(p) for p in projected["params"]} == chosen
    assert all(g["lr"] == LR for g in opt.param_groups)


def test_muon_is_one_optimizer_with_adamw_for_non_matrices():
    model = _model()
    opt = _build("muon", model)
    assert set(opt.optimizers) == {"muon", "adamw"}
    muon_params = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    assert all(p.ndim == 2 for p in model.parameters() if id(p) in muon_params)
    assert id(model.model.embed_tokens.weight) not in muon_params and id(model.lm_head.weight) not in muon_params
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    x = torch.randint(0, 128, (2, 16))
    _step(model, opt, x)
    assert len(opt.state) == len(list(model.parameters()))  # the union of both states
    for g in opt.param_groups:  # a scheduler acting on the chain acts on the inner optimizers
        g["lr"] = 0.5
    assert all(g["lr"] == 0.5 for o in opt.optimizers.values() for g in o.param_groups)


def test_missing_peer_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "galore_torch", None)  # import fails as if not installed
    with pytest.raises(MissingDependency, match=r"gwt-optim\[peers\]"):
        _build("galore", _model())


def test_unknown_option_is_rejected():
    with pytest.raises(ValueError, match="unknown option"):
        _build("galore:rnak=8", _model())
