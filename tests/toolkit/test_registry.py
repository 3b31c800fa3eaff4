"""The optimizer registry: options are checked up front against what each
entry declares, and ``regular_lr`` gives every contender the same AdamW lr on
the parameters outside the attention and MLP matrices (matrix-only fairness)."""

from __future__ import annotations

import pytest
import torch

from gwt_optim.groups import split_params
from gwt_optim.toolkit.registry import (
    REGISTRY,
    MissingDependency,
    OptimizerConfig,
    build_optimizer,
    parse_optimizer_arg,
    validate_optimizer_spec,
)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=1,
                      vocab_size=64, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _build(spec: str, model, **kw):
    name, opts = parse_optimizer_arg(spec)
    return build_optimizer(name, model, OptimizerConfig(options=opts, **kw))


@pytest.mark.parametrize("spec,message", [
    ("gwt-adamw:levle=2", "unknown option.*levle"),
    ("gwt-adamw:level=abc", "level=.abc. must be an integer"),
    ("gwt-adamw:level=2.5", "must be an integer"),
    ("adamw:lr=fast", "lr=.fast. must be a number"),
    ("galore:rank=big", "rank"),
    ("nosuch", "unknown optimizer"),
    ("adamw:lr", "expected key=value"),
    ("muon:nesterov=3", "true or false"),
])
def test_bad_specs_fail_before_anything_is_built(spec, message):
    with pytest.raises(ValueError, match=message):
        validate_optimizer_spec(spec)


def test_every_entry_builds_with_its_declared_defaults():
    """No declared option is left unread and no default is declared twice."""
    model = _model()
    for name in sorted(REGISTRY):
        if name.startswith("torchao"):
            continue  # torch.compile'd step; built in test_pretrain_peers
        try:
            opt = _build(name, model, lr=1e-3, scale=0.25)
        except MissingDependency:
            continue
        assert isinstance(opt, torch.optim.Optimizer), name


def test_gwt_options_reach_the_groups():
    model = _model()
    opt = _build("gwt-adamw:level=3:detail_clip=0.5:backend=eager:eps=1e-6", model, lr=1e-3)
    gwt = next(g for g in opt.param_groups if g["level"] > 0)
    assert (gwt["level"], gwt["detail_clip"], gwt["eps"]) == (3, 0.5, 1e-6)
    assert opt._backend == "eager"
    plain = next(g for g in opt.param_groups if g["level"] == 0)
    assert plain["detail_clip"] is None or plain["level"] == 0


FAIR = ["adamw", "gwt-adamw:level=2", "gwt-muon:level=2", "galore:rank=8", "adam8bit", "muon",
        "gwt-adafactor:level=2", "adam-mini"]


@pytest.mark.parametrize("spec", FAIR)
def test_regular_lr_sets_the_lr_of_everything_outside_the_matrices(spec):
    model = _model()
    try:
        opt = _build(spec, model, lr=2e-3, scale=1.0, regular_lr=7e-4)
    except MissingDependency:
        pytest.skip("peer not installed")
    matrices = {id(p) for _, p in split_params(model, "paper").transformed}
    seen = 0
    for group in opt.param_groups:
        for p in group["params"]:
            seen += 1
            if id(p) in matrices:
                assert group["lr"] == pytest.approx(2e-3), spec
            else:
                assert group["lr"] == pytest.approx(7e-4), spec
    assert seen == sum(1 for p in model.parameters() if p.requires_grad)


def test_regular_lr_is_a_shared_option_in_a_spec():
    model = _model()
    opt = _build("adamw:lr=1e-2:regular_lr=1e-3", model)
    lrs = sorted({g["lr"] for g in opt.param_groups})
    assert lrs == [1e-3, 1e-2]


def test_a_spec_eps_changes_the_matrices_only_under_regular_lr():
    model = _model()
    opt = _build("gwt-adamw:level=2:eps=1e-6", model, lr=1e-3, eps=1e-8, regular_lr=1e-3)
    eps = {g["level"]: g["eps"] for g in opt.param_groups}
    assert eps == {2: 1e-6, 0: 1e-8}


