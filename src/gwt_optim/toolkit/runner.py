"""The one way to run a set of training runs, shared by ``gwt-optim compare``
and ``benchmarks/quality.py`` (the fair protocol and its budget mode).

A run is one ``python -m gwt_optim pretrain --config RUN/requested_config.json``
process (under ``torch.distributed.run`` for ``nproc_per_node > 1``), with
everything it prints in ``RUN/log.txt``. :class:`Runner` runs jobs, at most
``jobs`` at a time on a thread pool (or one by one in the calling thread with
:meth:`Runner.run_job`), each job once:

- a finished run with the same configuration (:func:`same_config`) is reused
  with ``resume``, never retrained;
- a run cut short resumes from its last checkpoint (``resume_partial``);
- a finished run with another configuration is moved aside to
  ``NAME.old<k>``, never deleted (the default :meth:`Runner.prepare`;
  ``compare`` settles earlier runs before it starts and overrides it);
- ``deadline``: no job starts after it, and a job still going ``grace``
  seconds later is stopped (it saves); :meth:`Runner.abort` stops them all.

Every child runs in its own session: Ctrl-C at the terminal reaches only this
process, which passes one SIGINT (or its SIGTERM) on to the run in progress,
so it stops at a step boundary and saves; if this process is killed (SIGKILL),
Linux sends each child SIGTERM (``PR_SET_PDEATHSIG``), so a run never
outlives its driver as a second writer. How the signals reach this process
(SIGTERM as a ``Stopped`` while one run is waited for; an abort of every runner
for a study) is :mod:`gwt_optim.toolkit.signals`. A failed, diverged or stopped
run is a result with a ``status``, never an exception.

Specs are read and written as text by :func:`gwt_optim.registry.split_spec`
and :func:`~gwt_optim.registry.format_spec` (run folders and reused runs are
named by that text); :func:`~gwt_optim.registry.parse_optimizer_arg` checks a
spec and converts its values.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "Runner",
    "PriorityPool",
    "same_config",
    "launcher",
    "last_error",
    "end_with_parent",
    "die_with_parent",
    "lock_out",
    "signal_group",
    "MetricsFollower",
]


# --------------------------------------------------------------------------- #
# Specs as text
# --------------------------------------------------------------------------- #


# --------------------------------------------------------------------------- #
# Same configuration
# --------------------------------------------------------------------------- #


def same_config(have: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether a run's ``config.json`` (``have``) is the run ``want`` asks for. How it was driven (its folder,
    whether it was resumed: ``DRIVING_ONLY``) is left out, so a results folder copied elsewhere, or a run
    finished by a resume, still matches; a field that the run predates counts as equal when ``want`` has it
    at TrainConfig's default (a new option keeps the old behaviour by default)."""
    from gwt_optim.toolkit.train import DRIVING_ONLY, TrainConfig

    want = json.loads(json.dumps(want))
    defaults = json.loads(json.dumps(TrainConfig().to_dict()))
    for key, value in want.items():
        if key in DRIVING_ONLY:
            continue
        if key in have:
            if have[key] != value:
                return False
        elif key not in defaults or defaults[key] != value:
            return False
    return True


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- #
# Processes and signals
# --------------------------------------------------------------------------- #


def launcher(nproc: int) -> list[str]:
    """The command that runs ``gwt_optim``: this Python, or torchrun with ``nproc`` processes."""
    if nproc <= 1:
        return [sys.executable, "-m", "gwt_optim"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "gwt_optim"]


# Run first in a child (``parent``: the pid it expects as its parent): Linux
# then sends it SIGTERM when the thread that started it ends, even by SIGKILL
# (prctl(PR_SET_PDEATHSIG), which survives exec); a child whose parent is gone
# already exits, since nobody would send it. Text, so that both the wrapper
# below and die_with_parent run this one piece of code.
_ARM_PDEATHSIG = """\
import ctypes, os, signal, sys
try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != parent:  # the parent died before the call: nobody would send it
    sys.exit(128 + int(signal.SIGTERM))
"""

