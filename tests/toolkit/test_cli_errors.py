"""A user's mistake gets one line on stderr and exit code 2, never a traceback:
optimizer specs, numbers, files, devices, checkpoints, report and memory, the
offline Hub. Each case fails before any training where it can."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _waiting import CAP_S
import torch

from gwt_optim.cli import main


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert lines, "no message on stderr"
    assert lines[-1].startswith("gwt-optim "), err
    return lines[-1]


@pytest.fixture
def tiny_argv(tiny_model, corpus, tmp_path):
    def make(*extra: str, out: str | None = None) -> list[str]:
        return ["pretrain", "--model", tiny_model, "--data", corpus, "--tokenizer", "bpe:320", "--seq-len", "32",
                "--batch-size", "4", "--steps", "2", "--eval-every", "0", "--val-tokens", "512",
                "--device", "cpu", "--no-progress", "--out", out or str(tmp_path / "run"), *extra]

    return make


@pytest.fixture
def no_hub(monkeypatch):
    """What "at once" means, without a stopwatch a loaded machine can fail: no connection is
    attempted (none would succeed: it is refused and counted) and no tokenizer is asked of the Hub."""
    from gwt_optim.toolkit.data import tokenizers

    asked: list[str] = []

    def refused(self, address, *args):
        asked.append(f"connect {address}")
        raise OSError("no network in this test")

    def hub_tokenizer(spec):
        asked.append(f"tokenizer {spec}")
        return real_hub_tokenizer(spec)

    real_hub_tokenizer = tokenizers._hub_tokenizer
    monkeypatch.setattr(socket.socket, "connect", refused)
    monkeypatch.setattr(tokenizers, "_hub_tokenizer", hub_tokenizer)
    return asked


# ----------------------------------------------------------------- optimizer specs


@pytest.mark.parametrize("spec, words", [
    ("nope", "unknown optimizer 'nope'"),
    ("gwt-adamw:levle=2", "levle"),
    ("gwt-adamw:level=abc", "level"),
])
def test_bad_optimizer_spec(tiny_argv, capsys, spec, words):
    assert main(tiny_argv("--optimizer", spec)) == 2
    assert words in _error(capsys)


def test_compare_checks_every_spec_before_any_run_trains(tiny_argv, tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--optimizers", "adamw,gwt-adamw:levle=2", *tiny_argv()[1:], "--out", str(out)]
    assert main(argv) == 2
    assert "levle" in _error(capsys)
    assert not out.exists()


def test_an_optimizers_own_value_error_is_one_line(tiny_argv, capsys):
    # The registry accepts an integer level; the optimizer's constructor refuses 40.
    assert main(tiny_argv("--optimizer", "gwt-adamw:level=40")) == 2
    assert "level" in _error(capsys)


def test_a_level_too_deep_for_the_models_rows_is_capped_in_one_warning(tiny_argv, capsys):
    # The tiny model's rows have 32 or 64 columns (at most level 5 or 6): at level 10 each weight steps at the
    # deepest level it fits, with the rule's alpha there (2^(5/2) or 2^3, not 2^5; functional.step_level),
    # and the optimizer says so once.
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert main(tiny_argv("--optimizer", "gwt-adamw:level=10")) == 0
    said = [str(w.message) for w in said if not issubclass(w.category, ResourceWarning)]  # the run's files: GC's
    assert len(said) == 1, said
    assert said[0].startswith("GWTAdamW: the last axis of 14 weights is too short for the group's level"), said
    assert "12 from level 10 to 5" in said[0] and "2 from level 10 to 6" in said[0], said
    assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------------ numbers


@pytest.mark.parametrize("flag, value", [
    ("--batch-size", "0"), ("--batch-size", "-2"), ("--seq-len", "0"), ("--lr", "-1"),
    ("--steps", "0"), ("--steps", "-1"),
])
@pytest.mark.parametrize("command", ["pretrain", "compare"])
def test_impossible_numbers(tiny_argv, tmp_path, capsys, command, flag, value):
    argv = tiny_argv(flag, value)
    argv[0] = command
    assert main(argv) == 2
    assert flag in _error(capsys)
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("argv, flag", [
    (["lm", "--steps", "-1"], "--steps"), (["lm", "--scale", "-2"], "--scale"), (["lm", "--lrs", "1e-4,-1"], "--lrs"),
    (["lm", "--batch-size", "0"], "--batch-size"), (["lm", "--val-fraction", "1"], "--val-fraction"),
    (["glue", "--lr", "0"], "--lr"), (["glue", "--scale", "0"], "--scale"), (["glue", "--max-steps", "0"], "--max-steps"),
    (["glue", "--epochs", "-1"], "--epochs"),
])
def test_finetune_refuses_impossible_numbers_before_loading_anything(tmp_path, capsys, argv, flag):
    # --steps -1 used to reach the worker and end in an IndexError traceback
    assert main(["finetune", *argv, "--out", str(tmp_path / "out")]) == 2
    err = _error(capsys)
    assert flag in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------------- files


def test_missing_data_file_fails_at_once_without_the_hub(tiny_model, tmp_path, capsys, no_hub):
    # A Hub tokenizer is never looked for: the data is checked first.
    assert main(["pretrain", "--model", tiny_model, "--data", str(tmp_path / "nope.txt"), "--tokenizer", "t5-base",
                 "--out", str(tmp_path / "run"), "--device", "cpu"]) == 2
    assert "nope.txt" in _error(capsys)
    assert no_hub == []


def _write(path: Path, content: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


@pytest.mark.parametrize("name, content, words", [
    ("binary.txt", bytes(range(256)) * 8, "binary"),
    ("bad.jsonl", '{"text": "fine"}\n{"text": broken\n', "bad.jsonl:2"),
    ("empty.txt", "", "empty"),
    ("notext.jsonl", '{"body": "a"}\n', "'text'"),
    ("list.jsonl", "[1, 2]\n", "'text'"),
])
def test_unusable_data_file(tiny_argv, tmp_path, capsys, name, content, words):
    data = _write(tmp_path / "data" / name, content)
    argv = tiny_argv()
    argv[argv.index("--data") + 1] = data
    assert main(argv) == 2
    assert words in _error(capsys)


def test_folder_without_text_files(tiny_argv, tmp_path, capsys):
    _write(tmp_path / "data" / "table.csv", "a,b\n")
    argv = tiny_argv()
    argv[argv.index("--data") + 1] = str(tmp_path / "data")
    assert main(argv) == 2
    assert "found none" in _error(capsys)


def test_missing_model(tiny_argv, tmp_path, capsys):
    argv = tiny_argv()
    argv[argv.index("--model") + 1] = str(tmp_path / "no-model")
    assert main(argv) == 2
    assert "--model" in _error(capsys)


def test_out_in_the_way_of_a_file(tiny_argv, tmp_path, capsys):
    _write(tmp_path / "file", "x")
    assert main(tiny_argv(out=str(tmp_path / "file" / "run"))) == 2
    assert "file" in _error(capsys)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes to read-only folders")
def test_read_only_out(tiny_argv, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(tiny_argv(out=str(ro / "run"))) == 2
        assert "permission denied" in _error(capsys)
    finally:
        ro.chmod(0o700)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu(tiny_argv, capsys):
    assert main(tiny_argv("--device", "cuda")) == 2
    assert "--device cuda" in _error(capsys)


def test_bad_config_file(tiny_argv, tmp_path, capsys):
    bad = _write(tmp_path / "c.json", "{not json")
    assert main(tiny_argv("--config", bad)) == 2
    assert "c.json" in _error(capsys)


# --------------------------------------------------------------------- checkpoints


@pytest.fixture
def saved_run(tiny_config, tmp_path):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    from gwt_optim.toolkit.train import train

    cfg = tiny_config(out=str(tmp_path / "saved"), steps=4, save_every=2, eval_every=0)
    train(cfg)
    return Path(cfg.out)


def test_truncated_checkpoint_falls_back_to_the_previous_one(saved_run, capsys):
    pt = saved_run / "checkpoints" / "step_00000004" / "rank0.pt"
    pt.write_bytes(pt.read_bytes()[:1000])
    assert main(["pretrain", "--out", str(saved_run), "--resume", "--steps", "5"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "step_00000004 is unreadable" in err and "previous checkpoint" in err
    assert "the file was modified after saving.)" in err  # torch's whole reason, not cut mid-word
    assert (saved_run / "checkpoints" / "unreadable-step_00000004").is_dir()  # kept, not deleted
    assert json.loads((saved_run / "summary.json").read_text())["steps"] == 5


def test_a_long_unreadable_reason_is_cut_at_a_word():
    from gwt_optim.toolkit.checkpoint import _why_unreadable

    words = " ".join(f"word{i:03d}" for i in range(200))
    why = _why_unreadable(RuntimeError(words))
    assert why.startswith("RuntimeError: word000 word001") and why.endswith(" ...")
    assert why[len("RuntimeError: "):-len(" ...")].split()[-1] in words.split()  # a whole word before the cut
    assert len(why) < len(words)


def test_empty_meta_json_everywhere_is_one_line(saved_run, capsys):
    for meta in (saved_run / "checkpoints").glob("step_*/meta.json"):
        meta.write_text("")
    assert main(["pretrain", "--out", str(saved_run), "--resume"]) == 2
    assert "no readable checkpoint" in _error(capsys)


# ------------------------------------------------------------- report and memory


@pytest.mark.parametrize("argv, words", [
    (["memory", "--models", "nope"], "nope"),
    (["memory", "--optimizers", "nope"], "nope"),
    (["memory", "--rank", "0"], "rank"),
    (["memory", "--level", "40"], "level"),
])
def test_memory_mistakes(capsys, argv, words):
    assert main(argv) == 2
    assert words in _error(capsys)


@pytest.mark.parametrize("flag, names", [("--dtype", "DTYPE_NAMES"), ("--state-dtype", "STATE_DTYPE_NAMES")])
def test_memory_dtype_error_lists_what_the_help_offers(capsys, flag, names):
    import importlib

    module = importlib.import_module("gwt_optim.memory.estimate")  # the package's `estimate` is the function
    offered = list(getattr(module, names))
    assert (flag == "--state-dtype") == ("int8" in offered)  # GWT-AdamW's 8-bit moments: a state dtype only
    with pytest.raises(SystemExit):
        main(["memory", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert f"{', '.join(offered)} or a torch dtype name" in helped
    assert main(["memory", flag, "fp8"]) == 2
    assert f"use one of {', '.join(offered)} or a torch dtype name" in _error(capsys)


def test_report_on_an_empty_folder(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no summary.json" in _error(capsys)


# ------------------------------------------------------------------ offline Hub


def test_local_text_with_a_hub_tokenizer_offline_says_so_at_once(monkeypatch, tiny_model, corpus, tmp_path,
                                                                   capsys, no_hub):
    from gwt_optim.toolkit import data

    monkeypatch.setattr(data.tokenizers, "_hub_reachable", lambda timeout=3.0: False)  # no network, HF_HUB_OFFLINE unset
    assert main(["pretrain", "--model", tiny_model, "--data", corpus, "--tokenizer", "t5-base", "--out",
                 str(tmp_path / "run"), "--device", "cpu", "--no-progress"]) == 2
    # At once: the one look in the local cache, then the answer; the Hub client and its retries are never reached.
    assert no_hub == ["tokenizer t5-base"]
    line = _error(capsys)
    assert "'t5-base'" in line and "--tokenizer bpe" in line


# ------------------------------------------------------------ the entry point


def test_the_installed_command_prints_one_line_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gwt_optim", "pretrain", "--steps", "-1"],
                          capture_output=True, text=True, timeout=CAP_S)
    assert done.returncode == 2
    assert done.stderr.strip() == "gwt-optim pretrain: error: --steps must be an integer >= 1, got -1"


def test_eight_bit_adam_prints_no_third_party_noise(tiny_argv, tmp_path):
    pytest.importorskip("bitsandbytes")
    done = subprocess.run([sys.executable, "-m", "gwt_optim", *tiny_argv("--optimizer", "adam8bit")],
                          capture_output=True, text=True, timeout=CAP_S,
                          env={**os.environ, "GWT_OPTIM_CACHE": os.environ["GWT_OPTIM_CACHE"]})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kernels-community" not in done.stderr + done.stdout
