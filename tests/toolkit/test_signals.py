"""Stopping a run from outside: SIGTERM (what torchrun, Slurm and Kubernetes
send) saves like Ctrl-C, under torchrun too; one writer per run folder; a
``compare`` that is stopped or killed takes its training child with it; the
process-group timeout is an option.

Every signal here is real (``os.kill`` on real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from _waiting import CAP_S, finish, wait_for

from gwt_optim.cli import main
from gwt_optim.toolkit import checkpoint as ckpt
from gwt_optim.toolkit.compare import run_dir_name
from gwt_optim.toolkit.metrics import read_jsonl
from gwt_optim.toolkit.train import TrainConfig, train

# One thread: a tiny model gains nothing from more, and the in-process reference runs match it bit for bit.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
NEVER_ENDS = "100000"  # steps: a run that only a signal stops

# Every test here sends real signals: SIGINT and SIGTERM as at a terminal, whatever this worker inherited
# (a child inherits an ignored signal, and training honours it).
pytestmark = pytest.mark.usefixtures("terminal_signals")


def _settings(tiny_model: str, corpus: str, steps: str) -> list[str]:
    return ["--model", tiny_model, "--data", corpus, "--tokenizer", "bpe:320", "--seq-len", "32", "--batch-size", "4",
            "--steps", steps, "--eval-every", "0", "--val-tokens", "512", "--eval-batch-size", "8", "--lr", "3e-3",
            "--device", "cpu", "--no-progress", "--save-every", "0"]


def _pretrain(tiny_model, corpus, out: Path, steps: str = NEVER_ENDS) -> list[str]:
    return [sys.executable, "-m", "gwt_optim", "pretrain", *_settings(tiny_model, corpus, steps), "--out", str(out)]


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def _max_step(run: Path) -> int:
    try:
        return max((r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r), default=0)
    except (OSError, ValueError):
        return 0


def _wait_for_step(run: Path, step: int, procs: list[subprocess.Popen]) -> None:
    wait_for(lambda: _max_step(run) >= step, f"step {step} in {run}", procs, poll_s=0.01)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting for a reaper that never comes in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float = CAP_S) -> bool:
    """Gone, or still there after ``timeout`` (a cap for a hung process, not a deadline)."""
    end = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not _alive(pid)


def _kill_leftovers(pids) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _saved_step(run: Path) -> int:
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None, f"no checkpoint in {run}"
    return int(ckpt.load_checkpoint(latest)["step"])


# ------------------------------------------------------------------ SIGTERM, one process


def test_sigterm_saves_with_save_every_0_and_resume_continues_bitwise(tiny_model, corpus, tmp_path):
    part, full = tmp_path / "part", tmp_path / "full"
    steps = 60
    proc = subprocess.Popen(_pretrain(tiny_model, corpus, part, str(steps)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        _wait_for_step(part, 2, [proc])
        os.kill(proc.pid, signal.SIGTERM)
        out, err = finish(proc)
    finally:
        _kill_leftovers([proc.pid])
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "SIGTERM" in err
    stopped = _saved_step(part)
    assert stopped == _max_step(part) < steps  # the last step logged is the one saved: no work lost

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["pretrain", "--out", str(part), "--resume"]) == 0
        # The oracle: the same run, never interrupted.
        config = json.loads((part / "config.json").read_text())
        train(TrainConfig.from_dict({**config, "out": str(full), "resume": False}))
    finally:
        torch.set_num_threads(threads)
    assert len(_losses(part)) == steps and _losses(part) == _losses(full)
    a, b = (ckpt.load_checkpoint(ckpt.latest_checkpoint(r))["model"] for r in (part, full))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ under torchrun


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_torchrun_and_its_workers_saves(tiny_model, corpus, tmp_path, free_port, sig):
    """Slurm's scancel (SIGTERM, or --signal=INT) signals every process of the
    job: each worker gets the signal twice, its own and the copy torchrun
    forwards, and must still stop at one step with its peer and save before
    torchrun's grace period ends."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port}", "-m", "gwt_optim", "pretrain",
           *_settings(tiny_model, corpus, NEVER_ENDS), "--out", str(run)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    workers: list[int] = []
    try:
        _wait_for_step(run, 2, [launcher])
        workers = _children(launcher.pid)
        assert len(workers) == 2
        for pid in [launcher.pid, *workers]:
            os.kill(pid, sig)
        out, err = finish(launcher)
    finally:
        _kill_leftovers([launcher.pid, *workers])
    assert "Unable to shutdown process" not in err  # torchrun had to SIGKILL a worker
    assert all(not _alive(pid) for pid in workers)
    stopped = _saved_step(run)
    assert 2 <= stopped == _max_step(run)
    assert f"checkpoint of step {stopped} saved" in err


# ------------------------------------------------------------------ one writer per run folder


