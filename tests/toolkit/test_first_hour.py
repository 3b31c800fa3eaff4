"""A new user's first hour (issue 44): what the first commands of someone who
has just installed the toolkit say and do. A mistake is one line on stderr and
exit code 2, before anything is written; the help states the defaults the run
uses; a small local text file trains offline."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from gwt_optim.cli import main


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("gwt-optim "), err
    return lines[0]


# ----------------------------------------------------------------- --resume with nothing to resume


def _listing(folder: Path) -> dict[str, bytes] | None:
    """Every entry of ``folder`` (dot files too: the run lock) with its content."""
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else None


@pytest.mark.parametrize("folder", ["missing", "empty", "notes-only", "stopped-before-a-checkpoint"])
def test_resume_with_nothing_to_resume_refuses_in_one_line(tmp_path, capsys, folder):
    run = tmp_path / "notarun"
    if folder != "missing":
        run.mkdir()
    if folder in ("notes-only", "stopped-before-a-checkpoint"):
        (run / "notes.md").write_text("my notes\n")
    if folder == "stopped-before-a-checkpoint":
        (run / "config.json").write_text("{}")
        (run / ".writer.lock").write_text("12345 elsewhere\n")  # a lock file that was there stays as it was
    before = _listing(run)
    assert main(["pretrain", "--resume", "--out", str(run), "--no-progress"]) == 2
    line = _error(capsys)
    assert line.startswith("gwt-optim pretrain: error: --resume: ") and str(run) in line
    assert "continue" in line  # says there is nothing to continue, and what to do instead
    # Nothing trained or written: a missing folder stays missing, a folder keeps just what it held
    # (no run lock left behind).
    assert _listing(run) == before


def test_the_run_lock_is_retaken_when_its_file_was_removed_meanwhile(tmp_path, monkeypatch):
    """A refused run removes the lock file it made: a process that opened that file just before and locks
    it after holds a lock on a file no longer there, which guards nothing; it takes the one now in place."""
    import fcntl
    import os

    from gwt_optim.toolkit.run_folder import LOCK_FILE, lock_run_dir

    real_flock, removed = fcntl.flock, []

    def flock_after_removal(fd, op):
        if not removed:  # the other process removes the file between this one's open and its flock
            removed.append(True)
            os.unlink(tmp_path / LOCK_FILE)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_removal)
    with lock_run_dir(tmp_path):
        monkeypatch.setattr(fcntl, "flock", real_flock)
        assert removed and (tmp_path / LOCK_FILE).is_file()
        other = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # the file in place is the one held
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)


# ----------------------------------------------------------------- --help states the defaults the run uses


def _subparser(*names: str):
    from gwt_optim.cli import build_parser

    parser = build_parser()
    for name in names:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def _rendered(parser) -> dict[str, str]:
    """Each option's help as ``--help`` prints it (its formatter's expansion, whitespace joined):
    ``{"--lr": "peak learning rate ... (default: 0.003)"}``."""
    formatter = parser._get_formatter()
    full = re.sub(r"\s+", " ", parser.format_help())
    out = {}
    for action in parser._actions:
        if action.option_strings and action.help != argparse.SUPPRESS:
            out[action.option_strings[0]] = text = " ".join(formatter._expand_help(action).split())
            assert text.replace("- ", "-") in full.replace("- ", "-")  # printed so (argparse breaks at hyphens)
    return out


def _stated(help_text: str) -> str:
    """The default a help states: ``0.003`` of ``... (default: 0.003; with --optimizers: 0)``."""
    m = re.search(r"\(default: ([^;)]*)", help_text)
    assert m, help_text
    return m.group(1)


def _same(stated: str, value) -> bool:
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, tuple):  # a grid: --lrs 0.0001,0.0003
        return [float(x) for x in stated.split(",")] == list(value)
    if isinstance(value, (int, float)):
        return float(stated) == value
    return stated == str(value)


@pytest.mark.parametrize("command", ["pretrain", "compare"])
def test_training_help_states_the_defaults_the_run_uses(command):
    from gwt_optim.toolkit import recipes
    from gwt_optim.toolkit.pretrain import resolve_config

    parser = _subparser(command)
    helps = _rendered(parser)
    # What a run with no flags resolves to: the demo recipe for pretrain, the demo's setting for compare.
    ran = resolve_config(argparse.Namespace(), recipes.DEMO if command == "pretrain" else recipes.DEMO_SETTING)
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.dest not in ran.to_dict() or "(default: " not in (action.help or ""):
            continue
        value = getattr(ran, action.dest)
        stated = _stated(helps[action.option_strings[0]])
        if value is None:  # said in words: off, the whole batch, auto
            assert stated and stated != "None", (action.dest, stated)
        else:
            assert _same(stated, value), (action.dest, stated, value)
            checked += 1
    assert checked >= 15
    if command == "pretrain":  # the three the issue found stated wrongly
        assert [_stated(helps[f]) for f in ("--lr", "--batch-size", "--steps")] == ["0.003", "32", "100"]
        assert recipes.DEMO["lr"] == 0.003 and recipes.DEMO["batch_size"] == 32 and recipes.DEMO["steps"] == 100
    else:  # and what --optimizers alone changes, from pretrain's recipe
        alone = resolve_config(argparse.Namespace(), recipes.DEMO)
        assert helps["--data"].endswith(f"(default: {ran.data}; with --optimizers: {alone.data})")
        assert helps["--seed"].endswith(f"(default: {ran.seed}; with --optimizers: {alone.seed})")


@pytest.mark.parametrize("task", ["glue", "lm"])
def test_finetune_help_says_what_every_option_does_and_its_default_once(task):
    from gwt_optim.toolkit.finetune.glue_train import GlueSettings
    from gwt_optim.toolkit.finetune.lm_train import LMSettings

    parser = _subparser("finetune", task)
    helps = _rendered(parser)
    settings = (GlueSettings if task == "glue" else LMSettings)()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        text = helps[action.option_strings[0]]
        assert action.help and text, f"{action.option_strings[0]} has no help"
        assert text.count("(default:") <= 1 and "(default: None)" not in text, text
        value = getattr(settings, action.dest, None)
        if value is not None and action.default is not None and not isinstance(action.default, bool):
            assert _same(_stated(text), getattr(settings, action.dest)), (action.dest, text)
    for flag in ("--lr", "--batch-size", "--epochs") if task == "glue" else ("--steps", "--batch-size", "--cache-dir"):
        assert len(helps[flag]) > 20, (flag, helps[flag])


def test_the_pretraining_guide_states_the_same_defaults():
    from gwt_optim.toolkit.pretrain import run_defaults

    d = run_defaults()
    rows = (Path(__file__).resolve().parents[2] / "docs" / "pretraining.md").read_text()
    assert f"peak learning rate ({d['lr']:g})" in rows
    assert f"optimizer steps ({d['steps']}), sequences per step over all ranks ({d['batch_size']})" in rows
    assert f"tokens per sequence ({d['seq_len']})" in rows


# ----------------------------------------------------------------- one rule for a number, no empty folder left


@pytest.mark.parametrize("command", ["pretrain", "compare"])
@pytest.mark.parametrize("flag, spec_option, rule", [
    ("--lr", "lr", "must be a number > 0"),
    ("--weight-decay", "weight_decay", "must be a number >= 0"),
    ("--scale", "scale", "must be a number > 0"),
])
def test_a_spec_option_follows_the_rule_of_its_flag_and_leaves_no_folder(tmp_path, capsys, command, flag,
                                                                           spec_option, rule):
    out = tmp_path / "runs" / "new"
    optimizer = ["--optimizer" if command == "pretrain" else "--optimizers", f"gwt-adamw:{spec_option}=-1"]
    assert main([command, *optimizer, "--out", str(out)]) == 2
    from_spec = _error(capsys)
    assert main([command, flag, "-1", "--out", str(out)]) == 2
    from_flag = _error(capsys)
    assert f"{flag} {rule}, got -1.0" in from_flag
    assert f"'gwt-adamw:{spec_option}=-1': {spec_option} {rule}, got -1" in from_spec
    assert not (tmp_path / "runs").exists()


def test_a_check_made_after_the_folder_is_made_removes_it(tiny_model, corpus, tmp_path, capsys):
    out = tmp_path / "runs" / "new"
    # 6 sequences do not split into micro-batches of 4: found once the run has its folder and lock.
    assert main(["pretrain", "--model", tiny_model, "--data", corpus, "--tokenizer", "bpe:320", "--seq-len", "32",
                 "--batch-size", "6", "--micro-batch-size", "4", "--steps", "1", "--device", "cpu", "--no-progress",
                 "--out", str(out)]) == 2
    assert "--micro-batch-size" in _error(capsys)
    assert not (tmp_path / "runs").exists()
    kept = tmp_path / "mine"
    kept.mkdir()
    assert main(["pretrain", "--model", tiny_model, "--data", corpus, "--tokenizer", "bpe:320", "--seq-len", "32",
                 "--batch-size", "6", "--micro-batch-size", "4", "--steps", "1", "--device", "cpu", "--no-progress",
                 "--out", str(kept)]) == 2
    assert kept.is_dir()  # a folder the user made stays


# ----------------------------------------------------------------- a small local text file trains offline


def _small_text(path: Path, lines: int = 60, *, blank_lines: bool = False) -> Path:
    """A few KB of plain text, one sentence a line, as a user's notes are (no blank lines unless asked)."""
    import random

    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxes of milk".split()
    rows = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "." for _ in range(lines)]
    sep = "\n\n" if blank_lines else "\n"
    path.write_text(sep.join(rows) + "\n")
    return path


