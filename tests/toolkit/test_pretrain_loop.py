"""The training loop: schedule, a real run, exact resume, the NaN stop, checkpoints."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from gwt_optim.toolkit import checkpoint as ckpt
from gwt_optim.toolkit.metrics import read_jsonl
from gwt_optim.toolkit.schedules import WarmupCosine
from gwt_optim.toolkit.train import Callback, NonFiniteLossError, train

SUMMARY_KEYS = {"optimizer", "val_loss", "val_ppl", "state_bytes", "peak_rss_bytes", "tokens_per_s", "steps"}


def _losses(run: str | Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(Path(run) / "metrics.jsonl") if "loss" in r]


def test_warmup_cosine_schedule():
    f = WarmupCosine(total_steps=100, warmup_steps=10, min_ratio=0.1)
    assert [f(s) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert f(100) == pytest.approx(0.1) and f(1000) == pytest.approx(0.1)
    after = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(after, after[1:]))


def test_run_learns_and_writes_its_run_directory(tiny_config):
    cfg = tiny_config(steps=12, eval_every=6, warmup=0.25)
    summary = train(cfg)
    run = Path(cfg.out)
    assert SUMMARY_KEYS <= set(summary)
    assert json.loads((run / "summary.json").read_text())["val_loss"] == summary["val_loss"]
    assert summary["steps"] == 12 and summary["tokens"] == 12 * 4 * 32
    assert summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]))
    # 2 moments per parameter (fp32) plus AdamW's step counters
    assert summary["state_bytes"] >= 2 * 4 * summary["params"]
    losses = _losses(run)
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < losses[0] - 0.3
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evals] == [6, 12]
    config = json.loads((run / "config.json").read_text())
    assert config["steps"] == 12 and config["optimizer"] == "adamw"
    env = json.loads((run / "environment.json").read_text())
    assert {"torch", "transformers", "git_commit", "cpu"} <= set(env)
    lrs = [r["lr"] for r in read_jsonl(run / "metrics.jsonl") if "lr" in r]
    assert max(lrs) == pytest.approx(3e-3) and lrs[0] < lrs[1]  # warm-up, then decay
    assert ckpt.latest_checkpoint(run).name == "step_00000012"


@pytest.mark.parametrize("optimizer", ["adamw", "gwt-adamw:level=2:scale=0.25", "gwt-muon:level=2"])
def test_interrupted_and_resumed_run_equals_uninterrupted(tiny_config, tmp_path, optimizer, stop_at):
    full = train(tiny_config(out=str(tmp_path / "full"), optimizer=optimizer))
    # Ctrl-C before step 6: the loop saves a checkpoint of step 5 and re-raises.
    part = tiny_config(out=str(tmp_path / "part"), optimizer=optimizer)
    with pytest.raises(KeyboardInterrupt):
        train(part, callbacks=[stop_at(6)])
    assert ckpt.latest_checkpoint(part.out).name == "step_00000005"
    with pytest.raises(FileExistsError, match="--resume"):
        train(part)
    part.resume = True
    resumed = train(part)
    assert _losses(part.out) == _losses(tmp_path / "full")  # bitwise: same data, RNG, state
    assert resumed["val_loss"] == full["val_loss"]


def test_resume_after_a_crash_redoes_steps_since_the_last_checkpoint(tiny_config, tmp_path, stop_at):
    train(tiny_config(out=str(tmp_path / "full")))
    part = tiny_config(out=str(tmp_path / "part"), save_every=3)
    with pytest.raises(RuntimeError):
        train(part, callbacks=[stop_at(6, RuntimeError)])  # a crash saves nothing
    assert ckpt.latest_checkpoint(part.out).name == "step_00000003"
    part.resume = True
    train(part)
    assert _losses(part.out) == _losses(tmp_path / "full")


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


class _PoisonAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_start(self, step, model):
        if step == self.step:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tiny_config):
    cfg = tiny_config(save_every=2, steps=10)
    good = {}

    class Snapshot(Callback):
        def on_step_start(self, step, model):
            if step == 5:  # the step-4 checkpoint has just been written
                good.update(_digest(ckpt.latest_checkpoint(cfg.out)))

    with pytest.raises(NonFiniteLossError, match=r"step 6.*step_00000004.*intact"):
        train(cfg, callbacks=[Snapshot(), _PoisonAt(6)])
    last = ckpt.latest_checkpoint(cfg.out)
    assert last.name == "step_00000004" and _digest(last) == good
    state = ckpt.load_checkpoint(last)
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert not list((Path(cfg.out) / "checkpoints").glob(".staging*"))
    assert [r["step"] for r in read_jsonl(Path(cfg.out) / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5]


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, {"step": step, "x": torch.ones(3) * step}, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    # A save killed half-way leaves only a hidden staging folder, which is never picked up.
    (tmp_path / "checkpoints" / ".staging_step_00000004").mkdir()
    (tmp_path / "checkpoints" / "step_00000005").mkdir()  # no meta.json: incomplete
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000003"
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["x"].tolist() == [3.0] * 3


def test_gradient_accumulation_matches_one_big_batch(tiny_config, tmp_path):
    one = tiny_config(out=str(tmp_path / "one"), steps=4, eval_every=0)
    acc = tiny_config(out=str(tmp_path / "acc"), steps=4, eval_every=0, micro_batch_size=1)
    a, b = train(one), train(acc)
    assert _losses(one.out) == pytest.approx(_losses(acc.out), abs=1e-5)
    assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-5)


def test_batch_that_does_not_split_is_rejected(tiny_config):
    with pytest.raises(ValueError, match="--micro-batch-size"):
        train(tiny_config(micro_batch_size=3))


def test_streamed_c4_pipeline_trains_and_resumes_exactly(tiny_config, corpus, tmp_path, monkeypatch, stop_at):
    """C4 itself needs the network; the same streaming path runs on a stand-in stream."""
    from gwt_optim.toolkit import data

    docs = {split: data.load_texts(corpus, split) for split in ("train", "validation")}

    def fake_c4(split, *, seed=0, skip=0):
        rows = list(docs[data.SPLITS[split]])
        if data.SPLITS[split] == "train":
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
            rows = [rows[i] for i in order.tolist()]  # a seeded shuffle, as the real stream's buffer
        yield from rows[skip:]

    monkeypatch.setattr(data.sources, "c4_documents", fake_c4)  # the one place every C4 reader looks it up
    full = tiny_config(out=str(tmp_path / "full"), data="c4", tokenizer="bpe:320", steps=6, eval_every=3)
    train(full)
    part = tiny_config(out=str(tmp_path / "part"), data="c4", tokenizer="bpe:320", steps=6, eval_every=3)
    with pytest.raises(KeyboardInterrupt):
        train(part, callbacks=[stop_at(4)])
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(part.out))["data"]["kind"] == "stream"
    part.resume = True
    train(part)
    assert _losses(part.out) == _losses(full.out)


def test_run_files_follow_the_umask_and_record_what_each_group_runs(tiny_config, tmp_path):
    """config.json keeps the settings (resume and reuse compare them) and records under ``resolved`` the
    lr and betas each group runs; metrics.jsonl logs each named group's lr; every file has the umask's mode."""
    import os

    from gwt_optim.toolkit.pretrain import resolve_config
    from gwt_optim.toolkit.runner import same_config
    from gwt_optim.toolkit.train import RESOLVED, TrainConfig, resume_conflicts

    cfg = tiny_config(steps=3, eval_every=0, warmup=0, schedule="constant",
                      optimizer="gwt-adamw:lr=1e-3:regular_lr=2e-3:beta2=0.95")
    old = os.umask(0o027)
    try:
        train(cfg)
    finally:
        os.umask(old)
    run = Path(cfg.out)
    for name in ("config.json", "summary.json", "environment.json", "metrics.jsonl"):
        assert (run / name).stat().st_mode & 0o777 == 0o640, name
    config = json.loads((run / "config.json").read_text())
    assert config["lr"] == 3e-3 and config["betas"] == [0.9, 0.999]  # the flags' values, as given
    groups = {g["name"]: g for g in config[RESOLVED]["groups"]}
    assert set(groups) == {"transformed", "regular"}
    assert groups["transformed"]["lr"] == 1e-3 and groups["regular"]["lr"] == 2e-3
    assert groups["transformed"]["betas"] == [0.9, 0.95] == groups["regular"]["betas"]
    assert groups["transformed"]["level"] == 2 and groups["regular"]["level"] == 0
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert [r["group_lr"] for r in steps] == [{"transformed": 1e-3, "regular": 2e-3}] * 3
    assert all(r["lr"] == 2e-3 for r in steps)  # the largest group's
    # The record is not a setting: the run's config.json still reads, resumes and matches as before.
    assert TrainConfig.from_dict(config) == cfg
    assert resume_conflicts(config, cfg.to_dict()) == [] and same_config(config, cfg.to_dict())
    import argparse

    assert resolve_config(argparse.Namespace(config=str(run / "config.json"))) == cfg


def test_a_finished_run_leaves_its_metrics_log_closed(tiny_config):
    """The final validation writes a record after the loop closed the log: the log is closed again (a
    ResourceWarning for an unclosed metrics.jsonl, once per finished run, was the symptom)."""
    import gc
    import warnings

    cfg = tiny_config(steps=2, eval_every=2, warmup=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        train(cfg)
        gc.collect()
    unclosed = [str(w.message) for w in caught
                if issubclass(w.category, ResourceWarning) and "metrics" in str(w.message)]
    assert unclosed == []
    assert any("val_loss" in r for r in read_jsonl(Path(cfg.out) / "metrics.jsonl"))
