"""_dispatch.choose is the one place that decides where a parameter's step
runs: this table lists each case (family, device, dtype, level, backend,
moment dtype, 1-D, impl, wavelet) and the path and backend it takes, and
checks that a step takes exactly that route.

The paths: "batched" (a batched fused backend runs the whole step, with
others, under the stepper's plan), "fused" (a fused backend's phase 1 and
phase 2 around the limiter's all-reduce: sharded parameters), and the
family's eager halves, whose transform is "plain" (level 0), "haar" (the
closed form, impl="fast") or "reference" (wavedec and waverec).

The CUDA rows run the Triton backend on CPU tensors with its launches
replaced (``TritonBackend(cpu=True)``, as tests/test_host_overhead.py does):
what is checked is the routing, not the kernels.
"""

from __future__ import annotations

import pytest
import torch

from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon
from gwt_optim import _toolchain
from gwt_optim.optim import _dispatch, _native
from gwt_optim.optim._dispatch import choose
from gwt_optim.optim.functional import step_level
from gwt_optim.optim._sharded import is_dtensor, local
from gwt_optim.optim._stepper import Stepper

PATHS = ("batched", "fused", "plain", "haar", "reference")

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


def _native_built() -> bool:
    try:
        _native.native_library()
    except _toolchain.KernelUnavailable:
        return False
    return True


# (id, family, options, parameter shape, weight dtype, gradient dtype, backend, impl)
#   -> (path, backend name, dtype the path reads the gradient in, level)
TABLE = [
    # GWT-AdamW on CPU: the native kernels take the transformed step, torch's
    # fused AdamW the plain one (1-D, or level 0 with alpha 1 and no limiter).
    ("adamw-2d", GWTAdamW, {}, (8, 32), F32, F32, "auto", "fast", ("batched", "native", F32, 2)),
    ("adamw-3d", GWTAdamW, {}, (4, 3, 16), F32, F32, "auto", "fast", ("batched", "native", F32, 2)),
    ("adamw-bf16", GWTAdamW, {}, (8, 32), BF16, BF16, "auto", "fast", ("batched", "native", BF16, 2)),
    ("adamw-fp64", GWTAdamW, {}, (8, 32), F64, F64, "auto", "fast", ("batched", "native", F64, 2)),
    ("adamw-paper", GWTAdamW, {"detail_clip": None}, (8, 32), F32, F32, "auto", "fast", ("batched", "native", F32, 2)),
    # an fp32 weight with bf16 gradients: the native kernels read fp32, so the gradient is cast
    ("adamw-bf16-grad", GWTAdamW, {}, (8, 32), F32, BF16, "auto", "fast", ("batched", "native", F32, 2)),
    ("adamw-1d", GWTAdamW, {}, (12,), F32, F32, "auto", "fast", ("batched", "fused_adamw", F32, 0)),
    # torch's CPU kernel takes one dtype: bf16 weights with fp32 moments take the native level 0
    ("adamw-1d-bf16", GWTAdamW, {}, (12,), BF16, BF16, "auto", "fast", ("batched", "native", BF16, 0)),
    ("adamw-level0-plain", GWTAdamW, {"level": 0, "scale": 1.0, "norm_growth_limit": None}, (8, 32), F32, F32,
     "auto", "fast", ("batched", "fused_adamw", F32, 0)),
    # level 0 with alpha != 1 or the limiter is not the plain step: eager
    ("adamw-level0-scaled", GWTAdamW, {"level": 0}, (8, 32), F32, F32, "auto", "fast", ("plain", None, F32, 0)),
    ("adamw-scalar", GWTAdamW, {}, (), F32, F32, "auto", "fast", ("plain", None, F32, 0)),
    ("adamw-fp16", GWTAdamW, {}, (8, 32), F16, F16, "auto", "fast", ("haar", None, F32, 2)),
    ("adamw-int8", GWTAdamW, {"moment_dtype": "int8"}, (8, 32), F32, F32, "auto", "fast", ("haar", None, F32, 2)),
    ("adamw-bf16-moments", GWTAdamW, {"moment_dtype": "bfloat16"}, (8, 32), F32, F32, "auto", "fast",
     ("haar", None, F32, 2)),
    ("adamw-eager", GWTAdamW, {}, (8, 32), F32, F32, "eager", "fast", ("haar", None, F32, 2)),
    ("adamw-eager-1d", GWTAdamW, {}, (12,), F32, F32, "eager", "fast", ("plain", None, F32, 0)),
    ("adamw-reference", GWTAdamW, {}, (8, 32), F32, F32, "auto", "reference", ("reference", None, F32, 2)),
    ("adamw-db2", GWTAdamW, {"wavelet": "db2"}, (8, 32), F32, F32, "auto", "fast", ("reference", None, F32, 2)),
    ("adamw-bf16-eager", GWTAdamW, {}, (8, 32), BF16, BF16, "eager", "fast", ("haar", None, F32, 2)),
    # the other families have no fused kernels
    ("muon", GWTMuon, {}, (8, 32), F32, F32, "auto", "fast", ("haar", None, F32, 2)),
    ("muon-level0", GWTMuon, {"level": 0}, (8, 32), F32, F32, "auto", "fast", ("plain", None, F32, 0)),
    ("adam-mini", GWTAdamMini, {}, (8, 32), F32, F32, "auto", "fast", ("haar", None, F32, 2)),
    ("adam-mini-1d", GWTAdamMini, {}, (12,), F32, F32, "auto", "fast", ("plain", None, F32, 0)),
    ("adafactor", GWTAdafactor, {}, (8, 32), F32, F32, "auto", "fast", ("haar", None, F32, 2)),
    ("adafactor-reference", GWTAdafactor, {}, (8, 32), F32, F32, "auto", "reference", ("reference", None, F32, 2)),
    ("adafactor-bf16", GWTAdafactor, {}, (8, 32), BF16, BF16, "auto", "fast", ("haar", None, F32, 2)),
]