# Run by the child's own interpreter before it execs the real command. Not a
# preexec_fn: that runs between fork and exec, where a lock another thread of
# this process held at the fork (the runner forks from several threads) can
# deadlock the child.
_DIE_WITH_PARENT = "import sys\nparent = int(sys.argv[1])\n" + _ARM_PDEATHSIG + "os.execv(sys.argv[2], sys.argv[2:])\n"


def end_with_parent(command: list[str]) -> list[str]:
    """``command`` run so that Linux sends it SIGTERM when this process ends,
    even by SIGKILL, so a run never outlives its driver as a second writer
    (elsewhere ``command`` as it is). Linux ties the signal to the thread that
    starts the child: each :class:`Runner` thread waits for its child."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def die_with_parent(parent: int) -> None:
    """:func:`end_with_parent` from inside: called first in a child that is no
    command line (a ``multiprocessing`` worker), it has Linux send this process
    SIGTERM when the thread of ``parent`` that started it ends, even by SIGKILL;
    it exits at once if ``parent`` is gone already. Elsewhere nothing."""
    if sys.platform.startswith("linux"):
        exec(_ARM_PDEATHSIG, {"parent": int(parent)})  # noqa: S102 - the wrapper's own text, see above


def lock_out(stack: contextlib.ExitStack, out: Path, prog: str) -> bool:
    """Hold ``out`` against a second writer for the life of ``stack``
    (:func:`~gwt_optim.toolkit.run_folder.lock_run_dir`; each run also locks its own folder). False, after
    one line on stderr naming ``prog``, when another process holds it."""
    from gwt_optim.toolkit.errors import UsageError
    from gwt_optim.toolkit.run_folder import lock_run_dir

    out.mkdir(parents=True, exist_ok=True)
    try:
        stack.enter_context(lock_run_dir(out))
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return False
    return True


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    """``signum`` to the child's process group (it leads its own session: torchrun's workers too)."""
    with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
        os.killpg(proc.pid, signum)


def _stop(proc: subprocess.Popen, wait: float = 10.0) -> int:
    """SIGTERM (the run saves), then SIGKILL after ``wait`` seconds; the exit status."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
    return proc.wait()


class MetricsFollower:
    """The newest step and losses of a run's ``metrics.jsonl``, read incrementally
    (a resumed run truncates the file: reading then starts over)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""
        self.step, self.post = 0, {}

    def poll(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self.offset:
            self.offset, self.partial = 0, b""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            self.step = max(self.step, int(rec.get("step", 0))) if "loss" in rec else self.step
            if "loss" in rec:
                self.post["loss"] = f"{rec['loss']:.3f}"
            if "val_loss" in rec:
                self.post["val_loss"] = f"{rec['val_loss']:.3f}"


def last_error(log: Path) -> str:
    """The child's one-line error, or the end of its traceback."""
    try:
        lines = [ln.split("\r")[-1].rstrip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln.strip()]
    for ln in reversed(lines):
        if ": error: " in ln:
            return ln
    return "\n".join(lines[-5:])


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# What a result keeps of a run's summary.json.
SUMMARY_KEYS = ("val_loss", "train_loss", "state_bytes", "steps", "tokens", "epochs", "wall_s", "ms_per_step",
                "peak_gpu_bytes")


def _keep(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary.get(k) for k in SUMMARY_KEYS}


# --------------------------------------------------------------------------- #
# The runner
# --------------------------------------------------------------------------- #


class PriorityPool:
    """A fixed number of worker threads that each take, when free, the pending call of lowest
    ``priority`` (earliest submitted among equals): a plain first-in-first-out pool makes a study that
    queues all of one contender's seeds wait for them before its rival's first seed starts.

    Each :meth:`submit` queues the call on a heap and one trampoline on a ``ThreadPoolExecutor``, whose
    shutdown and exit behaviour it keeps; a trampoline runs whichever call is first when it starts, and
    there are as many trampolines as calls, so the heap is never empty when one pops.
    """

    def __init__(self, workers: int):
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers))
        self._heap: list[tuple[Any, int, Future, Any, tuple]] = []
        self._order = itertools.count()
        self._lock = threading.Lock()

    def submit(self, fn, /, *args: Any, priority: Any = ()) -> Future:
        fut: Future = Future()
        with self._lock:
            heapq.heappush(self._heap, (priority, next(self._order), fut, fn, args))
        self._pool.submit(self._run_first)
        return fut

    # After a call of t seconds, its worker waits min(SETTLE_MAX, SETTLE * t) before taking the next: a
    # caller waiting on that call (a study whose next runs depend on it) wakes and queues them in that
    # time, so they compete for the freed slot instead of losing it to whatever waited before.
    SETTLE, SETTLE_MAX = 0.01, 2.0

    def _run_first(self) -> None:
        with self._lock:
            *_, fut, fn, args = heapq.heappop(self._heap)
        if not fut.set_running_or_notify_cancel():
            return
        t0 = time.monotonic()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # as concurrent.futures does: the caller sees it on .result()
            fut.set_exception(exc)
        time.sleep(min(self.SETTLE_MAX, self.SETTLE * (time.monotonic() - t0)))

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)