@pytest.fixture
def offline(monkeypatch):
    """No connection can be made and none is tried: the Hub is never asked for a tokenizer."""
    import socket

    from gwt_optim.toolkit.data import tokenizers

    def refused(self, address, *args):
        raise AssertionError(f"a connection to {address} was tried")

    def hub_tokenizer(spec):
        raise AssertionError(f"the Hub was asked for tokenizer {spec!r}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refused)
    monkeypatch.setattr(tokenizers, "_hub_tokenizer", hub_tokenizer)


@pytest.mark.parametrize("blank_lines", [False, True], ids=["one-document", "paragraphs"])
def test_a_few_kb_text_file_trains_offline_with_the_defaults(tmp_path, capsys, offline, blank_lines):
    import json
    import math

    notes = _small_text(tmp_path / "notes.txt", blank_lines=blank_lines)
    assert 2_000 < notes.stat().st_size < 8_000
    out = tmp_path / "run"
    # Only the length is cut short: data, tokenizer, model and sequence length are the defaults.
    rc = main(["pretrain", "--data", str(notes), "--steps", "2", "--batch-size", "2", "--eval-every", "0",
               "--device", "cpu", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["val_loss"])
    # The validation text, the file's last tenth, is shorter than one sequence: said once, and used whole.
    assert "validating on them as one window" in err
    assert json.loads((out / "config.json").read_text())["seq_len"] == 256


def test_a_small_corpus_holds_out_the_end_of_its_text(tmp_path):
    from gwt_optim.toolkit.data import load_texts

    one = _small_text(tmp_path / "one.txt")
    train, val = load_texts(str(one), "train"), load_texts(str(one), "validation")
    assert len(train) == len(val) == 1
    text = one.read_text().strip()
    assert text.startswith(train[0]) and text.endswith(val[0])
    assert 0.05 < len(val[0]) / len(text) < 0.2  # about the last 10%, cut at a line break
    assert val[0][0].isupper() and train[0].endswith(".")
    # Paragraphs, none of which the hash puts in validation: the last ones (a tenth of the text) are.
    from gwt_optim.toolkit.data.sources import _in_validation

    docs = [d for d in _small_text(tmp_path / "many.txt", 20, blank_lines=True).read_text().split("\n\n")]
    docs = [d.strip() for d in docs if d.strip() and not _in_validation(d.strip())]
    (tmp_path / "many.txt").write_text("\n\n".join(docs))
    train, val = load_texts(str(tmp_path / "many.txt"), "train"), load_texts(str(tmp_path / "many.txt"), "validation")
    assert train + val == docs and 1 <= len(val) < len(docs) // 4


def test_a_file_too_small_for_one_sequence_says_the_fix_in_one_line(tmp_path, capsys, offline):
    tiny = _small_text(tmp_path / "tiny.txt", lines=8)
    assert main(["pretrain", "--data", str(tiny), "--steps", "1", "--device", "cpu", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 2
    line = _error(capsys)
    assert "training split holds" in line and "--seq-len" in line
    assert not (tmp_path / "run").exists()


def test_a_missing_split_says_how_text_is_cut_into_documents(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    _small_text(tmp_path / "data" / "train.txt")
    assert main(["pretrain", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run")]) == 2
    line = _error(capsys)
    assert "no validation documents" in line and "blank lines" in line


# ----------------------------------------------------------------- no third-party noise on import

# What transformers', peft's and bitsandbytes' imports print with the packages the set-up installs.
_NOISE = ("Failed to load", "_C_cutlass", "_pytree", "is an Enum subclass", "register_constant",
          "kernels-community", "publisher trust", "gemm_4bit")


@pytest.mark.parametrize("hub_offline", ["0", "1"])
def test_importing_the_toolkits_hf_path_prints_no_third_party_noise(hub_offline):
    import os
    import subprocess
    import sys

    from _waiting import CAP_S

    code = "\n".join([
        "import importlib.util",
        "import gwt_optim.toolkit.models, gwt_optim.toolkit.data, gwt_optim.toolkit.finetune.tiny",
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer",
        "LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,",
        "                             num_attention_heads=2, vocab_size=64))",
        "for name in ('peft', 'bitsandbytes'):  # finetune's LoRA and 8-bit Adam",
        "    if importlib.util.find_spec(name):",
        "        __import__(name)",
        "print('imported')",
    ])
    env = {**os.environ, "HF_HUB_OFFLINE": hub_offline, "PYTHONWARNINGS": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CAP_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "imported"
    printed = done.stdout + done.stderr
    assert not [n for n in _NOISE if n in printed], printed


# ----------------------------------------------------------------- the memory headline and table


def test_the_readmes_memory_headline_names_its_dtypes_and_the_default(capsys):
    import torch

    from gwt_optim import GWTAdamW
    from gwt_optim.memory import estimate

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    headline = " ".join(readme[readme.index("**At level 2"):].split("**")[1].split())

    def gb(name: str, state: str) -> str:
        return f"{estimate('7b', name, dtype='bf16', state_dtype=state).total_bytes / 1e9:.1f} GB"

    assert "bf16 weights" in headline
    assert f"AdamW's {gb('adamw', 'bf16')} to {gb('gwt-adamw', 'bf16')} with bf16 moments" in headline
    assert f"or {gb('gwt-adamw', 'fp32')} with the default fp32" in headline
    # the default it names: GWT-AdamW keeps fp32 moments for bf16 weights
    w = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.bfloat16))
    w.grad = torch.randn_like(w)
    opt = GWTAdamW([w], lr=1e-3)
    opt.step()
    moments = [t for t in opt.state[w].values() if torch.is_tensor(t) and t.dim() > 0]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    # and the command that prints that figure
    assert main(["memory", "--models", "7b", "--optimizers", "adamw,gwt-adamw", "--state-dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    fp32 = estimate("7b", "gwt-adamw", dtype="bf16", state_dtype="fp32").total_bytes / 1e9
    assert "bf16 weights, fp32 states" in out and f"| gwt-adamw (l=2) | {fp32:.2f} (" in out


def test_the_memory_table_names_a_custom_shape_by_its_file(tmp_path, capsys):
    import json

    shape = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 1000}
    (tmp_path / "my_shape.json").write_text(json.dumps(shape))
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text(json.dumps(shape))
    models = f"7b,{tmp_path / 'my_shape.json'},{tmp_path / 'my-model' / 'config.json'}"
    for extra in ([], ["--peak"]):
        assert main(["memory", "--models", models, "--optimizers", "adamw,gwt-adamw", *extra]) == 0
        out = capsys.readouterr().out
        assert "MY_SHAPE" not in out and "CONFIG.JSON" not in out and ".json" not in out.split("\n", 1)[1]
        assert "my_shape" in out and "my-model" in out
        assert "fp32 state | my_shape adamw, bf16 state |" in out if extra else "| optimizer | 7B | my_shape | my-model |" in out


# ----------------------------------------------------------------- the report: names and plots


def _demo_like_runs(root: Path) -> Path:
    """Finished runs as the demo's six (docs/benchmarks.md: its matrix lrs, losses and state), without training."""
    import json
    import math

    from gwt_optim.toolkit import recipes
    from gwt_optim.toolkit.registry import parse_optimizer_arg

    results = [(5.2937, 14.13), (5.4243, 14.13), (5.1710, 9.54), (5.2819, 11.29), (4.8473, 11.07), (4.7696, 8.77)]
    for i, (spec, (loss, mib)) in enumerate(zip(recipes.DEMO_OPTIMIZERS, results)):
        name, opts = parse_optimizer_arg(spec)
        run = root / f"{i:02d}-{name}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({
            "optimizer": spec, "optimizer_name": name, "lr": opts["lr"], "scale": 1.0, "options": opts,
            "val_loss": loss, "val_ppl": math.exp(loss), "state_bytes": mib * 2**20, "peak_rss_bytes": 9e8,
            "ms_per_step": 1100.0, "tokens_per_s": 7400.0, "steps": 100, "tokens": 819_200, "params": 1.9e6,
            "model": "llama_9m", "data": "pysrc-small", "seed": 1}))
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "val_loss": loss + (100 - s) / 40}) + "\n" for s in (25, 50, 75, 100)))
    return root


