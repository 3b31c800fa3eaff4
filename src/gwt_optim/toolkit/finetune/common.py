"""Pieces shared by ``finetune glue`` and ``finetune lm``: hub access that fails
clearly offline, per-run peak memory, optimizer specs, result files, and
what a stop keeps and ``--resume`` continues."""

from __future__ import annotations

import argparse
import contextlib
import json
import operator
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar
from urllib.parse import urlparse

import torch

# Shared with pretrain/compare: atomic result files and measured optimizer state.
from gwt_optim.toolkit.flags import setting
from gwt_optim.toolkit.metrics import atomic_write_json, atomic_write_text
from gwt_optim.toolkit.metrics import state_bytes as optimizer_state_bytes
from gwt_optim.toolkit.recipes import RECIPE_ALPHA

T = TypeVar("T")

__all__ = [
    "HubUnavailable",
    "prepare_hub_access",
    "from_hub",
    "PeakMemory",
    "MethodSpec",
    "parse_methods",
    "atomic_write_text",
    "atomic_write_json",
    "optimizer_state_bytes",
    "markdown_table",
    "pick_device",
    "run_measured",
    "seed_setting",
    "device_setting",
    "isolate_setting",
    "progress_setting",
    "scale_setting",
    "resume_setting",
    "previous_results",
    "settings_key",
    "report_kept_on_stop",
]


class HubUnavailable(RuntimeError):
    """A model or data set had to come from the Hugging Face hub and could not."""


