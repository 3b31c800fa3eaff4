"""The transfer rule: alpha = 2^(l/2) (:func:`gwt_optim.groups.adamw_scale`), with which GWT-AdamW steps
a block-constant gradient exactly as AdamW at the same lr, so that AdamW's learning rate carries over
(measured in docs/results/transfer-cpu.md); the torch habit of a plain parameter list, said once; and the
two candidate rules that the study measured and removed (``match_rms``, ``adamw_units``): their saved
groups load while off and are refused while on.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW


# ------------------------ the recipe: alpha = 2^(l/2), AdamW's lr as it is --- #


def test_gwt_param_groups_default_alpha_is_adamw_scale():
    from gwt_optim.groups import adamw_scale, gwt_param_groups

    model = torch.nn.ModuleDict({"attn": torch.nn.Linear(16, 16), "embed": torch.nn.Embedding(10, 16)})
    for level, want in ((1, 2**0.5), (2, 2.0), (3, 2**1.5)):
        (gwt, plain) = gwt_param_groups(model, level=level).groups
        assert gwt["scale"] == adamw_scale(level) == pytest.approx(want) and plain["scale"] == 1.0
    assert gwt_param_groups(model, scale=0.25).groups[0]["scale"] == 0.25  # the paper's, when asked for


@pytest.mark.parametrize("level", [1, 2, 3])
def test_alpha_adamw_scale_steps_a_block_constant_gradient_as_adamw(level):
    """With alpha 2^(l/2) GWT-AdamW (the default clip) steps a gradient constant over each block exactly as
    AdamW at the same lr (eps 0, float64): what lets AdamW's lr carry over."""
    from gwt_optim.groups import adamw_scale

    gen = torch.Generator().manual_seed(20 + level)
    b, n = 1 << level, 64
    w = torch.nn.Parameter(torch.zeros(6, n, dtype=torch.float64))
    ref = torch.nn.Parameter(torch.zeros(6, n, dtype=torch.float64))
    opt = GWTAdamW([w], lr=1e-2, eps=0.0, level=level, scale=adamw_scale(level), norm_growth_limit=None)
    adamw = torch.optim.AdamW([ref], lr=1e-2, eps=0.0, weight_decay=0.0)
    for _ in range(4):
        g = torch.randn(6, n // b, generator=gen, dtype=torch.float64).repeat_interleave(b, -1)
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-12, atol=1e-14)


# ------------------------------------------- the torch habit, said once --- #


def test_a_plain_parameter_list_says_once_what_it_transforms(monkeypatch):
    import warnings

    from gwt_optim.optim import _advice

    monkeypatch.setattr(_advice, "_said_flat", False)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 16))
    with pytest.warns(UserWarning, match=r"transforms all 2 tensors .*embeddings and output head included.*"
                                         r"gwt_param_groups\(model\)") as caught:
        opt = GWTAdamW(model.parameters(), lr=1e-3)  # a generator: read once, every tensor kept
    assert caught[0].filename == __file__  # it points at the user's line
    assert len(opt.param_groups[0]["params"]) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GWTAdamW(model.parameters(), lr=1e-3)  # once per process
        monkeypatch.setattr(_advice, "_said_flat", False)
        GWTAdamW([{"params": list(model.parameters())}], lr=1e-3)  # groups: the user chose
        GWTAdamW(model.parameters(), lr=1e-3, level=0)  # nothing is transformed
        GWTAdamW([model[1].bias], lr=1e-3)  # vectors only
    assert _advice._said_flat is False


# --------------------------- the removed candidates: match_rms, adamw_units --- #


@pytest.mark.parametrize("rule", ["match_rms", "adamw_units"])
@pytest.mark.parametrize("cls", [GWTAdamW, GWTAdamMini, GWTAdafactor])
def test_a_state_dict_saved_with_a_removed_rule_loads_when_off_and_is_refused_when_on(cls, rule):
    w = torch.nn.Parameter(torch.randn(8, 32))
    opt = cls([w], lr=0.01)
    w.grad = torch.randn(8, 32)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        g[rule] = False  # as every version with the option saved it
    new = cls([w], lr=0.01)
    new.load_state_dict(sd)
    assert rule not in new.param_groups[0]
    assert new.state_dict()["param_groups"][0].keys() == opt.state_dict()["param_groups"][0].keys()
    sd["param_groups"][0][rule] = True
    before = copy.deepcopy(new.state_dict())
    with pytest.raises(ValueError, match=f"{rule}=True, a transfer rule removed"):
        new.load_state_dict(sd)
    after = new.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][0][k], v) for k, v in before["state"][0].items())


@pytest.mark.parametrize("rule", ["match_rms", "adamw_units"])
def test_a_removed_rule_is_an_error_as_an_argument_and_in_a_spec(rule):
    from gwt_optim.toolkit.registry import parse_optimizer_arg

    with pytest.raises(TypeError, match=rule):
        GWTAdamW([torch.nn.Parameter(torch.randn(4, 8))], **{rule: True})
    with pytest.raises(ValueError, match=rule):
        parse_optimizer_arg(f"gwt-adamw:{rule}=true")
