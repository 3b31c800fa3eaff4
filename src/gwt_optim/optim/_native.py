r"""The ``"native"`` backend: the C kernels of ``_fused_cpu.c`` through :mod:`ctypes`.

The two phases of the step (see :mod:`gwt_optim.optim._fused`) are C
functions, built on first use by :mod:`gwt_optim.optim._toolchain` and run on
the OpenMP thread pool torch already uses. Phase 1 also stores :math:`d` and
:math:`h (M-A) d` in an :math:`A`-sized workspace, so phase 2 is a single
multiply-add pass, run right after phase 1 while the gradient and the
workspace are still in cache: the step reads :math:`G` and :math:`W` from
memory once (about 16 bytes per fp32 parameter at level 2, against AdamW's
28). The whole steps of all parameters that need no collective run in one
call, each parameter on one thread when there are at least two per thread
(one OpenMP fork and join per optimizer step; a per-tensor parallel loop
stalls at every join when other processes hold a core), each thread's phase 2
interleaved with the next parameter's phase 1. float32 and float64, and bf16
weights and gradients with float32 moments (levels up to 11: rows are
converted in segments of whole blocks); float32 blocks of 2 and 4 entries use
AVX2 where the CPU has it.

This module holds the library's interface (the ctypes mirrors of its structs
and the signatures of its functions) and :class:`NativeBackend`, which follows
:class:`~gwt_optim.optim._fused.FusedBackend`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import weakref
from pathlib import Path
from typing import Any, Callable, Hashable

import torch
from torch import Tensor

from gwt_optim.optim import _toolchain
from gwt_optim.optim._backends import CAPABILITIES, check_pointers

__all__ = ["NativeBackend", "native_library"]

_SOURCE = Path(__file__).with_name("_fused_cpu.c")

# Weight (and gradient) dtype -> the kernels' suffix, and the dtype of their
# moments and workspace: bf16 weights keep float32 moments.
_DTYPE_SUFFIX = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}
_STATE_DTYPE = {torch.float32: torch.float32, torch.float64: torch.float64, torch.bfloat16: torch.float32}


class _Hyper(ctypes.Structure):
    """Mirror of ``gwt_hyper`` in ``_fused_cpu.c``."""

    _fields_ = [(name, ctypes.c_double) for name in ("h", "w1", "beta2", "eps2", "scale", "decay", "clip", "hu")]


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
    for name in _DTYPE_SUFFIX.values():
        p1 = getattr(lib, f"gwt_adamw_haar_phase1_{name}")
        p1.restype = ctypes.c_double
        p1.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(_Hyper), ctypes.c_int]
        p2 = getattr(lib, f"gwt_adamw_haar_phase2_{name}")
        p2.restype = None
        p2.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(_Hyper), ctypes.c_int]
        p2c = getattr(lib, f"gwt_adamw_haar_phase2_clip_{name}")
        p2c.restype = None
        p2c.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(_Hyper), ctypes.c_int]
        steps = getattr(lib, f"gwt_adamw_haar_steps_{name}")
        steps.restype = None
        steps.argtypes = [ctypes.POINTER(_Task), ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    lib.gwt_bf16_max_level.restype = ctypes.c_int
    lib.gwt_bf16_max_level.argtypes = []
    return lib


@functools.lru_cache(maxsize=None)
def native_library() -> ctypes.CDLL:
    """Build (once per host and source version) and load the fused CPU
    kernels, once per process: :func:`gwt_optim.optim._toolchain.load_library`
    says how the build is cached and checked. Raises
    :class:`~gwt_optim.optim._toolchain.KernelUnavailable` when there is no C
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


