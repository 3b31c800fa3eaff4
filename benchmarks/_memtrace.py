"""Where a training run's peak RSS goes: by phase and by owner.

torch's CPU allocations bypass ``tracemalloc``, so this reads the kernel's
own counters instead. At each phase boundary (:meth:`MemTrace.mark`) it reads
the peak RSS since the last boundary (``VmHWM``, which writing ``5`` to
``/proc/self/clear_refs`` restarts) and the RSS now, so a phase's peak is
exact, not sampled; and glibc's ``mallinfo2`` (bytes malloc has handed out
and bytes it holds free: the allocator's slack). The phases of
``benchmarks/big_model.py``: the model's build, each forward, each backward's
autograd stretches and every in-backward parameter step (by name).

``big_model.py`` marks them with :func:`attach` and :func:`attach_after`
(hooks on the model and its parameters) and writes the phases to its JSON;
:func:`install` patches what an older ``big_model.py`` calls, so the same
trace runs on old commits from a ``git archive`` copy
(``benchmarks/trace_memory.py``). Results: docs/results/memory-trace-cpu.md.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any

GIB = 1 << 30


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def malloc_info() -> dict[str, int]:
    """glibc's view, over all arenas: ``used`` (handed out, mmapped chunks
    included) and ``free`` (held in the arenas, free: slack)."""
    if _LIBC is None:
        return {}
    m = _LIBC.mallinfo2()
    return {"used": m.uordblks + m.hblkhd, "free": m.fordblks, "mmapped": m.hblkhd, "arena": m.arena}


def status() -> dict[str, int]:
    """VmRSS and VmHWM (peak since the last reset), in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def smaps_rollup() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def file_mappings(top: int = 8) -> list[tuple[str, int]]:
    """RSS of the file-backed mappings (libraries, the kernel .so), largest first."""
    sizes: dict[str, int] = {}
    current = None
    try:
        for line in Path("/proc/self/smaps").read_text().splitlines():
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                current = parts[5] if len(parts) > 5 else "[anon]"
            elif parts and parts[0] == "Rss:" and current is not None:
                sizes[current] = sizes.get(current, 0) + int(parts[1]) * 1024
    except OSError:
        return []
    return sorted(sizes.items(), key=lambda kv: -kv[1])[:top]


class MemTrace:
    """Phases of one run, each with its exact peak RSS (VmHWM between marks)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.phase: str | None = None
        self.start: dict[str, int] = {}
        self.before = status().get("VmHWM", 0)  # the peak before this trace (a reset forgets it)
        self.enabled = reset_peak()
        self.owners: dict[str, int] = {}  # bytes by owner, updated by the run (weights, state)

    def mark(self, phase: str | None, **extra: Any) -> dict[str, Any] | None:
        """End the current phase (record its peak) and start ``phase``."""
        if not self.enabled:
            return None
        now = status()
        row = None
        if self.phase is not None:
            # RssFile: pages of files (libraries loaded lazily, on first use), not the model's.
            row = {"phase": self.phase, "rss_start": self.start["VmRSS"], "peak": now["VmHWM"],
                   "rss_end": now["VmRSS"], "file_start": self.start.get("RssFile", 0), **self.start_extra}
            self.rows.append(row)
        self.phase = phase
        self.start = now
        self.start_extra = {"malloc_start": malloc_info(), **extra}
        reset_peak()
        return row

    def peak_row(self) -> dict[str, Any] | None:
        return max(self.rows, key=lambda r: r["peak"], default=None)

    def peak(self) -> int:
        """The peak RSS over every phase so far."""
        return max((r["peak"] for r in self.rows), default=0)

    def largest_steps(self, n: int) -> list[dict[str, Any]]:
        """The ``n`` parameter steps with the largest transient (peak over the
        RSS at their start), with what each kept (RSS after over before)."""
        steps = [r for r in self.rows if ":step " in r["phase"]]
        steps.sort(key=lambda r: r["rss_start"] - r["peak"])
        return [{"phase": r["phase"], "transient": r["peak"] - r["rss_start"], "kept": r["rss_end"] - r["rss_start"],
                 "grad_bytes": r.get("grad_bytes", 0), "malloc_free_at_start": r["malloc_start"].get("free")}
                for r in steps[:n]]

    def summary(self) -> list[dict[str, Any]]:
        """Phases merged into the big ones: build, forward i, backward i
        (autograd and steps), with the top step and its transient."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.rows:
            big = r["phase"].split(":")[0]
            s = out.setdefault(big, {"phase": big, "rss_start": r["rss_start"], "file_start": r.get("file_start", 0),
                                     "peak": 0, "peak_at": None, "rss_end": r["rss_end"]})
            if r["peak"] > s["peak"]:
                s["peak"], s["peak_at"] = r["peak"], r["phase"]
                s["rss_before_peak"] = r["rss_start"]
                s["file_before_peak"] = r.get("file_start", 0)
                s["malloc_before_peak"] = r.get("malloc_start", {})
            s["rss_end"] = r["rss_end"]
        return list(out.values())

    def table(self, weights: int = 0, state: int = 0, baseline: int = 0) -> str:
        lines = ["| phase | RSS at start GiB | peak GiB | peak at | transient at peak GiB | RSS at end GiB |",
                 "|---|---:|---:|---|---:|---:|"]
        for s in self.summary():
            lines.append(
                f"| {s['phase']} | {s['rss_start'] / GIB:.3f} | {s['peak'] / GIB:.3f} | {s['peak_at']} | "
                f"{(s['peak'] - s.get('rss_before_peak', s['peak'])) / GIB:.3f} | {s['rss_end'] / GIB:.3f} |")
        return "\n".join(lines)

    def dump(self, path: str | os.PathLike, **extra: Any) -> None:
        Path(path).write_text(json.dumps({"rows": self.rows, "summary": self.summary(), **extra}, indent=1))


