"""docs/architecture.md's recipes, held to the code.

"How to add a family" is followed once with a toy family, GWT-SGD (heavy-ball
momentum on the approximation coefficients): written here as the recipe's
step 1 says, registered as step 4 says, given a memory estimator as step 5
says, and checked for what the recipe promises. Steps that edit files a test
cannot edit are checked the other way round: every file that lists the GWT
families or the peers must be named in its recipe, so a new list of names
fails here until the recipe names it.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from gwt_optim.optim import functional as F
from gwt_optim.optim._base import GWTOptimizer

ROOT = Path(__file__).resolve().parents[1]
ARCH = ROOT / "docs" / "architecture.md"


# ----------------------------------------------------------------------------- step 1: the family


class GWTSGD(GWTOptimizer):
    """SGD with heavy-ball momentum, B <- mu B + A_l, stepping along U = B with
    the details un-normalized (den = None). At level 0 with alpha 1, the limiter
    off and no weight decay this is ``torch.optim.SGD(momentum=mu)``."""

    _family = "GWTSGD"

    def __init__(self, params, lr=1e-2, momentum=0.9, weight_decay=0.0, level=2, wavelet="haar", scale=0.25,
                 norm_growth_limit=1.01, *, detail_clip=None, moment_dtype=None, impl="fast"):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, level=level, wavelet=wavelet,
                        scale=scale, norm_growth_limit=norm_growth_limit, detail_clip=detail_clip,
                        moment_dtype=moment_dtype)
        super().__init__(params, defaults, impl=impl)

    def _validate_family(self, group):
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"Invalid momentum: {group['momentum']} (must be in [0, 1))")

    def _init_family_state(self, group, state, approx, moment_dtype, transformed):
        state["momentum_buffer"] = torch.zeros_like(approx, dtype=moment_dtype, memory_format=torch.contiguous_format)

    # The recipe puts the halves in functional.py (gwt_sgd_moments, gwt_sgd_apply); a test
    # cannot edit it, so the toy states them here from functional's shared pieces.
    def _moments(self, group, state, W, G, step):
        G, A, coeffs, level = F.start(W, G, group["level"], self._impl, group["wavelet"])
        B = state["momentum_buffer"]
        b = B.to(A.dtype).mul_(group["momentum"]).add_(A)  # torch SGD's order: bit-equal at level 0
        if b is not B:  # low-precision buffer: update in the compute dtype, store once
            B.copy_(b)
        return F.Moments(G, A, b, None, coeffs, level)

    def _apply(self, group, W, m, r, step):
        lr = group["lr"]
        F.finish(W, m, r, lr=lr, weight_decay=group["weight_decay"], step_size=lr, alpha=group["scale"],
                 detail_clip=group["detail_clip"])


# ----------------------------------------------------------------------------- step 4: the registry


def _gwt_sgd_factory(model, cfg):
    from gwt_optim.groups import gwt_param_groups
    from gwt_optim.toolkit.registry import gwt_group_options

    split = gwt_param_groups(
        model, cfg.recipe, scale=cfg.scale, target_modules=cfg.target_modules,
        regular_options=cfg.regular_options(eps=False), **gwt_group_options(cfg),
    )
    return GWTSGD(list(split), lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.pop("momentum"),
                  impl=cfg.pop("impl"), moment_dtype=cfg.pop("moment_dtype"))


@pytest.fixture
def gwt_sgd():
    """``gwt-sgd`` in the registry for one test only (the registry is process-wide)."""
    from gwt_optim.toolkit import registry

    registry.register("gwt-sgd", help="GWT-SGD: momentum on Haar approximation coefficients (test toy)",
                      options={**registry.GWT_OPTIONS, "momentum": 0.9})(_gwt_sgd_factory)
    try:
        yield "gwt-sgd"
    finally:
        registry.REGISTRY.pop("gwt-sgd", None)


class TinyLM(nn.Module):
    """Named so that the paper recipe transforms ``attn`` and ``mlp`` and leaves the rest plain."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.Linear(dim, dim)
        self.mlp = nn.Linear(dim, 2 * dim)
        self.head = nn.Linear(2 * dim, vocab)

    def forward(self, x):
        h = self.embed(x)
        h = h + torch.tanh(self.attn(h))
        return self.head(torch.relu(self.mlp(h)))


def _model(seed=0):
    torch.manual_seed(seed)
    return TinyLM()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (8, 12), generator=g), torch.randint(0, 32, (8, 12), generator=g)


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _train(model, opt, steps, batch=None):
    batch = batch or _batch()
    losses = []
    for _ in range(steps):
        loss = _loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _build(spec, model, **config):
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer, parse_optimizer_arg

    name, opts = parse_optimizer_arg(spec)
    return build_optimizer(name, model, OptimizerConfig(options=opts, **config))


# ----------------------------------------------------------------------------- what the recipe promises


