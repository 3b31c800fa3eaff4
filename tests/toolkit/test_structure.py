"""One source of truth for each rule: shared helpers, no dead names, no
same-named functions in different modules."""

from __future__ import annotations

import importlib
import inspect

import pytest


@pytest.mark.parametrize("warmup, steps, expected", [(0.1, 100, 10), (0.25, 10, 2), (0.35, 10, 4), (3, 10, 3), (3.0, 1, 3)])
def test_one_warmup_rule(warmup, steps, expected):
    from gwt_optim.toolkit.schedules import warmup_steps

    assert warmup_steps(warmup, steps) == expected


def test_finetune_lm_uses_the_shared_helpers():
    from gwt_optim.toolkit import data, losses, models
    from gwt_optim.toolkit.finetune import lm, lm_train

    assert lm.pack_texts is data.pack_texts
    assert lm.IGNORE_INDEX == losses.IGNORE_INDEX
    src = inspect.getsource(lm_train)
    assert "warmup_steps(" in src and "count_parameters(" in src and "next_token_losses(" in src
    assert not hasattr(lm_train, "_trainable_params") and models.count_parameters


@pytest.mark.parametrize(
    "module, name",
    [
        ("gwt_optim.groups", "count_params"),
        ("gwt_optim.toolkit.metrics", "reset_peak_memory"),
        ("gwt_optim.toolkit.metrics", "format_bytes"),
        ("gwt_optim.toolkit.train", "_parse_optimizer"),
        ("gwt_optim.toolkit.data", "load_tokenizer"),
        ("gwt_optim.toolkit.finetune.lm", "load_tokenizer"),
        ("gwt_optim.toolkit.models", "load_config"),
        ("gwt_optim.memory", "load_config"),
        ("gwt_optim.toolkit.report", "markdown_table"),
    ],
)
def test_dead_or_ambiguous_name_is_gone(module, name):
    assert not hasattr(importlib.import_module(module), name)


def test_cache_rule(monkeypatch, tmp_path):
    from gwt_optim._cache import cache_dir
    from gwt_optim.toolkit import data

    monkeypatch.setenv("GWT_OPTIM_CACHE", str(tmp_path))
    assert data.cache_dir() == cache_dir("data") == tmp_path / "data"
    monkeypatch.delenv("GWT_OPTIM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.cache_dir() == tmp_path / "xdg" / "gwt-optim" / "data"


def test_split_packages_keep_their_public_names():
    import gwt_optim.memory as memory
    import gwt_optim.toolkit.data as data

    for mod in (memory, data):
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert not missing, (mod.__name__, missing)