MMAP_THRESHOLD = 128 << 10  # glibc's own starting value
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Serve every allocation of ``nbytes`` or more from its own mapping,
    unmapped when freed, and stop glibc from raising that threshold (as
    ``MALLOC_MMAP_THRESHOLD_`` does from the environment). False where the C
    library is not glibc."""
    if _LIBC is None or not hasattr(_LIBC, "mallopt"):
        return False
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, nbytes))


def attach(trace: MemTrace, model: Any, params: list, names: dict[int, str] | None = None) -> list[Any]:
    """Mark the phases of training ``model``: each forward, backward's
    autograd and (under ``step_in_backward``) each parameter's step.
    Call it before ``step_in_backward`` is installed (so the step's mark
    precedes its hook) and :func:`attach_after` after; returns the handles."""
    import torch

    names = names or {id(p): n for n, p in model.named_parameters()}
    count = [0]

    def pre(_module, _args, _kwargs):
        if torch.is_grad_enabled():
            count[0] += 1
            trace.mark(f"forward {count[0]}")

    def post(_module, _args, _kwargs, _out):
        if torch.is_grad_enabled():
            trace.mark(f"backward {count[0]}:autograd from the loss")

    def step(p):
        trace.mark(f"backward {count[0]}:step {names.get(id(p), tuple(p.shape))}",
                   grad_bytes=p.grad.numel() * p.grad.element_size())

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(post, with_kwargs=True)]
    handles += [p.register_post_accumulate_grad_hook(step) for p in params]
    trace.count, trace.names = count, names
    return handles


def attach_after(trace: MemTrace, params: list) -> list[Any]:
    """The marks that end each parameter's step (registered after the stepping hooks)."""

    def done(p):
        trace.mark(f"backward {trace.count[0]}:autograd after {trace.names.get(id(p), tuple(p.shape))}")

    return [p.register_post_accumulate_grad_hook(done) for p in params]


def install(trace: MemTrace) -> None:
    """Patch what an older ``benchmarks/big_model.py`` (before it called
    :func:`attach`) calls, so the trace marks the same phases on that
    commit's copy: ``build_model`` and ``step_in_backward``'s hook."""
    import torch

    import gwt_optim
    import gwt_optim.backward as backward
    import gwt_optim.toolkit.models as models

    names: dict[int, str] = {}
    count = {"forward": 0}
    build = models.build_model

    def build_model(*args, **kwargs):
        trace.mark("build")
        model = build(*args, **kwargs)
        for n, p in model.named_parameters():
            names[id(p)] = n
        trace.owners["weights"] = sum(p.numel() * p.element_size() for p in model.parameters())

        def pre(_module, _args, _kwargs):
            if torch.is_grad_enabled():
                count["forward"] += 1
                trace.mark(f"forward {count['forward']}")

        def post(_module, _args, _kwargs, _out):
            if torch.is_grad_enabled():
                trace.mark(f"backward {count['forward']}:autograd from the loss")

        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.register_forward_hook(post, with_kwargs=True)
        return model

    models.build_model = build_model
    hook = backward.StepInBackward._hook

    def traced_hook(self, p):
        i = count["forward"]
        name = names.get(id(p), f"param{id(p)}")
        trace.mark(f"backward {i}:step {name}", grad_bytes=p.grad.numel() * p.grad.element_size())
        try:
            return hook(self, p)
        finally:
            trace.mark(f"backward {i}:autograd after {name}")

    backward.StepInBackward._hook = traced_hook
    del gwt_optim  # imported so that gwt_optim.step_in_backward resolves the patched class