def test_a_second_writer_on_a_running_folder_is_refused(tiny_model, corpus, tmp_path, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen(_pretrain(tiny_model, corpus, run), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=ENV)
    try:
        _wait_for_step(run, 1, [first])
        config = (run / "config.json").read_text()
        capsys.readouterr()
        # --resume is the dangerous one: it would truncate the running run's metrics and train beside it.
        assert main(["pretrain", "--out", str(run), "--resume", "--steps", "3"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"pid {first.pid}" in err and str(run) in err
        assert (run / "config.json").read_text() == config and _max_step(run) >= 1
        os.kill(first.pid, signal.SIGTERM)
        finish(first)
    finally:
        _kill_leftovers([first.pid])
    assert first.returncode == 128 + signal.SIGTERM


# ------------------------------------------------------------------ compare and its child


def _compare(tiny_model, corpus, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gwt_optim", "compare", "--optimizers", "adamw",
            *_settings(tiny_model, corpus, NEVER_ENDS), "--out", str(out), *extra]


def _start_compare(tiny_model, corpus, out: Path) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen(_compare(tiny_model, corpus, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=ENV)
    _wait_for_step(out / run_dir_name(0, "adamw"), 1, [parent])
    children = _children(parent.pid)
    assert len(children) == 1
    return parent, children[0]


@pytest.mark.slow
def test_sigterm_to_compare_stops_and_saves_its_child(tiny_model, corpus, tmp_path, capsys):
    out = tmp_path / "cmp"
    parent, child = _start_compare(tiny_model, corpus, out)
    try:
        capsys.readouterr()
        # A second compare on the same folder: refused before it looks at the runs (the other --steps would
        # otherwise be refused for another reason).
        argv = _compare(tiny_model, corpus, out, "--resume")[3:]
        argv[argv.index("--steps") + 1] = "100001"
        assert main(argv) == 2
        assert f"pid {parent.pid}" in capsys.readouterr().err
        os.kill(parent.pid, signal.SIGTERM)
        _, err = finish(parent)
    finally:
        _kill_leftovers([parent.pid, child])
    assert parent.returncode == 128 + signal.SIGTERM, err
    assert not _alive(child)
    run = out / run_dir_name(0, "adamw")
    assert _saved_step(run) == _max_step(run) >= 1


def test_a_killed_compare_takes_its_child_with_it(tiny_model, corpus, tmp_path):
    out = tmp_path / "cmp"
    parent, child = _start_compare(tiny_model, corpus, out)
    try:
        os.kill(parent.pid, signal.SIGKILL)
        finish(parent)
        assert _wait_gone(child), "the training child outlived its killed parent"
    finally:
        _kill_leftovers([parent.pid, child])
    run = out / run_dir_name(0, "adamw")
    assert _saved_step(run) == _max_step(run) >= 1  # it got SIGTERM, so it saved on its way out


# ------------------------------------------------------------------ the process-group timeout


class _Joined(Exception):
    pass


def test_dist_timeout_reaches_init_process_group(tiny_model, corpus, tmp_path, monkeypatch, capsys):
    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(backend=backend, **kwargs)
        raise _Joined

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    argv = ["pretrain", *_settings(tiny_model, corpus, "2"), "--out", str(tmp_path / "run")]
    with pytest.raises(_Joined):
        main([*argv, "--dist-timeout", "7.5"])
    assert seen["backend"] == "gloo" and seen["timeout"] == timedelta(seconds=7.5)
    with pytest.raises(_Joined):
        main(argv)
    assert seen["timeout"] == timedelta(seconds=300)  # gloo's default here, not torch's 30 minutes
    capsys.readouterr()
    assert main([*argv, "--dist-timeout", "0"]) == 2
    assert "--dist-timeout" in capsys.readouterr().err


def _every_toolkit_handler():
    """What the toolkit installs for SIGINT and SIGTERM, each a context manager on signals.StopSignals."""
    from gwt_optim.toolkit.signals import StopAtStep, abort_on_signals, sigterm_stops

    class NoRunners:
        aborted = False

    return {"training": StopAtStep(), "a driver's": sigterm_stops(), "a study's": abort_on_signals([NoRunners()], "")}


def test_every_handler_leaves_an_ignored_signal_ignored_and_restores_the_rest():
    """One rule for all three (issue 55): a signal ignored when the block starts (a background job's SIGINT)
    stays ignored inside it, and every handler in place before is back after it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # terminal_signals puts Python's own back after the test
    before = signal.getsignal(signal.SIGTERM)
    for who, handler in _every_toolkit_handler().items():
        with handler:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, who
            if who != "a driver's":  # SIGTERM alone: Ctrl-C stays Python's KeyboardInterrupt
                assert signal.getsignal(signal.SIGTERM) is not before, who
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, who
        assert signal.getsignal(signal.SIGTERM) is before, who


def test_no_handler_is_installed_outside_the_main_thread():
    """Python lets only the main thread own a handler: in another (a runner's worker thread) the toolkit's
    handlers install nothing and raise nothing."""
    import threading

    seen: dict[str, tuple] = {}

    def enter_each() -> None:
        for who, handler in _every_toolkit_handler().items():
            with handler:
                seen[who] = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))

    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    worker = threading.Thread(target=enter_each)
    worker.start()
    worker.join(CAP_S)
    assert seen == dict.fromkeys(_every_toolkit_handler(), before)


def test_the_first_signal_is_the_request_and_a_second_ctrl_c_quits_training_at_once(capfd):
    """The training loop's policy over StopSignals: the first SIGTERM sets the stop request and names itself
    on stderr; a repeated SIGTERM changes nothing; a second Ctrl-C raises KeyboardInterrupt there and then."""
    from gwt_optim.toolkit.signals import StopAtStep, Stopped

    with StopAtStep() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt) as quit_now:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs at the next bytecode; this is never reached
    assert type(quit_now.value) is KeyboardInterrupt
    stopped = stop.stopped()
    assert isinstance(stopped, Stopped) and stopped.signum == signal.SIGTERM
    assert capfd.readouterr().err.count("SIGTERM: stopping after this step to save a checkpoint") == 1
