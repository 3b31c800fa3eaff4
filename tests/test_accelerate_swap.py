"""accelerate's FSDP2 ``prepare`` with a GWT optimizer (2 CPU processes, gloo).

On ``prepare(model, optimizer)`` accelerate shards the model with
``fully_shard`` and swaps every parameter in the optimizer's groups for the
prepared model's sharded one, matched by the old parameter's data pointer
(``fsdp2_switch_optimizer_parameters``); our ``add_param_group`` never sees the
new parameters. accelerate picks FSDP only on accelerator devices (on CPU it
silently stays with plain data parallelism), so this test builds the
``Accelerator`` on CPU and sets its state's distributed type to FSDP with an
``fsdp_version=2`` plugin by hand: from there ``prepare`` runs accelerate's own
FSDP2 path. The oracle: the same GWT-AdamW on one process, full batches.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _launch import launch

pytest.importorskip("accelerate", reason="accelerate is not installed (the train extra)")

from gwt_optim import GWTAdamW  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD, STEPS = 2, 3


def make_model():
    torch.manual_seed(0)
    # Odd sizes: uneven row shards. float64: the comparison is not swamped by reduction-order rounding.
    return torch.nn.Sequential(torch.nn.Linear(12, 21), torch.nn.Tanh(), torch.nn.Linear(21, 3)).double()


def make_opt(model):
    return GWTAdamW([{"params": [model[0].weight, model[2].weight]},
                     {"params": [model[0].bias, model[2].bias], "level": 0}], lr=1e-2, weight_decay=0.01)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64))
            for _ in range(STEPS)]


def _worker(rank, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator = Accelerator(cpu=True)
    assert accelerator.state.distributed_type == DistributedType.MULTI_CPU  # what it picks on CPU
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)

    model = make_model()
    opt = make_opt(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, prepared = accelerator.prepare(model, opt)
    # The groups now hold the prepared model's parameters, each once, sharded; the options stayed.
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in model.parameters()} and len(held) == 4
    assert all(type(p).__name__ == "DTensor" for p in held)
    assert [g["level"] for g in opt.param_groups] == [2, 0]

    for x, y in batches():
        prepared.zero_grad()
        torch.nn.functional.mse_loss(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank]).backward()
        prepared.step()
    # The state is keyed by the new parameters, and sharded like them (A_2 of 12 columns: 3).
    w = model[0].weight
    assert set(opt.state) == set(held)
    assert type(opt.state[w]["exp_avg"]).__name__ == "DTensor" and tuple(opt.state[w]["exp_avg"].shape) == (21, 3)
    full = [p.full_tensor() for p in model.parameters()]
    if rank == 0:
        torch.save([t.detach().clone() for t in full], os.path.join(out_dir, "accelerate.pt"))


def test_the_fsdp2_parameter_swap_keeps_gwt_adamw_training_as_one_process(tmp_path):
    launch(_worker, WORLD, tmp_path, str(tmp_path))
    model = make_model()
    opt = make_opt(model)
    for x, y in batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    got = torch.load(tmp_path / "accelerate.pt", weights_only=True)
    expected = [p.detach() for p in model.parameters()]
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert not torch.equal(expected[0], make_model()[0].weight)  # it trained
