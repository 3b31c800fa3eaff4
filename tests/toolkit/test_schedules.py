"""The lr schedules (cosine, warmup-stable-decay, constant): their values, their flags in every training
command, a resume mid-decay that is bit for bit the uninterrupted run, and a WSD run decayed on demand from
a stable-phase checkpoint that is bit for bit the run planned with that decay from the start."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from gwt_optim.cli import main
from gwt_optim.toolkit import checkpoint as ckpt
from gwt_optim.toolkit.metrics import read_jsonl
from gwt_optim.toolkit.schedules import (WarmupConstant, WarmupCosine, WarmupStableDecay, make_schedule, steps_of)
from gwt_optim.toolkit.train import train


def _lrs(run: str | Path) -> list[float]:
    return [r["lr"] for r in read_jsonl(Path(run) / "metrics.jsonl") if "loss" in r]


def _losses(run: str | Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(Path(run) / "metrics.jsonl") if "loss" in r]


def _weights(run: str | Path) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(ckpt.latest_checkpoint(run))["model"]


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_wsd_warms_up_holds_the_peak_and_decays_to_the_floor_on_the_last_step():
    s = WarmupStableDecay(100, 10, min_ratio=0.1, decay_steps=20, shape="1-sqrt")
    assert [s(i) for i in range(10)] == [(i + 1) / 10 for i in range(10)]
    assert all(s(i) == 1.0 for i in range(10, 80))  # exactly the peak: the stable phase is not a cosine
    assert s(80) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(1 / 20)), rel=1e-15)
    assert s(99) == 0.1 and s(100) == 0.1  # the last step runs at the floor
    lin = WarmupStableDecay(100, 10, min_ratio=0.0, decay_steps=20, shape="linear")
    assert [lin(i) for i in (80, 89, 99)] == pytest.approx([0.95, 0.5, 0.0], abs=1e-15)
    assert all(a >= b for a, b in zip([s(i) for i in range(10, 100)], [s(i) for i in range(11, 101)]))
    # no decay: the peak to the end; a decay longer than the run after its warm-up is cut to fit
    assert WarmupStableDecay(10, 2, 0.1, 0)(9) == 1.0
    assert WarmupStableDecay(10, 2, 0.1, 50).decay_start == 2


def test_constant_and_cosine():
    c = WarmupConstant(50, 5)
    assert [c(i) for i in (0, 4, 5, 49)] == [0.2, 1.0, 1.0, 1.0]
    cos = WarmupCosine(100, 10, 0.1)
    # the formula every run before the schedules used, unchanged to the bit
    ref = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (i - 10) / 90))) for i in range(10, 101)]
    assert [cos(i) for i in range(10, 101)] == ref


def test_make_schedule_reads_warmup_and_decay_by_one_rule():
    assert steps_of(0.2, 100) == 20 and steps_of(7, 100) == 7 and steps_of(0.125, 20) == 2  # halves to even
    s = make_schedule("wsd", 100, 0.1, min_ratio=0.1, decay=0.2, decay_shape="linear")
    assert (s.warmup_steps, s.decay_steps, s.shape) == (10, 20, "linear")
    assert make_schedule("wsd", 100, 5, decay=30).decay_steps == 30
    with pytest.raises(ValueError, match="choose one of cosine, wsd, constant"):
        make_schedule("step", 100, 0.1)
    with pytest.raises(ValueError, match="1-sqrt, linear"):
        make_schedule("wsd", 100, 0.1, decay_shape="cosine")


@pytest.mark.parametrize("args, words", [
    (["--schedule", "triangle"], "--schedule"),
    (["--decay-shape", "cosine"], "--decay-shape"),
    (["--decay", "-0.5"], "--decay"),
])
def test_bad_schedule_flags_are_one_line_and_exit_2(tmp_path, capsys, args, words):
    try:  # argparse's choices exit; the config's checks return
        code = main(["pretrain", "--out", str(tmp_path / "r"), *args])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_the_training_commands_offer_the_schedules(capsys):
    for command in (["pretrain"], ["compare"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        out = capsys.readouterr().out
        assert "--schedule {cosine,wsd,constant}" in out and "--decay-shape {1-sqrt,linear}" in out


def test_a_run_follows_its_schedule(tiny_config, tmp_path):
    cfg = tiny_config(out=str(tmp_path / "wsd"), steps=10, warmup=2, schedule="wsd", decay=4, decay_shape="linear",
                      min_lr_ratio=0.0)
    train(cfg)
    expected = [cfg.lr * WarmupStableDecay(10, 2, 0.0, 4, "linear")(s) for s in range(10)]
    assert _lrs(cfg.out) == pytest.approx(expected, rel=1e-12)
    assert json.loads((Path(cfg.out) / "config.json").read_text())["schedule"] == "wsd"
    const = tiny_config(out=str(tmp_path / "const"), steps=6, warmup=2, schedule="constant")
    train(const)
    assert _lrs(const.out) == pytest.approx([const.lr * v for v in (0.5, 1, 1, 1, 1, 1)], rel=1e-12)


def test_resume_mid_decay_is_the_uninterrupted_run(tiny_config, tmp_path, stop_at):
    kw = dict(steps=10, warmup=2, schedule="wsd", decay=4, save_every=2)
    full = tiny_config(out=str(tmp_path / "full"), **kw)
    train(full)
    part = tiny_config(out=str(tmp_path / "part"), **kw)
    with pytest.raises(KeyboardInterrupt):
        train(part, callbacks=[stop_at(8)])  # inside the decay (steps 7-10)
    assert main(["pretrain", "--out", part.out, "--resume"]) == 0
    assert _losses(part.out) == _losses(full.out) and _lrs(part.out) == _lrs(full.out)
    assert _same_weights(Path(part.out), Path(full.out))


def test_a_stable_phase_checkpoint_decays_on_demand(tiny_config, tmp_path):
    """WSD's point: train at the peak, then decay any stable-phase checkpoint: `--resume --steps K+D --decay D`
    from step K gives the very run that was planned with that decay from the start."""
    stable = tiny_config(out=str(tmp_path / "stable"), steps=6, warmup=2, schedule="wsd", decay=0)
    train(stable)
    decayed = tmp_path / "decayed"
    shutil.copytree(stable.out, decayed)
    assert main(["pretrain", "--out", str(decayed), "--resume", "--steps", "9", "--decay", "3"]) == 0
    planned = tiny_config(out=str(tmp_path / "planned"), steps=9, warmup=2, schedule="wsd", decay=3)
    train(planned)
    assert _losses(decayed) == _losses(planned.out)
    assert _lrs(decayed) == _lrs(planned.out) and _lrs(decayed)[-1] == pytest.approx(planned.lr * 0.1, rel=1e-12)
    assert _same_weights(decayed, Path(planned.out))
    assert json.loads((decayed / "config.json").read_text())["decay"] == 3


def _hf_lrs(kind: str, steps: int, warmup: int, **kw) -> list[float]:
    from transformers import get_scheduler

    from gwt_optim.toolkit.schedules import hf_scheduler_args

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    name, kwargs = hf_scheduler_args(kind, steps, **kw)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=steps,
                          scheduler_specific_kwargs=kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_finetune_trains_through_hugging_faces_schedulers():
    from transformers import get_cosine_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = get_cosine_schedule_with_warmup(opt, 3, 20)  # what finetune lm ran before the schedules
    cos = []
    for _ in range(20):
        cos.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    assert _hf_lrs("cosine", 20, 3) == cos
    wsd = _hf_lrs("wsd", 20, 2, decay=0.25, decay_shape="1-sqrt")
    # Hugging Face counts the decay's progress from 0 at its first step: the peak lasts one step longer than ours
    assert wsd[2:16] == [1.0] * 14 and 0 < wsd[19] < wsd[16] < 1.0 and all(a >= b for a, b in zip(wsd[15:], wsd[16:]))
    assert _hf_lrs("constant", 10, 2)[2:] == [1.0] * 8


def test_finetune_commands_offer_the_schedules(capsys, tmp_path):
    for command, kinds in ((["finetune", "lm"], "{cosine,wsd,constant}"),
                           (["finetune", "glue"], "{linear,cosine,wsd,constant}")):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        assert f"--schedule {kinds}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["finetune", "lm", "--schedule", "triangle", "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and "--schedule" in capsys.readouterr().err



def test_decay_from_branches_a_stable_phase_checkpoint_into_a_new_run(tiny_config, tmp_path, capsys):
    """`pretrain --decay-from RUN/checkpoints/step_K --out NEW --steps K+D --decay D`: NEW is the run planned with
    that decay from the start, and RUN is left as it was (it goes on at the peak)."""
    from gwt_optim.toolkit.checkpoint import list_checkpoints

    stable = tiny_config(out=str(tmp_path / "stable"), steps=8, warmup=2, schedule="wsd", decay=0, save_every=3)
    train(stable)
    before = sorted((p.relative_to(stable.out), p.read_bytes()) for p in Path(stable.out).rglob("*") if p.is_file())
    step6 = [c for c in list_checkpoints(stable.out) if c.name.endswith("06")][0]
    new = tmp_path / "decayed6"
    assert main(["pretrain", "--decay-from", str(step6), "--out", str(new), "--steps", "9", "--decay", "3"]) == 0
    planned = tiny_config(out=str(tmp_path / "planned"), steps=9, warmup=2, schedule="wsd", decay=3)
    train(planned)
    assert _losses(new) == _losses(planned.out) and _lrs(new) == _lrs(planned.out)
    assert _same_weights(new, Path(planned.out))
    after = sorted((p.relative_to(stable.out), p.read_bytes()) for p in Path(stable.out).rglob("*") if p.is_file())
    assert after == before
    # a folder that holds files, or a path that is not a checkpoint: one line, exit 2, nothing written
    capsys.readouterr()
    assert main(["pretrain", "--decay-from", str(step6), "--out", str(new), "--steps", "9"]) == 2
    assert main(["pretrain", "--decay-from", str(tmp_path), "--out", str(tmp_path / "x"), "--steps", "9"]) == 2
    err = capsys.readouterr().err
    assert "already holds files" in err and "not a checkpoint folder" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
