"""The transfer rule (``match_rms``, :func:`gwt_optim.optim.functional.match_row_rms`):
each row of a GWT step rescaled to the RMS of Adam's update on the
approximation coefficients, so that AdamW's learning rate carries over.

The float64 oracle and the eager path's equality to the function are in
tests/test_functional.py; here, the property the rule exists for (AdamW's
update RMS in both synthetic limits, every level, with and without the clip,
where the paper's update is 0.3x to 140x off), its routing and its saved form.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon
from gwt_optim.optim import functional as F


def _update_rms(grads, *, level, clip, match_rms, steps_averaged=10):
    """Mean RMS of the last steps' updates at lr 1, alpha 1, no limiter (AdamW at level 0)."""
    W = torch.zeros(grads[0].shape, dtype=torch.float64)
    n = W.shape[-1]
    shape = (*W.shape[:-1], -(-n // (1 << level)))
    M, V = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    rms = []
    for t, G in enumerate(grads, 1):
        before = W.clone()
        F.gwt_adamw(W, G, M, V, None, step=t, lr=1.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                    level=level, alpha=1.0, gamma=None, detail_clip=clip, match_rms=match_rms)
        rms.append((before - W).square().mean().sqrt().item())
    return sum(rms[-steps_averaged:]) / steps_averaged


def _limits(steps=60):
    gen = torch.Generator().manual_seed(0)
    noise = [torch.randn(32, 128, generator=gen, dtype=torch.float64) for _ in range(steps)]
    signal = [torch.randn(32, 128, generator=gen, dtype=torch.float64)] * steps
    return {"noise": noise, "signal": signal}


LIMITS = _limits()


@pytest.mark.parametrize("limit", ["noise", "signal"])
@pytest.mark.parametrize("level", [1, 2, 3, 4])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_the_rule_gives_adamws_update_rms_in_both_limits(limit, level, clip):
    grads = LIMITS[limit]
    adamw = _update_rms(grads, level=0, clip=None, match_rms=False)
    ratio = _update_rms(grads, level=level, clip=clip, match_rms=True) / adamw
    assert abs(ratio - 1) < 0.03, ratio
    paper = _update_rms(grads, level=level, clip=clip, match_rms=False) / adamw
    # What the rule corrects: without it the step's size depends on the limit, the level and the clip.
    assert abs(paper - 1) > 0.05, paper


def test_every_row_of_the_step_has_the_rms_of_us_row_over_r():
    gen = torch.Generator().manual_seed(1)
    G = torch.randn(6, 3, 40, generator=gen, dtype=torch.float64)
    A = F.haar_approx(G, 2)
    U = torch.randn(A.shape, generator=gen, dtype=torch.float64)
    den = torch.rand(A.shape, generator=gen, dtype=torch.float64) + 0.1
    r = 1.7
    delta = F.direction(G, A, U, den, r, 0.5, 2, clip=0.5, match_rms=True)
    rms = lambda x: x.square().mean(-1).sqrt()  # noqa: E731
    torch.testing.assert_close(rms(delta), rms(U) * 0.5 / r, rtol=1e-12, atol=0)
    assert torch.equal(F.direction(G, G, U[..., :1].expand(6, 3, 40).clone(), den[..., :1], r, 0.5, 0, match_rms=True),
                       F.direction(G, G, U[..., :1].expand(6, 3, 40).clone(), den[..., :1], r, 0.5, 0))


def test_level_zero_and_vectors_are_plain_adamw_with_the_rule_on():
    gen = torch.Generator().manual_seed(2)
    shapes = [(8, 16), (16,)]
    W0 = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    out = []
    for match_rms in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in W0]
        opt = GWTAdamW([{"params": params[:1], "level": 0}, {"params": params[1:]}], lr=0.01, match_rms=match_rms)
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        out.append(params)
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_no_kernel_has_the_rule_yet_so_its_matrices_step_eagerly():
    from gwt_optim.optim._backends import choose

    w, b = torch.nn.Parameter(torch.randn(8, 32)), torch.nn.Parameter(torch.randn(8))
    opt = GWTAdamW([w, b], lr=0.01, match_rms=True)
    group = opt.param_groups[0]

    def backend(o, p):
        g = o.param_groups[0]
        route = choose(o._kernels, g, p, torch.randn(p.shape), False, o._limiter_enabled(g, p.ndim >= 2))
        return getattr(route.backend, "name", None)

    assert backend(opt, w) is None  # the family's eager halves
    assert backend(opt, b) == "fused_adamw"  # level 0: the rule changes nothing
    plain = GWTAdamW([w], lr=0.01)
    assert backend(plain, w) == "native"


@pytest.mark.parametrize("rule", ["match_rms", "adamw_units"])
@pytest.mark.parametrize("cls", [GWTAdamW, GWTAdamMini, GWTAdafactor])
def test_a_state_dict_from_before_the_rule_keeps_the_papers_step(cls, rule):
    w = torch.nn.Parameter(torch.randn(8, 32))
    opt = cls([w], lr=0.01)
    w.grad = torch.randn(8, 32)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        del g[rule]
    new = cls([w], lr=0.01, **{rule: True})
    new.load_state_dict(sd)
    assert new.param_groups[0][rule] is False


def test_bad_values_and_muon_groups_are_value_errors():
    w = torch.nn.Parameter(torch.randn(8, 32))
    with pytest.raises(ValueError, match="match_rms"):
        GWTAdamW([w], match_rms="yes")
    with pytest.raises(ValueError, match="match_rms_adamw"):
        GWTMuon([{"params": [w], "match_rms": True}])
    GWTMuon([{"params": [w], "use_muon": False, "match_rms": True}])  # its AdamW groups take it


def test_the_registry_spec_sets_the_rule_on_the_transformed_matrices():
    from transformers import LlamaConfig, LlamaForCausalLM

    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer, parse_optimizer_arg

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                         num_hidden_layers=1, vocab_size=64, max_position_embeddings=32))
    for spec in ("gwt-adamw:match_rms=true", "gwt-adam-mini:match_rms=true", "gwt-adafactor:match_rms=true"):
        name, opts = parse_optimizer_arg(spec)
        opt = build_optimizer(name, model, OptimizerConfig(lr=1e-3, options=opts))
        flags = {g["level"] > 0: g["match_rms"] for g in opt.param_groups}
        assert flags[True] is True, spec
    name, opts = parse_optimizer_arg("gwt-adamw")
    opt = build_optimizer(name, model, OptimizerConfig(lr=1e-3, options=opts))
    assert not any(g["match_rms"] for g in opt.param_groups)


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


