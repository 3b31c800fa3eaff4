"""GWTAdamW on FSDP2 shards and under DDP (2 CPU processes, gloo) equals a
single-process run: the transform is local to each row shard and the limiter's
norms are all-reduced in one collective. On FSDP2, a run saved halfway with
``torch.distributed.checkpoint`` (DCP) and resumed in a fresh model and
optimizer ends bitwise where the uninterrupted run ends."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _launch import launch

from gwt_optim import GWTAdamW

pytestmark = pytest.mark.distributed

STEPS = 4
WORLD = 2
# At this step the first weight's gradient holds a NaN in its last row, which
# only rank 1's FSDP2 shard sees: every rank must skip that weight's update.
NAN_STEP = 2
# The DCP checkpoint is taken after this many steps (before the NaN step, so the resumed run meets it).
SAVE_AFTER = 2


def make_model():
    torch.manual_seed(0)
    # Odd sizes: uneven row shards and a padded last block. float64 so that the
    # comparison is not swamped by reduction-order rounding, which Adam-style
    # normalization amplifies where gradients are near zero.
    return torch.nn.Sequential(
        torch.nn.Linear(12, 21), torch.nn.Tanh(), torch.nn.Linear(21, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)
    ).double()


def batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 12, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64))
        for _ in range(STEPS)
    ]


def make_opt(params, gamma=1.01):
    return GWTAdamW(params, lr=1e-2, weight_decay=0.01, level=2, norm_growth_limit=gamma)


def single_process_result(gamma=1.01):
    model = make_model()
    opt = make_opt(model.parameters(), gamma)
    for t, (x, y) in enumerate(batches()):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if t == NAN_STEP:
            next(iter(model.parameters())).grad[-1, 0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
    assert opt.nonfinite_skips == 1
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank, out_dir):
    for mode in ("fsdp", "ddp"):
        _train_distributed(rank, mode, os.path.join(out_dir, f"{mode}.pt"), os.path.join(out_dir, "dcp"))
    _train_distributed(rank, "fsdp", os.path.join(out_dir, "fsdp-resumed.pt"), os.path.join(out_dir, "dcp"),
                       resume=True)


def _train_distributed(rank, mode, out_path, dcp_dir, resume=False):
    """``mode`` training on this rank's half of each batch. On FSDP2 the state after SAVE_AFTER steps goes to
    ``dcp_dir`` through DCP; ``resume`` loads it into this fresh model and optimizer and runs the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = make_model()
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = make_opt(model.parameters())
    first = 0
    if resume:
        msd, osd = get_state_dict(model, opt)  # the fresh run's own layout, which DCP loads into
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        first = SAVE_AFTER
    for t, (x, y) in enumerate(batches()):
        if t < first:
            continue
        if mode == "fsdp" and t == SAVE_AFTER and not resume:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
        xs, ys = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        if t == NAN_STEP:
            grad = next(iter(model.parameters())).grad
            if mode == "ddp":  # DDP's all-reduce would have spread it to every rank
                grad[-1, 0] = float("nan")
            elif rank == WORLD - 1:  # the last row is on the last rank's shard only
                grad.to_local()[-1, 0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
    assert opt.nonfinite_skips == 1  # the resumed run starts before the NaN step, so it meets it too
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    if mode == "fsdp":
        # State follows the parameter's sharding, so DCP can save/reshard it.
        w = next(iter(model.parameters()))
        assert type(opt.state[w]["exp_avg"]).__name__ == "DTensor"
        assert tuple(opt.state[w]["exp_avg"].shape) == (21, 3)
    if rank == 0:
        torch.save([t.detach().clone() for t in full], out_path)


def test_fsdp2_and_ddp_training_match_single_process(tmp_path):
    launch(_worker, WORLD, tmp_path, str(tmp_path))
    expected = single_process_result()
    for mode in ("fsdp", "ddp"):
        got = torch.load(tmp_path / f"{mode}.pt", weights_only=True)
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"{mode}: {m}")
    # DCP: saved after SAVE_AFTER steps, loaded into a fresh model and optimizer, run to the end: bitwise.
    resumed = torch.load(tmp_path / "fsdp-resumed.pt", weights_only=True)
    fsdp = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(resumed, fsdp, strict=True))
    # The limiter engaged in this run, so matching needs the cross-rank norm.
    unlimited = single_process_result(gamma=None)
    assert any(not torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(expected, unlimited))
