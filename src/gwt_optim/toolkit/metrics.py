"""Measurement helpers shared by ``pretrain``, ``compare`` and ``finetune``.

* :func:`peak_rss_bytes` / :func:`current_rss_bytes` -- process memory;
* :func:`cuda_peak_bytes` -- ``torch.cuda.max_memory_allocated`` when on CUDA;
* :class:`Throughput` -- steady-state ms/step and tokens/s, warm-up excluded;
* :func:`state_bytes` -- bytes really held by an optimizer's state;
* :class:`MetricsLog` -- the per-step ``metrics.jsonl`` of a run;
* :func:`environment` -- versions, machine and git commit, for the run directory;
* :func:`atomic_write_text` / :func:`atomic_write_json` -- never a half-written file.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import subprocess
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

__all__ = [
    "peak_rss_bytes",
    "current_rss_bytes",
    "cuda_peak_bytes",
    "Throughput",
    "state_bytes",
    "MetricsLog",
    "read_jsonl",
    "environment",
    "git_commit",
    "atomic_write_text",
    "atomic_write_json",
]


# --------------------------------------------------------------------------- #
# Files
# --------------------------------------------------------------------------- #


def _new_temp_file(path: Path) -> tuple[int, str]:
    """A new file beside ``path``, open for writing, created as ``open()`` creates one: mode 0666 less the
    umask (mkstemp's is 0600, which the rename would give the finished file)."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so a
    reader (or a crash) never sees a partial file. The file's mode follows the umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temp_file(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None:  # a write to a full disk names no file: the user needs to know which
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_jsonl(path: str | os.PathLike, *, bad: list[tuple[int, str]] | None = None) -> list[dict]:
    """The records (JSON objects) of a JSON-lines file, every one that can be read.

    A line that is not one -- the torn last line of a killed run, a line
    damaged later -- is skipped; pass a list as ``bad`` to get each as
    ``(line number, text)``. ``ValueError`` naming the file when it holds no
    record and bytes that are not text: that is no JSON-lines file at all."""
    path = Path(path)
    out = []
    binary = False
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                binary, record = True, None
            except ValueError:
                record = None
            if isinstance(record, dict):
                out.append(record)
            elif bad is not None:
                bad.append((number, raw.decode("utf-8", errors="surrogateescape")))  # byte for byte
    if binary and not out:
        raise ValueError(f"{path}: not a JSON-lines file (binary data, no record in it)")
    return out


def _line_numbers(bad: list[tuple[int, str]]) -> str:
    numbers = [str(n) for n, _ in bad]
    shown = ", ".join(numbers[:5]) + (f" and {len(numbers) - 5} more" if len(numbers) > 5 else "")
    return f"line{'s' if len(numbers) > 1 else ''} {shown}"


# --------------------------------------------------------------------------- #
# Memory
# --------------------------------------------------------------------------- #


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int:
    """Resident set size of this process now."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # Linux without psutil
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cuda_peak_bytes(device: torch.device | None = None) -> int | None:
    """``torch.cuda.max_memory_allocated`` on ``device``, or None off CUDA."""
    if device is not None and torch.device(device).type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated(device))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by ``optimizer``'s state on this process, each storage once.

    :func:`gwt_optim.memory.optimizer_state_bytes` also looks inside torchao's
    quantized state subclasses and helper objects such as GaLore's projector;
    sharded (DTensor) state counts this rank's shard.
    """
    from gwt_optim.memory import optimizer_state_bytes

    return int(optimizer_state_bytes(optimizer))


# --------------------------------------------------------------------------- #
# Speed
# --------------------------------------------------------------------------- #


@dataclass
class Throughput:
    """Steady-state speed: the first ``warmup`` steps (allocator warm-up,
    ``torch.compile``, GaLore's first SVD) are left out of the averages.

    Wrap each optimizer step (not evaluation) in ``with meter.step(tokens):``.
    """

    warmup: int = 2
    device: torch.device | None = None
    steps: int = 0
    timed_steps: int = 0
    timed_tokens: int = 0
    timed_seconds: float = 0.0
    last_seconds: float = 0.0
    _t0: float = field(default=0.0, repr=False)

    def _sync(self) -> None:
        if self.device is not None and torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def stop(self, tokens: int) -> float:
        self._sync()
        self.last_seconds = time.perf_counter() - self._t0
        self.steps += 1
        if self.steps > self.warmup:
            self.timed_steps += 1
            self.timed_tokens += tokens
            self.timed_seconds += self.last_seconds
        return self.last_seconds

    @contextlib.contextmanager
    def step(self, tokens: int) -> Iterator[None]:
        """Time the enclosed optimizer step, which processed ``tokens`` tokens."""
        self.start()
        yield
        self.stop(tokens)

    @property
    def ms_per_step(self) -> float | None:
        return 1000 * self.timed_seconds / self.timed_steps if self.timed_steps else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.timed_tokens / self.timed_seconds if self.timed_seconds > 0 else None


# --------------------------------------------------------------------------- #
# Per-step log
# --------------------------------------------------------------------------- #


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``.

    On resume, :meth:`truncate_after` drops the records of steps the resumed
    run will redo, so the file holds exactly one curve.
    """

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._f = None

    def truncate_after(self, step: int, *, redo_eval: bool = False) -> None:
        """Keep the records up to ``step`` (and, with ``redo_eval``, drop the
        validation at ``step``, which the run is about to make again).

        Lines that cannot be read are appended to ``metrics.jsonl.bad`` and
        named on stderr; every readable record around them is kept."""
        if not self.enabled or not self.path.exists():
            return
        bad: list[tuple[int, str]] = []
        keep, stepless = [], []
        for r in read_jsonl(self.path, bad=bad):
            at = r.get("step", 0)
            if isinstance(at, bool) or not isinstance(at, (int, float)):
                stepless.append(json.dumps(r) + "\n")  # an object, but no record of a step
            elif at < step or (at == step and not (redo_eval and "val_loss" in r)):
                keep.append(r)
        lines = [text if text.endswith("\n") else text + "\n" for _, text in bad] + stepless
        if lines:
            aside = self.path.with_name(self.path.name + ".bad")
            # Appended, so what an earlier resume set aside stays; the bytes as they were.
            with open(aside, "a", encoding="utf-8", errors="surrogateescape") as f:
                f.writelines(lines)
            where = f" ({_line_numbers(bad)})" if bad else ""
            print(f"{self.path}: {len(lines)} unreadable line{'s' if len(lines) > 1 else ''}{where} set aside in "
                  f"{aside.name}; kept the {len(keep)} readable records up to step {step}", file=sys.stderr)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a")
        try:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        except OSError as exc:  # a full disk: what did not fit is at most a torn last line
            f, self._f = self._f, None
            with contextlib.suppress(OSError):
                f.close()  # whose flush fails again
            if exc.filename is None:
                raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
            raise

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- #
# Environment
# --------------------------------------------------------------------------- #


def git_commit(path: str | os.PathLike | None = None) -> str | None:
    """The commit of the git checkout holding ``path`` (default: this package),
    with ``-dirty`` appended when tracked files are modified. Outside git (a
    ``git archive`` snapshot, an installed wheel): ``$GWT_OPTIM_COMMIT`` if the
    caller set it (benchmarks/budget_cpu.sh does for its snapshot), else None."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("GWT_OPTIM_COMMIT") or None
    return commit + ("-dirty" if dirty else "")


def process_environments(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of every process a run ran in, oldest first, from its ``environment.json`` (a resumed
    run keeps the earlier ones under ``earlier``); [] if it is missing or unreadable."""
    try:
        env = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(env, dict):
        return []
    earlier = env.pop("earlier", [])
    return [e for e in [*(earlier if isinstance(earlier, list) else []), env] if isinstance(e, dict)]


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(packages: Iterable[str] = ()) -> dict[str, Any]:
    """Versions, machine and git commit: what a reader needs to trust a number."""
    import gwt_optim

    info: dict[str, Any] = {
        "gwt_optim": gwt_optim.__version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import psutil

        info["memory_bytes"] = int(psutil.virtual_memory().total)
    except ImportError:
        pass
    for name in ("transformers", "datasets", "tokenizers", *packages):
        info[name] = _package_version(name)
    return info
