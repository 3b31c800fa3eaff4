"""`finetune` under faults: SIGTERM or Ctrl-C ends the run in flight and its
worker process (``--isolate yes``) and keeps the finished runs; a killed
``finetune`` takes its worker with it; one writer per ``--out``; ``--resume``
goes on from the finished runs, and an unreadable ``results.json`` under it
is one line.

Every signal here is real (``os.kill`` on real processes); the models are the
tiny random ones of ``gwt_optim.toolkit.finetune.tiny``, the data the local
fixtures in tests/data/finetune, so nothing needs the network."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _waiting import CAP_S, wait_for

pytest.importorskip("transformers")

from gwt_optim.cli import main
from gwt_optim.toolkit.finetune import lm
from gwt_optim.toolkit.finetune.common import run_measured
from gwt_optim.toolkit.finetune.tiny import save_tiny_llama
from gwt_optim.toolkit.run_folder import lock_run_dir

DATA = Path(__file__).resolve().parents[1] / "data" / "finetune"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
NEVER_ENDS = "1000000"  # steps: a run that only a signal stops
DIVERGES = "1e4"  # a learning rate whose run diverges (and so ends) within a few steps

# Every test here sends real signals: SIGINT and SIGTERM as at a terminal, whatever this worker inherited.
pytestmark = pytest.mark.usefixtures("terminal_signals")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    texts = [p.read_text() for p in (DATA / "lm_text").glob("*.txt")]
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), texts)


def _lm_argv(model: Path, out: Path, lrs: str) -> list[str]:
    return ["finetune", "lm", "--model", str(model), "--data", str(DATA / "lm_text"), "--methods", "adamw",
            "--lrs", lrs, "--steps", NEVER_ENDS, "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
            "--max-grad-norm", "0", "--warmup", "0", "--device", "cpu", "--isolate", "yes", "--no-progress",
            "--out", str(out)]


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe: nothing blocks on a full pipe
        # SIGINT at its default through terminal_signals, whatever this worker inherited.
        return subprocess.Popen([sys.executable, "-m", "gwt_optim", *argv], stdout=f, stderr=subprocess.STDOUT,
                                env=ENV)


def _status(pid: int) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running: not exited, not a zombie waiting for a reaper."""
    state = _status(pid).get("State", "")
    return bool(state) and not state.startswith(("Z", "X"))


def _wait_gone(pid: int, timeout: float = CAP_S) -> bool:
    """Gone, or still there after ``timeout`` (a cap for a hung process, not a deadline)."""
    end = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not _alive(pid)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _status(int(entry.name)).get("PPid") == str(pid):
            found.append(int(entry.name))
    return found


def _worker(parent: subprocess.Popen, log: Path) -> int:
    """The pid of ``parent``'s run worker (not multiprocessing's resource tracker) once it is set up: it
    ignores SIGINT, which it does just before it asks Linux for SIGTERM at its parent's death."""
    found = []

    def set_up() -> bool:
        found[:] = [pid for pid in _children(parent.pid) if "spawn_main" in _cmdline(pid)
                    and int(_status(pid).get("SigIgn", "0"), 16) & (1 << (signal.SIGINT - 1))]
        return bool(found)

    wait_for(set_up, "run worker", [parent], log, poll_s=0.05)
    time.sleep(0.2)  # past die_with_parent
    return found[0]


def _stop(parent: subprocess.Popen, log: Path) -> None:
    """Wait for ``parent`` to exit (it was just signalled)."""
    wait_for(lambda: parent.poll() is not None, "exit", [], log)


def _runs(out: Path) -> list[dict] | None:
    try:
        return json.loads((out / "results.json").read_text())["runs"]
    except (OSError, ValueError, KeyError):
        return None


def _kill_leftovers(pids) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ signals to an isolated finetune lm