def test_the_toy_family_builds_from_a_spec_and_trains(gwt_sgd):
    model = _model()
    opt = _build(f"{gwt_sgd}:level=2:momentum=0.9:lr=0.5", model, scale=0.5)
    assert type(opt) is GWTSGD
    by_level = {g["level"]: g for g in opt.param_groups}
    assert set(by_level) == {0, 2}
    assert {id(p) for p in by_level[2]["params"]} == {id(model.attn.weight), id(model.mlp.weight)}
    assert by_level[2]["scale"] == 0.5 and by_level[0]["scale"] == 1.0 and by_level[0]["lr"] == 0.5
    losses = _train(model, opt, 30)
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses
    # Only the approximation coefficients keep momentum: 16 x 16 at level 2 -> 16 x 4.
    assert opt.state[model.attn.weight]["momentum_buffer"].shape == (16, 4)
    assert opt.state[model.embed.weight]["momentum_buffer"].shape == model.embed.weight.shape


def test_the_toy_familys_options_are_checked_before_anything_trains(gwt_sgd):
    from gwt_optim.toolkit.registry import validate_optimizer_spec

    with pytest.raises(ValueError, match="unknown option.*momentom"):
        validate_optimizer_spec(f"{gwt_sgd}:momentom=0.9")
    with pytest.raises(ValueError, match="momentum=.fast. must be a number"):
        validate_optimizer_spec(f"{gwt_sgd}:momentum=fast")
    with pytest.raises(ValueError, match="Invalid momentum: 1.5"):
        _build(f"{gwt_sgd}:momentum=1.5", _model())


def test_the_toy_familys_state_round_trips_bit_exactly(gwt_sgd):
    spec = f"{gwt_sgd}:level=2:lr=0.05"
    model = _model()
    opt = _build(spec, model)
    _train(model, opt, 3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert {g["optimizer"] for g in saved["param_groups"]} == {"GWTSGD"}

    twin = _model()
    twin.load_state_dict(model.state_dict())
    opt2 = _build(spec, twin)
    opt2.load_state_dict(saved)
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert a.keys() == b.keys()
    for pid in a:
        assert a[pid].keys() == b[pid].keys()
        for key in a[pid]:
            assert a[pid][key].dtype == b[pid][key].dtype and torch.equal(a[pid][key], b[pid][key]), (pid, key)
    # Resumed and uninterrupted training stay bit-equal.
    _train(model, opt, 2)
    _train(twin, opt2, 2)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_at_level_0_the_toy_family_is_torch_sgd(gwt_sgd):
    model, ref = _model(), _model()
    opt = _build(f"{gwt_sgd}:level=0:norm_growth_limit=none:momentum=0.9:lr=0.05", model)  # scale 1
    sgd = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ours, theirs = _train(model, opt, 5), _train(ref, sgd, 5)
    assert ours == theirs
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_the_toy_familys_fast_path_equals_its_reference_path(gwt_sgd):
    outs = []
    for impl in ("fast", "reference"):
        model = _model()
        _train(model, _build(f"{gwt_sgd}:level=2:impl={impl}:lr=0.05", model), 4)
        outs.append([p.detach() for p in model.parameters()])
    for fast, reference in zip(*outs):
        torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-6)


def test_another_familys_state_is_refused_by_name(gwt_sgd):
    from gwt_optim import GWTAdamW

    model = _model()
    adamw = GWTAdamW(model.parameters(), lr=1e-3, backend="eager")
    _train(model, adamw, 1)
    with pytest.raises(ValueError, match="saved by GWTAdamW; it cannot be loaded into GWTSGD"):
        GWTSGD(model.parameters()).load_state_dict(adamw.state_dict())
    toy = GWTSGD(model.parameters())
    _train(model, toy, 1)
    with pytest.raises(ValueError, match="saved by GWTSGD; it cannot be loaded into GWTAdamW"):
        GWTAdamW(model.parameters()).load_state_dict(toy.state_dict())


def test_step_5_an_estimator_predicts_the_toy_familys_state(gwt_sgd, monkeypatch):
    import importlib

    from gwt_optim.memory import optimizer_state_bytes
    from gwt_optim.wavelets import approx_length

    # By importlib: gwt_optim.memory.estimate is also the name of a function the package exports.
    estimate_module = importlib.import_module("gwt_optim.memory.estimate")

    def transformed(t, s):  # the buffer on A_l, the step, the limiter's norm
        return t.rows * approx_length(t.cols, s.level) * s.state_bytes + 4 + s.scalar_bytes

    def regular(t, s):  # level 0, no limiter
        return t.numel * s.state_bytes + 4

    monkeypatch.setitem(estimate_module.ESTIMATORS, gwt_sgd,
                        estimate_module.Estimator(transformed, regular, "GWT-SGD at level l", uses_level=True))
    for level in (1, 2, 3):
        model = _model()
        opt = _build(f"{gwt_sgd}:level={level}", model)
        _train(model, opt, 1)
        assert estimate_module.estimate(model, gwt_sgd, level=level).state_bytes == optimizer_state_bytes(opt)


