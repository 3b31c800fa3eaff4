"""What a step plan must notice (issue 16): a weight re-pointed to its own
transpose keeps its address and, square, its shape; only its strides change.
A plan keyed without them kept handing the weight to the native kernels,
which read it as contiguous rows and updated it along the wrong axis."""

from __future__ import annotations

import pytest
import torch

from gwt_optim import GWTAdamW
from gwt_optim import _toolchain
from gwt_optim.optim import _native


def _native_or_skip():
    try:
        _native.native_library()
    except _toolchain.KernelUnavailable as exc:
        pytest.skip(f"no C compiler for the native kernels: {exc}")


@pytest.mark.parametrize("each", [False, True], ids=["step", "step_param"])
def test_a_weight_repointed_to_its_transpose_steps_as_the_reference(each):
    _native_or_skip()
    gen = torch.Generator().manual_seed(0)
    # float64: the native kernels and the reference path agree to rounding.
    W0 = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    grads = [torch.randn(8, 8, generator=gen, dtype=torch.float64) for _ in range(5)]
    kw = dict(lr=1e-2, weight_decay=0.1, level=2)
    p, ref = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    opt = GWTAdamW([p], backend="native", **kw)
    ref_opt = GWTAdamW([ref], impl="reference", **kw)
    for t, g in enumerate(grads):
        if t == 2:  # the plan is made (step 0) and held (step 1); then the same address, other strides
            address = p.data_ptr()
            for q in (p, ref):
                q.data = q.data.t()
            assert p.data_ptr() == address and p.shape == (8, 8) and p.stride() == (1, 8)
        p.grad, ref.grad = g.clone(), g.clone()  # contiguous, as set by hand
        (opt.step_param(p) if each else opt.step())
        ref_opt.step()
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-12, atol=1e-12, msg=f"step {t}")
