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
    parallel loop stalls at every join when other processes hold a core),
    each thread's phase 2 interleaved with the next parameter's phase 1.
    float32 and float64, and bf16 weights and gradients with float32 moments
    (levels up to 11: rows are converted in segments of whole blocks); float32
    blocks of 2 and 4 entries use AVX2 where the CPU has it.
``"triton"`` (CUDA)
    :mod:`gwt_optim.optim._triton`: every transformed weight of a bucket in
    three launches per step over pointer tables (phase 1, a deterministic
    limiter on the device, phase 2), with no host synchronization.

(An earlier ``"inductor"`` backend, the two phases as ``torch.compile``
functions, was removed once Triton covered CUDA: it was a fourth copy of the
rule, slower to start and host-bound.)

Parameters that no backend takes (other dtypes, non-contiguous tensors)
take the generic fast path.

Every backend follows :class:`FusedBackend`. Kernels index the moments by the
parameter's shape, so the optimizer checks each parameter's state with
:func:`check_state` before any backend sees it. A gradient holding a NaN or an
infinity leaves that parameter's weight and state unchanged (its step count
still advances), on every path: the native kernels find it in a first pass
over the gradient, before they change anything.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import math
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Hashable, Protocol, Sequence

import torch
from torch import Tensor

from gwt_optim import _cache, wavelets

__all__ = [
    "BACKENDS",
    "FusedBackend",
    "KernelUnavailable",
    "AdamWHaarKernels",
    "check_compile_option",
    "check_state",
    "native_library",
    "state_problem",
]


class KernelUnavailable(RuntimeError):
    """A fused backend cannot run here (no compiler, no Triton, ...)."""


