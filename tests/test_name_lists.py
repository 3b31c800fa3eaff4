"""The registry is the one list of optimizer names: every other list of them
is read off it, or checked against it here.

Names are never spelt out in this file beyond the two memory-only rules, so a
new registry entry needs no edit here to be checked.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from gwt_optim.registry import REGISTRY, OptimizerConfig, build_optimizer, register, validate_optimizer_spec

# By importlib: gwt_optim.memory.estimate is also the name of a function the package exports.
estimate_module = importlib.import_module("gwt_optim.memory.estimate")


def _estimators_of_the_registry() -> set[str]:
    return {estimate_module.estimator_key(name) for name in REGISTRY}


def test_every_registry_entry_has_a_memory_rule():
    missing = {n: spec.memory for n, spec in REGISTRY.items() if spec.memory not in estimate_module.ESTIMATORS}
    assert not missing, f"registry entries whose memory rule is not in ESTIMATORS: {missing}"


def test_every_memory_rule_is_reached_from_the_registry_but_the_plain_adafactor():
    # torch.optim.Adafactor is the plain form of GWT-Adafactor in the memory table;
    # the registry does not build it.
    assert set(estimate_module.ESTIMATORS) - _estimators_of_the_registry() == {"adafactor"}


def test_aliases_are_read_off_the_registry():
    aliases = estimate_module.ALIASES
    assert aliases == {n: s.memory for n, s in REGISTRY.items() if s.memory != n}
    assert set(aliases) <= set(REGISTRY) and set(aliases.values()) <= set(estimate_module.ESTIMATORS)
    assert all(estimate_module.estimator_key(n) == key for n, key in aliases.items())


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_memory_estimates_every_registry_name(name):
    e = estimate_module.estimate("60m", name, level=2)
    assert e.optimizer == estimate_module.estimator_key(name) and e.state_bytes > 0


def test_the_default_memory_table_has_a_row_per_registry_rule():
    from gwt_optim.memory import TABLE_OPTIMIZERS

    assert len(set(TABLE_OPTIMIZERS)) == len(TABLE_OPTIMIZERS)
    # The rows, as memory/cli.py's comment says: every rule the registry points
    # to but torchao's 4-bit layout, plus the plain Adafactor.
    assert set(TABLE_OPTIMIZERS) == (_estimators_of_the_registry() - {"adamw4bit"}) | {"adafactor"}
    assert {n for n in REGISTRY if n.startswith("gwt-")} <= set(TABLE_OPTIMIZERS)


def test_the_memory_command_offers_every_rule():
    import argparse

    from gwt_optim.memory import register as register_memory

    parser = argparse.ArgumentParser()
    register_memory(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["memory"]  # noqa: SLF001
    text = next(a.help for a in sub._actions if "--optimizers" in a.option_strings)  # noqa: SLF001
    known = text.split("known: ", 1)[1].split(", ")
    assert known == list(estimate_module.ESTIMATORS)
    assert _estimators_of_the_registry() <= set(known)


def _recipe_specs() -> list[str]:
    from gwt_optim.toolkit import recipes

    specs = list(recipes.DEMO_OPTIMIZERS)
    for size in recipes.PAPER_STEPS:
        specs += recipes.paper_optimizers(size) + [recipes.paper_recipe(size)["optimizer"]]
    return specs


@pytest.mark.parametrize("spec", sorted(set(_recipe_specs())))
def test_every_recipe_spec_is_a_registry_spec(spec):
    validate_optimizer_spec(spec)


def test_the_toolkit_registry_is_the_registry():
    import gwt_optim.registry as core
    from gwt_optim.toolkit import registry as toolkit_registry

    assert toolkit_registry.REGISTRY is core.REGISTRY
    assert toolkit_registry.__all__ == core.__all__
    assert all(getattr(toolkit_registry, n) is getattr(core, n) for n in core.__all__)


# ----------------------------------------------------------------------------- the seam: an entry names its rule


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)


@pytest.fixture
def toy_entry():
    """An entry registered after gwt_optim.memory was imported, whose rule is AdamW's."""

    def factory(model, cfg):
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    register("toy-adam", help="test toy", memory="adamw")(factory)
    try:
        yield "toy-adam"
    finally:
        REGISTRY.pop("toy-adam", None)


def test_an_entry_registered_later_is_estimated_through_its_rule(toy_entry):
    assert REGISTRY[toy_entry].memory == "adamw"
    model = _Tiny()
    ours = estimate_module.estimate(model, toy_entry)
    assert ours.optimizer == "adamw"
    assert ours.state_bytes == estimate_module.estimate(model, "adamw").state_bytes
    assert isinstance(build_optimizer(toy_entry, model, OptimizerConfig()), torch.optim.AdamW)


def test_an_entrys_rule_defaults_to_its_name():
    register("toy-rule", help="test toy")(lambda model, cfg: None)
    try:
        assert REGISTRY["toy-rule"].memory == "toy-rule"
        with pytest.raises(ValueError, match="no memory estimate for 'toy-rule'"):
            estimate_module.estimate(_Tiny(), "toy-rule")
    finally:
        REGISTRY.pop("toy-rule", None)