# ------------- the recipe: scale None gives every entry AdamW's lr units (issue 46) ------------- #


@pytest.mark.parametrize("spec,want", [
    ("gwt-adamw:level=1", 2**0.5), ("gwt-adamw", 2.0), ("gwt-adamw:level=3", 2**1.5), ("gwt-muon:level=2", 2.0),
    ("gwt-adam-mini:level=2", 2.0), ("gwt-adafactor:level=3", 2**1.5), ("adamw", 1.0), ("muon", 1.0),
    ("galore:rank=8", 1.0), ("adam-mini", 1.0),
])
def test_recipe_scale_is_adamw_scale_for_a_gwt_family_and_1_otherwise(spec, want):
    from gwt_optim.groups import adamw_scale
    from gwt_optim.toolkit.registry import recipe_scale

    name, opts = parse_optimizer_arg(spec)
    assert recipe_scale(name, opts) == pytest.approx(want)
    if name.startswith("gwt-"):
        assert recipe_scale(name, opts) == adamw_scale(opts.get("level", 2))


def test_build_optimizer_applies_the_recipe_unless_a_scale_is_given():
    model = _model()
    matrices = {id(p) for _, p in split_params(model, "paper").transformed}

    def transformed(opt):
        return next(g for g in opt.param_groups if any(id(p) in matrices for p in g["params"]))

    assert transformed(_build("gwt-adamw:level=3", model, lr=1e-3))["scale"] == pytest.approx(2**1.5)
    assert transformed(_build("adamw", model, lr=1e-3))["lr"] == 1e-3  # AdamW at alpha 1: its lr as it is
    assert transformed(_build("gwt-adamw", model, lr=1e-3, scale=1.0))["scale"] == 1.0
    assert transformed(_build("gwt-adamw:scale=0.25", model, lr=1e-3))["scale"] == 0.25
    assert transformed(_build("adamw", model, lr=1e-3, scale=0.5))["lr"] == pytest.approx(5e-4)


def test_every_toolkit_command_defaults_to_the_recipe():
    """pretrain, compare, finetune lm and finetune glue leave alpha to the recipe, and a pretrain run records the
    alpha it resolved to."""
    from gwt_optim.toolkit.finetune.glue_train import GlueSettings
    from gwt_optim.toolkit.finetune.lm_train import LMSettings
    from gwt_optim.toolkit.recipes import DEMO
    from gwt_optim.toolkit.train import TrainConfig, build_optimizer_for

    assert TrainConfig().scale is None and DEMO["scale"] is None
    assert LMSettings().scale is None and GlueSettings().scale is None
    model = _model()
    for spec, want in (("gwt-adamw:level=2", 2.0), ("adamw", 1.0), ("gwt-muon:level=1", 2**0.5)):
        _, resolved = build_optimizer_for(model, TrainConfig(optimizer=spec).validate())
        assert resolved["scale"] == pytest.approx(want), spec
    _, resolved = build_optimizer_for(model, TrainConfig(optimizer="gwt-adamw", scale=1.0).validate())
    assert resolved["scale"] == 1.0


def test_gwt_adafactor_takes_the_lr_in_adamws_units_in_the_toolkit():
    """The registry's gwt-adafactor steps by the lr itself (relative_step=False), as every toolkit lr is AdamW's;
    the class keeps torch's relative step, and a spec asks for it by name."""
    from gwt_optim.optim import GWTAdafactor
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer, parse_optimizer_arg

    model = _model()
    for spec, want in (("gwt-adafactor", False), ("gwt-adafactor:relative_step=true", True)):
        name, opts = parse_optimizer_arg(spec)
        opt = build_optimizer(name, model, OptimizerConfig(lr=1e-3, options=opts))
        assert {g["relative_step"] for g in opt.param_groups} == {want}, spec
    assert GWTAdafactor([torch.nn.Parameter(torch.zeros(4, 8))]).defaults["relative_step"] is True
