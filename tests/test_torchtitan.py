"""torchtitan 0.3.0's optimizer container with the GWT optimizers, on CPU.

What torchtitan does with an optimizer, through its own code
(``torchtitan.components.optimizer``): a ``ParamGroupConfig`` per group, the
``implementation``'s ``fused``/``foreach`` and ``param_names`` in every group,
one optimizer per name; the zero-gradient, zero-lr step it takes before a
state dict is read or loaded; its FQN-keyed flat state dict; and a DCP save
and load of the container (2 processes, gloo, FSDP2), resumed bitwise. The
trainer itself (CUDA by default, models, data) is not run here
(docs/scaling-out.md says what was not).

The oracles: the same GWT optimizer built directly (bitwise), and torch's
AdamW in the same container, which GWT-AdamW at level 0, alpha 1 without the
limiter equals to fp32 rounding.
"""

from __future__ import annotations

import copy
import inspect
import os
import re
from pathlib import Path

import pytest
import torch
from _launch import launch

pytest.importorskip("torchtitan.components.optimizer",
                    reason="torchtitan (with tyro, spmd_types) is not installed; scripts/setup.sh installs 0.3.0")

from torchtitan.components.optimizer import ParamGroupConfig  # noqa: E402

import gwt_optim.optim  # noqa: E402
from gwt_optim import GWTAdamW  # noqa: E402
from gwt_optim.integrations.torchtitan import GWTOptimizersContainer  # noqa: E402

MATRICES = r"\.(wq|wo|w1)\.weight$"  # the transformed weights (attention and MLP), as the paper's split
WORLD = 2
FAMILIES = [getattr(gwt_optim.optim, name) for name in gwt_optim.optim.__all__]
# GWT-AdamW has fused kernels; the others run their eager step.
EAGER_FAMILIES = [cls for cls in FAMILIES if cls is not GWTAdamW]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wo, self.w1 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 12)
        self.norm = torch.nn.LayerNorm(12)

    def forward(self, x):
        return self.norm(self.w1(torch.tanh(self.wo(torch.tanh(self.wq(x))))))


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), torch.nn.Linear(12, 4)).double()


def batch(t):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)


def gwt_config(name="GWTAdamW", implementation="fused", **matrix_kwargs):
    """Two groups: the matrices transformed (level 2), the rest plain (in
    GWT-Muon's AdamW groups)."""
    common = {"lr": 1e-2, "weight_decay": 0.1}
    rest = {**common, "level": 0}
    if "use_muon" in inspect.signature(getattr(gwt_optim.optim, name)).parameters:
        rest["use_muon"] = False
    return GWTOptimizersContainer.Config(
        implementation=implementation,
        param_groups=[
            ParamGroupConfig(pattern=MATRICES, optimizer_name=name,
                             optimizer_kwargs={**common, "level": 2, **matrix_kwargs}),
            ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=rest),
        ],
    )


def train(model, step, steps, first=0):
    for t in range(first, first + steps):
        x, y = batch(t)
        for p in model.parameters():
            p.grad = None
        torch.nn.functional.mse_loss(model(x), y).backward()
        step()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def direct(cls, model, config, **kwargs):
    """The optimizer the container builds, built by hand: the same groups, without torchtitan."""
    named = dict(model.named_parameters())
    groups, claimed = [], set()
    for pg in config.param_groups:
        names = [n for n in named if n not in claimed and re.search(pg.pattern, n)]
        claimed.update(names)
        groups.append({"params": [named[n] for n in names], **pg.optimizer_kwargs})
    return cls(groups, **kwargs)


# ------------------------------------------------------ the container --- #


@pytest.mark.parametrize("implementation,backend",
                         [("fused", "auto"), ("fused_opt_states_bf16", "auto"), ("for-loop", "eager")])
