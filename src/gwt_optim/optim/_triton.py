r"""The GWT-AdamW Haar step as multi-tensor Triton kernels (the ``"triton"`` backend).

All GWT-AdamW parameters of one *bucket* -- one block size :math:`b = 2^l`,
weight dtype, gradient dtype, moment dtype and set of step scalars -- step in
three launches, whatever their number and shapes:

phase 1 (grid: chunks)
    Each program owns one chunk: a range of ``TB`` consecutive blocks (rows of
    the moment matrices) of one tensor, found through a chunk table and a
    pointer table (int64 addresses and int64 offsets: a 28M-entry embedding
    is a real case). It writes the chunk's partial :math:`\|M d\|^2` of the
    *new* moments, and its count of non-finite gradient entries, but stores
    nothing else: a parameter whose gradient has a NaN/Inf anywhere must keep
    its moments, and a chunk cannot know that about the other chunks.
limiter (grid: parameters)
    Sums each parameter's chunk partials in a fixed order (deterministic, no
    atomics), computes the limiter's :math:`r` and the new :math:`s` on the
    device (``state["limiter_norm"]``, a 0-d tensor, is written in place), and
    leaves :math:`1/r` and a skip flag per parameter. Skipped parameters are
    counted on the device, in a running count per device that the steps
    return (no new tensor, no extra launch per step).
phase 2 (grid: chunks)
    Recomputes :math:`A` and the new moments from :math:`G`, :math:`M`,
    :math:`V` (about 22 bytes per fp32 parameter at level 2, against fused
    AdamW's 28), stores the moments and
    :math:`W \leftarrow W (1 - \eta\lambda) - s\,(h M_k d_k +
    \mathrm{clip}((G_i - h A_k) d_k, -c, c))`, :math:`s = \eta c_t \alpha / r`.

Every changing scalar (learning rate, bias corrections, weight decay, the
detail clip) is a kernel argument, so nothing recompiles from step to step,
and nothing reads device memory on the host: ``step()`` does not synchronize.
The pointer and chunk tables are cached per bucket and rebuilt when a pointer
or shape changes (a new gradient tensor, ``load_state_dict``); a rebuild is
one pinned, non-blocking host-to-device copy.

Precision: fp32 compute; fp32, bf16 and fp16 weights and gradients; fp32 and
bf16 moments. bf16 values are read and written as their bits and rounded to
nearest even by integer operations: Triton's interpreter truncates on
``.to(tl.bfloat16)``, and the bit version is the same on a GPU.

Level 0 (:math:`b = 1`) is plain AdamW on the same kernels (:math:`A = G`, no
details), which is how level-0 and 1-D parameters step on CUDA.

With ``TRITON_INTERPRET=1`` in the environment *when this module is first
imported*, the kernels run in Triton's interpreter on CPU tensors (the tests do
this); otherwise the backend takes CUDA tensors only.
"""

from __future__ import annotations

import dataclasses
import math
import os
from array import array
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import triton
import triton.language as tl

from gwt_optim.optim._backends import CAPABILITIES, check_pointers
from gwt_optim.optim.functional import AdamWScalars, adamw_scalars

__all__ = ["TritonBackend", "DEFAULT_CHUNK", "DEFAULT_WARPS", "MAX_LEVEL"]

# Decided at import, as Triton decides it for the kernels below.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Entries of W per phase program (a power of two): big enough to amortize the
# table lookups, small enough for registers.
DEFAULT_CHUNK = 4096
# Warps per phase program (Triton's own default).
DEFAULT_WARPS = 4
# A block is one row of a phase program's tile; 2^10 entries still fit
# (the backends' capability table declares it).
MAX_LEVEL = CAPABILITIES["triton"].levels[-1]
# Chunk partials summed per iteration of the limiter's loop.
_LIMITER_BLOCK = 1024

# Codes for the kernels' constexpr dtype arguments (ints, so that any Triton
# version specializes on them the same way).
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MOMENT_KINDS = (torch.float32, torch.bfloat16)
# Columns of the pointer table and of the geometry table (constexpr: kernels
# may read no other globals).
_W, _G, _M, _V, _S = (tl.constexpr(i) for i in range(5))
_N, _NB, _NBLOCKS, _FIRST, _COUNT = (tl.constexpr(i) for i in range(5))
_COLS = tl.constexpr(5)