class FusedBackend(Protocol):
    """A fused kernel backend for the transformed Haar GWT-AdamW step.

    :meth:`GWTOptimizer._fused_kernel <gwt_optim.optim._base.GWTOptimizer._fused_kernel>`
    returns one for a parameter it takes. The optimizer has checked the state
    with :func:`check_state` before calling any method with it.

    A batched backend may also provide ``step_batches(batches, limiter_eps,
    *, key)``: ``step_many`` for one of the optimizer's plans, a list of
    :class:`~gwt_optim.optim._base.StepBatch` that stays the same from step to
    step (see there for what the optimizer has checked). ``key`` names the
    plan: ``"step"`` for :meth:`~gwt_optim.optim._base.GWTOptimizer.step`'s,
    a parameter's id for ``step_param``'s; a backend may cache what it derives
    from a list until another list comes under the same key, or until
    ``invalidate()``, which the optimizer calls when it drops its plans
    (``load_state_dict``, ``add_param_group``). Without it, the plans call
    ``step_many`` with the same ParamSteps in the same order every step.
    """

    name: str
    #: True: the optimizer hands whole steps to :meth:`step_many` (for every
    #: parameter that needs no collective); the phases serve the rest.
    batched: bool

    def supports(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> bool:
        """Whether this backend takes this parameter (device, dtypes, layout).

        ``G`` is first the gradient in its own dtype (bf16 for bf16 weights):
        accepting it means the backend reads that dtype as it is, and the
        optimizer makes no copy. Otherwise the optimizer casts ``G`` to the
        compute dtype (at least fp32) and asks again."""
        ...

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Build or compile what this parameter needs, before any state changes."""
        ...

    def phase1(self, group: dict, state: dict, G: Tensor, level: int, step: int) -> tuple[float | Tensor, Any]:
        """Update the moments; return the limiter's squared norm and a carry.
        Only called with a finite gradient (the optimizer checks it first)."""
        ...

    def phase2(self, w: Tensor, G: Tensor, level: int, carry: Any, r: float | Tensor, scale: float, decay: float) -> None:
        """``w <- w * decay - scale / r * delta``, right after phase 1 or later."""
        ...

    def step_many(self, steps: list, limiter_eps: float) -> Sequence[Any] | tuple[Tensor, ...]:
        """Whole steps (phase 1, limiter, phase 2) of ``(ParamStep, scale,
        decay)`` items; only called when :attr:`batched`. A parameter whose
        gradient is not finite keeps its weight, moments and ``limiter_norm``.
        Returns the ParamSteps so skipped (CPU), or a tuple of the backend's
        running counts on the devices (0-d integer tensors that its kernels add
        the skips to), so that counting needs no host sync."""
        ...


def state_shape_problem(state: dict, key: str, expected: tuple, level: int, *, of: str = "") -> str | None:
    """Why ``state[key]`` is missing or has the wrong shape for a level-``level``
    step (``of`` names the parameter's shape), or None. Shared by the kernels'
    check and the eager paths' (``GWTOptimizer._state_problem``)."""
    t = state.get(key)
    if not isinstance(t, Tensor):
        return f"its state has no tensor {key!r} (keys: {sorted(state)})"
    if tuple(t.shape) != tuple(expected):
        return (
            f"state {key!r} has shape {tuple(t.shape)}, but a level-{level} step{of} needs {tuple(expected)}: "
            "the state belongs to another parameter or level"
        )
    return None


def state_problem(param: Tensor, grad: Tensor, state: dict, level: int, moment_dtype: torch.dtype) -> str | None:
    """What makes ``state`` unfit for a fused level-``level`` GWT-AdamW step
    of ``param``, or None. The kernels read and write the moments through raw
    pointers sized by the parameter, so anything else is out of bounds."""
    shape = tuple(param.shape)
    if tuple(grad.shape) != shape:
        return f"its gradient has shape {tuple(grad.shape)}, the parameter {shape}"
    if grad.device != param.device:
        return f"its gradient is on {grad.device}, the parameter on {param.device}"
    if not (param.is_contiguous() and grad.is_contiguous()):
        return "the fused kernels need a contiguous parameter and gradient"
    if not 0 <= level <= 16:  # level 0: plain AdamW (FusedAdamWBackend, Triton)
        return f"level {level} is outside the fused kernels' 0..16"
    expected = (*shape[:-1], wavelets.approx_length(shape[-1], level)) if shape else ()
    for key in ("exp_avg", "exp_avg_sq"):
        problem = state_shape_problem(state, key, expected, level, of=f" of a parameter of shape {shape}")
        if problem is not None:
            return problem
        t = state[key]
        if t.dtype != moment_dtype:
            return (
                f"state {key!r} is {t.dtype} but the group's moments are {moment_dtype}; set the group's "
                "moment_dtype to match the checkpoint, or pass compile=False"
            )
        if t.device != param.device:
            return f"state {key!r} is on {t.device}, the parameter on {param.device}"
        if not t.is_contiguous():
            return f"state {key!r} is not contiguous"
    s = state.get("limiter_norm")
    if s is not None and not (isinstance(s, Tensor) and s.numel() == 1):
        return f"state 'limiter_norm' must be a one-element tensor, got {s!r}"
    return None


def check_state(
    param: Tensor, grad: Tensor, state: dict, level: int, moment_dtype: torch.dtype, name: str = "a parameter"
) -> None:
    """Raise ``ValueError`` naming ``name`` unless the fused kernels may take
    this state (see :func:`state_problem`)."""
    problem = state_problem(param, grad, state, level, moment_dtype)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")


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
# Weight (and gradient) dtype -> the kernels' suffix, and the dtype of their
# moments and workspace: bf16 weights keep float32 moments.
_DTYPE_SUFFIX = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}
_STATE_DTYPE = {torch.float32: torch.float32, torch.float64: torch.float64, torch.bfloat16: torch.float32}


class _Hyper(ctypes.Structure):
    """Mirror of ``gwt_hyper`` in ``_fused_cpu.c``."""

    _fields_ = [(name, ctypes.c_double) for name in ("h", "w1", "beta2", "eps2", "scale", "decay", "clip")]


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
        ("skipped", ctypes.c_int32),
        ("gamma", ctypes.c_double),
        ("limiter_eps", ctypes.c_double),
        ("snorm", ctypes.c_void_p),
        ("hyper", _Hyper),
    ]