def test_gwt_adamw_in_the_container_steps_as_built_directly(implementation, backend):
    config = gwt_config(implementation=implementation)
    model = make_model()
    container = config.build(model_parts=[model])
    (opt,) = container.optimizers
    assert type(opt) is GWTAdamW and opt._backend == backend
    # torchtitan's keys ride in every group, and GWT holds them to its rule.
    assert all("param_names" in g and g["fused"] == (backend == "auto") for g in opt.param_groups)
    assert opt._strict == (backend == "auto")
    assert opt.param_groups[0]["param_names"] == ["0.wq.weight", "0.wo.weight", "0.w1.weight"]
    train(model, container.step, 3)

    oracle_model = make_model()
    oracle = direct(GWTAdamW, oracle_model, config, backend=backend)
    train(oracle_model, oracle.step, 3)
    for a, b in zip(params_of(model), params_of(oracle_model)):
        assert torch.equal(a, b)
    # torchtitan's bf16-state hook is for its own Adam/AdamW: GWT's moments stay in the compute dtype.
    assert all(st["exp_avg"].dtype == torch.float64 for st in opt.state.values())


@pytest.mark.parametrize("cls", EAGER_FAMILIES, ids=lambda c: c.__name__)
def test_families_without_kernels_take_the_for_loop_and_refuse_fused(cls):
    with pytest.raises(ValueError, match=f"{cls.__name__}: fused=True cannot hold: .* no fused kernels"):
        gwt_config(cls.__name__, implementation="fused").build(model_parts=[make_model()])
    with pytest.raises(ValueError, match="no foreach"):
        gwt_config(cls.__name__, implementation="foreach").build(model_parts=[make_model()])
    model = make_model()
    container = gwt_config(cls.__name__, implementation="for-loop").build(model_parts=[model])
    assert type(container.optimizers[0]) is cls
    train(model, container.step, 2)
    oracle_model = make_model()
    oracle = direct(cls, oracle_model, gwt_config(cls.__name__))
    train(oracle_model, oracle.step, 2)
    for a, b in zip(params_of(model), params_of(oracle_model)):
        assert torch.equal(a, b)


def test_torchtitans_own_names_still_build():
    config = GWTOptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=MATRICES, optimizer_name="GWTAdamW", optimizer_kwargs={"lr": 1e-2}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2}),
    ])
    container = config.build(model_parts=[make_model()])
    assert sorted(type(o).__name__ for o in container.optimizers) == ["AdamW", "GWTAdamW"]


class LlamaLike(torch.nn.Module):
    """Llama 3's parameter names in torchtitan 0.3.0, at toy sizes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        lin = torch.nn.Linear
        self.tok_embeddings = torch.nn.Embedding(32, 16)
        layer = torch.nn.Module()
        layer.attention = torch.nn.Module()
        layer.attention.qkv_linear = torch.nn.Module()
        for name in ("wq", "wk", "wv"):
            setattr(layer.attention.qkv_linear, name, lin(16, 16, bias=False))
        layer.attention.wo = lin(16, 16, bias=False)
        layer.feed_forward = torch.nn.Module()
        layer.feed_forward.w1, layer.feed_forward.w3 = lin(16, 24, bias=False), lin(16, 24, bias=False)
        layer.feed_forward.w2 = lin(24, 16, bias=False)
        layer.attention_norm, layer.ffn_norm = torch.nn.RMSNorm(16), torch.nn.RMSNorm(16)
        self.layers = torch.nn.ModuleDict({"0": layer})
        self.norm, self.output = torch.nn.RMSNorm(16), lin(16, 32, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        layer = self.layers["0"]
        a = layer.attention_norm(h)
        q = layer.attention.qkv_linear
        h = h + layer.attention.wo(torch.tanh(q.wq(a) + q.wk(a) * q.wv(a)))
        f = layer.ffn_norm(h)
        h = h + layer.feed_forward.w2(torch.nn.functional.silu(layer.feed_forward.w1(f)) * layer.feed_forward.w3(f))
        return self.output(self.norm(h))


def test_the_documented_recipe_builds_and_trains():
    """docs/scaling-out.md's config, run as written, on Llama 3's parameter names."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "scaling-out.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "GWTOptimizersContainer.Config(" in b]
    scope: dict = {}
    exec(code, scope)
    model = LlamaLike()
    container = scope["optimizer"].build(model_parts=[model])
    (opt,) = container.optimizers
    transformed, plain = opt.param_groups
    assert sorted(transformed["param_names"]) == sorted(
        [f"layers.0.attention.qkv_linear.{n}.weight" for n in ("wq", "wk", "wv")]
        + ["layers.0.attention.wo.weight"] + [f"layers.0.feed_forward.w{i}.weight" for i in (1, 2, 3)])
    assert (transformed["level"], transformed["scale"], plain["level"]) == (2, 2.0, 0)
    assert "tok_embeddings.weight" in plain["param_names"] and "output.weight" in plain["param_names"]
    before = params_of(model)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    container.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, params_of(model)))


