"""The detail-clip annealing remedy candidate (issues 18 and 54): the clip follows the lr
schedule's decay from its start value to ``detail_clip_end``, only on GWT
groups, with no state of its own (a resumed run is bitwise the uninterrupted one)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gwt_optim.optim import GWTAdamW
from gwt_optim.toolkit import checkpoint as ckpt
from gwt_optim.toolkit.metrics import read_jsonl
from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer, parse_optimizer_arg
from gwt_optim.toolkit.schedules import WarmupCosine, WarmupStableDecay
from gwt_optim.toolkit.train import DetailClipAnneal, train


def test_the_clip_follows_the_cosine_on_gwt_groups_only():
    w, b = torch.nn.Parameter(torch.zeros(8, 8)), torch.nn.Parameter(torch.zeros(8))
    opt = GWTAdamW([{"params": [w], "level": 2}, {"params": [b], "level": 0}], lr=1e-3, detail_clip=0.5)
    anneal = DetailClipAnneal(opt, 2.0, WarmupCosine(12, 2, 0.0))
    opt.load_state_dict(opt.state_dict())  # new group dicts, as on resume: the anneal must follow them
    seen = []
    for step in range(13):
        anneal.apply(step)
        seen.append(opt.param_groups[0]["detail_clip"])
        assert opt.param_groups[1]["detail_clip"] == 0.5  # level 0: no details to clip
    assert seen[:3] == [0.5, 0.5, 0.5]  # warm-up, and the first step after it
    assert seen[-1] == pytest.approx(2.0) and all(a <= b for a, b in zip(seen, seen[1:]))
    mid = 2 + 5  # halfway through the cosine
    assert seen[mid] == pytest.approx(2.0 + (0.5 - 2.0) * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_under_wsd_the_clip_holds_through_the_stable_phase_and_moves_with_the_decay():
    w = torch.nn.Parameter(torch.zeros(8, 8))
    opt = GWTAdamW([{"params": [w], "level": 2}], lr=1e-3, detail_clip=0.25)
    anneal = DetailClipAnneal(opt, 0.5, WarmupStableDecay(20, 2, min_ratio=0.1, decay_steps=4, shape="linear"))
    seen = []
    for step in range(20):
        anneal.apply(step)
        seen.append(opt.param_groups[0]["detail_clip"])
    assert seen[:16] == [0.25] * 16 and seen[19] == pytest.approx(0.5)
    assert seen[16] == pytest.approx(0.25 + 0.25 * 0.25) and all(a <= b for a, b in zip(seen, seen[1:]))


@pytest.mark.parametrize("spec", ["gwt-adamw:detail_clip_end=0", "gwt-adamw:detail_clip_end=inf",
                                  "gwt-adamw:detail_clip=none:detail_clip_end=1"])
def test_bad_ends_are_value_errors(spec):
    name, opts = parse_optimizer_arg(spec)
    with pytest.raises(ValueError, match="detail_clip"):
        build_optimizer(name, torch.nn.Linear(8, 8), OptimizerConfig(lr=1e-3, options=opts))


def test_a_resumed_annealed_run_is_bitwise_the_uninterrupted_one(tiny_config, tmp_path, stop_at):
    spec = "gwt-adamw:level=1:detail_clip_end=2"
    full = tiny_config(out=str(tmp_path / "full"), optimizer=spec, steps=8, save_every=2)
    train(full)
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(full.out))
    clips = {g["detail_clip"] for g in state["optimizer"]["param_groups"] if g.get("level")}
    assert len(clips) == 1 and clips.pop() == pytest.approx(2.0)

    part = tiny_config(out=str(tmp_path / "part"), optimizer=spec, steps=8, save_every=2)
    with pytest.raises(KeyboardInterrupt):
        train(part, callbacks=[stop_at(5)])
    train(tiny_config(out=part.out, optimizer=spec, steps=8, save_every=2, resume=True))
    losses = [[r["loss"] for r in read_jsonl(Path(d) / "metrics.jsonl") if "loss" in r] for d in (full.out, part.out)]
    assert losses[0] == losses[1]
    val = [json.loads((Path(d) / "summary.json").read_text())["val_loss"] for d in (full.out, part.out)]
    assert val[0] == val[1]
    # and the anneal changed the run: the same spec with a constant clip trains otherwise
    const = tiny_config(out=str(tmp_path / "const"), optimizer="gwt-adamw:level=1", steps=8)
    train(const)
    assert [r["loss"] for r in read_jsonl(Path(const.out) / "metrics.jsonl") if "loss" in r] != losses[0]