def _hub_reachable(timeout: float = 3.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _set_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    # huggingface_hub and datasets read the variable when first imported; if
    # they already are (a test, a notebook), flip their module constants too so
    # that a missing file fails at once instead of after minutes of retries.
    import sys

    hub_constants = sys.modules.get("huggingface_hub.constants")
    if hub_constants is not None:
        hub_constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True


def prepare_hub_access() -> bool:
    """Switch to the local cache when the hub cannot be reached; return whether online.

    Without this, every ``from_pretrained``/``load_dataset`` on a machine with
    no network retries for about a minute before failing.
    """
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        _set_offline()
        return False
    if _hub_reachable():
        return True
    _set_offline()
    return False


def from_hub(what: str, name: str, load: Callable[[], T], *, fix: str) -> T:
    """Run ``load`` (a hub download) and turn any failure into :class:`HubUnavailable`.

    ``fix`` tells the user what to do instead (a local path, a cache).
    """
    try:
        return load()
    except (OSError, ConnectionError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        reason = f"{type(exc).__name__}: {exc}" + (" (Hugging Face hub offline mode is on)" if offline else "")
        raise HubUnavailable(
            f"cannot load {what} {name!r}: {reason}. Either run once where the hub is reachable so that "
            f"it lands in the Hugging Face cache (then it also works offline), or {fix}."
        ) from exc


def run_measured(isolate: bool, fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)``, in a fresh process when ``isolate``.

    A process's resident set does not shrink back after a run: the C
    allocator keeps freed blocks of a few MiB (most weight matrices) for
    reuse. So on CPU, where peak memory is the process's peak RSS, every run
    gets its own spawned process and its peak is that run's alone. ``fn`` and
    ``args`` must be picklable (module-level functions, dataclasses, tensors);
    an exception ``fn`` raises there is raised here, with the worker's
    traceback as its cause.

    The worker never outlives this call: Ctrl-C or SIGTERM here (whatever
    exception leaves the wait) ends it before it goes on, and if this process
    is killed, Linux sends it SIGTERM (:func:`~gwt_optim.toolkit.runner.die_with_parent`).
    It ignores Ctrl-C itself: this process, which sees the terminal's too,
    ends it. A worker stopped by SIGTERM or SIGINT from outside (``kill`` of
    the whole job) stops this process as that signal would
    (:class:`~gwt_optim.toolkit.signals.Stopped`).
    """
    if not isolate:
        return fn(*args)
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_measured_worker, args=(send, os.getpid(), fn, args))
    worker.start()
    send.close()
    try:
        kind, value, tb = _worker_answer(worker, receive)
        worker.join(60)  # it ends on its own, through its exit handlers (SIGTERM would skip them)
    finally:
        receive.close()
        _end_worker(worker)
    if kind == "error":
        raise value from _RemoteTraceback(tb)
    return value


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in the worker of :func:`run_measured` (its ``__cause__``)."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0] if self.args else "")


def _measured_worker(send: Any, parent: int, fn: Callable[..., Any], args: tuple) -> None:
    import pickle
    import traceback

    from gwt_optim.toolkit.runner import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent sees Ctrl-C too, and ends this process
    die_with_parent(parent)
    try:
        answer = ("ok", fn(*args), None)
    except Exception as exc:  # noqa: BLE001 - every one goes back to the parent
        tb = traceback.format_exc()
        try:  # an exception that cannot make the trip goes as its text
            pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        answer = ("error", exc, tb)
    send.send(answer)
    send.close()


def _worker_answer(worker: Any, receive: Any) -> tuple[str, Any, str | None]:
    """The worker's answer: ("ok", result, None) or ("error", exception, traceback)."""
    from multiprocessing.connection import wait

    from gwt_optim.toolkit.signals import Stopped

    while True:
        ready = wait([receive, worker.sentinel])
        if receive in ready or receive.poll():
            try:
                return receive.recv()
            except EOFError:  # it ended without an answer
                break
        if worker.sentinel in ready:
            break
    worker.join()
    code = worker.exitcode
    if code is not None and -code in (signal.SIGTERM, signal.SIGINT):
        raise Stopped(-code)  # the job is being stopped: so is this process
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    else:
        how = f"exited with status {code}"
    raise RuntimeError(f"the worker process of this run {how} before it finished")


def _end_worker(worker: Any, wait: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``wait`` seconds; a second Ctrl-C meanwhile does not leave it running."""
    while True:
        try:
            if worker.is_alive():
                worker.terminate()
                worker.join(wait)
            if worker.is_alive():
                worker.kill()
                worker.join()
            return
        except KeyboardInterrupt:
            continue


def hide_library_progress_bars() -> None:
    """No progress bar from the libraries a run calls: transformers' weight loading, datasets' downloads and
    maps, the Hub's downloads. By their environment variables, read at import here and in every spawned
    ``--isolate`` worker, and by their switches where they are imported already."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers reads the Hub's at import
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()


class _NoProgress(argparse.Action):
    """``--no-progress``: True, and the libraries' bars hidden as the flag is read, before anything loads."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ARG002
        setattr(namespace, self.dest, True)
        hide_library_progress_bars()


# The fields every ``finetune`` task's classes share, each with its flag (gwt_optim.toolkit.flags);
# ``runs`` names what one isolated run is.

def seed_setting(default: int) -> Any:
    return setting(default, "weights, data order and dropout")


def device_setting() -> Any:
    return setting("auto", "auto, cpu or cuda")


# --isolate's words for the setting: None lets the device decide.
_ISOLATE = {"auto": None, "yes": True, "no": False}


def isolate_setting(runs: str) -> Any:
    return setting(None, f"run each {runs} in its own process so peak RSS is per run (auto: on CPU)",
                   choices=tuple(_ISOLATE), value=_ISOLATE.__getitem__,
                   text={v: word for word, v in _ISOLATE.items()}.__getitem__)


def progress_setting() -> Any:
    return setting(True, "hide progress bars (weight loading's and datasets' too)", name="--no-progress",
                   action=_NoProgress, text=operator.not_, value=operator.not_)


def scale_setting() -> Any:
    """``--scale``, whose default None is the recipe (gwt_optim.registry.recipe_scale)."""
    return setting(None, f"module-wise alpha on the target layers, for every method (default: {RECIPE_ALPHA})")


def resume_setting(runs: str) -> Any:
    return setting(False, f"skip the {runs} runs already in OUT/results.json", action="store_true")


# How a run is shown or placed, not what it computes: a resume may change these.
_NOT_IN_KEY = ("progress", "device", "isolate")


def settings_key(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings a ``--resume`` must match: all but how runs are shown and placed (JSON types)."""
    return json.loads(json.dumps({k: v for k, v in settings.items() if k not in _NOT_IN_KEY}))


def previous_results(path: Path, command: str) -> dict:
    """``results.json`` of an earlier ``finetune COMMAND``, for ``--resume``; ValueError naming it when it is none."""
    try:
        previous = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--resume: {path} is no results.json of finetune {command} ({exc}); use another --out") from exc
    if not (isinstance(previous, dict) and isinstance(previous.get("runs"), list)):
        raise ValueError(f"--resume: {path} is no results.json of finetune {command} (no list of runs); "
                         "use another --out")
    return previous


@contextlib.contextmanager
def report_kept_on_stop(command: str, out_dir: Path, finished: Callable[[], int],
                        write_report: Callable[[], object]) -> Iterator[None]:
    """A stop inside (Ctrl-C, or SIGTERM under the CLI) writes the report of the runs that finished, so
    ``results.md`` never shows an earlier command's, and says that ``--resume`` goes on from them."""
    try:
        yield
    except KeyboardInterrupt:
        n = finished()
        if n:
            write_report()
            print(f"[finetune {command}] stopped: {out_dir} keeps the {n} finished run(s); "
                  "--resume goes on from them", flush=True)
        raise


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _read_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory of one run inside a longer-lived process.

    On CUDA it is ``torch.cuda.max_memory_allocated`` after a reset. On CPU it
    is the process's resident-set high-water mark (``VmHWM``), which Linux
    lets a process reset by writing ``5`` to ``/proc/self/clear_refs``; so
    runs in the same process are measured separately instead of all reporting
    the largest one. Where that is unavailable, the lifetime peak is reported
    and :attr:`resettable` is ``False``.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.resettable = True
        self.kind = "CUDA max allocated" if self.device.type == "cuda" else "Peak RSS"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            self.resettable = False

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        hwm = _read_status_kib("VmHWM")
        if hwm is not None:
            return hwm * 1024
        import resource  # ru_maxrss is KiB on Linux and cannot be reset

        self.resettable = False
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class MethodSpec:
    """One column (or row) of a comparison: a registry optimizer with options, or LoRA."""

    label: str
    optimizer: str
    options: dict[str, Any] = field(default_factory=dict)
    lora: bool = False


def parse_methods(texts: Sequence[str]) -> list[MethodSpec]:
    """``["adamw", "gwt-adamw:level=2", "lora:r=8"]`` -> specs.

    ``lora`` (with ``r``, ``alpha`` and ``dropout`` options) wraps the model
    with ``peft`` adapters and trains them with AdamW; every other name must
    be in the optimizer registry.
    """
    from gwt_optim.toolkit.registry import _convert, parse_optimizer_arg

    specs = []
    for text in texts:
        text = text.strip()
        if not text:
            continue
        if text.split(":", 1)[0] == "lora":
            opts = {}
            for pair in text.split(":")[1:]:
                key, _, value = pair.partition("=")
                if not _:
                    raise ValueError(f"bad LoRA option {pair!r} in {text!r}; expected key=value")
                opts[key.strip()] = _convert(value.strip())
            specs.append(MethodSpec(text, "adamw", opts, lora=True))
        else:
            name, opts = parse_optimizer_arg(text)
            specs.append(MethodSpec(text, name, opts))
    if not specs:
        raise ValueError("no methods given")
    return specs


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; the first column is left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "| " + " | ".join(parts) + " |"

    sep = "| " + " | ".join([":" + "-" * (widths[0] - 1)] + ["-" * (w - 1) + ":" for w in widths[1:]]) + " |"
    return "\n".join([fmt(cells[0]), sep, *(fmt(r) for r in cells[1:])]) + "\n"


def alpha_phrase(scale: float | None) -> str:
    """How a report names the module-wise alpha of its runs."""
    if scale is None:
        return "module-wise alpha of the recipe (2^(l/2) for GWT at level l, 1 otherwise)"
    return f"module-wise alpha {scale:g} for every method"


def mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def check_settings(settings: Any, *, counts: Sequence[str] = (), positive: Sequence[str] = (),
                   non_negative: Sequence[str] = ()) -> None:
    """A fine-tuning command's numbers by the toolkit's one rule (``--steps must be an integer >= 1, got -1``),
    as a ``UsageError`` when the settings are made, before a model loads: ``counts`` are integers >= 1,
    ``positive`` numbers > 0 and ``non_negative`` >= 0; a None (a setting left to its default rule) passes."""
    from gwt_optim.toolkit.checks import check_number

    def check(name: str, value: Any, **bound: Any) -> None:
        if value is not None:
            check_number("--" + name.replace("_", "-"), value, **bound)

    for name in counts:
        check(name, getattr(settings, name), minimum=1, integer=True)
    for name in positive:
        value = getattr(settings, name)
        for v in value if isinstance(value, tuple) else (value,):
            check(name, v, minimum=0, strict=True)
    for name in non_negative:
        check(name, getattr(settings, name), minimum=0)