# -------------------------------------------- the zero-gradient init step --- #


@pytest.mark.parametrize("name", gwt_optim.optim.__all__)
def test_the_init_step_leaves_the_weights_as_they_were(name):
    model = make_model()
    before = params_of(model)
    container = gwt_config(name, implementation="fused" if name == GWTAdamW.__name__ else "for-loop").build(
        model_parts=[model])
    flat = container.state_dict()  # torchtitan's init_optim_state: zero gradients, lr 0, one step
    for a, b in zip(before, params_of(model)):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in model.parameters())
    assert [g["lr"] for g in container.optimizers[0].param_groups] == [1e-2, 1e-2]  # restored
    assert flat["param_groups.0.wq.weight.level"] == 2 and flat["param_groups.1.weight.level"] == 0
    assert float(flat["state.0.wq.weight.step"]) == 1


def test_after_the_init_step_gwt_adamw_at_level_0_trains_as_torchs_adamw():
    """The init step's bookkeeping (a step count of 1, zero moments, the
    limiter's norm 0) is what torch's AdamW gets from it too: from there,
    the two train alike."""
    plain = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)}
    results = []
    for name, kwargs in (("GWTAdamW", {**plain, "level": 0, "scale": 1.0, "norm_growth_limit": None}),
                         ("AdamW", plain)):
        model = make_model()
        container = GWTOptimizersContainer.Config(implementation="for-loop", param_groups=[
            ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=kwargs)]).build(model_parts=[model])
        container.state_dict()
        train(model, container.step, 4)
        results.append(params_of(model))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


# ------------------------------------------ the flat, FQN-keyed state dict --- #


def test_the_flat_state_dict_loads_into_a_fresh_container_and_training_continues_bitwise():
    model = make_model()
    container = gwt_config().build(model_parts=[model])
    train(model, container.step, 3)
    flat = copy.deepcopy(container.state_dict())
    assert flat["param_groups.0.wq.weight.optimizer"] == "GWTAdamW"
    assert tuple(flat["state.0.wq.weight.exp_avg"].shape) == (16, 4)  # A_2 of a 16-column weight

    model2 = make_model()
    model2.load_state_dict(model.state_dict())
    container2 = gwt_config().build(model_parts=[model2])
    container2.load_state_dict(flat)  # after torchtitan's own init step, as it loads
    (opt,), (opt2,) = container.optimizers, container2.optimizers
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[p2][k]), k
    train(model, container.step, 2, first=3)
    train(model2, container2.step, 2, first=3)
    for a, b in zip(params_of(model), params_of(model2)):
        assert torch.equal(a, b)


