"""The ``"native"`` backend: the C kernels of ``_fused_cpu.c`` through :mod:`ctypes`,
built on first use by :mod:`gwt_optim._toolchain` and run on the OpenMP thread
pool torch already uses. The kernels' design (the two phases and their
workspace, the pipelined batched step, bf16 row segments, AVX2 blocks) is
stated once, in the C file's header. This module holds the library's
interface (the ctypes mirrors of its structs and its functions' signatures)
and :class:`NativeBackend`, which follows :class:`~gwt_optim.optim._backends.FusedBackend`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gwt_optim import _toolchain
from gwt_optim.optim._backends import CAPABILITIES, Bucket, check_pointers
from gwt_optim.optim.functional import AdamWScalars

__all__ = ["NativeBackend", "native_library"]

_SOURCE = Path(__file__).with_name("_fused_cpu.c")

# Weight (and gradient) dtype -> the kernels' suffix, and the dtype of their
# moments and workspace: bf16 weights keep float32 moments.
_DTYPE_SUFFIX = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}
_STATE_DTYPE = {torch.float32: torch.float32, torch.float64: torch.float64, torch.bfloat16: torch.float32}


class _Hyper(ctypes.Structure):
    """Mirror of ``gwt_hyper`` in ``_fused_cpu.c``."""

    _fields_ = [(name, ctypes.c_double) for name in ("h", "w1", "beta2", "eps2", "scale", "decay", "clip")]


class _Task(ctypes.Structure):
    """Mirror of ``gwt_task`` in ``_fused_cpu.c``: one parameter's whole step."""

    # Field for field in the order of gwt_task: the kernels read it by offset.
    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("w", "g", "m", "v")],
        *[(name, ctypes.c_int64) for name in ("rows", "n")],
        *[(name, ctypes.c_int32) for name in ("level", "first", "skipped")],
        *[(name, ctypes.c_double) for name in ("gamma", "limiter_eps")],
        ("snorm", ctypes.c_void_p),
        ("hyper", _Hyper),
    ]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in _DTYPE_SUFFIX.values():
        # The phases: their pointers, then (rows, n, level, hyper, threads).
        for phase, restype, pointers in (("phase1", ctypes.c_double, 5), ("phase2", None, 4), ("phase2_clip", None, 5)):
            fn = getattr(lib, f"gwt_adamw_haar_{phase}_{name}")
            fn.restype, fn.argtypes = restype, [ptr] * pointers + [i64, i64, i32, ctypes.POINTER(_Hyper), i32]
        steps = getattr(lib, f"gwt_adamw_haar_steps_{name}")
        steps.restype, steps.argtypes = None, [ctypes.POINTER(_Task), i32, ptr, i64, i32, i32, i64]
    lib.gwt_bf16_max_level.restype, lib.gwt_bf16_max_level.argtypes = i32, []
    return lib


@functools.lru_cache(maxsize=None)
def native_library() -> ctypes.CDLL:
    """Build (once per host and source version) and load the fused CPU
    kernels, once per process: :func:`gwt_optim._toolchain.load_library`
    says how the build is cached and checked. Raises
    :class:`~gwt_optim._toolchain.KernelUnavailable` when there is no C
    compiler or no flag set compiles."""
    return _toolchain.load_library(_SOURCE, "adamw_haar", _bind)


# The pipelined batched step's workspace (two slots per thread) may be this
# share of the moments it steps, or this many bytes, whichever is more;
# beyond, the parameters run in turn on one slot.
_PIPELINE_WORKSPACE_SHARE = 0.25
_PIPELINE_WORKSPACE_BYTES = 256 << 20
# An OpenMP region costs a few microseconds; below this many entries per
# thread, more threads are slower.
_MIN_ENTRIES_PER_THREAD = 1 << 15


def _hyper(group: dict, level: int, s: AdamWScalars, step_size: float, decay: float) -> _Hyper:
    """The kernels' hyperparameters of a step of ``group`` at ``level`` with
    the step's scalars ``s`` (the stored detail clip 0 when off)."""
    h = 2.0 ** (-level / 2)
    return _Hyper(h=h, w1=s.w1, beta2=s.beta2, eps2=s.eps, scale=step_size, decay=decay,
                  clip=0.0 if s.clip is None else float(s.clip))