# ------------------- adamw_units: the approximation's part at AdamW's size --- #


def _step(W, G, M, V, t, *, level, clip, units, impl="fast", eps=0.0):
    F.gwt_adamw(W, G, M, V, None, step=t, lr=1.0, beta1=0.9, beta2=0.999, eps=eps, weight_decay=0.0, level=level,
                alpha=1.0, gamma=None, detail_clip=clip, impl=impl, adamw_units=units)


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_adamw_units_is_adamw_on_a_block_constant_gradient(level, clip, impl):
    """What the gain is for: a gradient constant over each block has no details, and with eps 0 its step
    is AdamW's exactly (float64), where the paper's is 2^(-l/2) of it."""
    gen = torch.Generator().manual_seed(level)
    n, b = 48, 1 << level
    shape = (5, -(-n // b))
    M, V = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    W = torch.zeros(5, n, dtype=torch.float64)
    ref = torch.zeros(5, n, dtype=torch.float64, requires_grad=True)
    adamw = torch.optim.AdamW([ref], lr=1.0, eps=0.0, weight_decay=0.0)
    for t in range(1, 5):
        G = torch.randn(shape, generator=gen, dtype=torch.float64).repeat_interleave(b, -1)[:, :n]
        _step(W, G, M, V, t, level=level, clip=clip, units=True, impl=impl)
        ref.grad = G.clone()
        adamw.step()
    torch.testing.assert_close(W, ref.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_adamw_units_adds_the_gain_to_us_part_only(level, clip):
    """Against the paper's step on the same moments: the difference is (2^(l/2) - 1) U 2^(-l/2) per entry of
    its block, the details untouched (and still clipped in the block denominator's units)."""
    gen = torch.Generator().manual_seed(10 + level)
    G = torch.randn(4, 3, 40, generator=gen, dtype=torch.float64)
    A = F.haar_approx(G, level)
    U = torch.randn(A.shape, generator=gen, dtype=torch.float64)
    den = torch.rand(A.shape, generator=gen, dtype=torch.float64) + 0.1
    for coeffs in (None, F.transform(G, level, "reference")[1]):
        units = F.direction(G, A, U, den, 1.3, 0.7, level, clip, coeffs, adamw_units=True)
        paper = F.direction(G, A, U, den, 1.3, 0.7, level, clip, coeffs)
        extra = (U * ((1 - 2.0 ** (-level / 2)) * 0.7 / 1.3)).repeat_interleave(1 << level, -1)[..., :40]
        torch.testing.assert_close(units - paper, extra, rtol=1e-10, atol=1e-12)


def test_adamw_units_routes_groups_takes_specs_and_refuses_muon_groups():
    from transformers import LlamaConfig, LlamaForCausalLM

    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer, parse_optimizer_arg

    w = torch.nn.Parameter(torch.randn(8, 32))
    with pytest.raises(ValueError, match="adamw_units"):
        GWTAdamW([w], adamw_units=1)
    with pytest.raises(ValueError, match="match_rms_adamw"):
        GWTMuon([{"params": [w], "adamw_units": True}])
    GWTMuon([{"params": [w], "use_muon": False, "adamw_units": True}])
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                         num_hidden_layers=1, vocab_size=64, max_position_embeddings=32))
    for spec in ("gwt-adamw:adamw_units=true", "gwt-adam-mini:adamw_units=true", "gwt-adafactor:adamw_units=true"):
        name, opts = parse_optimizer_arg(spec)
        opt = build_optimizer(name, model, OptimizerConfig(lr=1e-3, options=opts))
        assert {g["level"] > 0: g["adamw_units"] for g in opt.param_groups}[True] is True, spec


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
