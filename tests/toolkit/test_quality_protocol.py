"""The pure logic of the quality protocol (benchmarks/_protocol.py), without training:
the one-epoch step cap, tuning/reporting seed separation, best-lr selection, the
specs of each view, the gap computation, its tables and verdicts (benchmarks/_report.py),
and the plot redrawn from JSON."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "_protocol.py"
_spec = importlib.util.spec_from_file_location("_quality_protocol", _PATH)
P = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = P
_spec.loader.exec_module(P)
import _report as R  # noqa: E402 - benchmarks/ is on the path once the protocol is loaded


# ----------------------------------------------------------------------------- budget


def test_steps_are_capped_at_one_epoch():
    windows = 3735  # the demo split at seq 256
    for batch in (8, 32, 128):
        steps, epochs, capped = P.cap_steps(windows, batch)
        assert steps == windows // batch and steps * batch <= windows and not capped
        assert epochs == pytest.approx(steps * batch / windows) and epochs <= 1
    assert P.cap_steps(windows, 8, epochs=0.5)[0] == int(0.5 * windows) // 8
    steps, epochs, capped = P.cap_steps(windows, 128, steps=1000)  # asked for more than one epoch
    assert (steps, capped) == (29, True) and epochs <= 1
    assert P.cap_steps(windows, 8, steps=3) == (3, 24 / windows, False)
    with pytest.raises(ValueError):
        P.cap_steps(windows, 8, epochs=1.5)
    with pytest.raises(ValueError):
        P.cap_steps(100, 128)  # not even one step in an epoch


def test_batch_and_micro_batch():
    assert P.batch_for(8192, 256) == 32
    with pytest.raises(ValueError):
        P.batch_for(1000, 256)
    assert P.micro_batch_for(32, None) is None and P.micro_batch_for(32, 64) is None
    assert P.micro_batch_for(32, 16) == 16 and P.micro_batch_for(24, 10) == 8


def test_same_token_budget_for_every_batch():
    base = {"seq_len": 256}
    setting = P.Setting(base, windows=3735)
    shapes = [setting.for_tokens(T) for T in (2048, 8192, 32768)]
    assert [s["steps"] for s in shapes] == [466, 116, 29]
    assert all(s["steps"] * s["batch_size"] <= 3735 for s in shapes)


# ----------------------------------------------------------------------------- specs


def test_specs_of_each_view():
    assert P.run_spec("gwt-adamw:level=2", "paper", lr=1e-2) == "gwt-adamw:level=2:scale=0.25"
    assert P.run_spec("galore:rank=32", "paper", lr=1e-2) == "galore:rank=32:scale=0.25"
    assert P.run_spec("adam8bit", "paper", lr=1e-2) == "adam8bit:scale=1"
    assert P.run_spec("gwt-adamw:level=2:lr=5", "fair", lr=1e-2, regular_lr=3e-3) == \
        "gwt-adamw:level=2:scale=1:regular_lr=0.003"
    # AdamW at lr == regular lr is AdamW over the whole model: the regular-lr tuning run itself
    assert P.run_spec("adamw", "fair", lr=3e-3, regular_lr=3e-3) == P.run_spec("adamw", "paper", lr=0) == \
        "adamw:scale=1"
    assert P.run_spec("adamw", "fair", lr=1e-2, regular_lr=3e-3) == "adamw:scale=1:regular_lr=0.003"
    assert P.run_spec("gwt-adamw", "fair", lr=1, regular_lr=2, gwt_options="backend=eager") == \
        "gwt-adamw:scale=1:regular_lr=2:backend=eager"
    assert P.run_spec("muon", "fair", lr=1, regular_lr=2, gwt_options="backend=eager") == "muon:scale=1:regular_lr=2"
    # the library default (detail_clip 0.5) and the paper's update at each level and eps
    assert P.regime_specs([1, 2], ["1e-8", "1e-6"]) == [
        "gwt-adamw:level=1", "gwt-adamw:level=1:detail_clip=none", "gwt-adamw:level=1:detail_clip=none:eps=1e-6",
        "gwt-adamw:level=2", "gwt-adamw:level=2:detail_clip=none", "gwt-adamw:level=2:detail_clip=none:eps=1e-6"]
    assert P.with_baseline(["gwt-adamw:level=2", "adamw:lr=1e-3"]) == ["adamw", "gwt-adamw:level=2"]


# ----------------------------------------------------------------------------- selection and statistics


def test_best_lr_ignores_failures_and_breaks_ties_low():
    nan = float("nan")
    assert P.best_lr({1e-3: [5.0, 5.2], 3e-3: [4.9, 5.0], 1e-2: [nan, nan]}) == (3e-3, pytest.approx(4.95))
    assert P.best_lr({1e-3: [5.0], 3e-3: [5.0]})[0] == 1e-3
    assert P.best_lr({1e-3: [nan], 3e-3: [math.inf]}) == (None, None)
    assert P.best_lr({1e-3: [nan, 6.0], 3e-3: [5.5]})[0] == 3e-3  # a failed seed is left out of the mean


def test_paired_gap_uses_common_seeds():
    g = P.paired_gap({1: 5.1, 2: 5.3, 3: float("nan")}, {1: 5.0, 2: 5.0, 3: 5.0})
    assert g["n"] == 2 and g["seeds"] == [1, 2]
    assert g["mean"] == pytest.approx(0.2) and g["std"] == pytest.approx(math.sqrt(0.02))


def test_seeds_must_be_apart():
    with pytest.raises(ValueError):
        P.split_seeds([0, 1], [1, 2])
    P.split_seeds([0], [1, 2, 3])


# ----------------------------------------------------------------------------- a whole study on a fake runner


def _loss(job) -> float:
    """A made-up landscape: AdamW best at 3e-3; GWT best at 1e-2 and 0.1 worse; seed noise."""
    name, opts = P.parse_spec(job.spec)
    best = 1e-2 if name.startswith("gwt") else 3e-3
    if name == "adamw" and "regular_lr" not in opts:  # the whole-model AdamW grid
        best = 3e-3
    extra = 0.1 if name.startswith("gwt") else 0.0
    return 4.5 + extra + (math.log10(job.lr / best)) ** 2 + 0.01 * job.seed


class FakeRunner:
    def __init__(self, fail=()):
        self.jobs = []
        self.fail = set(fail)

    def run_all(self, jobs):
        out = {}
        for j in jobs:
            self.jobs.append(j)
            bad = j.spec in self.fail
            out[j] = {"status": "failed" if bad else "ok", "val_loss": float("nan") if bad else _loss(j),
                      "state_bytes": 1 << 20, "epochs": 1.0, "wall_s": 1.0, "error": "boom" if bad else None}
        return out


def _study(view="fair"):
    return P.Study(view, 8192, ["adamw", "gwt-adamw:level=2", "galore:rank=32"],
                   shape={"batch_size": 32, "steps": 116, "epochs": 0.99, "seq_len": 256})


def test_fair_study_tunes_then_reports_on_separate_seeds():
    runner = FakeRunner(fail={"galore:rank=32:scale=1:regular_lr=0.003"})
    lrs, tune, report = [1e-3, 3e-3, 1e-2, 3e-2], [0], [1, 2, 3]
    res = P.run_study(_study(), runner, lrs=lrs, tune_seeds=tune, report_seeds=report)
    assert res["regular_lr"] == 3e-3
    tuned_specs = {j.spec for j in runner.jobs if j.seed in tune}
    assert all("regular_lr=0.003" in s or s == "adamw:scale=1" for s in tuned_specs)
    # the reporting runs are exactly the best lr of each contender on the reporting seeds
    reported = [j for j in runner.jobs if j.seed in report]
    assert {j.seed for j in reported} == set(report)
    assert {(j.spec, j.lr) for j in reported} == {("adamw:scale=1", 3e-3),
                                                  ("gwt-adamw:level=2:scale=1:regular_lr=0.003", 1e-2)}
    tuning = [j for j in runner.jobs if j.seed in tune]
    # (the Runner runs a repeated job once) the regular-lr grid, AdamW's 3 other matrix lrs, GWT's 4, GaLore's 4
    assert len(set(tuning)) == 4 + 3 + 4 + 4
    assert len(reported) == 2 * 3 and {j.seed for j in runner.jobs} <= set(tune) | set(report)
    C = res["contenders"]
    assert C["adamw"]["best_lr"] == 3e-3 and C["gwt-adamw:level=2"]["best_lr"] == 1e-2
    assert C["gwt-adamw:level=2"]["gap"]["mean"] == pytest.approx(0.1)
    assert C["gwt-adamw:level=2"]["gap"]["std"] == pytest.approx(0.0, abs=1e-12)
    assert C["adamw"]["mean"] == pytest.approx(4.5 + 0.02) and C["adamw"]["std"] == pytest.approx(0.01)
    assert C["galore:rank=32"]["status"] == "failed" and C["galore:rank=32"]["best_lr"] is None

    md = "\n".join(R.study_tables(res))
    assert "| val loss | 4.7276 | **4.5000** | 4.7734 | 5.5000 |" in md  # the regular-lr grid, AdamW whole model
    assert "| gwt-adamw:level=2 | fair | 8192 | 116 | 1 | 0.01 | 0.003 | 4.6200 ± 0.0100 | +0.1000 ± 0.0000 |" in md
    v = "\n".join(R.verdicts(res))
    assert "MISSES the bar" in v and "incomplete: galore:rank=32" in v


def test_paper_study_uses_one_lr_and_the_papers_alpha():
    runner = FakeRunner()
    res = P.run_study(_study("paper"), runner, lrs=[1e-3, 1e-2], tune_seeds=[0], report_seeds=[1, 2])
    assert res["regular_lr"] is None
    assert {j.spec for j in runner.jobs} == {"adamw:scale=1", "gwt-adamw:level=2:scale=0.25",
                                            "galore:rank=32:scale=0.25"}
    assert res["contenders"]["gwt-adamw:level=2"]["alpha"] == 0.25


def test_remedy_verdict_reports_the_share_of_the_gap_closed():
    res = {"view": "fair", "tokens_per_step": 2048, "contenders": {
        "adamw": {"gap": None},
        "gwt-adamw:level=2": {"gap": {"mean": 0.4, "std": 0.01, "n": 3}},
        "gwt-adamw:level=2:detail_clip=0.5": {"gap": {"mean": 0.1, "std": 0.01, "n": 3}},
    }}
    v = "\n".join(R.verdicts(res))
    assert "closes 75% of gwt-adamw:level=2's gap" in v


# ----------------------------------------------------------------------------- plot from JSON


def test_plot_only_redraws_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    studies = []
    for T, gap in ((2048, 0.4), (8192, 0.1), (32768, 0.02)):
        studies.append({"view": "fair", "tokens_per_step": T, "contenders": {
            "adamw": {"gap": None},
            "gwt-adamw:level=2": {"gap": {"mean": gap, "std": 0.01, "n": 3}},
            "gwt-adamw:level=2:eps=1e-6": {"gap": {"mean": gap / 2, "std": 0.02, "n": 3}},
            "galore:rank=32": {"gap": {"mean": -0.2, "std": 0.01, "n": 3}},
        }})
    (tmp_path / "regime.json").write_text(json.dumps(
        {"studies": studies, "regime": {"specs": ["gwt-adamw:level=2", "gwt-adamw:level=2:eps=1e-6"]}}))
    pts = P.regime_points(P.load_reports([tmp_path / "regime.json"]), ["gwt-adamw:level=2"])
    assert pts == {"gwt-adamw:level=2": [(2048, 0.4, 0.01), (8192, 0.1, 0.01), (32768, 0.02, 0.01)]}
    png = tmp_path / "docs" / "gap.png"
    rc = P.main(["--plot-only", "--out", str(tmp_path), "--plot", str(png)], mode="regime", description="")
    assert rc == 0 and png.stat().st_size > 1000 and (tmp_path / "gap-vs-batch.png").is_file()


def test_gwt_options_go_only_where_the_registry_takes_them():
    assert P.run_spec("gwt-adamw:level=2", "fair", lr=1, regular_lr=2, gwt_options="backend=eager").endswith(
        ":backend=eager")
    # an entry without the option (plain AdamW) is not given it; the check reads the registry, not a list
    assert not P.accepts("adamw", "backend") and P.accepts("gwt-muon", "backend")
    assert "backend" not in P.run_spec("adamw", "fair", lr=1, regular_lr=2, gwt_options="backend=eager")
    assert P.run_spec("gwt-muon:level=2", "fair", lr=1, regular_lr=2, gwt_options="backend=eager").endswith(
        ":backend=eager")


def test_same_config_ignores_the_folder_and_fields_a_run_predates():
    from gwt_optim.toolkit.train import TrainConfig

    want = TrainConfig(out="/gpu/out/run", seed=1, lr=1e-3).to_dict()
    have = json.loads(json.dumps({**want, "out": "/here/run"}))
    assert P.same_config(have, want)
    assert not P.same_config({**have, "lr": 3e-3}, want)
    # a run finished by a resume is the same run (it was thrown aside and retrained before)
    assert P.same_config({**have, "resume": True, "progress": False}, want)
    # a field the finished run predates counts as equal only at its default
    assert P.same_config({k: v for k, v in have.items() if k != "grad_clip"}, want)  # default None
    assert not P.same_config({k: v for k, v in have.items() if k != "seed"}, want)  # 1, not the default 0


def test_grad_clip_and_weight_decay_reach_every_run(monkeypatch, capsys):
    seen = {}

    def stop(base):  # the runs' shared config, as main built it; stop before any data is prepared
        seen.update(base)
        raise RuntimeError("stop here")

    monkeypatch.setattr(P, "prepare_data", stop)
    assert P.main(["--grad-clip", "1", "--weight-decay", "0.1", "--no-preflight"], mode="quality",
                  description="") == 2
    assert seen["grad_clip"] == 1.0 and seen["weight_decay"] == 0.1
    seen.clear()
    assert P.main(["--grad-clip", "-1"], mode="quality", description="") == 2
    assert not seen and "--grad-clip must be a number > 0" in capsys.readouterr().err