def _rows(G: Tensor) -> tuple[int, int, int]:
    """(rows, n, numel) of a weight or gradient, rows of its last axis."""
    n, numel = G.shape[-1], G.numel()
    return (numel // n if n else 0), n, numel


@dataclass
class _NativeTasks:
    """One weight dtype's whole steps for ``gwt_adamw_haar_steps_*``: its
    parameters as (bucket, index), largest first, and their task array,
    whether the kernel pipelines them one parameter per thread (see
    ``_fused_cpu.c``), and the workspace entries of one slot."""

    dtype: torch.dtype
    items: list[tuple[Bucket, int]]
    tasks: ctypes.Array
    pipelined: bool
    stride: int


class NativeBackend:
    """The C kernels of ``_fused_cpu.c`` (CPU: float32 and float64, and bf16
    weights and gradients with float32 moments).

    Besides the two phases (for parameters whose phase 2 waits for a
    collective), it runs whole steps of many parameters in one call
    (:meth:`step_buckets`, ``batched = True``).
    """

    name = "native"
    capabilities = CAPABILITIES["native"]

    def __init__(self) -> None:
        lib = native_library()
        self._phase1 = {dt: getattr(lib, f"gwt_adamw_haar_phase1_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        self._phase2 = {dt: getattr(lib, f"gwt_adamw_haar_phase2_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        self._phase2_clip = {dt: getattr(lib, f"gwt_adamw_haar_phase2_clip_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        self._steps = {dt: getattr(lib, f"gwt_adamw_haar_steps_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        # bf16 rows are converted a segment of whole blocks at a time, which
        # bounds the block: the library says how far.
        bf16_max_level = ((torch.bfloat16, lib.gwt_bf16_max_level()),)
        if bf16_max_level != self.capabilities.max_level:
            self.capabilities = dataclasses.replace(self.capabilities, max_level=bf16_max_level)
        self._batch_workspace: dict[torch.dtype, Tensor] = {}

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Nothing to do: the library was built in ``__init__``."""

    @staticmethod
    def _threads(numel: int, rows: int) -> int:
        return max(1, min(torch.get_num_threads(), rows, numel // _MIN_ENTRIES_PER_THREAD))

    def step_buckets(self, buckets: list[Bucket], limiter_eps: float, table: dict | None = None) -> list[Tensor]:
        """Whole steps (phase 1, limiter, phase 2) of the parameters of
        ``buckets``, one call per weight dtype; returns those skipped for a
        non-finite gradient (weight and state unchanged). The kernels read
        and write the limiter's norm ``state["limiter_norm"]`` in place.

        Under a plan (its ``table``, see :class:`~gwt_optim.optim._backends.Bucket`)
        the task arrays are made once, kept in the table with the threads and
        limiter eps they were made for, and afterwards only the gradients'
        addresses and the per-step scalars are written into them: filling one
        ctypes struct per parameter per step costs more than the kernel on
        small weights."""
        threads = torch.get_num_threads()
        cached = table.get("native") if table is not None else None
        if cached is None or cached[0] != (threads, limiter_eps):
            cached = ((threads, limiter_eps), self._tasks(buckets, threads, limiter_eps))
            if table is not None:
                table["native"] = cached
        return self._run(cached[1], threads)

    def _tasks(self, buckets: list[Bucket], threads: int, limiter_eps: float) -> list[_NativeTasks]:
        """The task arrays of these buckets' parameters, one per weight dtype,
        largest parameter first (so that the dynamic schedule ends evenly),
        with everything but what :meth:`_run` writes on every step."""
        by_dtype: dict[torch.dtype, list[tuple[Bucket, int]]] = {}
        for b in buckets:
            for i, w in enumerate(b.params):
                by_dtype.setdefault(w.dtype, []).append((b, i))
        planned = []
        for dtype, items in by_dtype.items():
            items.sort(key=lambda item: -item[0].params[item[1]].numel())
            tasks = (_Task * len(items))()
            ws_numel = 0
            for task, (b, i) in zip(tasks, items):
                w, st = b.params[i], b.states[i]
                check_pointers(self.name, w, b.grads[i], st, b.levels[i])
                M = st["exp_avg"]
                task.w, task.m, task.v = w.data_ptr(), M.data_ptr(), st["exp_avg_sq"].data_ptr()
                task.rows, task.n, _ = _rows(w)
                task.level = b.levels[i]
                task.limiter_eps = limiter_eps
                task.snorm = st["limiter_norm"].data_ptr() if b.limited[i] else None
                ws_numel = max(ws_numel, 2 * M.numel())
            # One parameter per thread when there are enough to share out and
            # none would keep one thread busy after the others are done, and
            # the two workspace slots per thread (each as big as the largest
            # parameter's moments) stay small: next to the moments, or in
            # bytes (LLaMA-7B at 64 threads would need 12 GB of them);
            # otherwise one after the other, each split by rows (one slot).
            sizes = [b.params[i].numel() for b, i in items]
            moments = sum(2 * b.states[i]["exp_avg"].numel() for b, i in items)
            itemsize = _STATE_DTYPE[dtype].itemsize
            allowed = max(_PIPELINE_WORKSPACE_SHARE * moments, _PIPELINE_WORKSPACE_BYTES / itemsize)
            pipelined = (len(items) >= 2 * threads and sizes[0] * threads <= sum(sizes)
                         and 2 * threads * ws_numel <= allowed)
            planned.append(_NativeTasks(dtype, items, tasks, pipelined, ws_numel))
        return planned

    def _run(self, planned: list[_NativeTasks], threads: int) -> list[Tensor]:
        """Write this step's gradients and scalars into the task arrays, run
        them, and return the parameters skipped for a non-finite gradient."""
        skipped = []
        for entry in planned:
            hypers: dict[tuple, _Hyper] = {}
            for task, (b, i) in zip(entry.tasks, entry.items):
                level = b.levels[i]
                # One struct per bucket and level (a group's 1-D weights step
                # at level 0, its matrices at its level).
                hyper = hypers.get((id(b), level))
                if hyper is None:
                    s = b.scalars
                    hyper = hypers[id(b), level] = _hyper(b.group, level, s, s.step_size, s.decay)
                task.hyper = hyper
                w, g = b.params[i], b.grads[i]  # a new gradient on most steps: its layout is checked every time
                if not (g.is_contiguous() and g.shape == w.shape and g.dtype == w.dtype):
                    check_pointers(self.name, w, g, None, level)
                    raise ValueError(f"GWT-AdamW ({self.name}): a {g.dtype} gradient for a {w.dtype} weight")
                task.g = g.data_ptr()
                task.gamma = b.group["norm_growth_limit"] if b.limited[i] else 0.0
                task.first = b.step == 1
            needed = entry.stride * (2 * threads if entry.pipelined else 1)
            state_dtype = _STATE_DTYPE[entry.dtype]
            buf = self._batch_workspace.get(state_dtype)
            if buf is None or buf.numel() < needed:
                buf = self._batch_workspace[state_dtype] = torch.empty(needed, dtype=state_dtype)
            self._steps[entry.dtype](entry.tasks, len(entry.items), buf.data_ptr(), entry.stride, threads,
                                     int(entry.pipelined), _MIN_ENTRIES_PER_THREAD)
            skipped += [b.params[i] for task, (b, i) in zip(entry.tasks, entry.items) if task.skipped]
        return skipped

    def phase1(self, group: dict, state: dict, G: Tensor, level: int, step: int, scalars: AdamWScalars):
        M, V = state["exp_avg"], state["exp_avg_sq"]
        check_pointers(self.name, G, G, state, level)  # the weight is checked in phase2
        rows, n, numel = _rows(G)
        # The carry to phase 2 (which runs after the limiter's all-reduce): the (d, t) workspace, the
        # hyperparameters, the first moment, which the clipped phase 2 reads, and the step's scalars.
        buf, hyper = torch.empty(2 * M.numel(), dtype=M.dtype), _hyper(group, level, scalars, 0.0, 0.0)
        norm_sq = self._phase1[G.dtype](G.data_ptr(), M.data_ptr(), V.data_ptr(), buf.data_ptr(),
                                        buf[M.numel():].data_ptr(), rows, n, level, ctypes.byref(hyper),
                                        self._threads(numel, rows))
        return norm_sq, (buf, hyper, M, scalars)

    def phase2(self, w: Tensor, G: Tensor, level: int, carry: tuple, r) -> None:
        check_pointers(self.name, w, G, None, level)
        buf, hyper, M, scalars = carry
        rows, n, numel = _rows(G)
        hyper.scale, hyper.decay = scalars.step_size / float(r), scalars.decay
        d, t = buf.data_ptr(), buf[M.numel():].data_ptr()
        if hyper.clip > 0:
            self._phase2_clip[w.dtype](w.data_ptr(), G.data_ptr(), M.data_ptr(), d, t, rows, n, level,
                                       ctypes.byref(hyper), self._threads(numel, rows))
        else:
            self._phase2[w.dtype](w.data_ptr(), G.data_ptr(), d, t, rows, n, level, ctypes.byref(hyper),
                                  self._threads(numel, rows))
