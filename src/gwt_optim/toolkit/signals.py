"""SIGINT (Ctrl-C) and SIGTERM (torchrun, Slurm, Kubernetes, ``compare``) as a request to stop.

One rule for every part of the toolkit that takes these signals over, kept by
:class:`StopSignals`: the first signal is the request (stop at a safe point and
save), a second Ctrl-C means "quit at once", and a repeated SIGTERM is the
same request again (launchers deliver it twice: Slurm signals every process of
a job and torchrun forwards its own copy). Handlers are installed only in the
main thread (the only one Python lets own them) and never over a signal that
is ignored (a background job's SIGINT: its launcher said so), and the previous
handlers are back when the block ends.

What each caller does with a request:

- the training loop (:class:`StopAtStep`): notes it and stops at the next step
  boundary, where it saves; a second Ctrl-C raises ``KeyboardInterrupt`` there
  and then (not under torchrun, whose copy of the first is no second press);
- a driver waiting on one run (:func:`sigterm_stops`): SIGTERM raises
  :class:`Stopped` as Ctrl-C raises ``KeyboardInterrupt``, so the driver
  unwinds to where it forwards the signal to its child and waits for it
  (``runner.Runner._watch``);
- a driver of several runs (:func:`abort_on_signals`): aborts its runners,
  whose runs are told to stop and save; a second Ctrl-C reaches the runs as
  one, so they quit at once.

Nothing here imports another toolkit module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Callable, Iterator, Sequence

__all__ = ["STOP_SIGNALS", "Stopped", "StopSignals", "StopAtStep", "sigterm_stops", "abort_on_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal (``signum``: SIGINT or SIGTERM), after saving
    unless a second Ctrl-C quit at once; the CLI exits with ``128 + signum``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


class StopSignals:
    """While the ``with`` block runs, each of ``signals`` calls ``on_signal(signum, again)``:
    ``again`` is False for the first one (the request, its number kept in ``signum``) and True
    for any after it. A context manager; see the module for where it installs nothing."""

    def __init__(self, on_signal: Callable[[int, bool], None], signals: Sequence[int] = STOP_SIGNALS):
        self.on_signal = on_signal
        self.signals = tuple(signals)
        self.signum: int | None = None  # the first signal's, once one came
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        again = self.signum is not None
        if not again:
            self.signum = int(signum)
        self.on_signal(int(signum), again)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


class StopAtStep(StopSignals):
    """The training loop's: a request sets ``requested``, which the loop reads (and shares with the
    other ranks) at each step boundary. A second Ctrl-C raises ``KeyboardInterrupt`` at once; a
    repeated SIGTERM, or any repeat under torchrun, changes nothing: a launcher ends a worker that
    outlasts its grace period with SIGKILL itself."""

    def __init__(self) -> None:
        from torch.distributed import is_torchelastic_launched

        super().__init__(self._on_signal)
        self._torchrun = is_torchelastic_launched()

    def _on_signal(self, signum: int, again: bool) -> None:
        if again:
            if signum == signal.SIGINT and not self._torchrun:
                raise KeyboardInterrupt
            return
        if signum == signal.SIGINT and not self._torchrun:
            note = b"Ctrl-C: stopping after this step to save a checkpoint (Ctrl-C again quits without saving)"
        else:
            note = signal.Signals(signum).name.encode() + b": stopping after this step to save a checkpoint"
        # os.write, not print: a handler that prints while the loop prints can raise a reentrant-call error.
        with contextlib.suppress(OSError):
            os.write(2, b"\n" + note + b"\n")

    def stopped(self) -> Stopped:
        # A rank that got no signal itself was stopped by its peers: a job being terminated.
        return Stopped(self.signum or signal.SIGTERM)


@contextlib.contextmanager
def sigterm_stops() -> Iterator[None]:
    """SIGTERM raises :class:`Stopped` here, as Ctrl-C raises ``KeyboardInterrupt``, so the run in
    progress is told and waited for (every SIGTERM: the waiting code passes each one on)."""

    def raise_stopped(signum: int, again: bool) -> None:  # noqa: ARG001
        raise Stopped(signum)

    with StopSignals(raise_stopped, (signal.SIGTERM,)):
        yield


@contextlib.contextmanager
def abort_on_signals(runners: Sequence[Any], message: str) -> Iterator[None]:
    """While the block runs, SIGINT or SIGTERM prints ``signal N: MESSAGE`` and aborts ``runners``
    (``runner.Runner``s: their runs in flight are told to stop and save; the block then reports what
    finished); a repeated SIGTERM asks again. A second SIGINT reaches the runs as one (their children
    lead their own sessions, so the terminal's does not): they quit at once."""

    def on_signal(signum: int, again: bool) -> None:
        if again and signum == signal.SIGINT:
            # Ctrl-C again: as at a run's own terminal, the runs quit without saving.
            print(f"\nsignal {signum} again: the runs in flight quit without saving", flush=True)
            for r in runners:
                r.signal_runs(signal.SIGINT)
            return
        print(f"\nsignal {signum}: {message}", flush=True)
        for r in runners:
            r.abort()

    with StopSignals(on_signal):
        yield