def test_the_frozen_matrix_row_has_its_own_name(tmp_path, capsys):
    runs = _demo_like_runs(tmp_path / "runs")
    assert main(["report", str(runs)]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| adamw")]
    names = [r.split(" | ")[0] for r in rows]
    assert names == ["| adamw (beta2=0.95, regular_lr=0.003)",
                     "| adamw, frozen matrices (beta2=0.95, regular_lr=0.003)"], rows


def test_the_plots_keep_every_label_inside_the_figure_and_apart(tmp_path):
    import matplotlib.pyplot as plt

    from gwt_optim.toolkit import plots, report

    runs = report.find_runs([_demo_like_runs(tmp_path / "runs")])
    summaries = [report.load_run(r)[0] for r in runs]
    shared = report.shared_options(summaries)
    assert shared == {"beta2": 0.95, "regular_lr": 0.003}
    labels = [report.label(s, leave_out=tuple(shared)) for s in summaries]
    assert len(set(labels)) == len(labels)  # the frozen row too
    for fig in (plots.memory_vs_perplexity_figure(summaries, labels),
                plots.validation_loss_figure([(lab, report.load_run(r)[1]) for lab, r in zip(labels, runs)])):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        inside = ax.get_window_extent(renderer)
        numbers = [t.get_window_extent(renderer) for t in ax.texts]
        for box in numbers:  # a point's number stays in the axes ...
            assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
        for i, a in enumerate(numbers):  # ... and clear of the others
            assert not any(a.overlaps(b) for b in numbers[i + 1:])
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.y1 < inside.y0  # the labels are below the axes, not over the data
        saved = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # bbox_inches="tight", in pixels
        assert saved.x0 <= legend.x0 + 1 and legend.x1 <= saved.x1 + 1 and saved.y0 <= legend.y0 + 1
        texts = [t.get_window_extent(renderer) for t in ax.get_legend().get_texts()]
        assert all(not a.overlaps(b) for i, a in enumerate(texts) for b in texts[i + 1:])
        plt.close(fig)
    paths = report.write_report(runs, tmp_path / "report")
    for png in (paths["val_loss"], paths["memory"]):
        assert png.stat().st_size > 10_000


def test_output_cut_short_by_its_reader_ends_quietly():
    """`gwt-optim memory | head -3`: the reader leaves early, the command ends without a traceback."""
    import subprocess
    import sys

    from _waiting import CAP_S

    proc = subprocess.Popen([sys.executable, "-m", "gwt_optim", "memory"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # gone before the table is printed
    err = proc.stderr.read()
    assert proc.wait(timeout=CAP_S) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_run_folder_without_a_checkpoint_is_not_sent_to_resume(tmp_path, capsys):
    """Without --resume, a folder holding a run with no checkpoint says what will work, not --resume."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    assert main(["pretrain", "--out", str(run), "--no-progress"]) == 2
    line = _error(capsys)
    assert "no checkpoint" in line and "--resume" not in line and "another --out" in line


# ----------------------------------------------------------------- a first compare says what it builds


def test_first_compare_says_it_builds_its_corpus(tmp_path, monkeypatch, capsys):
    from gwt_optim.toolkit import compare
    from gwt_optim.toolkit.data import pending_build, pysrc

    monkeypatch.setenv("GWT_OPTIM_CACHE", str(tmp_path / "cache"))  # nothing built yet
    started = []
    monkeypatch.setattr(compare, "_run_plan", lambda plan, *rest: started.append(plan) or 0)
    argv = ["compare", "--optimizers", "adamw", "--data", "pysrc-small", "--no-progress", "--out", str(tmp_path / "c")]
    assert main(argv) == 0 and started
    built = pysrc.corpus_dir(pysrc.SMALL)
    assert built.is_relative_to(tmp_path)
    line = f"--data pysrc-small: fetching its {len(pysrc.SMALL)} pinned sdists and building the corpus in {built}"
    assert line in capsys.readouterr().out
    # Once built, nothing is said (and a bundled corpus never needs it).
    built.mkdir(parents=True)
    (built / "manifest.json").write_text("{}")
    assert pending_build("pysrc-small") is None and pending_build("demo") is None
    assert main(argv) == 0
    assert "fetching" not in capsys.readouterr().out
