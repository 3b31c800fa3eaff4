"""The one study driver of ``benchmarks/quality.py``: settings -> runs -> records -> report.

Both studies run through it: the demo protocol (``_protocol.py``, also ``regime.py``) and the budget study
(``_budget.py``, ``quality.py --budget``). Each study owns its logic (which runs, what they measure) and
returns its figures as data; ``_report.py`` turns them into markdown and plots; this module owns what the two
share: the setting every run of a study trains (a validated ``TrainConfig`` less :data:`RUN_KEYS`), the
threads per run, the corpus prepared once, one writer of ``--out``, the environment and command line the
report records, and writing ``OUT/NAME.json`` and ``OUT/NAME.md``.

It imports neither study nor the report module, so both build on it.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from gwt_optim.toolkit.runner import lock_out  # noqa: E402

BASELINE = "adamw"  # every study's reference: gaps are to it, and it is always a contender
# The fields of a TrainConfig that each run sets itself: the rest is the study's setting, shared by its runs.
RUN_KEYS = ("optimizer", "lr", "seed", "out", "progress", "batch_size", "micro_batch_size", "steps")


def fmt_lr(lr: float) -> str:
    return f"{lr:g}"


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def threads_for(jobs: int, threads: int | None) -> int:
    """OMP threads per run: ``threads`` as given, else the CPU cores shared among ``jobs`` runs."""
    return threads or max(1, (os.cpu_count() or 1) // max(1, jobs))


def prepare_data(base: dict[str, Any]) -> dict[str, Any]:
    """Train the tokenizer and tokenize the corpus once (cached for every run); the epoch's size."""
    from gwt_optim.toolkit.data import build_data

    data = build_data(base["data"], seq_len=base["seq_len"], val_tokens=base["val_tokens"], seed=0,
                      tokenizer=base["tokenizer"], vocab_size=base["vocab_size"], progress=False)
    return {"train_tokens": data.info["train_tokens"], "train_windows": data.info["train_windows"],
            "tokenizer": data.tokenizer}


@dataclass
class Driver:
    """One call of a study: where it writes and how it names itself.

    ``who`` names the study in its errors and in the lock of ``out`` (``quality.py``, ``quality.py
    --budget``); ``script`` is the command line's (``benchmarks/SCRIPT``); ``name`` the report's files
    (``OUT/NAME.json``, ``OUT/NAME.md``); ``packages``: versions the environment records beyond its own.
    """

    name: str
    who: str
    script: str
    out: Path
    jobs: int
    threads: int
    commit: str | None = None
    report_only: bool = False
    packages: Sequence[str] = ()

    def error(self, what: Any) -> None:
        print(f"{self.who}: error: {what}", file=sys.stderr)

    def setting(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """The validated ``config`` less :data:`RUN_KEYS`: what every run of the study shares; None after one
        error line (a bad flag, before any data is prepared)."""
        from gwt_optim.toolkit.train import TrainConfig

        try:
            full = TrainConfig.from_dict(config).validate().to_dict()
        except ValueError as exc:
            self.error(exc)
            return None
        return {k: v for k, v in full.items() if k not in RUN_KEYS}

    @staticmethod
    def data(base: dict[str, Any], prepare: Callable[[dict[str, Any]], dict[str, Any]],
             failed: Callable[[Exception], str]) -> dict[str, Any] | None:
        """The corpus of ``base`` prepared by ``prepare`` (:func:`prepare_data`, or a test's); None after the
        line ``failed`` words (e.g. DataUnavailable: the corpus package is missing, or offline)."""
        print(f"preparing the {base['data']} data (tokenizer, token cache) ...", flush=True)
        try:
            return prepare(base)
        except Exception as exc:  # noqa: BLE001 - any failure means no run can start
            print(failed(exc), file=sys.stderr)
            return None

    def environment(self) -> dict[str, Any]:
        from gwt_optim.toolkit.metrics import environment

        env = environment(packages=tuple(self.packages))
        if self.commit:
            env["git_commit"] = self.commit
        return env

    def command(self, argv: list[str] | None) -> str:
        return shlex.join(["python", f"benchmarks/{self.script}", *(sys.argv[1:] if argv is None else argv)])

    def run(self, argv: list[str] | None, setting: dict[str, Any], *, before: dict[str, Any],
            runs: Callable[[], dict[str, Any]], render: Callable[[dict[str, Any]], str],
            after: dict[str, Any] | None = None, check: Callable[[dict[str, Any]], int | None] | None = None,
            draw: Callable[[dict[str, Any]], None] | None = None, also: Sequence[Path] = (),
            outcome: Callable[[dict[str, Any]], int] | None = None) -> int:
        """Lock ``out`` (unless only reporting), run, and write the report.

        The report is ``command, environment, setting, **before, jobs, threads, **after``, then what ``runs``
        returns and its ``wall_s``. ``check`` may end the call with its exit status before anything is
        written (nothing to report); ``draw`` makes the plots (``also``: the files it writes, for the last
        line); ``outcome`` is the exit status (default 0).
        """
        with contextlib.ExitStack() as held:
            if not self.report_only and not lock_out(held, self.out, self.who):  # one writer of --out at a time
                return 2
            report: dict[str, Any] = {"command": self.command(argv), "environment": self.environment(),
                                      "setting": setting, **before, "jobs": self.jobs, "threads": self.threads,
                                      **(after or {})}
            t0 = time.monotonic()
            report.update(runs())
            report["wall_s"] = time.monotonic() - t0
            if check is not None and (status := check(report)) is not None:
                return status
            self.write(report, render(report))
            if draw is not None:
                draw(report)
            files = [self.out / f"{self.name}.md", self.out / f"{self.name}.json", *also]
            print(f"wrote {', '.join(map(str, files[:-1]))} and {files[-1]}")
            return 0 if outcome is None else outcome(report)

    def write(self, report: dict[str, Any], md: str) -> None:
        from gwt_optim.toolkit.metrics import atomic_write_json, atomic_write_text

        print("\n" + md)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.out / f"{self.name}.json", report)
        atomic_write_text(self.out / f"{self.name}.md", md)