@pytest.mark.slow
def test_sigterm_ends_the_worker_and_keeps_the_finished_run(tiny_llama, tmp_path, capsys):
    out, log = tmp_path / "out", tmp_path / "log.txt"
    # The first run diverges within a few steps and is recorded; the second would train for hours.
    argv = _lm_argv(tiny_llama, out, f"{DIVERGES},1e-3")
    parent = _start(argv, log)
    helpers: list[int] = []
    try:
        wait_for(lambda: bool(_runs(out)), "results.json with its first run", [parent], log, poll_s=0.05)
        worker = _worker(parent, log)
        helpers = _children(parent.pid)  # the worker and multiprocessing's resource tracker
        assert len(_runs(out)) == 1
        # A second finetune on the same --out: one line, exit 2, and it writes nothing there.
        before = (out / "results.json").read_bytes()
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert "gwt-optim finetune lm: error:" in err and f"pid {parent.pid}" in err and str(out) in err
        assert (out / "results.json").read_bytes() == before

        os.kill(parent.pid, signal.SIGTERM)
        _stop(parent, log)
    finally:
        _kill_leftovers([parent.pid, *helpers])
    text = log.read_text()
    assert parent.returncode == 128 + signal.SIGTERM, text
    assert "stopped by SIGTERM" in text and "Traceback" not in text, text
    assert not _alive(worker), "the run worker outlived its stopped parent"
    assert all(_wait_gone(pid) for pid in helpers), "a child of finetune outlived it"
    runs = _runs(out)
    assert [(r["method"], r["lr"]) for r in runs] == [("adamw", float(DIVERGES))]
    assert runs[0]["val_ppl"] == math.inf and runs[0]["steps"] < 100
    # The report is of the finished run, and the folder is free again.
    assert "| adamw " in (out / "results.md").read_text()
    with lock_run_dir(out):
        pass


def test_ctrl_c_ends_the_worker_of_the_run_in_flight(tiny_llama, tmp_path):
    out, log = tmp_path / "out", tmp_path / "log.txt"
    parent = _start(_lm_argv(tiny_llama, out, "1e-3"), log)
    worker = None
    try:
        worker = _worker(parent, log)
        os.kill(parent.pid, signal.SIGINT)  # to the parent alone: the worker learns it from the parent
        _stop(parent, log)
    finally:
        _kill_leftovers([parent.pid] + ([worker] if worker else []))
    text = log.read_text()
    assert parent.returncode == 128 + signal.SIGINT, text
    assert "interrupted" in text and "Traceback" not in text, text
    assert not _alive(worker)
    saved = json.loads((out / "results.json").read_text())  # what was done: the model's perplexity before
    assert saved["runs"] == [] and math.isfinite(saved["val_ppl_before"])
    assert not (out / "results.md").exists()  # no report of no run


def test_a_killed_finetune_takes_its_worker_with_it(tiny_llama, tmp_path):
    out, log = tmp_path / "out", tmp_path / "log.txt"
    parent = _start(_lm_argv(tiny_llama, out, "1e-3"), log)
    worker = None
    try:
        worker = _worker(parent, log)
        os.kill(parent.pid, signal.SIGKILL)  # no handler runs: Linux tells the worker (PR_SET_PDEATHSIG)
        _stop(parent, log)
        assert _wait_gone(worker), "the run worker outlived its killed parent"
    finally:
        _kill_leftovers([parent.pid] + ([worker] if worker else []))


# ------------------------------------------------------------------ the worker's own ending


def test_an_error_in_the_worker_is_raised_in_the_parent():
    # int("x") in a worker: the ValueError itself (a user error: one line, exit 2), the worker's traceback its cause
    with pytest.raises(ValueError, match="invalid literal") as caught:
        run_measured(True, int, "x")
    assert "Traceback" in str(caught.value.__cause__)


def test_a_worker_killed_from_outside_is_an_error_naming_the_signal():
    with pytest.raises(RuntimeError, match="killed by SIGKILL"):
        run_measured(True, signal.raise_signal, signal.SIGKILL)  # as the kernel's OOM killer does


def test_a_worker_stopped_from_outside_stops_the_parent_too():
    # SIGTERM to the whole job (kill of the process group, systemd) may reach the worker first: the parent stops
    # as that signal stops it (exit 128 + 15 under the CLI), it does not fail.
    from gwt_optim.toolkit.signals import Stopped

    with pytest.raises(Stopped) as caught:
        run_measured(True, signal.raise_signal, signal.SIGTERM)
    assert caught.value.signum == signal.SIGTERM


# ------------------------------------------------------------------ one writer, readable files


