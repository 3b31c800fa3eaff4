"""Faults of the machine and of the files a run leaves behind: damaged or
crafted checkpoints, a damaged metrics.jsonl, a full disk, a read-only
folder, a bogus model config. Each ends in a resumed run or in one line on
stderr with exit code 2, never a traceback, and never costs a good checkpoint.

The full-disk and read-only cases use real file systems of their own (a
tmpfs, mounted as root); without the right to mount, the read-only ones fall
back to a folder without write permission, and the full-disk one is skipped
(the monkeypatched torch.save case still runs)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from gwt_optim.cli import main
from gwt_optim.toolkit import checkpoint as ckpt
from gwt_optim.toolkit.metrics import read_jsonl


from test_cli_errors import _error  # noqa: E402 - the one check of a one-line error, shared with that file


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def finished(tiny_model, corpus, tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4 (trained once per module)."""
    from gwt_optim.toolkit.train import TrainConfig, train

    out = tmp_path_factory.mktemp("finished") / "run"
    train(TrainConfig(out=str(out), model=tiny_model, data=corpus, tokenizer="bpe:320", seq_len=32, batch_size=4,
                      steps=4, save_every=2, eval_every=0, val_tokens=512, eval_batch_size=8, lr=3e-3,
                      progress=False, device="cpu", timing_warmup=1))
    return out


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run, to damage."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


def _resume(run: Path, *extra: str) -> int:
    return main(["pretrain", "--out", str(run), "--resume", *extra])


def _newest(run: Path) -> Path:
    return run / "checkpoints" / "step_00000004" / "rank0.pt"


def _rewrite_payload(run: Path, change) -> None:
    payload = ckpt.load_checkpoint(_newest(run).parent)
    change(payload)
    torch.save(payload, _newest(run))


def _tiny_argv(tiny_model, corpus, out, *extra: str) -> list[str]:
    return ["pretrain", "--model", tiny_model, "--data", corpus, "--tokenizer", "bpe:320", "--seq-len", "32",
            "--batch-size", "4", "--steps", "2", "--eval-every", "0", "--val-tokens", "512", "--device", "cpu",
            "--no-progress", "--out", str(out), *extra]


# ------------------------------------------------- item 4: a damaged newest checkpoint


def _other_shape(payload):
    name = next(iter(payload["model"]))
    payload["model"][name] = torch.zeros(3, 5)