def cache_dir() -> Path:
    """Where built kernels are kept: the ``kernels`` folder of the one cache
    rule (:mod:`gwt_optim._cache`), ``~/.cache/gwt-optim/kernels`` by default."""
    return _cache.cache_dir("kernels")


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
def _private_dir() -> Path:
    """A fresh directory only this process's user can use (mode 0700)."""
    import atexit

    directory = Path(tempfile.mkdtemp(prefix="gwt_optim-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _open_private_dir() -> tuple[Path, int]:
    """:func:`_private_dir`, opened and checked as the cache is: path and descriptor."""
    try:
        return _cache.open_private_dir(_private_dir())
    except (_cache.UnsafePath, OSError) as exc:
        raise KernelUnavailable(
            f"no private folder for the fused CPU kernels ({exc}); set $TMPDIR to a folder only you can "
            "write to, or pass compile=False to use the eager path"
        ) from exc


def _fall_back(directory: Path, reason: str) -> tuple[Path, int]:
    private, fd = _open_private_dir()
    warnings.warn(
        f"GWT: not caching the fused CPU kernels in {directory} ({reason}); building them in {private} "
        "for this process only. Set $GWT_OPTIM_CACHE to a directory only you can write to",
        RuntimeWarning,
        stacklevel=3,
    )
    return private, fd


def _kernel_dir() -> tuple[Path, int]:
    """:func:`cache_dir` when it is this user's alone (see
    :func:`gwt_optim._cache.open_private_dir`), else a private temporary
    directory: its path and an open descriptor, which the caller closes."""
    if not _cache.SECURE_OPEN:
        raise KernelUnavailable(
            "loading the fused CPU kernels safely needs POSIX openat and O_NOFOLLOW, which this platform "
            "lacks; pass compile=False to use the eager path"
        )
    try:
        # Our own default cache may have been created group-writable under a umask of 002.
        return _cache.open_private_dir(_cache.cache_root(), "kernels", repair="GWT_OPTIM_CACHE" not in os.environ)
    except _cache.UnsafePath as exc:
        reason = str(exc)
    except OSError as exc:
        reason = f"it cannot be used: {exc}"
    return _fall_back(cache_dir(), reason)


def _library_path(directory: Path, name: str, digest: str) -> Path:
    # Named by content, so that a concurrent build never replaces the file a
    # digest names with another build (compilers need not be deterministic).
    return directory / f"{name}-{digest[:16]}.so"


# What a missing, stale, foreign or broken cached library raises on loading.
_LOAD_ERRORS = (OSError, ValueError, AttributeError, _cache.UnsafePath)
_copies = itertools.count()


def _load_checked(dir_fd: int, directory: Path, name: str) -> ctypes.CDLL:
    """Open the library the digest file ``name.sha256`` names in the checked
    kernels folder ``dir_fd`` (shown as ``directory``), check it, and load
    exactly the bytes checked.

    dlopen takes a path and opens it again, so it never sees the cache: the
    bytes read through one descriptor (a regular file of this user's, no
    link) are hashed, written to a new file in this process's private folder
    and that file is loaded, through that folder's descriptor where /proc
    allows. A file swapped in at the cache's path after the check never loads,
    nor does a truncated one (it would SIGBUS the process when it maps the
    missing pages). Raises one of :data:`_LOAD_ERRORS`.
    """
    pointer = directory / f"{name}.sha256"
    digest = _cache.read_private_file(dir_fd, pointer.name, pointer).decode("ascii", "replace").strip()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError(f"{pointer} holds no SHA-256 digest")
    path = _library_path(directory, name, digest)
    data = _cache.read_private_file(dir_fd, path.name, path)
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"{path} no longer matches its digest")
    private, fd = _open_private_dir()
    try:
        # A new name for every load: dlopen hands back whatever library it
        # already loaded under a name, without opening the file.
        copy = f"loaded-{os.getpid()}-{next(_copies)}-{path.name}"
        _cache.write_private_file(fd, copy, data, mode=0o700)
        via_fd = f"/proc/self/fd/{fd}"
        lib = ctypes.CDLL(f"{via_fd}/{copy}" if os.path.isdir(via_fd) else str(private / copy))
    finally:
        os.close(fd)
    lib._name = str(path)  # the file it was checked as, for messages: the copy is gone at exit
    return _bind(lib)


def _build_library(cc: str) -> bytes:
    """Compile ``_fused_cpu.c`` with the first flag set that works; the library's bytes.

    The compiler writes by path, so it writes into a fresh private folder;
    :func:`_publish` copies the result into the cache through its descriptor."""
    errors = []
    with tempfile.TemporaryDirectory(prefix="gwt_optim-build-") as work:
        out = os.path.join(work, "kernels.so")
        for flags in _FLAG_SETS:
            proc = subprocess.run([cc, *flags, *_COMMON_FLAGS, "-o", out, str(_SOURCE)], capture_output=True, text=True)
            if proc.returncode == 0:
                with open(out, "rb") as f:
                    return f.read()
            errors.append(f"{' '.join(flags)}: {proc.stderr.strip()[-500:]}")
    raise KernelUnavailable(
        f"building the fused CPU kernels with {cc} failed; pass compile=False to use the eager path. "
        + "\n".join(errors)
    )


def _publish(dir_fd: int, name: str, data: bytes) -> None:
    """Write a build, then the digest file naming it, into the kernels folder
    ``dir_fd``, each atomically: concurrent processes (pytest -n, torchrun)
    may build the same library at once."""
    digest = hashlib.sha256(data).hexdigest()
    _cache.write_private_file(dir_fd, _library_path(Path(), name, digest).name, data, mode=0o755)
    _cache.write_private_file(dir_fd, f"{name}.sha256", f"{digest}\n".encode())


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
    """Build (once per host and source version) and load the fused CPU kernels.

    The library is cached in :func:`cache_dir` beside its SHA-256, opened
    through that folder's checked descriptor and verified before every load
    (:func:`_load_checked`); a missing, stale or unfit library is rebuilt once.
    When another user could write there, or it is no folder, the kernels are
    built in a private temporary directory instead, and so they are when it
    cannot be written (one warning each: training still gets its kernels).
    Raises :class:`KernelUnavailable` with the compiler's message when no
    flag set compiles.
    """
    cc = _compiler()
    source = _SOURCE.read_text()
    key = hashlib.sha256((source + _host_fingerprint(cc) + repr(_FLAG_SETS + (_COMMON_FLAGS,))).encode()).hexdigest()[:20]
    name = f"adamw_haar_{key}"
    directory, fd = _kernel_dir()
    try:
        try:
            return _load_checked(fd, directory, name)
        except _LOAD_ERRORS:
            pass
        data = _build_library(cc)
        try:
            _publish(fd, name, data)
        except OSError as exc:  # a read-only cache (or a full disk): training still gets its kernels
            os.close(fd)
            fd = -1
            directory, fd = _fall_back(directory, f"it cannot be written: {exc.strerror or exc}")
            try:
                _publish(fd, name, data)
            except OSError as again:
                raise KernelUnavailable(
                    f"writing the fused CPU kernels to {directory} failed ({again}); "
                    "pass compile=False to use the eager path"
                ) from again
        try:
            return _load_checked(fd, directory, name)
        except _LOAD_ERRORS as exc:
            raise KernelUnavailable(
                f"loading the fused CPU kernels from {directory} failed after a rebuild ({exc}); "
                "pass compile=False to use the eager path"
            ) from exc
    finally:
        if fd >= 0:
            os.close(fd)


# The pipelined batched step's workspace (two slots per thread) may be this
# share of the moments it steps, or this many bytes, whichever is more;
# beyond, the parameters run in turn on one slot.
_PIPELINE_WORKSPACE_SHARE = 0.25
_PIPELINE_WORKSPACE_BYTES = 256 << 20
# An OpenMP region costs a few microseconds; below this many entries per
# thread, more threads are slower.
_MIN_ENTRIES_PER_THREAD = 1 << 15


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
    """The C kernels of ``_fused_cpu.c`` (CPU, float32/float64).

    Besides the two phases (for parameters whose phase 2 waits for a
    collective), it runs whole steps of many parameters in one call
    (:meth:`step_many`, ``batched = True``).
    """

    name = "native"
    batched = True
    detail_clip = True  # a hyperparameter of phase 2 (0 when off)

    def __init__(self) -> None:
        lib = native_library()
        self._phase1 = {dt: getattr(lib, f"gwt_adamw_haar_phase1_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        self._phase2 = {dt: getattr(lib, f"gwt_adamw_haar_phase2_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        self._phase2_clip = {dt: getattr(lib, f"gwt_adamw_haar_phase2_clip_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        self._steps = {dt: getattr(lib, f"gwt_adamw_haar_steps_{sfx}") for dt, sfx in _DTYPE_SUFFIX.items()}
        # bf16 rows are converted a segment of whole blocks at a time, which bounds the block.
        self._bf16_max_level = lib.gwt_bf16_max_level()
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

    def supports(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> bool:
        return (
            w.device.type == "cpu"
            and w.dtype in _DTYPE_SUFFIX
            and G.dtype == w.dtype
            and moment_dtype == _STATE_DTYPE[w.dtype]
            and (w.dtype != torch.bfloat16 or level <= self._bf16_max_level)
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

    def step_many(self, steps: list, limiter_eps: float) -> list:
        """Whole steps (phase 1, limiter, phase 2) of many parameters; returns
        those skipped for a non-finite gradient (weight and state unchanged).

        ``steps`` holds ``(ps, scale, decay)``: a :class:`~gwt_optim.optim._base.ParamStep`
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
        :class:`~gwt_optim.optim._base.StepBatch`; ``key`` names the plan, and
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
                    )
                task.hyper = hyper
                task.g = ps.grad.data_ptr()  # gradients are new tensors on most steps
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
        )
        norm_sq = self._phase1[G.dtype](
            G.data_ptr(), M.data_ptr(), V.data_ptr(), d, t, rows, n, level, ctypes.byref(hyper), self._threads(numel, rows)
        )
        carry = _NativeCarry(buf, d, t, hyper, M.data_ptr())
        if shared:
            self._owner[M.dtype] = weakref.ref(carry)
        return norm_sq, carry

    def phase2(self, w: Tensor, G: Tensor, level: int, carry: _NativeCarry, r, scale: float, decay: float) -> None:
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


class FusedAdamWBackend:
    """Level-0 and 1-D parameters of a GWT-AdamW group on CPU: that is plain
    AdamW, so ``torch._fused_adamw_`` steps all of them in one call per set of
    hyperparameters instead of about fifteen eager operations each.

    A parameter whose gradient has a NaN or an Inf is left out of the call
    (its weight and moments keep their values): on CPU that check costs no
    synchronization.
    """

    name = "fused_adamw"
    batched = True
    detail_clip = True  # level 0 has no details: the clip changes nothing

    @staticmethod
    def supports(w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> bool:
        # torch's CPU kernel takes one dtype for weights, gradients and moments.
        return (
            level == 0
            and w.device.type == "cpu"
            and w.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
            and G.dtype == w.dtype
            and moment_dtype == w.dtype
        )

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Nothing to build: the kernel ships with torch."""

    def step_many(self, steps: list, limiter_eps: float) -> list:
        """One ``torch._fused_adamw_`` call per set of hyperparameters; returns
        the ParamSteps skipped for a non-finite gradient."""
        skipped = []
        calls: dict[tuple, list] = {}
        for ps, _, _ in steps:
            g = ps.group
            lr = g["lr"].item() if isinstance(g["lr"], Tensor) else g["lr"]
            key = (ps.param.dtype, lr, *g["betas"], g["eps"], g["weight_decay"])
            calls.setdefault(key, []).append(ps)
        for (_, lr, beta1, beta2, eps, wd), items in calls.items():
            finite = all_finite([ps.grad for ps in items])
            if not all(finite):
                skipped += [ps for ps, ok in zip(items, finite) if not ok]
                items = [ps for ps, ok in zip(items, finite) if ok]
                if not items:
                    continue
            torch._fused_adamw_(
                [ps.param for ps in items],
                [ps.grad for ps in items],
                [ps.state["exp_avg"] for ps in items],
                [ps.state["exp_avg_sq"] for ps in items],
                [],
                # The optimizer has advanced the step counts (CPU float32
                # tensors, as fused AdamW keeps them on CPU) before this call.
                [ps.state["step"] for ps in items],
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
            )
        return skipped


def all_finite(tensors: list[Tensor]) -> list[bool]:
    """Whether each tensor (one device and dtype) holds only finite values: one
    foreach max-norm, read once (on a GPU, one wait instead of one each)."""
    return torch.stack(torch._foreach_norm(tensors, math.inf)).isfinite().tolist()


# --------------------------------------------------------------- choice --- #


def _triton_backend() -> Any:
    try:
        from gwt_optim.optim import _triton
    except ImportError as exc:
        raise KernelUnavailable(f"Triton is not installed ({exc}); pip install triton") from exc
    return _triton.TritonBackend()


BACKENDS: dict[str, Callable[[], Any]] = {
    "native": NativeBackend,
    "triton": _triton_backend,
}
# The backends compile=None/True tries per device type, in order.
_AUTO = {"cpu": ("native",), "cuda": ("triton",)}


def check_compile_option(compile: bool | str | None) -> None:
    """Validate the optimizers' ``compile`` argument."""
    if compile is None or isinstance(compile, bool) or compile in BACKENDS:
        return
    if compile == "inductor":
        raise ValueError('compile="inductor" was removed: on CUDA the Triton backend ("triton", the default) '
                         "replaces it")
    raise ValueError(f"compile must be None (auto), True, False or one of {sorted(BACKENDS)}, got {compile!r}")


class AdamWHaarKernels:
    """Picks and builds the backend for each parameter, per ``compile``:

    ``None`` (auto)
        the device's backend (native on CPU, Triton on CUDA)
        when it can be built; otherwise one warning and the generic eager path.
    ``True``
        the same, but failing to build the device's last choice raises.
    ``False``
        never (always the generic path).
    ``"native"`` / ``"triton"``
        that backend on every device it supports; failing to build raises.

    Level 0 (plain AdamW: 1-D parameters, level-0 groups) takes
    ``torch._fused_adamw_`` on CPU (the native kernels for bf16 weights with
    fp32 moments, which torch's kernel does not take) and the Triton kernels on
    CUDA, unless ``compile`` is ``False`` (or names a backend without a
    level-0 step).
    """

    def __init__(self, compile: bool | str | None) -> None:
        check_compile_option(compile)
        self.compile = compile
        self._backends: dict[str, Any] = {}
        self._failed: set[str] = set()
        self._plain_cpu = FusedAdamWBackend()

    def _backend(self, name: str, last: bool = True) -> Any | None:
        if name in self._backends:
            return self._backends[name]
        if name in self._failed:
            return None
        try:
            backend = BACKENDS[name]()
        except Exception as exc:  # a missing compiler, a failed build, no torch.compile, no triton
            if self.compile is not None and last:
                raise
            if last:
                warnings.warn(
                    f"GWT-AdamW: the fused '{name}' kernels are unavailable ({exc}); using the eager path",
                    RuntimeWarning,
                    stacklevel=5,
                )
            self._failed.add(name)
            return None
        self._backends[name] = backend
        return backend

    def _candidates(self, device_type: str) -> tuple[str, ...]:
        if isinstance(self.compile, str):
            return (self.compile,)
        return _AUTO.get(device_type, ())

    def select(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> Any | None:
        """The backend for this parameter, or None for the generic path."""
        if self.compile is False:
            return None
        if level == 0:
            if w.device.type == "cpu" and self.compile != "triton":
                if self._plain_cpu.supports(w, G, moment_dtype, 0):
                    return self._plain_cpu
                # torch's CPU kernel takes one dtype for weights and moments;
                # bf16 weights keep fp32 moments, and the native kernels' level
                # 0 (blocks of one entry: A = G, no details) is AdamW.
                if self.compile in (None, True, "native"):
                    return self._ready("native", w, G, moment_dtype, 0, last=False)
                return None
            if self.compile not in (None, True, "triton"):
                return None
            return self._ready("triton", w, G, moment_dtype, 0, last=False)
        names = self._candidates(w.device.type)
        for i, name in enumerate(names):
            backend = self._ready(name, w, G, moment_dtype, level, last=i == len(names) - 1)
            if backend is not None:
                return backend
        return None

    def _ready(self, name: str, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int, last: bool) -> Any | None:
        """The backend ``name``, built and compiled for this parameter, or None."""
        backend = self._backend(name, last)
        if backend is None or not backend.supports(w, G, moment_dtype, level):
            return None
        try:
            backend.prepare(w, G, moment_dtype, level)
        except Exception as exc:  # e.g. no C compiler, or Triton fails to build
            if self.compile is not None and last:
                raise KernelUnavailable(
                    f"compiling the fused '{name}' kernels failed: {exc}; pass compile=False to use the eager path"
                ) from exc
            warnings.warn(
                f"GWT-AdamW: compiling the fused '{name}' kernels failed ({exc}); using "
                + ("the eager path" if last else "the next backend"),
                RuntimeWarning,
                stacklevel=4,
            )
            self._failed.add(name)
            self._backends.pop(name, None)
            return None
        return backend