# The CUDA rows: the Triton backend, which reads bf16 and fp16 gradients as they are.
CUDA_TABLE = [
    ("triton-2d", GWTAdamW, {}, (8, 32), F32, F32, "triton", "fast", ("batched", "triton", F32, 2)),
    ("triton-bf16", GWTAdamW, {}, (8, 32), BF16, BF16, "triton", "fast", ("batched", "triton", BF16, 2)),
    ("triton-bf16-grad", GWTAdamW, {}, (8, 32), F32, BF16, "triton", "fast", ("batched", "triton", BF16, 2)),
    ("triton-1d", GWTAdamW, {}, (12,), F32, F32, "triton", "fast", ("batched", "triton", F32, 0)),
    ("triton-int8", GWTAdamW, {"moment_dtype": "int8"}, (8, 32), F32, F32, "triton", "fast", ("haar", None, F32, 2)),
    ("triton-reference", GWTAdamW, {}, (8, 32), F32, F32, "triton", "reference", ("reference", None, F32, 2)),
]


def _make(family, options, shape, dtype, backend, impl):
    p = torch.nn.Parameter(torch.randn(shape).to(dtype))
    p.grad_dtype = None  # torch lets a gradient have another dtype (the mixed rows)
    kw = {"backend": backend} if family is GWTAdamW else {}
    group = {"params": [p], **options}
    if family is GWTMuon and len(shape) < 2:
        group["use_muon"] = False
    return p, family([group], lr=1e-3, impl=impl, **kw)


def route(opt, group, p, grad):
    """(path, backend, gradient as read, level) of ``p``'s step, from choose()."""
    sharded = is_dtensor(p)
    r = choose(opt._kernels, group, local(p), local(grad), sharded, opt._rule_of(group).limited(group, p.ndim >= 2),
               *step_level(p.shape, group["level"], group["scale"]))
    if r.backend is not None:
        path = "batched" if r.backend.capabilities.batched and not sharded else "fused"
    elif r.level == 0:
        path = "plain"
    else:
        path = "haar" if opt._impl == "fast" and group["wavelet"] == "haar" else "reference"
    return path, r.backend, r.grad, r.level


def _check(case, monkeypatch=None):
    _, family, options, shape, dtype, gdtype, option, impl, (path, backend, read, level) = case
    assert path in PATHS
    p, opt = _make(family, options, shape, dtype, option, impl)
    grad = torch.randn(shape).to(gdtype)
    got, fused, read_grad, got_level = route(opt, opt.param_groups[0], p, grad)
    assert (got, getattr(fused, "name", None), read_grad.dtype, got_level) == (path, backend, read, level)
    if read_grad.dtype == gdtype:
        assert read_grad is grad  # read as it is: no copy

    # A step takes exactly this route: the ParamStep phase 1 makes carries it.
    seen = []
    phase1 = Stepper._phase1

    def spy(self, *args):
        ps = phase1(self, *args)
        seen.append(ps)
        return ps

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Stepper, "_phase1", spy)
        p.grad = grad
        opt.step()
    (ps,) = seen
    assert ps.batched == (path == "batched") and getattr(ps.backend, "name", None) == backend
    assert ps.transformed == (len(shape) >= 2)
    assert (ps.backend is None and ps.carry.coeffs is not None) == (path == "reference")
    assert ps.level == level


@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_route_table(case):
    if case[-1][1] == "native" and not _native_built():
        pytest.skip("no C compiler for the native kernels")
    _check(case)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    _triton = pytest.importorskip("gwt_optim.optim._triton", exc_type=ImportError)
    for name in ("_launch_phase1", "_launch_limiter", "_launch_phase2"):
        monkeypatch.setattr(_triton, name, lambda *a, **k: None)
    monkeypatch.setitem(_dispatch.BACKENDS, "triton", lambda: _triton.TritonBackend(cpu=True))


@pytest.mark.parametrize("case", CUDA_TABLE, ids=[c[0] for c in CUDA_TABLE])
def test_route_table_cuda(case, triton_on_cpu):
    _check(case)


def test_every_path_has_a_row():
    assert {c[-1][0] for c in TABLE} == set(PATHS) - {"fused"}
    # "fused" (phase 1 and phase 2 around the limiter's all-reduce) is a sharded
    # parameter's: tests/test_distributed.py runs it under FSDP2.
    assert "fused" in PATHS