@pytest.mark.parametrize("damage", ["text", "a part missing", "another model's shape"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(run, capsys, damage):
    if damage == "text":  # pickle reads "I..." as an integer: a ValueError, not an unpickling error
        _newest(run).write_bytes(b"Interrupted by the copy\n")
    elif damage == "a part missing":
        _rewrite_payload(run, lambda p: p.pop("scheduler"))
    else:
        _rewrite_payload(run, _other_shape)
    assert _resume(run, "--steps", "5") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    said = [ln for ln in err.splitlines() if "step_00000004" in ln]
    assert len(said) == 1 and "unreadable" in said[0] and "step_00000002" in said[0], err
    assert (run / "checkpoints" / "unreadable-step_00000004").is_dir()  # kept for a look, not deleted
    assert json.loads((run / "summary.json").read_text())["steps"] == 5
    # Steps 3 and 4 were redone from the step-2 checkpoint: one record each.
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5]


def test_no_usable_checkpoint_is_one_line_and_moves_none_aside(run, capsys):
    for pt in (run / "checkpoints").glob("step_*/rank0.pt"):
        pt.write_bytes(b"Interrupted\n")
    assert _resume(run) == 2
    assert "no readable checkpoint" in _error(capsys)
    # Nothing was gained by moving them: a later look (or fix) finds them where they were.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


# ---------------------------------------------- item 5: metrics.jsonl torn in the middle


def test_a_torn_line_in_the_middle_of_metrics_keeps_every_readable_record(run, capsys):
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    torn = '{"step": 2, "loss": 5.8, "lr\n'
    path.write_text("".join(lines[:2]) + torn + "".join(lines[2:]))
    from gwt_optim.toolkit.report import load_run

    assert [r["step"] for r in load_run(run)[1] if "loss" in r] == [1, 2, 3, 4]  # report reads past it, and says so
    assert "line" in capsys.readouterr().err
    assert _resume(run, "--steps", "6") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "metrics.jsonl" in err and "line 3" in err, err
    assert [r["step"] for r in read_jsonl(path) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert (run / "metrics.jsonl.bad").read_text() == torn


def test_resuming_a_finished_run_keeps_one_final_validation(run):
    assert _resume(run) == 0
    finals = [r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in finals] == [4]


# ------------------------------------------------------ item 6: weights-only checkpoints


def test_a_training_checkpoint_loads_weights_only(finished):
    payload = torch.load(_newest(finished), weights_only=True)
    assert {"model", "optimizer", "scheduler", "data", "rng", "step"} <= set(payload)


class _Planted:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_crafted_checkpoint_runs_no_code_on_resume(run, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    _rewrite_payload(run, lambda p: p.update(model=_Planted(marker)))
    assert _resume(run, "--steps", "5") == 0  # the previous checkpoint is used instead
    assert not marker.exists()
    assert "step_00000004 is unreadable" in capsys.readouterr().err


def test_an_old_format_checkpoint_is_refused_in_one_line(run, capsys):
    for meta in (run / "checkpoints").glob("step_*/meta.json"):
        old = json.loads(meta.read_text())
        old.pop("format", None)  # what gwt-optim wrote before weights-only checkpoints
        meta.write_text(json.dumps(old))
    assert _resume(run, "--steps", "5") == 2
    line = _error(capsys)
    assert "step_00000004" in line and "weights_only" in line
    assert (run / "checkpoints" / "step_00000004").is_dir()  # not treated as damaged


@pytest.mark.parametrize("spec", ["galore:rank=4", "apollo:rank=4"])
def test_optimizer_helper_objects_round_trip_weights_only(tmp_path, spec):
    """GaLore's and APOLLO's projectors are objects, not tensors: saved as
    plain data and rebuilt on load, the resumed optimizer takes the same step."""
    pytest.importorskip(spec.split(":")[0] + "_torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer, parse_optimizer_arg

    name, opts = parse_optimizer_arg(spec)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                         num_hidden_layers=1, vocab_size=64, max_position_embeddings=16)

    def build():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        return model, build_optimizer(name, model, OptimizerConfig(lr=1e-2, options=dict(opts)))

    def step(model, opt, x):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model, opt = build()
    for _ in range(2):
        step(model, opt, x)
    ckpt.save_checkpoint(tmp_path, 2, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    torch.load(tmp_path / "checkpoints" / "step_00000002" / "rank0.pt", weights_only=True)
    twin, twin_opt = build()
    saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    twin.load_state_dict(saved["model"])
    twin_opt.load_state_dict(saved["optimizer"])
    step(model, opt, x)
    step(twin, twin_opt, x)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


# ------------------------------------------------------------ item 9: a full disk


def test_a_checkpoint_cut_short_by_a_full_disk_is_one_line_and_keeps_the_previous(run, monkeypatch, capsys):
    previous = _digest(run / "checkpoints" / "step_00000002")
    real = torch.save

    def disk_full(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"PK\x03\x04 half a zip")
        # what torch.save raises when the disk fills under its zip writer
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 354304 vs 354196")

    shutil.rmtree(run / "checkpoints" / "step_00000004")
    monkeypatch.setattr(torch, "save", disk_full)
    assert _resume(run) == 2
    line = _error(capsys)
    assert "step_00000004" in line and "step_00000002" in line and "disk" in line
    monkeypatch.setattr(torch, "save", real)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000002"]  # no half-written staging
    assert _digest(run / "checkpoints" / "step_00000002") == previous


def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.fixture
def mounts():
    mounted: list[Path] = []
    yield mounted
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a tmpfs needs root")
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_resumes(finished, tmp_path, mounts, capsys):
    from gwt_optim.toolkit.errors import run_command
    from gwt_optim.toolkit.train import Callback, TrainConfig, train

    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "size=4m")
    mounts.append(disk)
    cfg = TrainConfig.from_dict({**json.loads((finished / "config.json").read_text()), "out": str(disk / "run")})
    filler = disk / "filler"

    def fill(leave: int) -> None:
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        with open(filler, "ab") as f:
            f.write(b"\0" * max(0, free - leave))

    class FillTheDisk(Callback):
        def on_step_start(self, step, model):
            if step == 3:  # the step-2 checkpoint is in; leave room for the log, not for the next one
                fill(64 * 1024)

    assert run_command("pretrain", lambda _: train(cfg, callbacks=[FillTheDisk()]), None) == 2
    line = _error(capsys)
    assert "step_00000004" in line and "step_00000002" in line
    kept = _digest(disk / "run" / "checkpoints" / "step_00000002")
    fill(0)
    assert _resume(disk / "run") == 2  # still full: one line, nothing half-done
    line = _error(capsys)
    assert "no space left on device" in line.lower() and str(disk / "run") in line
    filler.unlink()
    assert _digest(disk / "run" / "checkpoints" / "step_00000002") == kept
    assert _resume(disk / "run") == 0
    assert json.loads((disk / "run" / "summary.json").read_text())["steps"] == 4


# ------------------------------------------------------ item 9: a read-only folder


def _read_only(folder: Path, mounts: list[Path]) -> str:
    """Make ``folder`` read-only for this process; the words its error will say."""
    if os.geteuid() != 0:
        for p in [folder, *folder.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
        return "permission denied"
    keep = folder.with_name(folder.name + ".keep")
    shutil.move(folder, keep)
    _mount_tmpfs(folder, "size=8m")
    mounts.append(folder)
    shutil.copytree(keep, folder, dirs_exist_ok=True)
    done = subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True)
    assert done.returncode == 0, done.stderr
    return "read-only file system"


def test_a_new_run_in_a_read_only_folder_is_one_line(tiny_model, corpus, tmp_path, mounts, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    words = _read_only(ro, mounts)
    assert main(_tiny_argv(tiny_model, corpus, ro / "run")) == 2
    line = _error(capsys)
    assert words in line.lower() and str(ro / "run") in line


def test_report_in_a_read_only_run_folder_is_one_line(run, mounts, capsys):
    words = _read_only(run, mounts)
    assert main(["report", str(run)]) == 2
    line = _error(capsys)
    assert words in line.lower() and str(run) in line and "--out" in line


# ---------------------------------------------------------- item 9: a bogus --model


@pytest.mark.parametrize("config, words", [
    ([1, 2], "JSON object"),
    ({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2}, "intermediate_size"),
    ({"model_type": "llama", "hidden_size": "big", "intermediate_size": 64, "num_attention_heads": 4,
      "num_hidden_layers": 2}, "hidden_size"),
    ({"model_type": "llama", "hidden_size": -32, "intermediate_size": 64, "num_attention_heads": 4,
      "num_hidden_layers": 2}, "hidden_size"),
], ids=["not an object", "a size missing", "a wrong type", "a negative size"])
def test_a_bogus_model_config_is_one_line_naming_it(corpus, tmp_path, capsys, config, words):
    model = tmp_path / "bogus" / "config.json"
    model.parent.mkdir()
    model.write_text(json.dumps(config))
    assert main(_tiny_argv(str(model), corpus, tmp_path / "run")) == 2
    line = _error(capsys)
    assert str(model) in line and words in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------- item 9: a binary metrics.jsonl


@pytest.mark.parametrize("command", ["report", "resume"])
def test_a_binary_metrics_file_is_one_line_naming_it(run, capsys, command):
    (run / "metrics.jsonl").write_bytes(bytes(range(256)) * 8)
    argv = ["report", str(run)] if command == "report" else ["pretrain", "--out", str(run), "--resume"]
    assert main(argv) == 2
    assert str(run / "metrics.jsonl") in _error(capsys)


# --------------------------------------------------------------- item 9: --vocab-size


def test_a_vocab_size_the_tokenizer_cannot_honour_is_refused(tiny_model, corpus, tmp_path, capsys):
    argv = _tiny_argv(tiny_model, corpus, tmp_path / "run", "--vocab-size", "1")
    argv[argv.index("--tokenizer") + 1] = "bpe"
    assert main(argv) == 2
    line = _error(capsys)
    assert "--vocab-size" in line and "259" in line
    assert not (tmp_path / "run").exists()  # refused before anything was trained or written
