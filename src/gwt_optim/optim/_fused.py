r"""Fused kernels for the GWT-AdamW step with the Haar wavelet.

The generic fast path (:mod:`gwt_optim.optim._base`) runs the closed-form
Haar step as a dozen eager tensor operations per parameter, many of them
broadcasts over blocks of :math:`2^l` entries that do not vectorize, plus
full-size temporaries. The step itself needs only two passes over memory: with
:math:`h = 2^{-l/2}` and blocks of :math:`b = 2^l` columns,

phase 1
    :math:`A_k = h \sum \mathrm{block}_k`; update :math:`M, V` on :math:`A`;
    return :math:`\|M/\mathrm{den}\|_F^2` for the limiter
    (:math:`\mathrm{den} = \sqrt V + \epsilon\sqrt{1-\beta_2^t}`);
phase 2
    :math:`W \leftarrow W (1 - \eta\lambda) - s \cdot \big(G_k d_k + h (M_k - A_k) d_k\big)`
    on block :math:`k`, with :math:`d = 1/\mathrm{den}` (0 where
    :math:`\mathrm{den} = 0`) and the scalar
    :math:`s = \eta\, c_t\, \alpha / r` (:math:`r` from the limiter).

Between them sits only the limiter's scalar (and, under FSDP2, its one
all-reduce). Two backends implement the phases; both are tested against the
reference path:

``"native"`` (CPU)
    A small C library (``_fused_cpu.c``) built on first use with the system C
    compiler, the same requirement as ``torch.compile`` on CPU, cached on disk
    (:func:`cache_dir`) and called through :mod:`ctypes`. It runs on the
    OpenMP thread pool torch already uses. Phase 1 also stores :math:`d` and
    :math:`h (M-A) d` in an :math:`A`-sized workspace, so phase 2 is a single
    multiply-add pass, run right after phase 1 while the gradient and the
    workspace are still in cache: the step reads :math:`G` and :math:`W` from
    memory once (about 16 bytes per fp32 parameter at level 2, against
    AdamW's 28). The whole steps of all parameters that need no collective
    run in one call, each parameter on one thread when there are at least two
    per thread (one OpenMP fork and join per optimizer step; a per-tensor
    parallel loop stalls at every join when other processes hold a core).
    float32 and float64; level 2 float32 block sums use AVX2 where the CPU
    has it.
``"inductor"`` (CUDA; on CPU only when asked for)
    The two phases as :func:`torch.compile` functions over flat
    ``(blocks, b)`` views. The number of blocks is marked dynamic, so one
    compilation per block size and dtype combination serves every parameter
    shape, and the changing scalars (learning rate, bias corrections, the
    limiter's ratio) are runtime arguments: nothing recompiles from step to
    step. Phase 2 recomputes :math:`A` and :math:`d` from the gradient block
    and :math:`M, V`, which moves no more bytes than a workspace would: about
    22 bytes per fp32 parameter at level 2, against AdamW's 28. Any dtype;
    needs the last dimension to be a multiple of :math:`2^l`.

Parameters that no backend takes (other dtypes, non-contiguous tensors,
:math:`n \bmod 2^l \ne 0` for Inductor) take the generic fast path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["BACKENDS", "KernelUnavailable", "AdamWHaarKernels", "check_compile_option", "native_library"]


class KernelUnavailable(RuntimeError):
    """A fused backend cannot run here (no compiler, no Triton, ...)."""


# --------------------------------------------------------------- native --- #

_SOURCE = Path(__file__).with_name("_fused_cpu.c")
# Tried in order: the fastest flags first, then without the ones a compiler
# may lack (-march=native on some ARM toolchains, OpenMP on Apple clang; the
# kernels then run on one thread).
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3", "-march=native"],
    ["-O3"],
)
# Vectorizing the selects around divisions needs -fno-trapping-math; the
# kernels never read floating-point exception flags or errno.
_COMMON_FLAGS = ["-std=gnu11", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-Wno-unknown-pragmas"]
_DTYPE_SUFFIX = {torch.float32: "float32", torch.float64: "float64"}


class _Hyper(ctypes.Structure):
    """Mirror of ``gwt_hyper`` in ``_fused_cpu.c``."""

    _fields_ = [(name, ctypes.c_double) for name in ("h", "w1", "beta2", "eps2", "scale", "decay")]


class _Task(ctypes.Structure):
    """Mirror of ``gwt_task`` in ``_fused_cpu.c``: one parameter's whole step."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("level", ctypes.c_int32),
        ("first", ctypes.c_int32),
        ("gamma", ctypes.c_double),
        ("limiter_eps", ctypes.c_double),
        ("s", ctypes.c_double),
        ("hyper", _Hyper),
    ]


