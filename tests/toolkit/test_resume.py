"""Resume: Ctrl-C at any moment then --resume is bit for bit the uninterrupted
run; --resume takes the run's own settings and refuses the ones that would
splice two runs; a longer --steps rebuilds the schedule."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _waiting import finish, run, wait_for

from gwt_optim.cli import main
from gwt_optim.toolkit import checkpoint as ckpt
from gwt_optim.toolkit.metrics import read_jsonl
from gwt_optim.toolkit.schedules import WarmupCosine
from gwt_optim.toolkit.train import Callback, TrainConfig, train


def _losses(run: str | Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(Path(run) / "metrics.jsonl") if "loss" in r]


def _final_weights(run: str | Path) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(ckpt.latest_checkpoint(run))["model"]


def _evals(run: str | Path) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in read_jsonl(Path(run) / "metrics.jsonl") if "val_loss" in r]


def _assert_bitwise_equal(run: Path, reference: Path) -> None:
    assert _losses(run) == _losses(reference)
    assert _evals(run) == _evals(reference)  # every validation, once, with the same figure
    a, b = _final_weights(run), _final_weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = [json.loads((r / "summary.json").read_text()) for r in (run, reference)]
    assert summary[0]["val_loss"] == summary[1]["val_loss"] and summary[0]["steps"] == summary[1]["steps"]


# ----------------------------------------------------------------- SIGINT, in process


class _SigintAfter(Callback):
    """Send this process a real SIGINT a random time (up to ``span_s``) after
    the first step of this attempt starts: it lands anywhere -- forward,
    backward, optimizer step, logging, evaluation, a checkpoint save."""

    def __init__(self, rng: random.Random, span_s: float):
        self.rng, self.span_s, self.timer = rng, span_s, None

    def on_step_start(self, step, model):
        if self.timer is None:
            self.timer = threading.Timer(self.rng.uniform(0, self.span_s), os.kill, (os.getpid(), signal.SIGINT))
            self.timer.start()

    def cancel(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()


@pytest.mark.usefixtures("terminal_signals")
def test_sigint_at_random_moments_then_resume_is_bitwise_exact(tiny_config, tmp_path):
    """17 real SIGINTs; the subprocess test below sends 3 more."""
    rng = random.Random(7)
    full = tiny_config(out=str(tmp_path / "full"), steps=40, eval_every=3, save_every=4)
    train(full)
    # A step and a bit: signals land in every phase of a step, and in evaluations and saves.
    step_s = sorted(r["ms"] for r in read_jsonl(Path(full.out) / "metrics.jsonl") if "ms" in r)[20] / 1000
    training = False

    def like_python_while_training(signum, frame):
        if training:  # Python's own handler, for whatever train() does not handle itself
            raise KeyboardInterrupt
        # a SIGINT that arrives after train() returned must not stop pytest

    previous = signal.signal(signal.SIGINT, like_python_while_training)
    part = tiny_config(out=str(tmp_path / "part"), steps=40, eval_every=3, save_every=4)
    interrupts = attempts = 0
    try:
        while True:
            attempts += 1
            sender = _SigintAfter(rng, 1.5 * step_s) if interrupts < 17 else None
            try:
                training = True
                train(part, callbacks=[sender] if sender else [])
                break
            except KeyboardInterrupt:
                interrupts += 1
            finally:
                training = False
                if sender:
                    sender.cancel()
            part.resume = True
            assert attempts < 40, "the run never finished"
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupts == 17
    _assert_bitwise_equal(Path(part.out), Path(full.out))


class _SigintAtEnd(Callback):
    """A real SIGINT as step ``step`` ends: the stop lands between the step and its validation."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, step, record):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.usefixtures("terminal_signals")  # training installs its handler only for a signal not ignored
def test_a_stop_before_a_validation_makes_it_on_resume(tiny_config, tmp_path, stop_at):
    full = tiny_config(out=str(tmp_path / "full"), steps=8, eval_every=4)
    train(full)
    part = tiny_config(out=str(tmp_path / "part"), steps=8, eval_every=4)
    with pytest.raises(KeyboardInterrupt):
        train(part, callbacks=[_SigintAtEnd(4)])
    # The loop stops before step 4's validation, so that a launcher's grace period need not cover one.
    assert ckpt.latest_checkpoint(part.out).name == "step_00000004" and _evals(part.out) == []
    part.resume = True
    train(part)
    assert [s for s, _ in _evals(full.out)] == [4, 8]
    _assert_bitwise_equal(Path(part.out), Path(full.out))
    # A resume at a validation step that was made (a crash after a periodic save) makes it again, once.
    crash = tiny_config(out=str(tmp_path / "crash"), steps=8, eval_every=4, save_every=4)
    with pytest.raises(RuntimeError):
        train(crash, callbacks=[stop_at(6, RuntimeError)])
    assert _evals(crash.out) == _evals(full.out)[:1]
    crash.resume = True
    train(crash)
    _assert_bitwise_equal(Path(crash.out), Path(full.out))