# -------------------------------------------------------------- kernels --- #


@triton.jit
def _typed(addr, KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """An int64 address as a pointer of the storage type of dtype code KIND;
    ALIGNED: 16-byte aligned (checked on the host), which an address loaded
    from a table cannot show the compiler otherwise."""
    if KIND == 0:
        p = addr.to(tl.pointer_type(tl.float32))
    elif KIND == 2:
        p = addr.to(tl.pointer_type(tl.float16))
    else:  # bf16 travels as its bits; see _to_f32 / _from_f32
        p = addr.to(tl.pointer_type(tl.uint16))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _to_f32(x, KIND: tl.constexpr):
    if KIND == 1:
        y = (x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _from_f32(x, KIND: tl.constexpr):
    if KIND == 1:
        # Round to nearest even on the bits, as torch does; NaN would carry
        # into the sign and exponent, so it becomes torch's canonical 0x7FC0.
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        y = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)
    elif KIND == 2:
        y = x.to(tl.float16)
    else:
        y = x
    return y


@triton.jit
def _tile(ptrs, geom, chunk_tensor, skip, pid, B: tl.constexpr, TB: tl.constexpr, G_KIND: tl.constexpr,
          SKIPPABLE: tl.constexpr, ALIGNED: tl.constexpr):
    """This program's chunk: its tensor, block ids, masks, offsets and gradient tile.
    With SKIPPABLE, a parameter flagged in ``skip`` gets all-false masks.
    ALIGNED: every block of the bucket is whole (b divides n) and every
    address 16-byte aligned, so block q is entries q*b .. q*b + b - 1 and a
    tile is contiguous: its loads and stores vectorize (128-bit for fp32 at
    b >= 4), which row and column arithmetic with a runtime n prevents."""
    t = tl.load(chunk_tensor + pid).to(tl.int64)
    n = tl.load(geom + t * _COLS + _N)
    nb = tl.load(geom + t * _COLS + _NB)
    nblocks = tl.load(geom + t * _COLS + _NBLOCKS)
    if SKIPPABLE:
        # Folded into the bound, not and-ed into the masks: the interpreter
        # rejects a mask made from a scalar and a vector condition.
        nblocks = tl.where(tl.load(skip + t) == 0, nblocks, 0)
    first = tl.load(geom + t * _COLS + _FIRST)
    q = (pid - first) * TB + tl.arange(0, TB)  # int64 block ids (rows of M)
    qmask = q < nblocks
    if ALIGNED:
        off = q[:, None] * B + tl.arange(0, B)[None, :]
        # Constant along a block, as the vectorizer needs it to be.
        emask = tl.broadcast_to(qmask[:, None], [TB, B])
    else:
        row = q // nb
        col = (q - row * nb)[:, None] * B + tl.arange(0, B)[None, :]
        # The last block of a row is partial when b does not divide n: its
        # missing entries are the zero padding of the transform.
        emask = qmask[:, None] & (col < n)
        off = row[:, None] * n + col
    g_ptr = _typed(tl.load(ptrs + t * _COLS + _G), G_KIND, ALIGNED)
    g = _to_f32(tl.load(g_ptr + off, mask=emask, other=0), G_KIND)
    return t, q, qmask, emask, off, g


@triton.jit
def _new_moments(ptrs, t, q, qmask, A, w1, beta2, w2, M_KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """This chunk's moment pointers and its new M and V (not stored)."""
    m_ptr = _typed(tl.load(ptrs + t * _COLS + _M), M_KIND, ALIGNED) + q
    v_ptr = _typed(tl.load(ptrs + t * _COLS + _V), M_KIND, ALIGNED) + q
    m = _to_f32(tl.load(m_ptr, mask=qmask, other=0), M_KIND)
    v = _to_f32(tl.load(v_ptr, mask=qmask, other=0), M_KIND)
    # torch.lerp's two-sided formula, as the eager path's lerp_ computes it.
    m = tl.where(w1 < 0.5, m + w1 * (A - m), A - (A - m) * (1.0 - w1))
    v = v * beta2 + w2 * A * A
    return m_ptr, v_ptr, m, v


@triton.jit
def _phase1_kernel(
    ptrs, geom, chunk_tensor, partial, flags,
    h, w1, beta2, w2, eps2,
    B: tl.constexpr, TB: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr, LIMITED: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    t, q, qmask, emask, off, g = _tile(ptrs, geom, chunk_tensor, flags, pid, B, TB, G_KIND, False, ALIGNED)
    bad = (g != g) | (tl.abs(g) == float("inf"))
    tl.store(flags + pid, tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0))
    if LIMITED:
        A = tl.sum(g, axis=1) * h
        m_ptr, v_ptr, m, v = _new_moments(ptrs, t, q, qmask, A, w1, beta2, w2, M_KIND, ALIGNED)
        den = tl.sqrt_rn(v) + eps2
        u = tl.where(qmask & (den > 0), tl.div_rn(m, tl.where(den > 0, den, 1.0)), 0.0)
        tl.store(partial + pid, tl.sum(u * u, axis=0))


@triton.jit
def _limiter_kernel(
    ptrs, geom, partial, flags, inv_r, skip, norm_sq, skipped,
    gamma, limiter_eps, first,
    RB: tl.constexpr, MODE: tl.constexpr,
):
    """MODE 0: no limiter; 1: the limiter; 2: only reduce (norm_sq and skip, for
    a caller that runs the limiter itself: FSDP2's all-reduce sits in between)."""
    t = tl.program_id(0).to(tl.int64)
    start = tl.load(geom + t * _COLS + _FIRST)
    count = tl.load(geom + t * _COLS + _COUNT)
    acc = tl.zeros([RB], dtype=tl.float32)
    bad = tl.zeros([RB], dtype=tl.int32)
    for i in range(0, count, RB):
        idx = i + tl.arange(0, RB)
        mask = idx < count
        bad += tl.load(flags + start + idx, mask=mask, other=0)
        if MODE != 0:
            acc += tl.load(partial + start + idx, mask=mask, other=0.0)
    is_bad = tl.sum(bad, axis=0) > 0
    tl.store(skip + t, is_bad.to(tl.int32))
    if MODE != 2:
        tl.atomic_add(skipped, is_bad.to(tl.int64), mask=is_bad)
    if MODE == 1:
        norm = tl.sqrt_rn(tl.sum(acc, axis=0))
        s_ptr = tl.load(ptrs + t * _COLS + _S).to(tl.pointer_type(tl.float32))
        s = tl.load(s_ptr)
        r = tl.maximum(norm / (s + limiter_eps), gamma) / gamma
        # No norm recorded yet (step 1, or only skipped steps so far): record it.
        r = tl.where((first != 0.0) | (s <= 0.0), 1.0, r)
        tl.store(s_ptr, norm / r, mask=~is_bad)
        tl.store(inv_r + t, 1.0 / r)
    elif MODE == 2:
        tl.store(norm_sq + t, tl.sum(acc, axis=0))
    else:
        tl.store(inv_r + t, 1.0)


@triton.jit
def _phase2_kernel(
    ptrs, geom, chunk_tensor, inv_r, skip,
    h, w1, beta2, w2, eps2, scale, decay, clip,
    B: tl.constexpr, TB: tl.constexpr, W_KIND: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    # A skipped parameter (non-finite gradient) keeps W, M and V.
    t, q, qmask, emask, off, g = _tile(ptrs, geom, chunk_tensor, skip, pid, B, TB, G_KIND, True, ALIGNED)
    A = tl.sum(g, axis=1) * h
    m_ptr, v_ptr, m, v = _new_moments(ptrs, t, q, qmask, A, w1, beta2, w2, M_KIND, ALIGNED)
    tl.store(m_ptr, _from_f32(m, M_KIND), mask=qmask)
    tl.store(v_ptr, _from_f32(v, M_KIND), mask=qmask)
    den = tl.sqrt_rn(v) + eps2
    d = tl.where(den > 0, tl.div_rn(1.0, tl.where(den > 0, den, 1.0)), 0.0)
    detail = (g - (h * A)[:, None]) * d[:, None]
    detail = tl.minimum(tl.maximum(detail, -clip), clip)
    delta = (h * m * d)[:, None] + detail
    s = scale * tl.load(inv_r + t)
    w_ptr = _typed(tl.load(ptrs + t * _COLS + _W), W_KIND, ALIGNED) + off
    w = _to_f32(tl.load(w_ptr, mask=emask, other=0), W_KIND)
    tl.store(w_ptr, _from_f32(w * decay - s * delta, W_KIND), mask=emask)


# Launches go through these three functions only, so that a test can count them.


def _launch_phase1(grid, *args, **meta) -> None:
    _phase1_kernel[grid](*args, **meta)


def _launch_limiter(grid, *args, **meta) -> None:
    _limiter_kernel[grid](*args, **meta)


def _launch_phase2(grid, *args, **meta) -> None:
    _phase2_kernel[grid](*args, **meta)


# ------------------------------------------------------------------ host --- #


@dataclass
class _Hyper:
    """The scalars of one launch (the same for every parameter of a bucket)."""

    h: float
    w1: float
    beta2: float
    w2: float
    eps2: float
    gamma: float
    first: float
    clip: float


@dataclass
class _Bucket:
    """The cached tables and workspaces of one set of parameters."""

    device: torch.device
    layout: tuple  # the shapes (and level) the geometry was built for
    pointers: tuple  # the address columns the pointer table holds (_addresses)
    geom: Tensor  # int64 (T, _COLS)
    chunks: Tensor  # int32 (total chunks,): the tensor of each chunk
    table: array | None  # int64, T rows of _COLS, on the host: the pointer table
    ptrs: Tensor | None  # the same on the device
    partial: Tensor  # fp32 (total chunks,)
    flags: Tensor  # int32 (total chunks,)
    inv_r: Tensor  # fp32 (T,)
    skip: Tensor  # int32 (T,)
    norm_sq: Tensor  # fp32 (T,), MODE 2 only
    n_chunks: int
    n_tensors: int
    whole: bool  # b divides every n: no partial blocks
    aligned: bool = False  # whole, and every W, G, M, V address 16-byte aligned: the kernels' ALIGNED
    state_aligned: bool = False  # every W, M and V address 16-byte aligned


@dataclass
class _Planned:
    """The parameters of a Bucket (see step_buckets) that share launches."""

    batch: Any  # the Bucket (its scalars and gradients change from step to step)
    index: list[int]  # these parameters' positions in it
    level: int
    limited: bool
    kinds: tuple  # (W, G, moment) dtypes
    bucket: _Bucket


def _to_device(values: Tensor, device: torch.device) -> Tensor:
    """A host table on the device without a host synchronization: staged in
    pinned memory and copied asynchronously (the caching host allocator keeps
    the staging buffer alive until the copy has run)."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def _addresses(tensors: list, limited: bool) -> tuple[list[int], ...]:
    """The pointer table's columns (W, G, M, V, s) for (W, G, state) triples."""
    return (
        [w.data_ptr() for w, _, _ in tensors],
        [g.data_ptr() for _, g, _ in tensors],
        [st["exp_avg"].data_ptr() for _, _, st in tensors],
        [st["exp_avg_sq"].data_ptr() for _, _, st in tensors],
        [st["limiter_norm"].data_ptr() for _, _, st in tensors] if limited else [0] * len(tensors),
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


class TritonBackend:
    """GWT-AdamW's Haar step on multi-tensor Triton kernels.

    ``step_buckets(buckets, limiter_eps, table)`` runs whole steps, three
    launches per bucket (under the optimizer's plans, which own the tables:
    all the batched weights for ``step()``, one for each ``step_param``);
    ``phase1``/``phase2`` split the step around an external limiter (FSDP2).

    ``chunk`` (entries of W per phase program, a power of two) and
    ``num_warps`` (of the phase kernels) default to ``$GWT_TRITON_CHUNK`` and
    ``$GWT_TRITON_WARPS``, else :data:`DEFAULT_CHUNK` and
    :data:`DEFAULT_WARPS`; the variables let a benchmark sweep them
    (``benchmarks/gpu_check.sh``) without code. ``cpu=True`` takes CPU
    tensors too: the interpreter runs them (the default when it was on at
    import), and ``benchmarks/host_time.py`` times the host side with the
    launches replaced by counters.
    """

    name = "triton"
    capabilities = CAPABILITIES["triton"]

    def __init__(self, chunk: int | None = None, *, num_warps: int | None = None, cpu: bool = INTERPRET) -> None:
        chunk = _env_int("GWT_TRITON_CHUNK", DEFAULT_CHUNK) if chunk is None else chunk
        if chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two, got {chunk}")
        num_warps = _env_int("GWT_TRITON_WARPS", DEFAULT_WARPS) if num_warps is None else num_warps
        if num_warps < 1 or num_warps & (num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {num_warps}")
        self.chunk = chunk
        self.num_warps = num_warps
        self.cpu = cpu
        if cpu:
            self.capabilities = dataclasses.replace(self.capabilities, devices=self.capabilities.devices | {"cpu"})
        self._buckets: dict[tuple, _Bucket] = {}
        # Per device: the running count of steps skipped for a non-finite
        # gradient, which the limiter kernel adds to (see _count).
        self._skipped: dict[torch.device, Tensor] = {}
        self._ready: set[tuple] = set()

    # ------------------------------------------------------- selection --- #

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Compile the kernels for this dtype combination and block size on
        throw-away tensors, so that a compiler failure surfaces before any
        optimizer state has changed."""
        key = (w.device, w.dtype, G.dtype, moment_dtype, level)
        if key in self._ready:
            return
        b = 1 << level
        state = {
            "exp_avg": torch.zeros(3, 2, dtype=moment_dtype, device=w.device),
            "exp_avg_sq": torch.zeros(3, 2, dtype=moment_dtype, device=w.device),
            "limiter_norm": torch.zeros((), device=w.device),
        }
        group = {"norm_growth_limit": 1.01}
        scalars = adamw_scalars(2, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, alpha=1.0)
        hyper = self._hyper(group, level, 2, True, scalars)
        kinds = (w.dtype, G.dtype, moment_dtype)
        # Both forms of the phase kernels: ALIGNED, and one entry into a
        # storage (not 16-byte aligned), the general one.
        for skew in (0, 1):
            W = torch.zeros(6 * b + skew, dtype=w.dtype, device=w.device)[skew:].view(3, 2 * b)
            g = torch.zeros_like(W, dtype=G.dtype)
            for limited in (True, False):
                bucket = self._bucket((("prepare", skew, limited),), [(W, g, state)], level, limited, kinds)
                count = torch.zeros((), dtype=torch.int64, device=w.device)
                self._launch(bucket, hyper, level, kinds, 0.0, 1.0, limited, 1e-8, count)
        self._ready.add(key)

    # ----------------------------------------------------------- steps --- #

    def step_buckets(self, buckets: list, limiter_eps: float, table: dict | None = None) -> tuple[Tensor, ...]:
        """Whole steps (phase 1, limiter, phase 2) of the parameters of
        ``buckets`` (:class:`~gwt_optim.optim._backends.Bucket`): three
        launches for the parameters of a bucket that share a device, a
        level, dtypes and the limiter.

        Under a plan (its ``table``: the optimizer's step plan, or one
        parameter's for ``step_param``) the split and the tables are made
        once, with every check, and kept in the plan's table; afterwards only
        the gradients' addresses may change (the optimizer has checked the
        rest), and their column of the pointer table is uploaded again when
        they do. Without a table they are kept per set of parameters and
        checked on every call.

        Returns the number of parameters skipped for a non-finite gradient as
        running counts: a tuple of 0-d int64 tensors, one per device, that
        every step of this backend adds to (read them only when needed:
        reading synchronizes).
        """
        planned = table.get("triton") if table is not None else None
        if planned is None:
            planned = [self._plan_bucket(b, index, table is None) for b in buckets for index in self._split(b)]
            if table is not None:
                table["triton"] = planned
        counts = []
        for entry in planned:
            bucket, batch = entry.bucket, entry.batch
            grads = [batch.grads[i].data_ptr() for i in entry.index]
            if grads != bucket.pointers[1]:
                self._point_grads(bucket, grads)
            count = self._count(bucket.device, counts)
            s = batch.scalars
            hyper = self._hyper(batch.group, entry.level, batch.step, entry.limited, s)
            self._launch(bucket, hyper, entry.level, entry.kinds, s.step_size, s.decay, entry.limited, limiter_eps,
                         count)
        return tuple(counts)

    def phase1(self, group: dict, state: dict, G: Tensor, level: int, step: int, scalars: AdamWScalars):
        """Phase 1 and the reduction of one parameter, for a caller that runs
        the limiter itself: returns ``(norm_sq, carry)``, norm_sq a 0-d tensor."""
        # Phase 1 never touches W (G stands in for it in this table) nor s.
        kinds = (G.dtype, G.dtype, state["exp_avg"].dtype)
        bucket = self._bucket(("phase1", id(state)), [(G, G, state)], level, False, kinds)
        hyper = self._hyper(group, level, step, False, scalars)
        self._launch_phase1(bucket, hyper, level, kinds, limited=True)
        _launch_limiter(
            (bucket.n_tensors,), bucket.ptrs, bucket.geom, bucket.partial, bucket.flags, bucket.inv_r, bucket.skip,
            bucket.norm_sq, bucket.norm_sq, hyper.gamma, 0.0, hyper.first, RB=_LIMITER_BLOCK, MODE=2,
        )
        return bucket.norm_sq[0], (bucket, hyper, state, scalars)

    def phase2(self, w: Tensor, G: Tensor, level: int, carry, r) -> None:
        reduced, hyper, state, scalars = carry
        # The phase-1 table pointed W at G (phase 1 does not know W); this one points at W.
        kinds = (w.dtype, G.dtype, state["exp_avg"].dtype)
        bucket = self._bucket(("phase2", id(state)), [(w, G, state)], level, False, kinds)
        if isinstance(r, Tensor):
            reduced.inv_r[0].copy_(r.reciprocal())
        else:
            reduced.inv_r[0].fill_(1.0 / r)
        self._launch_phase2(bucket, hyper, level, kinds, scalars.step_size, scalars.decay, reduced.inv_r,
                            reduced.skip)

    # --------------------------------------------------------- helpers --- #

    @staticmethod
    def _bucket_key(b, i: int) -> tuple:
        """What the parameters of a bucket must share to run in one set of launches."""
        return (b.params[i].device, b.levels[i], b.params[i].dtype, b.grads[i].dtype, b.states[i]["exp_avg"].dtype,
                b.limited[i])

    def _split(self, b) -> list[list[int]]:
        split: dict[tuple, list[int]] = {}
        for i in range(len(b.params)):
            split.setdefault(self._bucket_key(b, i), []).append(i)
        return list(split.values())

    def _plan_bucket(self, b, index: list[int], unplanned: bool) -> _Planned:
        _, level, wdt, gdt, mdt, limited = self._bucket_key(b, index[0])
        tensors = [(b.params[i], b.grads[i], b.states[i]) for i in index]
        kinds = (wdt, gdt, mdt)
        if unplanned:  # tables kept per set of parameters, checked on every call
            bucket = self._bucket(tuple(id(w) for w, _, _ in tensors), tensors, level, limited, kinds)
        else:
            self._validate(tensors, level, limited, tensors[0][0].device, kinds)
            bucket = self._new_bucket(tensors, level, limited)
            self._point(bucket, _addresses(tensors, limited))
        return _Planned(b, index, level, limited, kinds, bucket)

    def _count(self, device: torch.device, used: list[Tensor]) -> Tensor:
        """The running skip count of ``device``, added to ``used`` once."""
        count = self._skipped.get(device)
        if count is None:
            count = self._skipped[device] = torch.zeros((), dtype=torch.int64, device=device)
        if not any(c is count for c in used):
            used.append(count)
        return count

    @staticmethod
    def _hyper(group: dict, level: int, step: int, limited: bool, s: AdamWScalars) -> _Hyper:
        """The launch's scalars: the step's ``s`` (:func:`._backends.kernel_scalars`), the group's limiter, clip."""
        clip = s.clip
        return _Hyper(
            h=2.0 ** (-level / 2),
            w1=s.w1,
            beta2=s.beta2,
            w2=s.w2,
            eps2=s.eps,
            gamma=float(group["norm_growth_limit"]) if limited else 1.0,
            first=1.0 if step == 1 else 0.0,
            clip=math.inf if clip is None else float(clip),
        )

    def _bucket(self, key: tuple, tensors: list, level: int, limited: bool, kinds: tuple) -> _Bucket:
        """The cached tables for these (W, G, state) triples, rebuilt when a
        shape or an address has changed."""
        layout = (level, limited, tuple(w.shape for w, _, _ in tensors))
        columns = _addresses(tensors, limited)
        bucket = self._buckets.get(key)
        if bucket is not None and bucket.layout == layout and bucket.pointers == columns:
            return bucket
        self._validate(tensors, level, limited, tensors[0][0].device, kinds)
        if bucket is None or bucket.layout != layout:
            if len(self._buckets) > 4096:  # many single-parameter buckets of dead parameters
                self._buckets.clear()
            bucket = self._new_bucket(tensors, level, limited)
        self._point(bucket, columns)
        self._buckets[key] = bucket
        return bucket

    def _new_bucket(self, tensors: list, level: int, limited: bool) -> _Bucket:
        """Geometry and workspaces for these (W, G, state) triples; no pointers yet."""
        b = 1 << level
        device = tensors[0][0].device
        tb = self._tb(level)
        geom, counts, first = [], [], 0
        for w, _, _ in tensors:
            n = w.shape[-1]
            nb = -(-n // b)
            nblocks = (w.numel() // n) * nb if n else 0
            count = -(-nblocks // tb)
            geom += [n, nb, nblocks, first, count]
            counts.append(count)
            first += count
        chunks = torch.repeat_interleave(torch.arange(len(tensors), dtype=torch.int32), torch.tensor(counts))
        total = max(first, 1)
        return _Bucket(
            device=device, layout=(level, limited, tuple(w.shape for w, _, _ in tensors)), pointers=(),
            geom=_to_device(torch.tensor(geom, dtype=torch.int64), device),
            chunks=_to_device(chunks, device),
            table=None,
            ptrs=None,
            partial=torch.empty(total, dtype=torch.float32, device=device),
            flags=torch.empty(total, dtype=torch.int32, device=device),
            inv_r=torch.empty(len(tensors), dtype=torch.float32, device=device),
            skip=torch.empty(len(tensors), dtype=torch.int32, device=device),
            norm_sq=torch.empty(len(tensors), dtype=torch.float32, device=device),
            n_chunks=first, n_tensors=len(tensors),
            whole=all(w.shape[-1] % b == 0 for w, _, _ in tensors),
        )

    @staticmethod
    def _point(bucket: _Bucket, columns: tuple) -> None:
        """Upload the pointer table for these address columns."""
        # A Python array: a new gradient column is then one slice assignment
        # (_point_grads), where a tensor's index_put costs more than the rest
        # of a one-parameter step's host work.
        bucket.table = array("q", [a for row in zip(*columns) for a in row])
        bucket.pointers = columns
        w, _, m, v, _ = columns
        bucket.state_aligned = not any(a & 15 for column in (w, m, v) for a in column)
        TritonBackend._upload(bucket)

    @staticmethod
    def _point_grads(bucket: _Bucket, grads: list[int]) -> None:
        """Upload the pointer table with a new gradient column (the plans'
        gradients change when backward makes new ones)."""
        # In place: on CUDA the upload stages a copy, and on CPU the previous
        # launch has finished.
        bucket.table[_G.value::_COLS.value] = array("q", grads)
        w, _, *state = bucket.pointers
        bucket.pointers = (w, grads, *state)
        TritonBackend._upload(bucket)

    @staticmethod
    def _upload(bucket: _Bucket) -> None:
        bucket.ptrs = _to_device(torch.frombuffer(bucket.table, dtype=torch.int64), bucket.device)
        bucket.aligned = bucket.whole and bucket.state_aligned and not any(a & 15 for a in bucket.pointers[_G.value])

    @staticmethod
    def _validate(tensors: list, level: int, limited: bool, device: torch.device, kinds: tuple) -> None:
        """What the kernels assume of every tensor whose address they get;
        ``kinds``: the (W, G, moment) dtypes the launches will read them as."""
        wdt, gdt, mdt = kinds
        for w, g, st in tensors:
            M, V = st["exp_avg"], st["exp_avg_sq"]
            problems = []  # besides check_pointers'
            if w.device != device:
                problems.append(f"parameter on {w.device}, not {device}")
            if M.dtype != mdt or V.dtype != mdt or mdt not in _MOMENT_KINDS:
                problems.append(f"moments of dtypes {M.dtype}/{V.dtype}, the kernels read {mdt}")
            if w.dtype != wdt or g.dtype != gdt or wdt not in _KIND or gdt not in _KIND:
                problems.append(f"parameter/gradient dtypes {w.dtype}/{g.dtype}, the kernels read {wdt}/{gdt}")
            if limited:
                s = st.get("limiter_norm")
                if not (isinstance(s, Tensor) and s.ndim == 0 and s.dtype == torch.float32 and s.device == device):
                    problems.append("limiter_norm is not a 0-d float32 tensor on the parameter's device")
            check_pointers("triton", w, g, st, level, problems)

    def _tb(self, level: int) -> int:
        return max(1, self.chunk // (1 << level))

    def _launch_phase1(self, bucket: _Bucket, hyper: _Hyper, level: int, kinds: tuple, limited: bool) -> None:
        if bucket.n_chunks == 0:
            bucket.flags.zero_()
            bucket.partial.zero_()
            return
        _, gdt, mdt = kinds
        _launch_phase1(
            (bucket.n_chunks,), bucket.ptrs, bucket.geom, bucket.chunks, bucket.partial, bucket.flags,
            hyper.h, hyper.w1, hyper.beta2, hyper.w2, hyper.eps2,
            B=1 << level, TB=self._tb(level), G_KIND=_KIND[gdt], M_KIND=_KIND[mdt], LIMITED=limited,
            ALIGNED=bucket.aligned, num_warps=self.num_warps,
        )

    def _launch_phase2(self, bucket: _Bucket, hyper: _Hyper, level: int, kinds: tuple, step_size: float,
                       decay: float, inv_r: Tensor, skip: Tensor) -> None:
        if bucket.n_chunks == 0:
            return
        wdt, gdt, mdt = kinds
        _launch_phase2(
            (bucket.n_chunks,), bucket.ptrs, bucket.geom, bucket.chunks, inv_r, skip,
            hyper.h, hyper.w1, hyper.beta2, hyper.w2, hyper.eps2, float(step_size), float(decay), hyper.clip,
            B=1 << level, TB=self._tb(level), W_KIND=_KIND[wdt], G_KIND=_KIND[gdt], M_KIND=_KIND[mdt],
            ALIGNED=bucket.aligned, num_warps=self.num_warps,
        )

    def _launch(self, bucket: _Bucket, hyper: _Hyper, level: int, kinds: tuple, step_size: float, decay: float,
                limited: bool, limiter_eps: float, count: Tensor) -> None:
        self._launch_phase1(bucket, hyper, level, kinds, limited)
        _launch_limiter(
            (bucket.n_tensors,), bucket.ptrs, bucket.geom, bucket.partial, bucket.flags, bucket.inv_r, bucket.skip,
            bucket.norm_sq, count, hyper.gamma, float(limiter_eps), hyper.first,
            RB=_LIMITER_BLOCK, MODE=1 if limited else 0,
        )
        self._launch_phase2(bucket, hyper, level, kinds, step_size, decay, bucket.inv_r, bucket.skip)


def backend_info() -> dict[str, Any]:
    """Versions, for benchmark reports."""
    return {"triton": triton.__version__, "interpret": INTERPRET}