def test_a_flat_state_dict_from_before_a_hyperparameter_existed_loads_with_its_default():
    # torch's own load_state_dict fills a group key a checkpoint predates from the defaults; torchtitan's flat
    # loader raised KeyError for it (a GWT checkpoint written before detail_clip_units existed).
    model = make_model()
    container = gwt_config().build(model_parts=[model])
    train(model, container.step, 3)
    full = copy.deepcopy(container.state_dict())
    old = {k: v for k, v in full.items() if not k.endswith(".detail_clip_units")}
    assert len(old) < len(full)
    twins = []
    for flat in (full, old):
        twin = make_model()
        twin.load_state_dict(model.state_dict())
        loaded = gwt_config().build(model_parts=[twin])
        loaded.load_state_dict(copy.deepcopy(flat))  # loaded by reference: training would change `full`
        assert all(g["detail_clip_units"] == "stored" for g in loaded.optimizers[0].param_groups)
        train(twin, loaded.step, 2, first=3)
        twins.append(params_of(twin))
    for a, b in zip(*twins):
        assert torch.equal(a, b)
    # A group the checkpoint does not hold at all is still torchtitan's error, not filled in.
    with pytest.raises(KeyError, match="not found in checkpoint"):
        gwt_config().build(model_parts=[make_model()]).load_state_dict(
            {k: v for k, v in full.items() if ".wq.weight." not in k})


def test_a_flat_state_dict_of_another_family_is_refused_and_nothing_changes():
    """torchtitan rebuilds each group from the live optimizer's keys, so the
    family tag does not come back; the check of every saved state tensor
    refuses it instead."""
    model = make_model()
    other_family = "GWTAdamMini"
    container = gwt_config(other_family, implementation="for-loop").build(model_parts=[model])
    train(model, container.step, 1)
    flat = container.state_dict()
    other = gwt_config().build(model_parts=[make_model()])
    before = copy.deepcopy(other.optimizers[0].state_dict())
    # torchtitan unflattens Adam-mini's groups as GWT-AdamW's (the key Adam-mini lacks, detail_clip_units,
    # takes its default, as from a checkpoint that predates it): the check of every saved state tensor refuses them
    with pytest.raises(ValueError, match="GWTAdamW: parameter 0 of group 0 .* saved state"):
        other.load_state_dict(flat)
    after = other.optimizers[0].state_dict()
    assert all(torch.equal(v, after["state"][i][k]) for i, st in before["state"].items() for k, v in st.items())


# -------------------------------------------------- DCP, FSDP2, 2 ranks --- #

SAVE_AFTER, STEPS = 2, 4


def _dcp_worker(rank, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for resume in (False, True):
        model = make_model()
        for layer in (model[0].wq, model[0].wo, model[0].w1, model[1]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        container = gwt_config().build(model_parts=[model])
        first = 0
        if resume:
            # torchtitan's checkpointer: the container and the model as Stateful, loaded in place.
            state = {"model": model.state_dict(), "optimizer": container}
            dcp.load(state, checkpoint_id=os.path.join(out_dir, "dcp"))
            model.load_state_dict(state["model"])
            first = SAVE_AFTER
        for t in range(first, STEPS):
            if t == SAVE_AFTER and not resume:
                dcp.save({"model": model.state_dict(), "optimizer": container},
                         checkpoint_id=os.path.join(out_dir, "dcp"))
            x, y = batch(t)
            container.zero_grad()
            torch.nn.functional.mse_loss(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank]).backward()
            container.step()
        full = [p.full_tensor() for p in model.parameters()]
        w = model[0].wq.weight
        assert type(container.optimizers[0].state[w]["exp_avg"]).__name__ == "DTensor"
        if rank == 0:
            torch.save(full, os.path.join(out_dir, f"resumed-{resume}.pt"))


@pytest.mark.distributed
def test_dcp_save_and_load_of_the_container_on_fsdp2_resumes_bitwise(tmp_path):
    launch(_dcp_worker, WORLD, tmp_path, str(tmp_path))
    straight = torch.load(tmp_path / "resumed-False.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed-True.pt", weights_only=True)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
    model = make_model()
    assert not all(torch.equal(a, b) for a, b in zip(straight, params_of(model)))  # it trained
