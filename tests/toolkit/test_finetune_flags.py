"""The finetune commands' flags are derived from their dataclasses' fields (``gwt_optim.toolkit.flags``):
each field has exactly one flag, each flag is one field's, and the parsed flags make the dataclasses."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from gwt_optim.toolkit.finetune import glue, lm
from gwt_optim.toolkit.flags import add_flags, from_flags, setting

COMMANDS = {"lm": (lm.LMSettings, lm.LMCommand), "glue": (glue.GlueSettings, glue.GlueCommand)}


def _parser(command: str) -> argparse.ArgumentParser:
    from gwt_optim.toolkit import finetune

    root = argparse.ArgumentParser()
    finetune.register(root.add_subparsers())
    (tasks,) = (a for a in root._subparsers._group_actions[0].choices["finetune"]._actions
                if isinstance(a, argparse._SubParsersAction))
    return tasks.choices[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_field_has_one_flag_and_each_flag_one_field(command):
    fields = [f.name for cls in COMMANDS[command] for f in dataclasses.fields(cls)]
    actions = [a for a in _parser(command)._actions if not isinstance(a, argparse._HelpAction)]
    shown = [a for a in actions if a.help != argparse.SUPPRESS]
    # --no-progress's value lands in no_progress, the setting it makes is progress
    field_of = {a: "progress" if a.dest == "no_progress" else a.dest for a in actions}
    assert sorted(field_of[a] for a in shown) == sorted(fields)  # each field once in --help
    assert all(len(a.option_strings) == 1 for a in actions)
    assert set(field_of.values()) == set(fields)  # no flag without a field (glue's hidden --task is --tasks')
    assert [a.option_strings[0] for a in actions if a not in shown] == (["--task"] if command == "glue" else [])


@pytest.mark.parametrize("command", COMMANDS)
def test_the_flags_defaults_are_the_fields(command):
    args = _parser(command).parse_args([])
    for cls in COMMANDS[command]:
        assert from_flags(cls, args) == cls()


def test_flags_convert_to_the_settings():
    args = _parser("lm").parse_args(
        "--lrs 1e-3,,2e-3 --max-grad-norm 0 --isolate yes --no-progress --tf32 --seq-len 32 --format alpaca "
        "--schedule wsd --decay 3 --decay-shape linear --val-data v.json --resume --cache-dir c".split())
    assert from_flags(lm.LMSettings, args) == lm.LMSettings(
        lrs=(1e-3, 2e-3), max_grad_norm=None, isolate=True, progress=False, tf32=True, seq_len=32, format="alpaca",
        schedule="wsd", decay=3, decay_shape="linear", val_data="v.json")
    assert from_flags(lm.LMCommand, args) == lm.LMCommand(resume=True, cache_dir="c")
    args = _parser("glue").parse_args("--task rte,cola --isolate no --max-train-samples 8 --epochs 1.5".split())
    assert from_flags(glue.GlueSettings, args) == glue.GlueSettings(isolate=False, max_train_samples=8, epochs=1.5)
    assert from_flags(glue.GlueCommand, args).tasks == "rte,cola"


def test_a_field_without_a_flag_or_an_order_that_misses_one_is_refused():
    @dataclasses.dataclass
    class Settings:
        steps: int = setting(1, "steps")
        seen: bool = False

    with pytest.raises(TypeError, match="Settings.seen has no flag"):
        add_flags(argparse.ArgumentParser(), Settings)

    @dataclasses.dataclass
    class Flagged:
        steps: int = setting(1, "steps")
        lr: float = setting(0.1, "lr")

    with pytest.raises(ValueError, match="must name each of"):
        add_flags(argparse.ArgumentParser(), Flagged, order=("steps", "steps"))
    p = argparse.ArgumentParser()
    add_flags(p, Flagged, order=("lr", "steps"))
    assert [a.dest for a in p._actions[1:]] == ["lr", "steps"]
    assert from_flags(Flagged, p.parse_args(["--steps", "3"])) == Flagged(steps=3)
    assert p.parse_args(["--lr", "2"]).lr == 2.0  # typed from the field
