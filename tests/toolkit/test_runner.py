"""The one experiment runner (issue 17, item 5): ``compare`` and the quality
protocol drive runs through ``gwt_optim.toolkit.runner``. Its seams are tested
here on a toy child process (no training): reuse, moving a finished run aside,
resuming a cut-short run, the deadline, abort, a busy folder, and each child in
its own session."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _waiting import CAP_S, finish, wait_for

from gwt_optim.toolkit import runner as R

ROOT = Path(__file__).resolve().parents[2]

# The toy "pretrain": reads its requested config, records how it was started, then either finishes
# (config.json, summary.json) or, with "wait" set, waits for SIGTERM and saves on its way out.
CHILD = r"""
import json, os, signal, sys, time
from pathlib import Path
requested = Path(sys.argv[1])
run = requested.parent
cfg = json.loads(requested.read_text())
(run / "started.json").write_text(json.dumps({"pid": os.getpid(), "sid": os.getsid(0),
                                              "resume": "--resume" in sys.argv}))
print("child says hello", flush=True)
if cfg.get("wait"):
    def stop(signum, frame):
        (run / "saved").write_text(str(signum))
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(0.05)
(run / "config.json").write_text(json.dumps(cfg))
(run / "summary.json").write_text(json.dumps({"val_loss": cfg["lr"], "steps": cfg["steps"]}))
"""


class Toy(R.Runner):
    def __init__(self, out: Path, *, wait=(), lr=1.0, **kw):
        kw.setdefault("quiet", True)
        super().__init__(out, **kw)
        self.script = out / "child.py"
        out.mkdir(parents=True, exist_ok=True)
        self.script.write_text(CHILD)
        self.wait, self.lr = set(wait), lr

    def run_dir(self, job):
        return self.out / f"job{job}"

    def config(self, job):
        return {"steps": 2, "lr": self.lr + job, "wait": job in self.wait, "out": str(self.run_dir(job))}

    def job_fields(self, job):
        return {"job": job}

    def command(self, requested, resume):
        return [sys.executable, str(self.script), str(requested)] + (["--resume"] if resume else [])


def _started(run: Path) -> dict:
    return json.loads((run / "started.json").read_text())


def test_runs_each_job_once_then_reuses_it_and_moves_a_changed_one_aside(tmp_path):
    toy = Toy(tmp_path, jobs=2)
    res = toy.run_all([0, 1, 0])
    toy.shutdown()
    assert [res[j]["status"] for j in (0, 1)] == ["ok", "ok"] and res[1]["val_loss"] == 2.0
    assert res[0]["job"] == 0 and res[0]["rc"] == 0 and toy.counts["ran"] == 2
    assert "child says hello" in (tmp_path / "job0" / "log.txt").read_text()  # the child's output: its log
    assert not _started(tmp_path / "job0")["resume"]

    again = Toy(tmp_path, resume=True)
    assert again.run_job(0)["reused"] and again.counts == {"ran": 0, "reused": 1, "failed": 0, "skipped": 0}

    changed = Toy(tmp_path, resume=True, lr=5.0)  # another lr: not the same run, and never deleted
    assert changed.run_job(0)["val_loss"] == 5.0
    assert json.loads((tmp_path / "job0.old1" / "summary.json").read_text())["val_loss"] == 1.0


def test_a_cut_short_run_resumes_from_its_checkpoint(tmp_path):
    toy = Toy(tmp_path, resume=True)
    toy.resume_partial = True
    run = toy.run_dir(0)
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({**toy.config(0), "out": "/elsewhere", "resume": True}))
    (run / "log.txt").write_text("the first session\n")
    assert toy.run_job(0)["status"] == "ok"
    assert _started(run)["resume"] and (run / "log.txt").read_text().startswith("the first session")
    # a cut-short run with another configuration starts afresh
    other = Toy(tmp_path / "b", resume=True, lr=3.0)
    other.resume_partial = True
    run = other.run_dir(0)
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({**other.config(0), "lr": 9.0}))
    assert other.run_job(0)["status"] == "ok" and not _started(run)["resume"]


@pytest.mark.usefixtures("terminal_signals")  # abort sends the child a real SIGTERM
def test_nothing_starts_after_the_deadline_and_abort_stops_a_run_that_saves(tmp_path):
    late = Toy(tmp_path / "late", deadline=0.0, start=time.monotonic() - 1)
    assert late.run_job(0)["status"] == "skipped" and not late.run_dir(0).exists()

    toy = Toy(tmp_path, wait={0})
    run = toy.run_dir(0)
    fut = toy.submit(0)
    wait_for((run / "started.json").is_file, "started.json", poll_s=0.05)
    child = _started(run)
    assert child["sid"] == child["pid"]  # its own session: a Ctrl-C at the terminal reaches only the driver
    toy.abort()
    result = fut.result(timeout=CAP_S)
    toy.shutdown()
    assert result["status"] == "stopped" and (run / "saved").read_text() == str(int(signal.SIGTERM))
    assert toy.counts["skipped"] == 1 and toy.run_job(1)["status"] == "skipped"  # aborted: nothing more starts


def test_a_folder_another_process_writes_is_left_alone(tmp_path):
    from gwt_optim.toolkit.run_folder import lock_run_dir

    toy = Toy(tmp_path)
    run = toy.run_dir(0)
    run.mkdir()
    (run / "summary.json").write_text("{}")
    with lock_run_dir(run):  # another writer (a second open file description: flock refuses it)
        result = toy.run_job(0)
    assert result["status"] == "failed" and "in use" in result["error"]
    assert (run / "summary.json").read_text() == "{}" and not list(tmp_path.glob("job0.old*"))


@pytest.mark.usefixtures("terminal_signals")
def test_a_killed_driver_takes_its_child_with_it(tmp_path):
    """PR_SET_PDEATHSIG: the child of a thread of a SIGKILLed driver gets SIGTERM and saves."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys, time\n"
        f"sys.path[:0] = [{str(ROOT / 'src')!r}, {str(Path(__file__).parent)!r}]\n"
        "from pathlib import Path\n"
        "from test_runner import Toy\n"
        "toy = Toy(Path(sys.argv[1]), wait={0})\n"
        "toy.submit(0)\n"
        "time.sleep(600)\n")
    import subprocess

    proc = subprocess.Popen([sys.executable, str(driver), str(tmp_path / "out")], env={**os.environ},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "out" / "job0"
    try:
        wait_for((run / "started.json").is_file, "started.json", [proc], poll_s=0.05)
        assert (run / "started.json").is_file()
        proc.kill()
        finish(proc)
        wait_for((run / "saved").is_file, "saved", poll_s=0.05)
        assert (run / "saved").read_text() == str(int(signal.SIGTERM))
    finally:
        if proc.poll() is None:
            proc.kill()
        child = json.loads((run / "started.json").read_text())["pid"] if (run / "started.json").is_file() else None
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_free_worker_takes_the_waiting_call_of_lowest_priority_and_errors_reach_the_caller():
    import threading

    pool, gate, order = R.PriorityPool(1), threading.Event(), []
    held = pool.submit(gate.wait)  # the one worker is busy while the rest queue
    futs = [pool.submit(order.append, name, priority=p)
            for name, p in [("c", (2,)), ("a1", (0,)), ("b", (1, 5)), ("a2", (0,)), ("b0", (1, 0))]]

    def fail():
        raise OSError("disk full")

    bad = pool.submit(fail, priority=(1, 9))
    gate.set()
    pool.shutdown(wait=True)
    assert held.result() and all(f.done() for f in futs)
    assert order == ["a1", "a2", "b0", "b", "c"]  # by priority, then first submitted first
    with pytest.raises(OSError, match="disk full"):
        bad.result()


def test_a_freed_worker_waits_for_the_calls_its_finished_call_releases():
    """A stage waiting on a run queues its next runs when the run ends; they must compete for the slot the
    run frees, not lose it to a lower-priority call that waited longer (the budget study's weight-decay run
    and the reporting seeds that wait on it)."""
    import threading

    pool, order = R.PriorityPool(1), []
    pool.SETTLE, pool.SETTLE_MAX = 4.0, 4.0  # a 0.5 s call: its worker waits 2 s, ample for a waiting thread
    first = pool.submit(lambda: time.sleep(0.5) or order.append("tuning"), priority=(0,))
    later = pool.submit(order.append, "seed 3", priority=(1, 3))

    def stage():  # waits for the tuning run, then queues the run that depends on it
        first.result()
        pool.submit(order.append, "seed 1", priority=(1, 1)).result()

    waiter = threading.Thread(target=stage)
    waiter.start()
    waiter.join(timeout=60)
    later.result(timeout=60)
    pool.shutdown()
    assert order == ["tuning", "seed 1", "seed 3"]


def test_spec_text_round_trips_as_written():
    from gwt_optim.registry import format_spec, parse_optimizer_arg, split_spec

    assert split_spec(" gwt-adamw:level=2:detail-clip=none:eps=1e-6 ") == (
        "gwt-adamw", {"level": "2", "detail_clip": "none", "eps": "1e-6"})
    spec = "adamw:scale=1:regular_lr=0.003:lr=1e-2"
    assert format_spec(*split_spec(spec)) == spec
    with pytest.raises(ValueError, match="expected key=value"):
        split_spec("adamw:level")
    # the registry's checked parse is the same split, then each value converted
    assert parse_optimizer_arg("gwt-adamw:level=2:detail-clip=none") == ("gwt-adamw", {"level": 2, "detail_clip": None})


def _load(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"_runner_test_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_compare_and_the_protocol_share_the_one_runner():
    from gwt_optim.toolkit import compare

    P = _load("_protocol")
    assert issubclass(P.Runner, R.Runner) and issubclass(compare._CompareRunner, R.Runner)
    from gwt_optim import registry

    assert P.same_config is R.same_config and P.parse_spec is registry.split_spec
    assert P.format_spec is registry.format_spec
    # no second way to start or signal a run: only the toolkit's runner starts processes
    for path in ("benchmarks/_protocol.py", "benchmarks/_budget.py", "benchmarks/quality.py",
                 "src/gwt_optim/toolkit/compare.py"):
        text = (ROOT / path).read_text()
        assert "subprocess" not in text and "signal.signal(" not in text and "Popen" not in text, path


def test_the_protocol_runner_names_runs_as_before(tmp_path):
    """The run-folder layout and requested config that a results folder is reused by (runs/budget)."""
    P = _load("_protocol")
    base = {"model": "llama_tiny", "data": "demo", "seq_len": 256, "tokenizer": "bpe", "vocab_size": 4096}
    runner = P.Runner(tmp_path, P.Setting(base, windows=3735, steps=100))
    job = P.Job(8192, "gwt-adamw:level=2:scale=1:regular_lr=0.003", 1e-2, 1)
    assert runner.run_dir(job) == tmp_path / "runs" / "tokens8192-steps100" / "seed1" / \
        "gwt-adamw-level2-scale1-regular-lr0.003-lr0.01"
    cfg = runner.config(job)
    assert (cfg["optimizer"], cfg["lr"], cfg["seed"], cfg["steps"], cfg["batch_size"]) == (job.spec, 1e-2, 1, 100, 32)
    assert cfg["out"] == str(runner.run_dir(job)) and cfg["progress"] is False
    assert runner.env["TOKENIZERS_PARALLELISM"] == "false" and runner.cwd == ROOT
    runner.shutdown()


@pytest.mark.usefixtures("terminal_signals")  # an ignored SIGTERM is left alone
def test_sigterm_stops_raises_stopped_and_restores_the_handler():
    from gwt_optim.toolkit.signals import Stopped, sigterm_stops

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped), sigterm_stops():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_protocol_on_the_same_out_is_refused(tmp_path, monkeypatch, capsys):
    from gwt_optim.toolkit.run_folder import lock_run_dir

    P = _load("_protocol")
    monkeypatch.setattr(P, "prepare_data", lambda base: {"train_tokens": 10**6, "train_windows": 4000,
                                                         "tokenizer": None})
    monkeypatch.setattr(P, "run_study", lambda *a, **k: pytest.fail("a run started"))
    out = tmp_path / "q"
    out.mkdir()
    with lock_run_dir(out):  # another quality.py writes here
        assert P.main(["--out", str(out), "--no-preflight", "--contenders", "adamw", "--lrs", "1e-3"],
                      mode="quality", description="") == 2
    err = capsys.readouterr().err
    assert "quality.py: error:" in err and "in use by another gwt-optim process" in err
    assert not (out / "quality.json").exists()


def test_the_child_is_the_command_itself_after_the_wrapper(tmp_path):
    # end_with_parent execs the command in the same process: its pid, output and exit status are the command's
    cmd = R.end_with_parent([sys.executable, "-c", "import os, sys; print(os.getpid()); sys.exit(3)"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out, _ = finish(proc)
    assert proc.returncode == 3 and int(out) == proc.pid


@pytest.mark.usefixtures("terminal_signals")  # no handler goes over an ignored SIGINT (a background worker's)
def test_ctrl_c_again_reaches_the_runs():
    from gwt_optim.toolkit.signals import abort_on_signals

    class Stub:
        aborted = False
        sent: list = []

        def abort(self):
            self.aborted = True
            self.sent.append("abort")

        def signal_runs(self, signum):
            self.sent.append(signum)

    stub = Stub()
    with abort_on_signals([stub], "stopping"):
        handler = signal.getsignal(signal.SIGINT)
        handler(signal.SIGINT, None)
        handler(signal.SIGTERM, None)  # a repeated SIGTERM asks again for the same stop
        handler(signal.SIGINT, None)
    assert stub.sent == ["abort", "abort", signal.SIGINT]