class Runner:
    """Runs jobs as ``pretrain`` processes, at most ``jobs`` at a time, each job once.

    A subclass says where a job's run lives and what it trains: :meth:`run_dir`
    and :meth:`config` (a ``TrainConfig`` dict); optionally :meth:`describe`,
    :meth:`job_fields` (the job's own keys in its result) and
    :meth:`unavailable_reason`. ``deadline`` (seconds from ``start``, default
    now): no job starts after it, and a job still running ``grace`` seconds
    later is stopped. ``pool``: another runner's, so that runners of different
    stages share one limit of ``jobs``; :meth:`submit`'s ``priority`` orders
    the jobs waiting in it (:class:`PriorityPool`). ``env`` adds to this process's
    environment for every run (``threads``: their OMP and MKL threads);
    ``progress`` draws a bar per run from its ``metrics.jsonl``.
    """

    def __init__(self, out: Path, *, jobs: int = 1, threads: int | None = None, resume: bool = False,
                 keep_checkpoints: bool = True, deadline: float | None = None, grace: float = 45.0,
                 quiet: bool = False, offline: bool = False, start: float | None = None,
                 pool: PriorityPool | None = None, env: dict[str, str] | None = None,
                 cwd: Path | None = None, nproc_per_node: int = 1, progress: bool = False):
        self.out, self.resume, self.keep = Path(out), resume or offline, keep_checkpoints
        self.offline = offline  # report only: read finished runs, start none
        self.run_env: dict[str, Any] | None = None  # environment.json of one finished run
        self.threads, self.env, self.cwd, self.nproc, self.progress = threads, env, cwd, nproc_per_node, progress
        self.pool = pool if pool is not None else PriorityPool(jobs)
        self.t0 = time.monotonic() if start is None else start
        self.stop_at = None if deadline is None else self.t0 + deadline
        self.kill_at = None if deadline is None else self.t0 + deadline + grace
        self.aborted = False
        self.quiet = quiet
        self._lock = threading.Lock()
        self._futures: dict[Path, tuple[Any, Future]] = {}
        self._procs: set[subprocess.Popen] = set()
        self.counts = {"ran": 0, "reused": 0, "failed": 0, "skipped": 0}
        # Resume a cut-short run from its last checkpoint (its config.json unchanged) instead of starting
        # it afresh: long runs span sessions.
        self.resume_partial = False

    # what a job is (for subclasses) ---------------------------------------- #
    def run_dir(self, job: Any) -> Path:
        raise NotImplementedError

    def config(self, job: Any) -> dict[str, Any]:
        raise NotImplementedError

    def describe(self, job: Any) -> str:
        return str(job)

    def job_fields(self, job: Any) -> dict[str, Any]:  # noqa: ARG002
        return {}

    def unavailable_reason(self, job: Any) -> str | None:  # noqa: ARG002
        return None

    # reuse ----------------------------------------------------------------- #
    def finished(self, job: Any) -> dict[str, Any] | None:
        """The summary of a finished run with exactly this configuration, else None. The run's own folder
        (``out``) is left out of the comparison, so a results folder copied elsewhere still matches."""
        run = self.run_dir(job)
        try:
            if not same_config(_read_json(run / "config.json"), self.config(job)):
                return None
            summary = _read_json(run / "summary.json")
            if self.run_env is None and (run / "environment.json").is_file():
                self.run_env = _read_json(run / "environment.json")
            return summary
        except (OSError, json.JSONDecodeError):  # absent, or a run folder left half-written
            return None

    # scheduling ------------------------------------------------------------ #
    def submit(self, job: Any, priority: Any = ()) -> Future:
        """Queue ``job`` (once: a job already queued returns its future); waiting jobs start in order of
        ``priority``, then of submission."""
        path = self.run_dir(job)
        with self._lock:
            if path in self._futures:
                other, fut = self._futures[path]
                if other != job:
                    raise RuntimeError(f"two different runs map to one folder {path}: {other} and {job}")
                return fut
            fut = self.pool.submit(self.run_job, job, priority=priority)
            self._futures[path] = (job, fut)
            return fut

    def run_all(self, jobs: Iterable[Any]) -> dict[Any, dict[str, Any]]:
        futures = {job: self.submit(job) for job in jobs}
        return {job: fut.result() for job, fut in futures.items()}

    def abort(self) -> None:
        """Stop: start nothing more and tell the runs in flight to stop (they save; reported as stopped)."""
        self.aborted = True
        self.signal_runs(signal.SIGTERM)

    def signal_runs(self, signum: int) -> None:
        """``signum`` to every run in flight (the worker threads wait for them and kill any that linger)."""
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            if proc.poll() is None:
                signal_group(proc, signum)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)

    # one run --------------------------------------------------------------- #
    def _result(self, job: Any, status: str, **extra: Any) -> dict[str, Any]:
        return {**self.job_fields(job), "status": status, "val_loss": float("nan"), "run": str(self.run_dir(job)),
                **extra}

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(f"  [{time.monotonic() - self.t0:6.0f} s] {text}", flush=True)

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def run_job(self, job: Any) -> dict[str, Any]:
        """Run ``job`` in this thread (reuse, resume or train it); its result."""
        if self.resume and (summary := self.finished(job)) is not None:
            self._count("reused")
            return {**self._result(job, "ok", reused=True), **_keep(summary)}
        if self.offline:
            return self._result(job, "missing", error="no finished run with this configuration (--report-only)")
        if (why := self.unavailable_reason(job)) is not None:
            return self._result(job, "unavailable", error=why)
        if self.aborted or (self.stop_at is not None and time.monotonic() > self.stop_at):
            self._count("skipped")
            return self._result(job, "skipped", error="deadline reached before it started")
        from gwt_optim.toolkit.errors import UsageError

        try:
            resume = self.prepare(job)
        except UsageError as exc:  # its folder is in use by another process
            self._count("failed")
            self._say(f"{self.describe(job)}: FAILED ({exc})")
            return self._result(job, "failed", error=str(exc))
        return self._launch(job, resume=resume)

    def _resumable(self, job: Any) -> bool:
        run = self.run_dir(job)
        ckpt = run / "checkpoints"
        try:
            return (not (run / "summary.json").is_file() and ckpt.is_dir() and any(ckpt.iterdir())
                    and same_config(_read_json(run / "config.json"), self.config(job)))
        except (OSError, json.JSONDecodeError):
            return False

    def prepare(self, job: Any) -> bool:
        """Make the job's folder ready to train in; True: resume it from its last checkpoint.

        A run cut short resumes (``resume_partial``); otherwise the run starts afresh, and a finished run
        in its folder is moved aside to ``NAME.old<k>``, never deleted. Nothing is touched while another
        process writes in the folder (its lock: :class:`~gwt_optim.toolkit.errors.UsageError`)."""
        from gwt_optim.toolkit.run_folder import lock_run_dir

        run = self.run_dir(job)
        held = lock_run_dir(run) if run.is_dir() else contextlib.nullcontext()
        with held:
            if self.resume_partial and self._resumable(job):
                return True
            if (run / "summary.json").is_file():
                k = 1
                while run.with_name(f"{run.name}.old{k}").exists():
                    k += 1
                run.rename(run.with_name(f"{run.name}.old{k}"))
                self._say(f"kept the earlier finished run of {self.describe(job)} as {run.name}.old{k}")
        run.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # a half-written run starts afresh
        (run / "config.json").unlink(missing_ok=True)
        return False

    def log_mode(self, resume: bool) -> str:
        """How ``log.txt`` is opened: appended to for a resumed run, else started afresh."""
        return "a" if resume else "w"

    def announce(self, job: Any, resume: bool) -> None:
        """Said just before the run starts."""
        if resume:
            self._say(f"{self.describe(job)}: resuming from its last checkpoint")

    def command(self, requested: Path, resume: bool) -> list[str]:
        return [*launcher(self.nproc), "pretrain", "--config", str(requested)] + (["--resume"] if resume else [])

    def _environment(self) -> dict[str, str] | None:
        if not self.env and not self.threads:
            return None
        env = {**os.environ, **(self.env or {})}
        if self.threads:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        return env

    def _launch(self, job: Any, *, resume: bool) -> dict[str, Any]:
        run = self.run_dir(job)
        config = self.config(job)
        requested = run / "requested_config.json"
        requested.write_text(json.dumps(config, indent=2))
        self.announce(job, resume)
        t0 = time.perf_counter()
        status = "ok"
        with open(run / "log.txt", self.log_mode(resume)) as log:
            proc = subprocess.Popen(end_with_parent(self.command(requested, resume)), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._environment(),
                                    cwd=self.cwd, start_new_session=True)
            with self._lock:
                self._procs.add(proc)
            try:
                rc, stopped = self._watch(proc, run, config.get("steps"), self.describe(job))
                status = "stopped" if stopped else status
            finally:
                with self._lock:
                    self._procs.discard(proc)
        wall = time.perf_counter() - t0
        if self.aborted and status == "ok" and rc != 0:
            status = "stopped"
        if status == "ok" and rc == 0 and (run / "summary.json").is_file():
            summary = _read_json(run / "summary.json")
            if not self.keep:
                shutil.rmtree(run / "checkpoints", ignore_errors=True)  # bulky; summary and metrics stay
            self._count("ran")
            if not self.quiet:  # (a run without a validation has no val_loss to print)
                self._say(f"{self.describe(job)}: val_loss {summary['val_loss']:.4f} ({wall:.0f} s)")
            return {**self._result(job, "ok", wall_s=wall, rc=rc), **_keep(summary)}
        tail = _tail(run / "log.txt")
        if status == "ok":
            status = "diverged" if "training loss is" in tail and ("nan" in tail or "inf" in tail) else "failed"
        self._count("failed" if status != "stopped" else "skipped")
        self._say(f"{self.describe(job)}: {status.upper()} (exit {rc}, {wall:.0f} s; see {run / 'log.txt'})")
        return self._result(job, status, error=tail[-600:], wall_s=wall, rc=rc)

    def _watch(self, proc: subprocess.Popen, run: Path, total: int | None, desc: str) -> tuple[int, bool]:
        """Wait for ``proc``: (exit status, whether it was stopped by :meth:`abort` or the deadline).

        In the main thread, Ctrl-C (``KeyboardInterrupt``) or SIGTERM (:func:`~gwt_optim.toolkit.signals.sigterm_stops`)
        is passed on to the run once, which stops at its next step and saves; this waits for it, then re-raises."""
        from tqdm.auto import tqdm

        follower = MetricsFollower(run / "metrics.jsonl")
        bar = tqdm(total=total, desc=desc, unit="step", disable=not self.progress, dynamic_ncols=True, leave=False)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    rc = None
                if self.progress:
                    follower.poll()
                    if follower.step != bar.n:
                        bar.update(follower.step - bar.n)
                        bar.set_postfix(follower.post, refresh=False)
                if rc is not None:
                    return rc, False
                if self.aborted or (self.kill_at is not None and time.monotonic() >= self.kill_at):
                    return _stop(proc), True
        except KeyboardInterrupt as stop:
            bar.close()
            signum = getattr(stop, "signum", signal.SIGINT)
            again = " (Ctrl-C again to stop it at once)" if signum == signal.SIGINT else ""
            print(f"\nstopping {desc} at its next step to save it{again}", file=sys.stderr)
            signal_group(proc, signum)
            while True:
                try:
                    proc.wait()
                    break
                except KeyboardInterrupt as more:
                    signal_group(proc, getattr(more, "signum", signal.SIGINT))
            raise
        finally:
            bar.close()