def cache_dir() -> Path:
    """Where built kernels are kept: ``$GWT_OPTIM_CACHE``, else ``$XDG_CACHE_HOME/gwt_optim``
    (``~/.cache/gwt_optim``)."""
    if os.environ.get("GWT_OPTIM_CACHE"):
        return Path(os.environ["GWT_OPTIM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gwt_optim"


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise KernelUnavailable(
        "the fused CPU kernels need a C compiler and none was found (set $CC, or install gcc/clang, "
        "e.g. apt-get install gcc); pass compile=False to use the eager path"
    )


def _host_fingerprint(cc: str) -> str:
    """What a ``-march=native`` build depends on: compiler version and CPU features."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                cpu += line
                break
    except OSError:
        pass
    return version + cpu


@functools.lru_cache(maxsize=None)
def native_library() -> ctypes.CDLL:
    """Build (once per host and source version) and load the fused CPU kernels.

    Raises :class:`KernelUnavailable` with the compiler's message when no flag
    set compiles.
    """
    cc = _compiler()
    source = _SOURCE.read_text()
    key = hashlib.sha256((source + _host_fingerprint(cc) + repr(_FLAG_SETS + (_COMMON_FLAGS,))).encode()).hexdigest()[:20]
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        directory = Path(tempfile.gettempdir()) / "gwt_optim"
        directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"adamw_haar_{key}.so"
    if not target.exists():
        errors = []
        for flags in _FLAG_SETS:
            # Build under a private name and rename: concurrent processes
            # (pytest -n, torchrun) may build the same library at once.
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so")
            os.close(fd)
            proc = subprocess.run([cc, *flags, *_COMMON_FLAGS, "-o", tmp, str(_SOURCE)], capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(tmp, target)
                break
            os.unlink(tmp)
            errors.append(f"{' '.join(flags)}: {proc.stderr.strip()[-500:]}")
        else:
            raise KernelUnavailable(
                f"building the fused CPU kernels with {cc} failed; pass compile=False to use the eager path. "
                + "\n".join(errors)
            )
    lib = ctypes.CDLL(str(target))
    for name in _DTYPE_SUFFIX.values():
        p1 = getattr(lib, f"gwt_adamw_haar_phase1_{name}")
        p1.restype = ctypes.c_double
        p1.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(_Hyper), ctypes.c_int]
        p2 = getattr(lib, f"gwt_adamw_haar_phase2_{name}")
        p2.restype = None
        p2.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(_Hyper), ctypes.c_int]
        steps = getattr(lib, f"gwt_adamw_haar_steps_{name}")
        steps.restype = None
        steps.argtypes = [ctypes.POINTER(_Task), ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    return lib


# An OpenMP region costs a few microseconds; below this many entries per
# thread, more threads are slower.
_MIN_ENTRIES_PER_THREAD = 1 << 15


class _NativeCarry:
    """What native phase 1 leaves for phase 2: the (d, t) workspace, as the
    buffer holding it and two addresses, and the hyperparameters."""

    __slots__ = ("buffer", "d", "t", "hyper", "__weakref__")

    def __init__(self, buffer: Tensor, d: int, t: int, hyper: _Hyper) -> None:
        self.buffer, self.d, self.t, self.hyper = buffer, d, t, hyper


class NativeBackend:
    """The C kernels of ``_fused_cpu.c`` (CPU, float32/float64).

    Besides the two phases (for parameters whose phase 2 waits for a
    collective), it runs whole steps of many parameters in one call
    (:meth:`step_many`, ``batched = True``).
    """

    name = "native"
    batched = True

    def __init__(self) -> None:
        lib = native_library()
        self._phase1 = {dt: getattr(lib, f"gwt_adamw_haar_phase1_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        self._phase2 = {dt: getattr(lib, f"gwt_adamw_haar_phase2_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        self._steps = {dt: getattr(lib, f"gwt_adamw_haar_steps_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        self._batch_workspace: dict[torch.dtype, Tensor] = {}
        # One workspace per dtype, reused by every parameter whose phase 2 runs
        # before the next phase 1 (all but FSDP2's): fresh A-sized allocations
        # on every step would page-fault on each use. _owner is the carry
        # using it; while that carry waits for its phase 2, others get their own.
        self._workspace: dict[torch.dtype, Tensor] = {}
        self._owner: dict[torch.dtype, weakref.ref] = {}

    def supports(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> bool:
        return (
            w.device.type == "cpu"
            and w.dtype in _DTYPE_SUFFIX
            and G.dtype == w.dtype
            and moment_dtype == w.dtype
            and w.is_contiguous()
            and G.is_contiguous()
        )

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

    def step_many(self, steps: list, limiter_eps: float) -> None:
        """Whole steps (phase 1, limiter, phase 2) of many parameters.

        ``steps`` holds ``(ps, scale, decay)``: a :class:`~gwt_optim.optim._base.ParamStep`
        of a GWT-AdamW parameter, ``scale`` = alpha * lr * bias correction and
        ``decay`` = 1 - lr * weight_decay.
        """
        by_dtype: dict[torch.dtype, list] = {}
        for item in steps:
            by_dtype.setdefault(item[0].param.dtype, []).append(item)
        threads = torch.get_num_threads()
        for dtype, items in by_dtype.items():
            # Largest first, so that the dynamic schedule ends evenly.
            items.sort(key=lambda item: -item[0].grad.numel())
            tasks = (_Task * len(items))()
            ws_numel = 0
            for task, (ps, scale, decay) in zip(tasks, items):
                group, state, G = ps.group, ps.state, ps.grad
                beta1, beta2 = group["betas"]
                M, V = state["exp_avg"], state["exp_avg_sq"]
                n = G.shape[-1]
                task.w, task.g, task.m, task.v = ps.param.data_ptr(), G.data_ptr(), M.data_ptr(), V.data_ptr()
                task.rows, task.n = (G.numel() // n if n else 0), n
                task.level, task.first = ps.level, ps.step == 1
                task.gamma = group["norm_growth_limit"] if ps.limited else 0.0
                task.limiter_eps = limiter_eps
                task.s = state["limiter_norm"].item() if ps.limited else 0.0
                task.hyper = _Hyper(
                    h=2.0 ** (-ps.level / 2),
                    w1=1.0 - beta1,
                    beta2=beta2,
                    eps2=group["eps"] * math.sqrt(1.0 - beta2**ps.step),
                    scale=scale,
                    decay=decay,
                )
                ws_numel = max(ws_numel, 2 * M.numel())
            # One parameter per thread when there are enough to share out and
            # none would keep one thread busy after the others are done;
            # otherwise one after the other, each split by rows.
            sizes = [ps.grad.numel() for ps, _, _ in items]
            across = threads > 1 and len(items) >= 2 * threads and sizes[0] * threads <= sum(sizes)
            stride = ws_numel
            needed = stride * (threads if across else 1)
            buf = self._batch_workspace.get(dtype)
            if buf is None or buf.numel() < needed:
                buf = self._batch_workspace[dtype] = torch.empty(needed, dtype=dtype)
            self._steps[dtype](tasks, len(items), buf.data_ptr(), stride, threads, int(across), _MIN_ENTRIES_PER_THREAD)
            for task, (ps, _, _) in zip(tasks, items):
                if ps.limited:
                    ps.state["limiter_norm"].fill_(task.s)

    def phase1(self, group: dict, state: dict, G: Tensor, level: int, step: int):
        beta1, beta2 = group["betas"]
        M, V = state["exp_avg"], state["exp_avg_sq"]
        n = G.shape[-1]
        numel = G.numel()
        rows = numel // n if n else 0
        buf, shared = self._buffer(2 * M.numel(), G.dtype)
        d = buf.data_ptr()
        t = d + M.numel() * buf.element_size()
        hyper = _Hyper(
            h=2.0 ** (-level / 2),
            w1=1.0 - beta1,
            beta2=beta2,
            eps2=group["eps"] * math.sqrt(1.0 - beta2**step),
        )
        norm_sq = self._phase1[G.dtype](
            G.data_ptr(), M.data_ptr(), V.data_ptr(), d, t, rows, n, level, ctypes.byref(hyper), self._threads(numel, rows)
        )
        carry = _NativeCarry(buf, d, t, hyper)
        if shared:
            self._owner[G.dtype] = weakref.ref(carry)
        return norm_sq, carry

    def phase2(self, w: Tensor, G: Tensor, level: int, carry: _NativeCarry, r, scale: float, decay: float) -> None:
        n = G.shape[-1]
        numel = G.numel()
        rows = numel // n if n else 0
        hyper = carry.hyper
        hyper.scale = scale / float(r)
        hyper.decay = decay
        self._phase2[w.dtype](
            w.data_ptr(), G.data_ptr(), carry.d, carry.t, rows, n, level, ctypes.byref(hyper), self._threads(numel, rows)
        )
        owner = self._owner.get(w.dtype)
        if owner is not None and owner() is carry:
            del self._owner[w.dtype]


# ------------------------------------------------------------- inductor --- #


def _inductor_phase1(G: Tensor, M: Tensor, V: Tensor, h: float, w1: float, beta2: float, eps2: float) -> Tensor:
    """Phase 1 on flat views: G is (blocks, b), M and V are (blocks,)."""
    cdt = torch.promote_types(G.dtype, torch.float32)
    A = G.to(cdt).sum(-1) * h
    m = torch.lerp(M.to(cdt), A, w1)
    v = V.to(cdt) * beta2 + (1.0 - beta2) * A * A
    M.copy_(m)
    V.copy_(v)
    den = v.sqrt() + eps2
    u = torch.where(den > 0, m / torch.where(den > 0, den, 1.0), 0.0)
    return u.square().sum()


def _inductor_phase2(
    W: Tensor, G: Tensor, M: Tensor, V: Tensor, h: float, eps2: float, inv_r: Tensor, scale: float, decay: float
) -> None:
    """Phase 2 on flat views: W and G are (blocks, b), M and V are (blocks,)."""
    cdt = torch.promote_types(W.dtype, torch.float32)
    g = G.to(cdt)
    A = g.sum(-1, keepdim=True) * h
    den = V.to(cdt).sqrt().unsqueeze(-1) + eps2
    d = torch.where(den > 0, 1.0 / torch.where(den > 0, den, 1.0), 0.0)
    delta = g * d + h * (M.to(cdt).unsqueeze(-1) - A) * d
    W.copy_((W.to(cdt) * decay - (scale * inv_r.to(cdt)) * delta).to(W.dtype))


@functools.lru_cache(maxsize=None)
def _compiled_phases() -> tuple[Callable, Callable]:
    """The two phases under ``torch.compile``, shared by all optimizers.

    ``dynamic=True``: the number of blocks and the Python floats (learning
    rate, bias corrections) are symbolic from the first compilation, so neither
    a new parameter shape nor the next step recompiles. Only the block size is
    static (see ``InductorBackend._flat``), for a fixed-size reduction; so there
    is one graph per block size, dtype combination and device.
    """
    if not hasattr(torch, "compile"):
        raise KernelUnavailable("this torch has no torch.compile; pass compile=False to use the eager path")
    return (
        torch.compile(_inductor_phase1, fullgraph=True, dynamic=True),
        torch.compile(_inductor_phase2, fullgraph=True, dynamic=True),
    )


class InductorBackend:
    """The two phases compiled by ``torch.compile`` (Triton on CUDA, C++ on CPU)."""

    name = "inductor"

    def __init__(self) -> None:
        self._phase1, self._phase2 = _compiled_phases()
        self._ones: dict[torch.device, Tensor] = {}
        self._ready: set[tuple] = set()

    def supports(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> bool:
        if w.device.type == "cuda":
            from torch.utils._triton import has_triton

            if not has_triton():
                return False
        return w.shape[-1] % (1 << level) == 0 and w.is_contiguous() and G.is_contiguous()

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Compile both phases for this dtype combination and block size on
        throw-away tensors, so that a compiler failure surfaces before any
        optimizer state has changed."""
        key = (w.device, w.dtype, G.dtype, moment_dtype, level)
        if key in self._ready:
            return
        b = 1 << level
        blocks = 7  # not 0 or 1 (specialized), nor a power of two (duck-sized with b)
        W = torch.zeros(blocks * b, dtype=w.dtype, device=w.device)
        M = torch.zeros(blocks, dtype=moment_dtype, device=w.device)
        g = torch.zeros(blocks * b, dtype=G.dtype, device=w.device)
        state = {"exp_avg": M, "exp_avg_sq": M.clone()}
        _, carry = self.phase1({"betas": (0.9, 0.999), "eps": 1e-8}, state, g, level, 1)
        self.phase2(W, g, level, carry, 1.0, 1.0, 1.0)
        self._ready.add(key)

    @staticmethod
    def _flat(x: Tensor, b: int) -> Tensor:
        """``x`` as a (blocks, b) tensor, or (blocks,) for b = 1.

        A fresh tensor on x's storage rather than a view: Dynamo guards on a
        view's base, whose shape differs from parameter to parameter.
        """
        size, stride = ((x.numel() // b, b), (b, 1)) if b > 1 else ((x.numel(),), (1,))
        flat = x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), size, stride)
        if b > 1:
            torch._dynamo.mark_static(flat, 1)
        return flat

    def phase1(self, group: dict, state: dict, G: Tensor, level: int, step: int):
        beta1, beta2 = group["betas"]
        b = 1 << level
        eps2 = group["eps"] * math.sqrt(1.0 - beta2**step)
        norm_sq = self._phase1(
            self._flat(G, b), self._flat(state["exp_avg"], 1), self._flat(state["exp_avg_sq"], 1),
            2.0 ** (-level / 2), 1.0 - beta1, beta2, eps2,
        )
        return norm_sq, (state["exp_avg"], state["exp_avg_sq"], eps2)

    def phase2(self, w: Tensor, G: Tensor, level: int, carry, r, scale: float, decay: float) -> None:
        M, V, eps2 = carry
        b = 1 << level
        if isinstance(r, Tensor):
            inv_r = r.reciprocal()
        else:
            # Always a tensor, so that the graph does not change with the
            # limiter's state; r is 1.0 here (limiter off or first step).
            inv_r = self._ones.get(w.device)
            if inv_r is None:
                inv_r = self._ones[w.device] = torch.ones((), device=w.device)
            if r != 1.0:
                inv_r = inv_r / r
        self._phase2(
            self._flat(w, b), self._flat(G, b), self._flat(M, 1), self._flat(V, 1),
            2.0 ** (-level / 2), eps2, inv_r, scale, decay,
        )


# --------------------------------------------------------------- choice --- #

BACKENDS: dict[str, Callable[[], Any]] = {"native": NativeBackend, "inductor": InductorBackend}
# The backend compile=None/True picks per device type.
_AUTO = {"cpu": "native", "cuda": "inductor"}


def check_compile_option(compile: bool | str | None) -> None:
    """Validate the optimizers' ``compile`` argument."""
    if compile is None or isinstance(compile, bool) or compile in BACKENDS:
        return
    raise ValueError(f"compile must be None (auto), True, False or one of {sorted(BACKENDS)}, got {compile!r}")


class AdamWHaarKernels:
    """Picks and builds the backend for each parameter, per ``compile``:

    ``None`` (auto)
        the device's backend (native on CPU, Inductor on CUDA) when it can be
        built; otherwise one warning and the generic eager path.
    ``True``
        the same, but failing to build raises.
    ``False``
        never (always the generic path).
    ``"native"`` / ``"inductor"``
        that backend on every device it supports; failing to build raises.
    """

    def __init__(self, compile: bool | str | None) -> None:
        check_compile_option(compile)
        self.compile = compile
        self._backends: dict[str, Any] = {}
        self._failed: set[str] = set()

    def _backend(self, name: str) -> Any | None:
        if name in self._backends:
            return self._backends[name]
        if name in self._failed:
            return None
        try:
            backend = BACKENDS[name]()
        except Exception as exc:  # a missing compiler, a failed build, no torch.compile
            if self.compile is not None:
                raise
            warnings.warn(
                f"GWT-AdamW: the fused '{name}' kernels are unavailable ({exc}); using the eager path",
                RuntimeWarning,
                stacklevel=4,
            )
            self._failed.add(name)
            return None
        self._backends[name] = backend
        return backend

    def select(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> Any | None:
        """The backend for this parameter, or None for the generic path."""
        if self.compile is False or level == 0:
            return None
        name = self.compile if isinstance(self.compile, str) else _AUTO.get(w.device.type)
        if name is None:
            return None
        backend = self._backend(name)
        if backend is None or not backend.supports(w, G, moment_dtype, level):
            return None
        try:
            backend.prepare(w, G, moment_dtype, level)
        except Exception as exc:  # e.g. Inductor cannot find a compiler or Triton fails
            if self.compile is not None:
                raise KernelUnavailable(
                    f"compiling the fused '{name}' kernels failed: {exc}; pass compile=False to use the eager path"
                ) from exc
            warnings.warn(
                f"GWT-AdamW: compiling the fused '{name}' kernels failed ({exc}); using the eager path",
                RuntimeWarning,
                stacklevel=3,
            )
            self._failed.add(name)
            self._backends.pop(name, None)
            return None
        return backend
