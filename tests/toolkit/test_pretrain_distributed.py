"""DDP and FSDP2 under torchrun (2 CPU processes, gloo) against one process.

One process with a global batch of 4 and two with 2 each see the same
sequences per step and average the same gradient, so their loss curves agree
to float rounding. FSDP2 hands the optimizer row shards (DTensors): GWT-AdamW
runs its wavelet transform on each shard and all-reduces the norm-growth
limiter's whole-matrix norms, so sharded training must match too.

GWT divides each detail coefficient by its approximation coefficient's
``sqrt(V) + eps``; with a tiny ``eps`` a near-cancelling approximation turns
1-ulp gradient differences (the order of summation differs across ranks) into
visibly different steps. The runs here use ``eps = 1e-4`` so that agreement
to 2e-5 is a meaningful check of the harness and the sharded optimizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _waiting import CAP_S

from gwt_optim.toolkit.metrics import read_jsonl
from gwt_optim.toolkit.train import TrainConfig, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GWT = "gwt-adamw:level=2:scale=0.25:lr=1e-2"


def _curve(run: Path) -> tuple[list[float], list[float]]:
    records = read_jsonl(run / "metrics.jsonl")
    return [r["loss"] for r in records if "loss" in r], [r["val_loss"] for r in records if "val_loss" in r]


def _torchrun(config: dict, run: Path, port: int) -> subprocess.CompletedProcess:
    run.mkdir(parents=True)
    path = run / "requested.json"
    path.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={port}",
           "-m", "gwt_optim", "pretrain", "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=CAP_S, env=env)


@pytest.fixture(scope="module")
def single_process_runs(tiny_model, corpus, tmp_path_factory):
    """optimizer -> the config of a finished single-process run to reproduce."""
    done: dict[str, TrainConfig] = {}

    def get(optimizer: str) -> TrainConfig:
        if optimizer not in done:
            out = tmp_path_factory.mktemp("single") / "run"
            cfg = TrainConfig(out=str(out), model=tiny_model, data=corpus, tokenizer="bpe:320", seq_len=32,
                              batch_size=4, steps=6, eval_every=3, val_tokens=512, eval_batch_size=4,
                              optimizer=optimizer, eps=1e-4, progress=False, device="cpu")
            train(cfg)
            done[optimizer] = cfg
        return done[optimizer]

    return get


@pytest.mark.parametrize("mode, optimizer", [("ddp", GWT), ("fsdp", GWT), ("fsdp", "adamw:lr=1e-2")])
def test_two_processes_match_one(single_process_runs, tmp_path, free_port, mode, optimizer):
    reference = single_process_runs(optimizer)
    run = tmp_path / mode
    done = _torchrun({**reference.to_dict(), "out": str(run), "fsdp": mode == "fsdp"}, run, free_port)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["fsdp"] == (mode == "fsdp")
    losses, vals = _curve(run)
    ref_losses, ref_vals = _curve(Path(reference.out))
    assert len(losses) == 6 and len(vals) == 2
    assert losses == pytest.approx(ref_losses, abs=2e-5)
    assert vals == pytest.approx(ref_vals, abs=2e-5)
    shards = sorted(p.name for p in (run / "checkpoints" / "step_00000006").glob("rank*.pt"))
    # FSDP ranks hold different shards; DDP replicas are identical and saved once.
    assert shards == (["rank0.pt", "rank1.pt"] if mode == "fsdp" else ["rank0.pt"])
    if mode == "fsdp":  # each rank holds about half of the optimizer state
        ref_state = json.loads((Path(reference.out) / "summary.json").read_text())["state_bytes"]
        assert summary["state_bytes_per_rank"] < 0.7 * ref_state
        assert summary["state_bytes"] == pytest.approx(ref_state, rel=0.05)