def _moments(state: dict) -> dict[str, Tensor]:
    return {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


def _hu(group: dict, level: int) -> float:
    """U's factor in the inverse (functional.approx_gain): 1 with adamw_units, else h = 2^(-l/2)."""
    return 1.0 if group.get("adamw_units") else 2.0 ** (-level / 2)


def _clip(group: dict) -> float:
    """detail_clip as the kernels take it: 0 when off."""
    clip = group.get("detail_clip")
    return 0.0 if clip is None else float(clip)


class _NativeCarry:
    """What native phase 1 leaves for phase 2: the (d, t) workspace, as the
    buffer holding it and two addresses, and the hyperparameters."""

    __slots__ = ("buffer", "d", "t", "hyper", "m", "__weakref__")

    def __init__(self, buffer: Tensor, d: int, t: int, hyper: _Hyper, m: int) -> None:
        # m: the first moment's address, which the clipped phase 2 reads
        self.buffer, self.d, self.t, self.hyper, self.m = buffer, d, t, hyper, m


class _NativeTasks:
    """One weight dtype's whole steps for ``gwt_adamw_haar_steps_*``: its
    ParamSteps (largest first) and their task array, whether the kernel
    pipelines them one parameter per thread (see ``_fused_cpu.c``), and the
    workspace entries of one slot."""

    __slots__ = ("dtype", "steps", "tasks", "pipelined", "stride")

    def __init__(self, dtype: torch.dtype, steps: list, tasks: ctypes.Array, pipelined: bool, stride: int) -> None:
        self.dtype, self.steps, self.tasks, self.pipelined, self.stride = dtype, steps, tasks, pipelined, stride


class NativeBackend:
    """The C kernels of ``_fused_cpu.c`` (CPU: float32 and float64, and bf16
    weights and gradients with float32 moments).

    Besides the two phases (for parameters whose phase 2 waits for a
    collective), it runs whole steps of many parameters in one call
    (:meth:`step_many`, ``batched = True``).
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
        # The task arrays of the optimizer's step plan (step_batches), kept
        # while it hands over the same StepBatch list: filling one ctypes
        # struct per parameter per step costs more than the kernel on small
        # weights.
        # Per plan key (see step_batches): the list, the threads and limiter
        # eps the arrays were made for, the StepBatch of each ParamStep, and
        # the task arrays.
        self._plans: dict[Hashable, tuple[list, tuple, dict[int, Any], list[_NativeTasks]]] = {}
        self._batch_workspace: dict[torch.dtype, Tensor] = {}
        # One workspace per dtype, reused by every parameter whose phase 2 runs
        # before the next phase 1 (all but FSDP2's): fresh A-sized allocations
        # on every step would page-fault on each use. _owner is the carry
        # using it; while that carry waits for its phase 2, others get their own.
        self._workspace: dict[torch.dtype, Tensor] = {}
        self._owner: dict[torch.dtype, weakref.ref] = {}

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Nothing to do: the library was built in ``__init__``."""

    def _buffer(self, numel: int, dtype: torch.dtype) -> tuple[Tensor, bool]:
        """A workspace of numel entries, and whether it is the shared one."""
        owner = self._owner.get(dtype)
        if owner is not None and owner() is not None:
            return torch.empty(numel, dtype=dtype), False
        buf = self._workspace.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = self._workspace[dtype] = torch.empty(numel, dtype=dtype)
        return buf, True

    @staticmethod
    def _threads(numel: int, rows: int) -> int:
        return max(1, min(torch.get_num_threads(), rows, numel // _MIN_ENTRIES_PER_THREAD))

    def step_many(self, steps: list, limiter_eps: float) -> list:
        """Whole steps (phase 1, limiter, phase 2) of many parameters; returns
        those skipped for a non-finite gradient (weight and state unchanged).

        ``steps`` holds ``(ps, scale, decay)``: a :class:`~gwt_optim.optim._stepper.ParamStep`
        of a GWT-AdamW parameter, ``scale`` = alpha * lr * bias correction and
        ``decay`` = 1 - lr * weight_decay. The kernels read and write the
        limiter's norm ``state["limiter_norm"]`` in place.
        """
        threads = torch.get_num_threads()
        scalars = {id(ps): (scale, decay) for ps, scale, decay in steps}
        planned = self._tasks([ps for ps, _, _ in steps], threads, limiter_eps)
        return self._run(planned, lambda ps: scalars[id(ps)], threads)

    def step_batches(self, batches: list, limiter_eps: float, *, key: Hashable = None) -> list:
        """:meth:`step_many` for one of the optimizer's plans (a list of
        :class:`~gwt_optim.optim._stepper.StepBatch`; ``key`` names the plan, and
        a new list under a key replaces the old one): the task arrays are made
        once per list, and afterwards only the gradients' addresses and the
        per-step scalars are written into them."""
        threads = torch.get_num_threads()
        cached = self._plans.get(key)
        if cached is None or cached[0] is not batches or cached[1] != (threads, limiter_eps):
            batch_of = {id(ps): b for b in batches for ps in b.steps}
            planned = self._tasks([ps for b in batches for ps in b.steps], threads, limiter_eps)
            cached = self._plans[key] = (batches, (threads, limiter_eps), batch_of, planned)
        _, _, batch_of, planned = cached
        return self._run(planned, lambda ps: (batch_of[id(ps)].scale, batch_of[id(ps)].decay), threads)

    def invalidate(self) -> None:
        """Forget the task arrays kept for the optimizer's plans."""
        self._plans.clear()

    def _tasks(self, steps: list, threads: int, limiter_eps: float) -> list[_NativeTasks]:
        """The task arrays of these ParamSteps, one per weight dtype, largest
        parameter first (so that the dynamic schedule ends evenly), with
        everything but what :meth:`_run` writes on every step."""
        by_dtype: dict[torch.dtype, list] = {}
        for ps in steps:
            by_dtype.setdefault(ps.param.dtype, []).append(ps)
        planned = []
        for dtype, group in by_dtype.items():
            group.sort(key=lambda ps: -ps.grad.numel())
            tasks = (_Task * len(group))()
            ws_numel = 0
            for task, ps in zip(tasks, group):
                G, M = ps.grad, ps.state["exp_avg"]
                check_pointers(self.name, ps.param, G, _moments(ps.state), ps.level)
                n = G.shape[-1]
                task.w, task.m, task.v = ps.param.data_ptr(), M.data_ptr(), ps.state["exp_avg_sq"].data_ptr()
                task.rows, task.n = (G.numel() // n if n else 0), n
                task.level = ps.level
                task.limiter_eps = limiter_eps
                task.snorm = ps.state["limiter_norm"].data_ptr() if ps.limited else None
                ws_numel = max(ws_numel, 2 * M.numel())
            # One parameter per thread when there are enough to share out and
            # none would keep one thread busy after the others are done, and
            # the two workspace slots per thread (each as big as the largest
            # parameter's moments) stay small: next to the moments, or in
            # bytes (LLaMA-7B at 64 threads would need 12 GB of them);
            # otherwise one after the other, each split by rows (one slot).
            sizes = [ps.grad.numel() for ps in group]
            moments = sum(2 * ps.state["exp_avg"].numel() for ps in group)
            itemsize = _STATE_DTYPE[dtype].itemsize
            allowed = max(_PIPELINE_WORKSPACE_SHARE * moments, _PIPELINE_WORKSPACE_BYTES / itemsize)
            pipelined = (len(group) >= 2 * threads and sizes[0] * threads <= sum(sizes)
                         and 2 * threads * ws_numel <= allowed)
            planned.append(_NativeTasks(dtype, group, tasks, pipelined, ws_numel))
        return planned

    def _run(self, planned: list[_NativeTasks], scalars: Callable[[Any], tuple[float, float]], threads: int) -> list:
        """Write this step's gradients and scalars into the task arrays, run
        them, and return the ParamSteps skipped for a non-finite gradient."""
        skipped = []
        for entry in planned:
            hypers: dict[tuple, _Hyper] = {}
            for task, ps in zip(entry.tasks, entry.steps):
                group = ps.group
                scale, decay = scalars(ps)
                # Steps, lr and decay are almost always shared: one struct each
                # (a group's 1-D weights step at level 0, its matrices at its level).
                key = (id(group), ps.level, ps.step, scale, decay)
                hyper = hypers.get(key)
                if hyper is None:
                    beta1, beta2 = group["betas"]
                    hyper = hypers[key] = _Hyper(
                        h=2.0 ** (-ps.level / 2),
                        w1=1.0 - beta1,
                        beta2=beta2,
                        eps2=group["eps"] * math.sqrt(1.0 - beta2**ps.step),
                        scale=scale,
                        decay=decay,
                        clip=_clip(group),
                        hu=_hu(group, ps.level),
                    )
                task.hyper = hyper
                g = ps.grad  # a new tensor on most steps: its layout is checked every time
                if not (g.is_contiguous() and g.shape == ps.param.shape and g.dtype == ps.param.dtype):
                    check_pointers(self.name, ps.param, g, {}, ps.level)
                    raise ValueError(f"GWT-AdamW ({self.name}): a {g.dtype} gradient for a {ps.param.dtype} weight")
                task.g = g.data_ptr()
                task.gamma = group["norm_growth_limit"] if ps.limited else 0.0
                task.first = ps.step == 1
            needed = entry.stride * (2 * threads if entry.pipelined else 1)
            state_dtype = _STATE_DTYPE[entry.dtype]
            buf = self._batch_workspace.get(state_dtype)
            if buf is None or buf.numel() < needed:
                buf = self._batch_workspace[state_dtype] = torch.empty(needed, dtype=state_dtype)
            self._steps[entry.dtype](entry.tasks, len(entry.steps), buf.data_ptr(), entry.stride, threads,
                                     int(entry.pipelined), _MIN_ENTRIES_PER_THREAD)
            skipped += [ps for task, ps in zip(entry.tasks, entry.steps) if task.skipped]
        return skipped

    def phase1(self, group: dict, state: dict, G: Tensor, level: int, step: int):
        beta1, beta2 = group["betas"]
        M, V = state["exp_avg"], state["exp_avg_sq"]
        check_pointers(self.name, G, G, _moments(state), level)  # the weight is checked in phase2
        n = G.shape[-1]
        numel = G.numel()
        rows = numel // n if n else 0
        buf, shared = self._buffer(2 * M.numel(), M.dtype)
        d = buf.data_ptr()
        t = d + M.numel() * buf.element_size()
        hyper = _Hyper(
            h=2.0 ** (-level / 2),
            w1=1.0 - beta1,
            beta2=beta2,
            eps2=group["eps"] * math.sqrt(1.0 - beta2**step),
            clip=_clip(group),
            hu=_hu(group, level),
        )
        norm_sq = self._phase1[G.dtype](
            G.data_ptr(), M.data_ptr(), V.data_ptr(), d, t, rows, n, level, ctypes.byref(hyper), self._threads(numel, rows)
        )
        carry = _NativeCarry(buf, d, t, hyper, M.data_ptr())
        if shared:
            self._owner[M.dtype] = weakref.ref(carry)
        return norm_sq, carry

    def phase2(self, w: Tensor, G: Tensor, level: int, carry: _NativeCarry, r, scale: float, decay: float) -> None:
        check_pointers(self.name, w, G, {}, level)
        n = G.shape[-1]
        numel = G.numel()
        rows = numel // n if n else 0
        hyper = carry.hyper
        hyper.scale = scale / float(r)
        hyper.decay = decay
        threads = self._threads(numel, rows)
        if hyper.clip > 0:
            self._phase2_clip[w.dtype](
                w.data_ptr(), G.data_ptr(), carry.m, carry.d, carry.t, rows, n, level, ctypes.byref(hyper), threads
            )
        else:
            self._phase2[w.dtype](
                w.data_ptr(), G.data_ptr(), carry.d, carry.t, rows, n, level, ctypes.byref(hyper), threads
            )
        owner = self._owner.get(carry.buffer.dtype)
        if owner is not None and owner() is carry:
            del self._owner[carry.buffer.dtype]