# ----------------------------------------------------------------------------- the real families follow it


def test_every_family_is_tagged_registered_and_estimated():
    """Steps 2-6 for the families the package ships."""
    import gwt_optim
    from gwt_optim.memory import ALIASES, ESTIMATORS, TABLE_OPTIMIZERS
    from gwt_optim.optim._saved import shipped_families
    from gwt_optim.toolkit.registry import REGISTRY

    classes = {name: getattr(gwt_optim, name) for name in gwt_optim.optim.__all__}
    assert all(issubclass(cls, GWTOptimizer) and cls._family == name for name, cls in classes.items())
    assert set(shipped_families(GWTOptimizer)) == set(classes)
    gwt_names = {n for n in REGISTRY if n.startswith("gwt-")}
    assert len(gwt_names) == len(classes)
    assert gwt_names <= set(ESTIMATORS) | set(ALIASES)
    assert gwt_names <= set(TABLE_OPTIMIZERS)


# ----------------------------------------------------------------------------- the recipes name every list


def _section(title: str) -> str:
    text = ARCH.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


_PATH = re.compile(r"`((?:src|tests|docs|benchmarks|scripts)/[\w./-]+|README\.md|pyproject\.toml)`")
RECIPES = ("How to add a family", "How to add a peer", "How to add a subcommand")


def _named(title: str) -> set[str]:
    return set(_PATH.findall(_section(title)))


def _mentions(text: str, names) -> set[str]:
    return {n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)}


def _repository_files() -> list[Path]:
    globs = ("src/**/*.py", "src/**/*.c", "benchmarks/*", "tests/**/*.py", "docs/*.md", "scripts/*")
    files = {p for g in globs for p in ROOT.glob(g) if p.is_file() and "__pycache__" not in p.parts}
    files |= {ROOT / "README.md", ROOT / "pyproject.toml"}
    # This page and this test name every family on purpose.
    return sorted(files - {ARCH, Path(__file__).resolve()})


def _listing(names: set[str], at_least: int) -> set[str]:
    """Files that name at least ``at_least`` of ``names``: the lists a new name must join."""
    return {str(p.relative_to(ROOT)) for p in _repository_files()
            if len(_mentions(p.read_text(errors="replace"), names)) >= at_least}


@pytest.mark.parametrize("title", RECIPES)
def test_every_file_a_recipe_names_exists(title):
    named = _named(title)
    assert len(named) >= 3, named
    # NAME and CMD stand for the new family's or command's own files.
    missing = sorted(p for p in named if not re.search(r"NAME|CMD", p) and not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md '{title}' names files that do not exist: {missing}"


def test_the_family_recipe_names_every_file_that_lists_the_families():
    import gwt_optim
    from gwt_optim.toolkit.registry import REGISTRY

    classes = set(gwt_optim.optim.__all__)
    registry_names = {n for n in REGISTRY if n.startswith("gwt-")}
    assert len(classes) >= 4 and len(registry_names) >= 4
    lists = _listing(classes, 3) | _listing(registry_names, 3)
    assert "src/gwt_optim/optim/__init__.py" in lists and "src/gwt_optim/memory/estimate.py" in lists  # the scan works
    unnamed = sorted(lists - _named("How to add a family"))
    assert not unnamed, ("files that list the GWT families, missing from 'How to add a family' in "
                         f"docs/architecture.md: {unnamed}")


# Files that name several peers without being a list a new peer joins.
PEER_MENTIONS_ONLY = {
    "tests/toolkit/test_quality_protocol.py": "example specs for the protocol's spec rules and planner",
}


def test_the_peer_recipe_names_every_file_that_lists_the_peers():
    from gwt_optim.toolkit.registry import REGISTRY

    peers = {n for n, spec in REGISTRY.items() if spec.factory.__module__ == "gwt_optim.registry.peers"}
    assert {"galore", "adam8bit", "muon"} <= peers
    lists = _listing(peers, 3)
    assert "src/gwt_optim/registry/peers.py" in lists and "src/gwt_optim/memory/estimate.py" in lists
    unnamed = sorted(lists - _named("How to add a peer") - set(PEER_MENTIONS_ONLY))
    assert not unnamed, ("files that list the peers, missing from 'How to add a peer' in "
                         f"docs/architecture.md: {unnamed}")


def test_the_subcommand_table_is_cli_commands():
    import importlib

    from gwt_optim import cli

    rows = dict(re.findall(r"^\| `([\w-]+)` \| `(src/[\w/.]+\.py)`", _section("How to add a subcommand"), re.M))
    assert rows.keys() == cli.COMMANDS.keys()
    for command, module in cli.COMMANDS.items():
        assert Path(importlib.import_module(module).__file__).resolve() == ROOT / rows[command], command