# ------------------------------------------------------- SIGINT, a real subprocess


def _max_step(run: Path) -> int:
    try:
        return max((r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r), default=0)
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
@pytest.mark.usefixtures("terminal_signals")  # a terminal's Ctrl-C reaches the child, not a background job's
def test_sigint_to_the_pretrain_command_then_resume_is_bitwise_exact(tiny_model, corpus, tmp_path):
    def argv(out: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "gwt_optim", "pretrain", "--model", tiny_model, "--data", corpus,
                # enough steps that an idle machine cannot finish before the signal lands
                "--tokenizer", "bpe:320", "--seq-len", "32", "--batch-size", "4", "--steps", "200",
                "--eval-every", "4", "--save-every", "5", "--val-tokens", "512", "--lr", "3e-3",
                "--device", "cpu", "--no-progress",
                "--out", str(out), *extra]

    # One thread: a tiny model gains nothing from more, and they spin against other work on a busy machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full, part = tmp_path / "full", tmp_path / "part"
    rng = random.Random(3)
    interrupts, resume = 0, ()
    while interrupts < 3:
        start = _max_step(part)
        proc = subprocess.Popen(argv(part, *resume), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
        # wait for the loop to run (or for the run to end: reported below)
        wait_for(lambda: _max_step(part) > start or proc.poll() is not None, "training step", poll_s=0.005)
        time.sleep(rng.uniform(0, 0.015))
        proc.send_signal(signal.SIGINT)
        out, err = finish(proc)
        assert "Traceback" not in err, err
        assert proc.returncode in (0, 130), err
        if proc.returncode == 0:
            break  # finished before the signal: reported by the assert below
        assert "interrupted" in out + err
        interrupts += 1
        resume = ("--resume",)
    if proc.returncode == 130:
        run(argv(part, "--resume"), env=env)
    assert interrupts == 3, "the run finished before the third SIGINT: give it more steps"
    # The oracle: the same run, never interrupted, in this process (one thread, as the command's).
    config = json.loads((part / "config.json").read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(TrainConfig.from_dict({**config, "out": str(full), "resume": False}))
    finally:
        torch.set_num_threads(threads)
    _assert_bitwise_equal(part, full)


# ------------------------------------------------------------ --resume settings


def _interrupted(tiny_config, stop_at, out: Path, at: int, **kw):
    cfg = tiny_config(out=str(out), **kw)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, callbacks=[stop_at(at)])
    return cfg


def test_resume_with_no_other_flags_uses_the_runs_own_settings(tiny_config, tmp_path, stop_at):
    opt = "gwt-adamw:level=2:scale=0.25"
    full = tiny_config(out=str(tmp_path / "full"), optimizer=opt, steps=6)
    train(full)
    part = _interrupted(tiny_config, stop_at, tmp_path / "part", 4, optimizer=opt, steps=6)
    assert main(["pretrain", "--out", part.out, "--resume"]) == 0
    assert json.loads((Path(part.out) / "config.json").read_text())["optimizer"] == opt
    _assert_bitwise_equal(Path(part.out), Path(full.out))


@pytest.mark.parametrize("flag, value, key", [
    ("--optimizer", "gwt-adamw", "optimizer"), ("--model", "llama_9m", "model"), ("--data", "demo", "data"),
    ("--lr", "1e-2", "lr"), ("--seq-len", "16", "seq_len"),
])
def test_resume_refuses_settings_that_would_splice_two_runs(tiny_config, tmp_path, capsys, stop_at, flag, value, key):
    part = _interrupted(tiny_config, stop_at, tmp_path / "part", 3)
    before = (Path(part.out) / "config.json").read_text()
    assert main(["pretrain", "--out", part.out, "--resume", flag, value]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{key}:" in err and "--resume" in err
    assert (Path(part.out) / "config.json").read_text() == before  # not overwritten


def test_resume_with_more_steps_rebuilds_the_schedule(tiny_config, tmp_path):
    short = tiny_config(out=str(tmp_path / "short"), steps=5, warmup=2)
    train(short)
    assert main(["pretrain", "--out", short.out, "--resume", "--steps", "10"]) == 0
    run = Path(short.out)
    assert json.loads((run / "config.json").read_text())["steps"] == 10
    assert json.loads((run / "summary.json").read_text())["steps"] == 10
    lrs = [r["lr"] for r in read_jsonl(run / "metrics.jsonl") if "lr" in r]
    new = WarmupCosine(10, 2, short.min_lr_ratio)
    # Steps 6..10 follow the 10-step schedule (steps 1..5 kept the 5-step one).
    assert lrs[5:] == pytest.approx([short.lr * new(s) for s in range(5, 10)], rel=1e-12)
    assert lrs[5] > short.lr * WarmupCosine(5, 2, short.min_lr_ratio)(5)


def test_resume_below_the_checkpoint_step_is_refused(tiny_config, tmp_path, capsys):
    cfg = tiny_config(out=str(tmp_path / "run"), steps=6)
    train(cfg)
    assert main(["pretrain", "--out", cfg.out, "--resume", "--steps", "3"]) == 2
    assert "--steps 3" in capsys.readouterr().err


def test_a_new_run_never_replaces_a_finished_one(tiny_config, tmp_path):
    cfg = tiny_config(out=str(tmp_path / "run"), steps=2)
    train(cfg)
    shutil.rmtree(Path(cfg.out) / "checkpoints")  # even without its checkpoints
    before = (Path(cfg.out) / "summary.json").read_text()
    # (with nothing to resume, the message sends the user to another --out, not to --resume)
    with pytest.raises(FileExistsError, match="no checkpoint to continue from; choose another --out"):
        train(tiny_config(out=cfg.out, steps=3))
    assert (Path(cfg.out) / "summary.json").read_text() == before


def test_resaving_a_step_never_leaves_it_missing(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, 3, {"x": torch.ones(2)})
    real = os.replace

    def killed_before_the_new_copy_moves_in(src, dst):
        if Path(src).name.startswith(".staging"):  # the old copy is aside by now
            raise OSError("killed")
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", killed_before_the_new_copy_moves_in)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, 3, {"x": torch.zeros(2)})
    monkeypatch.setattr(ckpt.os, "replace", real)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000003"
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["x"].tolist() == [1.0, 1.0]


class _Draws(Callback):
    """What a data collator or a user's callback would draw, from each generator a checkpoint saves."""

    def __init__(self):
        self.draws = []

    def on_step_start(self, step, model):
        import numpy as np

        self.draws.append((random.random(), float(np.random.rand()), float(torch.rand(()))))


def test_python_numpy_and_torch_draws_follow_the_seed_fresh_and_resumed(tiny_config, tmp_path):
    random.seed(11)  # another test's leftovers must not matter
    runs = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        d = _Draws()
        train(tiny_config(out=str(tmp_path / name), steps=4, seed=seed), callbacks=[d])
        runs.append(d.draws)
        random.seed(12)
    assert runs[0] == runs[1] and runs[0] != runs[2]
    # A run stopped after 2 steps and resumed draws what the uninterrupted one drew, step for step.
    first, rest = _Draws(), _Draws()
    part = tiny_config(out=str(tmp_path / "part"), steps=2, seed=1)
    train(part, callbacks=[first])
    random.seed(13)
    train(tiny_config(out=part.out, steps=4, seed=1, resume=True), callbacks=[rest])
    assert first.draws + rest.draws == runs[0]
    # The run spans two processes, and its environment.json keeps the first one's record (and its commit).
    env = json.loads((Path(part.out) / "environment.json").read_text())
    assert env["resumed_at_step"] == 2 and len(env["earlier"]) == 1
    assert "earlier" not in env["earlier"][0] and env["earlier"][0]["git_commit"] == env["git_commit"]


def test_outside_git_the_commit_comes_from_the_environment_variable(tmp_path, monkeypatch):
    from gwt_optim.toolkit.metrics import git_commit

    monkeypatch.delenv("GWT_OPTIM_COMMIT", raising=False)
    assert git_commit(tmp_path) is None  # a git archive snapshot: git cannot tell
    monkeypatch.setenv("GWT_OPTIM_COMMIT", "2acb08f")
    assert git_commit(tmp_path) == "2acb08f"
    repo = tmp_path / "repo"  # inside a checkout, git's own answer wins
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout
    assert git_commit(repo) == head.strip()
