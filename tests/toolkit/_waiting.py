"""Waiting on the processes a test starts: for an event (a file, a step, an
exit), never against a wall-clock deadline that a loaded 2-core CI machine
can miss. ``CAP_S`` only keeps a hung process from hanging the suite, and a
failure shows what the process printed."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable

CAP_S = 900.0


def printed(proc: subprocess.Popen | None = None, log: Path | None = None) -> str:
    """What ``proc`` printed (to ``log``, or to its pipes once it has ended; a running one is killed first)."""
    if log is not None:
        try:
            return Path(log).read_text(errors="replace")
        except OSError:
            return "(no log)"
    if proc is None or proc.stdout is None and proc.stderr is None:
        return ""
    if proc.poll() is None:
        proc.kill()
    try:
        out, err = proc.communicate(timeout=60)
    except (ValueError, subprocess.TimeoutExpired):  # already read
        return "(output already read)"
    return f"stdout:\n{out}\nstderr:\n{err}"


def wait_for(done: Callable[[], bool], what: str, procs: list[subprocess.Popen] = (), log: Path | None = None,
             cap_s: float = CAP_S, poll_s: float = 0.02) -> None:
    """Until ``done()``; fails at once if one of ``procs`` exits first, and after ``cap_s`` with their output."""
    end = time.monotonic() + cap_s
    while not done():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"exited with {p.returncode} before {what}:\n{printed(p, log)}")
        if time.monotonic() > end:
            raise AssertionError(f"no {what} after {cap_s:.0f} s:\n" + "\n".join(printed(p, log) for p in procs))
        time.sleep(poll_s)


def finish(proc: subprocess.Popen, log: Path | None = None, cap_s: float = CAP_S) -> tuple[str, str]:
    """``proc.communicate()``: its (stdout, stderr) once it exits; after ``cap_s`` it is killed and the test
    fails with what it printed."""
    try:
        return proc.communicate(timeout=cap_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        shown = printed(None, log) if log is not None else f"stdout:\n{out}\nstderr:\n{err}"
        raise AssertionError(f"{proc.args!r} still running after {cap_s:.0f} s:\n{shown}") from None


def run(argv: list[str], cap_s: float = CAP_S, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True)`` that must exit 0; a failure shows its output."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=cap_s, **kw)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{argv!r} still running after {cap_s:.0f} s:\n{exc.stdout}\n{exc.stderr}") from None
    assert done.returncode == 0, f"{argv!r} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done