def test_a_second_finetune_glue_on_a_held_out_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    with lock_run_dir(out):  # another finetune writes here
        rc = main(["finetune", "glue", "--tasks", "rte", "--methods", "adamw", "--model", str(tmp_path / "none"),
                   "--data-dir", str(DATA / "glue"), "--isolate", "no", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "gwt-optim finetune glue: error:" in err and f"pid {os.getpid()}" in err
    assert not (out / "results.json").exists()


def test_a_stopped_finetune_glue_keeps_its_finished_runs_and_resume_goes_on(tmp_path, monkeypatch, capsys):
    from gwt_optim.toolkit.finetune import glue, glue_train

    calls = []

    def one_run(task, spec, tokenizer, data, settings, work_dir):
        calls.append(spec.label)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the second run
            time.sleep(5)
        return {"task": task.name, "method": spec.label, "scores": {"accuracy": 0.5}, "train_loss": 0.7,
                "steps": 1, "train_seconds": 0.1, "train_samples_per_second": 10.0, "optimizer_state_bytes": 8,
                "peak_memory_bytes": 8, "peak_memory_kind": "Peak RSS"}

    monkeypatch.setattr(glue_train, "_load_glue_tokenizer", lambda name: None)
    monkeypatch.setattr(glue_train, "_tokenize", lambda data, *a: data)
    monkeypatch.setattr(glue_train, "_run_one", one_run)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.md").write_text("an earlier command's report\n")
    settings = glue.GlueSettings(model=str(tmp_path), data_dir=str(DATA / "glue"), isolate=False, progress=False)
    # A terminal's Ctrl-C: Python's own handler, from terminal_signals.
    with pytest.raises(KeyboardInterrupt):
        glue.run_glue(["rte"], ["adamw", "gwt-adamw:level=2"], settings, out)
    assert calls == ["adamw", "gwt-adamw:level=2"]
    saved = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in saved["runs"]] == ["adamw"]
    report = (out / "results.md").read_text()
    assert "| adamw " in report and "earlier" not in report
    assert "keeps the 1 finished run(s); --resume goes on from them" in capsys.readouterr().out
    with lock_run_dir(out):  # released
        pass

    # --resume trains only the run that did not finish, and the report has both.
    records, report = glue.run_glue(["rte"], ["adamw", "gwt-adamw:level=2"], settings, out, resume=True)
    assert calls == ["adamw", "gwt-adamw:level=2", "gwt-adamw:level=2"]
    assert [r["method"] for r in records] == ["adamw", "gwt-adamw:level=2"]
    assert [r["method"] for r in json.loads((out / "results.json").read_text())["runs"]] == ["adamw",
                                                                                             "gwt-adamw:level=2"]
    assert "| adamw " in report and "| gwt-adamw:level=2 " in report
    # Once everything is done, a resume trains nothing; how runs are shown or placed may change.
    quiet = glue.GlueSettings(**{**settings.__dict__, "device": "cpu", "isolate": True, "progress": True})
    assert glue.run_glue(["rte"], ["adamw", "gwt-adamw:level=2"], quiet, out, resume=True)[1] == report
    assert len(calls) == 3
    # Other settings are other runs: refused, not mixed into one table.
    with pytest.raises(ValueError, match="other settings"):
        glue.run_glue(["rte"], ["adamw"], glue.GlueSettings(**{**settings.__dict__, "lr": 3e-5}), out, resume=True)
    assert len(calls) == 3


@pytest.mark.parametrize("content", [b'{"settings": {', b"\x00\xff binary", b"[1, 2]"],
                         ids=["torn", "binary", "no-runs"])
@pytest.mark.parametrize("command", ["lm", "glue"])
def test_resume_from_an_unreadable_results_json_is_one_line(tiny_llama, tmp_path, capsys, content, command):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_bytes(content)
    if command == "lm":
        argv = _lm_argv(tiny_llama, out, "1e-3")
        argv[argv.index("--isolate") + 1] = "no"
    else:  # read before any model or data: the model path need not exist
        argv = ["finetune", "glue", "--tasks", "rte", "--methods", "adamw", "--model", str(tmp_path / "none"),
                "--data-dir", str(DATA / "glue"), "--isolate", "no", "--no-progress", "--out", str(out)]
    rc = main([*argv, "--resume"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert str(out / "results.json") in errors[0] and "--resume" in errors[0]
