"""Quality at a real budget (issue 18): the ``pysrc`` corpus builder on local
sdists, its offline failure, the beta1/beta2 spec options, the budget mode's
pure logic, and one smoke budget end to end."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("_budget", ROOT / "benchmarks" / "_budget.py")
B = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = B
_spec.loader.exec_module(B)


# ----------------------------------------------------------------------------- the corpus


def _sdist(folder: Path, name: str, files: dict[str, str]) -> Path:
    path = folder / f"{name}-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-1.0/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def sdists(tmp_path, monkeypatch):
    monkeypatch.setenv("GWT_OPTIM_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "index"
    src.mkdir()
    body = "def f(x):\n    '''Return x, doubled, for the test corpus.'''\n    return 2 * x\n"
    files_a = {f"pkg/mod{i}.py": body + f"# module {i}\n" for i in range(200)}
    files_a.update({"LICENSE.txt": "the same licence text in both packages " * 4,
                    "docs/intro.rst": "Introduction\n============\n\nSome prose about the package. " * 5,
                    "pkg/data.bin.py": "x = '\0'\n" * 20, "pkg/tiny.py": "x = 1\n",
                    "pkg/image.png": "not text"})
    files_b = {f"lib/m{i}.py": body + f"# other {i}\n" for i in range(100)}
    files_b["LICENSE.txt"] = files_a["LICENSE.txt"]
    paths = {"a": _sdist(src, "a", files_a), "b": _sdist(src, "b", files_b)}
    from gwt_optim.toolkit.data import pysrc

    pinned = (pysrc.Sdist("a", "1.0", _sha(paths["a"])), pysrc.Sdist("b", "1.0", _sha(paths["b"])))

    def download(sd, dest):
        target = dest / paths[sd.name].name
        target.write_bytes(paths[sd.name].read_bytes())
        return target

    return pysrc, pinned, download


def test_the_corpus_is_split_by_source_file_and_deduplicated(sdists):
    pysrc, pinned, download = sdists
    folder = pysrc.build(pinned, download=download, progress=False)
    rows = {s: [json.loads(line) for line in (folder / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "validation")}
    train_src = {r["source"] for r in rows["train"]}
    val_src = {r["source"] for r in rows["validation"]}
    assert rows["validation"] and not train_src & val_src  # no validation document shares a source file
    assert all(pysrc.in_validation(s) for s in val_src) and not any(pysrc.in_validation(s) for s in train_src)
    texts = [r["text"] for s in rows for r in rows[s]]
    assert len(texts) == len(set(texts))  # the shared licence is kept once
    assert not any(s.endswith(("tiny.py", "data.bin.py", ".png")) for s in train_src | val_src)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["documents"] == {"train": len(rows["train"]), "validation": len(rows["validation"])}
    assert [s["sha256"] for s in manifest["sdists"]] == [p.sha256 for p in pinned]
    # built once: a second call downloads nothing
    assert pysrc.build(pinned, download=lambda *a: pytest.fail("downloaded again"), progress=False) == folder


def test_a_checksum_mismatch_is_refused_and_leaves_nothing(sdists):
    pysrc, pinned, download = sdists
    bad = (pinned[0], pysrc.Sdist("b", "1.0", "0" * 64))
    with pytest.raises(ValueError, match="expected 0000"):
        pysrc.build(bad, download=download, progress=False)
    assert not pysrc.corpus_dir(bad).exists()
    assert not any(p.name.startswith(".pysrc") for p in pysrc.corpus_dir(bad).parent.iterdir())


def test_offline_the_corpus_fails_fast_in_one_line(tmp_path):
    env = {**os.environ, "GWT_OPTIM_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path), "PIP_CONFIG_FILE": os.devnull}
    proc = subprocess.run([sys.executable, "-m", "gwt_optim", "pretrain", "--data", "pysrc", "--steps", "1",
                           "--out", str(tmp_path / "run"), "--no-progress"], capture_output=True, text=True,
                          env=env, timeout=900)  # a cap for a hang only: a loaded machine may take minutes
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]  # the rest: its progress bar
    assert len(errors) == 1 and "pysrc" in errors[0] and "PyPI" in errors[0] and "Traceback" not in proc.stderr
    # Fast, counted rather than timed: it stops at the first sdist it cannot get, without trying the others.
    from gwt_optim.toolkit.data.pysrc import PINNED

    named = [sd.name for sd in PINNED if f"{sd.name}=={sd.version}" in proc.stderr]
    assert named == [PINNED[0].name], proc.stderr


# ----------------------------------------------------------------------------- beta options


def test_beta_options_set_the_betas_of_every_group():
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer, parse_optimizer_arg

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    for spec, want in [("adamw:beta2=0.95", (0.9, 0.95)), ("gwt-adamw:level=1:beta1=0.8:beta2=0.99", (0.8, 0.99)),
                       ("gwt-adamw:level=1", (0.9, 0.999))]:
        name, opts = parse_optimizer_arg(spec)
        opt = build_optimizer(name, model, OptimizerConfig(lr=1e-3, options=opts, regular_lr=3e-3))
        assert {tuple(g["betas"]) for g in opt.param_groups} == {want}, spec
    # Adafactor's own beta1 stays its own option, not AdamW's betas
    name, opts = parse_optimizer_arg("gwt-adafactor:level=1:beta1=0.9")
    opt = build_optimizer(name, model, OptimizerConfig(lr=1e-3, options=opts))
    assert {g["beta1"] for g in opt.param_groups} == {0.9}


@pytest.mark.parametrize("spec", ["adamw:beta2=1.0", "adamw:beta1=-0.1", "gwt-adamw:beta2=x", "muon:beta2=true"])
def test_bad_beta_options_are_value_errors(spec):
    from gwt_optim.toolkit.registry import parse_optimizer_arg

    with pytest.raises(ValueError, match="beta"):
        parse_optimizer_arg(spec)


# ----------------------------------------------------------------------------- budget logic


def test_tokens_to_reach_interpolates_between_validations():
    curve = [(100, 5.0), (200, 4.0), (300, 3.0)]
    assert B.tokens_to_reach(curve, 4.0) == 200
    assert B.tokens_to_reach(curve, 3.5) == pytest.approx(250)
    assert B.tokens_to_reach(curve, 6.0) == 100
    assert B.tokens_to_reach(curve, 2.9) is None
    assert B.parse_tokens("16M") == 16_000_000 and B.parse_tokens("64K") == 64_000 and B.parse_tokens("8192") == 8192
    with pytest.raises(ValueError):
        B.parse_tokens("lots")


def _report(gwt_final: float, frozen: float) -> dict:
    def runs(final, seeds=(1, 2)):
        return [{"seed": s, "val_loss": final + 0.01 * s, "status": "ok", "state_bytes": 2**20,
                 "curve": [(1000, final + 1), (2000, final + 0.01 * s)]} for s in seeds]

    return {"budget_tokens": 2000, "contenders": {
        "adamw": {"runs": runs(3.0), "mean": 3.015, "edge": False, "lrs": [1e-3, 3e-3, 1e-2], "best_lr": 3e-3},
        "gwt-adamw:level=2": {"runs": runs(gwt_final), "mean": gwt_final + 0.015, "edge": True,
                              "lrs": [1e-3, 3e-3], "best_lr": 3e-3}},
        "frozen": {"runs": [{"seed": 1, "val_loss": frozen}]}}


def test_an_interim_report_measures_the_seed_mean_speedup_on_the_seeds_both_finished():
    """Seeds 3-4 still running (their curves partial): the seed-mean speedup is taken on seeds 1-2, against
    AdamW's mean on seeds 1-2, as the paired gap is; a diverged seed leaves it unreached."""
    def runs(final, done=(1, 2), todo=(3, 4)):
        return [{"seed": s, "val_loss": final + 0.01 * s, "status": "ok",
                 "curve": [(1000, final + 1), (2000, final + 0.01 * s)]} for s in done] + [
            {"seed": s, "val_loss": None, "status": "missing", "curve": [(1000, final + 0.5)]} for s in todo]

    base = {"runs": runs(3.0), "mean": 3.015}
    vs = B._against({"runs": runs(2.5)}, base, 2000)
    # seeds 1-2: the mean curve 3.5 -> 2.515 reaches AdamW's 3.015 at 1000 + 1000 * 0.485 / 0.985 tokens
    reach = 1000 + 1000 * 0.485 / 0.985
    assert vs["gap"]["n"] == 2 and vs["tokens_to_target"] == pytest.approx(reach)
    assert vs["speedup"] == pytest.approx(2000 / reach)
    diverged = runs(2.5)
    diverged[1].update(val_loss=float("nan"), status="diverged", curve=[(1000, 3.5)])
    assert B._against({"runs": diverged}, base, 2000)["speedup"] is None


def test_gaps_speedups_and_gates():
    out = _report(2.5, 3.2)
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    g = out["contenders"]["gwt-adamw:level=2"]
    assert g["gap"]["mean"] == pytest.approx(-0.5) and g["gap"]["n"] == 2
    assert g["speedup"] > 1.0 and out["contenders"]["adamw"]["speedup"] == pytest.approx(1.0)
    assert out["gates"]["a"] == {"adamw": True, "gwt-adamw:level=2": False}
    assert out["gates"]["b"]["margin"] == pytest.approx(3.2 - 3.01) and not out["gates"]["b"]["pass"]
    slow = _report(3.5, 4.0)
    B.analyse(slow, 0.3)
    assert slow["contenders"]["gwt-adamw:level=2"]["speedup"] is None  # never reaches AdamW's loss
    assert slow["gates"]["b"]["pass"]


def test_each_gwt_family_is_also_measured_against_the_optimizer_it_transforms():
    # GWT-Adafactor against Adafactor stands for GWT-Muon against Muon (the report's use).
    out = _report(2.5, 3.2)
    C = out["contenders"]
    def runs(curve_mid: float, finals: tuple[float, float]) -> list[dict]:
        return [{"seed": s, "val_loss": v, "curve": [(1000, curve_mid), (2000, v)]} for s, v in zip((1, 2), finals)]

    C["adafactor"] = {"runs": runs(3.0, (2.4, 2.6)), "mean": 2.5, "n": 2, "lrs": [1e-2], "best_lr": 1e-2}
    C["gwt-adafactor:level=2"] = {"runs": runs(2.8, (2.3, 2.4)), "mean": 2.35, "n": 2, "lrs": [1e-2], "best_lr": 1e-2}
    assert B.family_base("gwt-adafactor:level=2", list(C)) == "adafactor"
    assert B.family_base("gwt-adamw:level=2", list(C)) == "adamw" and B.family_base("adafactor", list(C)) is None
    # Not Adafactor at its own defaults: no pair.
    assert B.family_base("gwt-adafactor:level=2", ["adamw", "adafactor:beta2=0.95"]) is None
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    v = C["gwt-adafactor:level=2"]["vs_family"]
    assert v["base"] == "adafactor" and v["gap"]["mean"] == pytest.approx(-0.15) and v["gap"]["n"] == 2
    # Its seed-mean curve (2.8 at 1000, 2.35 at 2000) crosses Adafactor's mean final loss 2.5 two thirds of the way.
    assert v["tokens_to_target"] == pytest.approx(1000 + 1000 * 0.3 / 0.45)
    assert v["speedup"] == pytest.approx(2000 / v["tokens_to_target"])
    # AdamW's own family is the main table; it is not repeated.
    assert C["gwt-adamw:level=2"]["vs_family"] is None and C["adafactor"]["vs_family"] is None
    # The speedup against AdamW is unchanged by the pairing.
    assert C["gwt-adafactor:level=2"]["gap"]["mean"] == pytest.approx(2.35 - 3.015)
    out.update(setting=_SETTING, train_tokens=1, beta2s=[0.999], jobs=1, threads=1, command="c",
               environment={})
    for t in C.values():
        t.setdefault("std", 0.0)
        t.setdefault("n", len(t["runs"]))
    text = B.render({**out, "budget": {**out, "tokens_per_step": 1, "steps": 2, "tune_steps": 1, "regular_lr": 3e-3,
                                        "grids": {}, "tune_seeds": [0], "report_seeds": [1, 2]}})
    row = next(line for line in text.splitlines() if line.startswith("| gwt-adafactor:level=2 | adafactor |"))
    # Paired differences -0.1 and -0.2: std 0.0707, and with one degree of freedom a 95% t of 12.706.
    assert "-0.1500 ± 0.6353 (n=2)" in row and f"{v['speedup']:.2f}x" in row
    # Per seed, each curve against Adafactor's loss on the same seed: 2000/1800 and 2000/1500.
    sp = v["speedup_paired"]
    assert sp["reached"] == sp["of"] == 2 and sp["mean"] == pytest.approx((2000 / 1800 + 2000 / 1500) / 2)
    assert f"{sp['mean']:.2f}× ± {sp['half']:.2f}" in row


def test_the_default_is_judged_against_the_papers_update_and_adamw_with_the_interval():
    v = B.bar_verdict
    assert v({"mean": 0.05, "ci": 0.01}, 0.02) == "failed"  # the whole interval above the bar
    assert v({"mean": 0.03, "ci": 0.02}, 0.02) == "not met"  # above on the mean, not significantly
    assert v({"mean": 0.01, "ci": 0.02}, 0.02) == "met" and v({"mean": 0.01, "ci": None}, 0.02) == "met"
    assert v({"mean": 0.0, "ci": 0.01}, 0.02) == "shown" and v({"mean": float("nan")}, 0.02) is None
    out = _report(2.5, 3.2)  # the default: 2.51 and 2.52 on seeds 1 and 2, AdamW 3.01 and 3.02
    C = out["contenders"]
    C["gwt-adamw:level=2"]["edge"] = False  # (the fixture's grid is on its edge: see below)
    C["gwt-adamw:level=2:detail_clip=none"] = {
        "runs": [{"seed": 1, "val_loss": 2.7, "curve": []}, {"seed": 2, "val_loss": 2.9, "curve": []}],
        "mean": 2.8, "std": 0.14, "n": 2, "lrs": [1e-3], "best_lr": 1e-3}
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    d = C["gwt-adamw:level=2"]["default"]
    assert d["paper"] == "gwt-adamw:level=2:detail_clip=none" and d["vs_paper"]["mean"] == pytest.approx(-0.285)
    # against the paper's update: -0.19 and -0.38, below 0 on the mean, the interval (one df) reaching past it
    assert d["bars"] == {"paper": "met", "adamw": "shown"} and d["stays"] is True
    assert "default" not in C["gwt-adamw:level=2:detail_clip=none"] and "default" not in C["adamw"]
    out.update(setting=_SETTING, train_tokens=1, beta2s=[0.999], jobs=1, threads=1, command="c", environment={})
    for t in C.values():
        t.setdefault("std", 0.0)
        t.setdefault("n", len(t["runs"]))
    text = B.render({**out, "budget": {**out, "tokens_per_step": 1, "steps": 2, "tune_steps": 1, "regular_lr": 3e-3,
                                        "grids": {}, "tune_seeds": [0], "report_seeds": [1, 2]}})
    assert "| gwt-adamw:level=2 | adamw | -0.5000 ± 0.0000 (n=2) | ≤ +0.02 | shown |" in text
    assert "gwt-adamw:level=2: **the default stays**." in text
    C["gwt-adamw:level=2"]["runs"][0]["val_loss"] = 3.05  # 0.04 and 0.08 behind AdamW: 0.06 on the mean
    C["gwt-adamw:level=2"]["runs"][1]["val_loss"] = 3.1
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    assert C["gwt-adamw:level=2"]["default"]["bars"]["adamw"] == "not met"
    assert C["gwt-adamw:level=2"]["default"]["stays"] is False
    C["gwt-adamw:level=2:detail_clip=none"].update(edge=True, lrs=[5e-4, 1e-3])  # its best lr on an edge
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    d = C["gwt-adamw:level=2"]["default"]
    assert d["stays"] is None and d["edge"] == ["gwt-adamw:level=2:detail_clip=none"]
    C["gwt-adamw:level=2:detail_clip=none"].update(edge=False, runs=[])  # not run yet: no verdict
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    assert C["gwt-adamw:level=2"]["default"]["stays"] is None


def test_the_paired_delta_along_the_run_uses_the_seeds_both_sides_finished():
    base = [{"seed": s, "val_loss": 3.0, "curve": [(100, 5.0), (200, 4.0), (300, 3.0)]} for s in (1, 2, 3)]
    runs = [{"seed": 1, "val_loss": 2.9, "curve": [(100, 4.8), (200, 4.0), (300, 2.9)]},
            {"seed": 2, "val_loss": 3.1, "curve": [(100, 4.6), (200, 4.2), (300, 3.1)]},
            {"seed": 3, "val_loss": float("nan"), "curve": [(100, 9.0)]},  # cut short: left out
            {"seed": 4, "val_loss": 2.0, "curve": [(100, 1.0), (300, 2.0)]}]  # AdamW has no seed 4
    d = B.paired_delta_curve(runs, base)
    assert [x for x, _ in d] == [100, 200, 300] and all(v["n"] == 2 for _, v in d)
    assert d[0][1]["mean"] == pytest.approx(-0.3) and d[1][1]["mean"] == pytest.approx(0.1)
    # -0.1 and +0.1 at the end: std 0.1414, and with one degree of freedom a 95% t of 12.706
    assert d[2][1]["mean"] == pytest.approx(0.0) and d[2][1]["half"] == pytest.approx(12.706 * 0.1, rel=1e-4)
    assert B.paired_delta_curve(runs[2:3], base) == [] and B.paired_delta_curve(runs, []) == []


def test_budget_to_match_interpolates_in_log_tokens():
    pts = [(4e6, 3.2), (8e6, 3.0), (16e6, 2.9)]
    tokens, how = B.budget_to_match(pts, 3.1)
    assert how == "interpolated" and tokens == pytest.approx((4e6 * 8e6) ** 0.5)  # halfway in log tokens
    tokens, how = B.budget_to_match(pts, 2.8)  # better than AdamW at the largest budget: along the last segment
    assert how == "extrapolated" and tokens == pytest.approx(32e6)
    assert B.budget_to_match(pts, 3.4) == (pytest.approx(2e6), "extrapolated")  # worse than AdamW at the least
    assert B.budget_to_match([(4e6, 3.0), (8e6, 3.1)], 2.9) == (None, "")  # more data did not help: no answer
    assert B.budget_to_match(pts[:1], 3.0) == (None, "")
    out = {"budget_tokens": 16, "contenders": {
        "adamw": {"runs": [{"seed": 1, "val_loss": 2.9}, {"seed": 2, "val_loss": 2.9}, {"seed": 3, "val_loss": 9}]},
        "gwt-adamw:level=2": {"runs": [{"seed": 1, "val_loss": 2.95}, {"seed": 2, "val_loss": 3.05}]}},
        "match": {"seeds": [1, 2], "budgets": [{"tokens": 8, "runs": [{"seed": 1, "val_loss": 3.0},
                                                                      {"seed": 2, "val_loss": 3.0}]}]}}
    B._data_to_match(out)  # the 1x point is AdamW's mean on the match seeds alone (seed 3 is left out)
    assert out["match"]["points"] == [(8, 3.0), (16, 2.9)]
    d = out["contenders"]["gwt-adamw:level=2"]["data_to_match"]
    assert d["how"] == "interpolated" and d["ratio"] == pytest.approx(0.5)
    assert out["contenders"]["adamw"]["data_to_match"]["ratio"] == pytest.approx(1.0)
    for bad in ("1", "0,0.5", "-1", "0.5,0.5"):
        with pytest.raises(ValueError, match="--match-budgets"):
            B.match_fractions_of(bad)
    assert B.match_seeds_of(None, [1, 2, 3]) == [1, 2]
    with pytest.raises(ValueError, match="--match-seeds"):
        B.match_seeds_of("5", [1, 2, 3])


def test_t_interval_and_the_weight_decay_axis():
    assert B.t_interval([1.0, 2.0, 3.0, 4.0]) == pytest.approx({"mean": 2.5, "half": 3.182 * 1.2910 / 2, "n": 4},
                                                               rel=1e-4)
    assert B.t_interval([0.5])["half"] is None and B.t_interval([])["mean"] is None
    assert B.t_interval([0.0] * 41)["half"] == 0.0  # past the table: the normal quantile
    assert B.with_weight_decay("adamw:beta2=0.999", 0.1) == "adamw:beta2=0.999:weight_decay=0.1"
    assert B.with_weight_decay("gwt-adamw:level=2", None) == "gwt-adamw:level=2"  # the lr grid keeps its folders
    assert B.weight_decays_of("0,0.1") == [0.0, 0.1] and B.weight_decays_of("0.1,0", 0.1) == [0.1, 0.0]
    for bad, base in (("0,0", 0.0), ("0.1,0", 0.0), ("0,-1", 0.0), ("", 0.0)):
        with pytest.raises(ValueError, match="--weight-decays"):
            B.weight_decays_of(bad, base)


def test_the_report_says_which_commit_each_run_started_from(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert B.run_commits(run) == []  # not started
    (run / "environment.json").write_text(json.dumps(
        {"git_commit": "d571fd1", "earlier": [{"git_commit": None}, {"git_commit": "7cc90cd"}]}))
    assert B.run_commits(run) == [None, "7cc90cd", "d571fd1"]
    runs = [{"commits": [None, "7cc90cd", "d571fd1"]}, {"commits": ["2acb08f"]}, {"commits": []}]
    budget = {"contenders": {"adamw": {"runs": runs[:2]}}, "frozen": {"runs": runs[2:]},
              "match": {"budgets": [{"runs": [{"commits": ["2acb08f", "2acb08f"]}]}]}}
    assert B._code_line(budget) == ("Code: reporting runs started from not recorded (1), 2acb08f (2); 1 of them "
                                    "resumed under another commit (each run's environment.json has the list).")


def test_a_best_lr_on_an_edge_extends_the_grid_past_it():
    import math
    from concurrent.futures import Future
    from types import SimpleNamespace

    assert B.beyond_edge([1e-3, 2e-3, 4e-3], 4e-3) == 8e-3 and B.beyond_edge([1e-3, 2e-3, 4e-3], 1e-3) == 5e-4
    assert B.beyond_edge([1e-3, 3e-3, 1e-2], 1e-2) == 3.3e-2

    class Pool:  # a tuning run's final loss is a parabola in log lr around `best`: what a grid would measure
        def __init__(self, best):
            self.best, self.ran = best, []

        def submit(self, job, priority):
            assert priority == (B.Budget.TUNE,)
            self.ran.append(job.lr)
            done = Future()
            done.set_result({"val_loss": 2.5 + math.log(job.lr / self.best) ** 2, "status": "ok"})
            return done

    def tune(best, extend):
        b = object.__new__(B.Budget)
        b.args, b.T, b.R, b.tuner = SimpleNamespace(extend_edges=extend, weight_decay=0.0), 128, 3e-3, Pool(best)
        return b.tune("adamw", [1e-3, 2e-3, 4e-3], [0.999], [0]), b.tuner.ran

    t, ran = tune(9e-3, 2)  # past the top edge: one more lr (8e-3), then 1.6e-2 shows that 8e-3 is inside
    assert ran == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2] and t["best_lr"] == 8e-3 and not t["edge"] and t["extended"] == 2
    assert list(t["grid"]["0.999"]) == [B.P.fmt_lr(x) for x in (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)]
    t, ran = tune(1e-4, 1)  # below the grid and only one extension allowed: still on the edge, and it says so
    assert ran == [1e-3, 2e-3, 4e-3, 5e-4] and t["best_lr"] == 5e-4 and t["edge"] and t["extended"] == 1
    t, ran = tune(2e-3, 3)  # inside: nothing added
    assert ran == [1e-3, 2e-3, 4e-3] and t["best_lr"] == 2e-3 and t["extended"] == 0
    assert tune(9e-3, 0)[0]["edge"]  # the default: the grid as given


def test_waiting_runs_start_tuning_first_then_seed_by_seed_then_the_match_runs(tmp_path):
    """One worker, held while a study queues: AdamW's and GWT-AdamW's reporting seeds, AdamW's data-to-match
    seeds, then a tuning run and a re-tuning run (of a ``--prior-best``). The tuning run goes first, then each
    seed's runs of both contenders before the next seed's (an interim report is paired) up to the three an
    interval needs, the re-tuning, the match runs, and last the fourth seed."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from _waiting import wait_for

    from gwt_optim.toolkit.runner import PriorityPool

    pool, gate, started, queued = PriorityPool(1), threading.Event(), [], []
    held = pool.submit(gate.wait)

    class Stage:  # a runner of one stage on the shared pool
        def __init__(self, name):
            self.name = name

        def submit(self, job, priority):
            queued.append(job)
            return pool.submit(lambda: started.append((self.name, job.seed)) or {"val_loss": 2.5, "status": "ok"},
                               priority=priority)

        def run_dir(self, job):
            return tmp_path / "no-run"

    b = object.__new__(B.Budget)
    b.T, b.R, b.tuner, b.reporter, match = 128, 3e-3, Stage("tune"), Stage("report"), Stage("match")
    b.args = SimpleNamespace(report_seeds="1,2,3,4", weight_decay=0.0)
    with ThreadPoolExecutor(3) as stages:  # each waits for its own runs, as _stages's threads do
        calls = [stages.submit(b.report, "adamw", 2e-3, 0.999, [1, 2, 3, 4]),
                 stages.submit(b.report, "gwt-adamw:level=2", 6e-3, 0.999, [1, 2, 3, 4]),
                 stages.submit(b.report, "adamw", 2e-3, 0.999, [1, 2], runner=match)]
        wait_for(lambda: len(queued) == 10, "the reporting and match runs queued")
        b.submit_tune("adamw", [2e-3], [0.999], [0], rank=B.Budget.RETUNE)
        b.submit_tune("gwt-adamw:level=2", [6e-3], [0.999], [0])
        gate.set()
        assert [c.result()["n"] for c in calls] == [4, 4, 2] and held.result()
    pool.shutdown()
    assert started == ([("tune", 0)] + [("report", s) for s in (1, 1, 2, 2, 3, 3)] + [("tune", 0)]
                       + [("match", 1), ("match", 2), ("report", 4), ("report", 4)])


def _study(tmp_path, priors, *, tuning_finished=True, more=(), gate_seeds=(), wds=(0.0, 0.1)):
    """Stages 1-3 of a small study (AdamW, GWT-AdamW and the contenders ``more``, lrs 1e-3/2e-3/4e-3, weight
    decays 0 and 0.1, reporting seeds 1-2, frozen runs on ``gate_seeds``) on one held worker, with
    ``--prior-best`` ``priors``: (the report, the runs in the order they started, and in the order they were
    submitted, and the queueing and starts interleaved). A run's loss is least at lr 2e-3 and weight decay 0."""
    import math
    import threading
    from types import SimpleNamespace

    from gwt_optim.toolkit.runner import PriorityPool

    pool, gate, started, submitted, futs = PriorityPool(1), threading.Event(), [], [], {}
    events = []  # ("queued" | "started", (stage, spec, lr, seed)) in the order they happened
    held = pool.submit(gate.wait)

    class Stage:  # a runner of one stage on the shared pool; a run queued twice is queued once, as Runner does
        def __init__(self, name):
            self.name = name

        def submit(self, job, priority):
            def run():
                started.append((self.name, job.spec.split("@")[0], job.lr, job.seed))
                events.append(("started", (self.name, job.spec, job.lr, job.seed)))
                if self.name == "tune" and not tuning_finished:
                    return {"val_loss": float("nan"), "status": "missing"}
                decayed = "weight_decay" in job.spec
                return {"val_loss": 2.5 + math.log(job.lr / 2e-3) ** 2 + 0.01 * decayed, "status": "ok"}
            key = (self.name, job.spec, job.lr, job.seed)
            if key not in futs:
                submitted.append((self.name, job.spec.split(":")[0], job.lr, job.seed))
                events.append(("queued", key))
                futs[key] = pool.submit(run, priority=priority)
            return futs[key]

        def run_dir(self, job):
            return tmp_path / "no-run"

        def shutdown(self):
            pass

    b = object.__new__(B.Budget)
    b.T, b.R, b.tuner, b.reporter, b.matchers = 128, 3e-3, Stage("tune"), Stage("report"), {}
    b.args = args = SimpleNamespace(beta2=0.999, tune_only=False, extend_edges=0, prior_best=priors,
                                    report_seeds="1,2", weight_decay=wds[0])
    grids = {c: [1e-3, 2e-3, 4e-3] for c in ("adamw", "gwt-adamw:level=2", *more)}
    out = {"contenders": {}}
    study = threading.Thread(target=B._stages, args=(args, b, out, grids, [0.999], list(wds), [0], [1, 2],
                                                     list(gate_seeds), []))
    study.start()
    from _waiting import wait_for
    # the prior's reporting runs, every lr grid and the frozen runs, before the first run starts
    wait_for(lambda: sum(k[0] == "tune" for k in futs) >= 3 * len(grids)
             and sum(k[2] == B.FROZEN_LR for k in futs) == len(gate_seeds), "the first runs queued")
    gate.set()
    study.join(60)
    assert not study.is_alive() and held.result()
    pool.shutdown()
    return out, started, submitted, events


def test_a_run_names_any_nonzero_weight_decay_so_a_grid_at_0_1_never_takes_the_folders_of_one_at_0(tmp_path):
    """With the lr grid at weight decay 0.1 (--weight-decay 0.1 --weight-decays 0.1) every run's spec names it,
    the spec the weight-decay axis gives a run at 0.1: the folders differ from the runs at 0 and equal the
    axis's, whose runs are then reused rather than moved aside."""
    _, started, _, _ = _study(tmp_path, [], wds=[0.1])
    assert started and all("weight_decay=0.1" in spec for _, spec, _, _ in started)
    _, axis, _, _ = _study(tmp_path, [], wds=[0.0, 0.1])
    at_0_1 = {spec for _, spec, _, _ in axis if "weight_decay" in spec}
    assert at_0_1 and at_0_1 <= {spec for _, spec, _, _ in started}
    assert all(B.with_weight_decay(spec, None) == spec for _, spec, _, _ in axis if "weight_decay" not in spec)


def test_a_prior_best_runs_the_reporting_seeds_first_and_the_tuning_re_decides_it(tmp_path):
    """A study started over (its runs lost) gets its reporting seeds first, at the best an earlier tuning found;
    the tuning runs after them, and the report follows the tuning and says whether it agrees."""
    with pytest.raises(ValueError, match="prior-best"):
        B.priors_of(SimpleNamespace(prior_best=["muon=1e-3"], beta2=0.999), {"adamw": [1e-3]}, [0.999], [0.0])
    with pytest.raises(ValueError, match="weight decay"):
        B.priors_of(SimpleNamespace(prior_best=["adamw=1e-3,0.3"], beta2=0.999), {"adamw": [1e-3]}, [0.999],
                    [0.0, 0.1])
    with pytest.raises(ValueError, match="beta2"):
        B.priors_of(SimpleNamespace(prior_best=["adamw=1e-3"], beta2=None), {"adamw": [1e-3]}, [0.999], [0.0])
    out, started, submitted, _ = _study(tmp_path, ["adamw=2e-3", "gwt-adamw:level=2=4e-3,0.1"])
    first = [(stage, spec.split(":")[0], lr, seed) for stage, spec, lr, seed in started[:4]]
    assert first == submitted[:4] == [("report", "adamw", 2e-3, 1), ("report", "gwt-adamw", 4e-3, 1),
                                      ("report", "adamw", 2e-3, 2), ("report", "gwt-adamw", 4e-3, 2)]
    assert {stage for stage, *_ in started[4:12]} == {"tune"}  # both lr grids and weight decays
    C = out["contenders"]
    assert C["adamw"]["prior"] == {"lr": 2e-3, "wd": 0.0, "complete": True, "agrees": True}
    assert C["adamw"]["best_lr"] == 2e-3 and [r["val_loss"] for r in C["adamw"]["runs"]] == [2.5, 2.5]
    # GWT-AdamW's prior (4e-3, 0.1) is not what the tuning finds: it reports at the tuning's (2e-3, 0)
    g = C["gwt-adamw:level=2"]
    assert g["prior"]["complete"] and not g["prior"]["agrees"] and (g["best_lr"], g["best_wd"]) == (2e-3, 0.0)
    assert [r["val_loss"] for r in g["runs"]] == [2.5, 2.5] and started[-2:] == [
        ("report", g["runs"][0]["spec"].split("@")[0], 2e-3, 1), ("report", g["runs"][1]["spec"].split("@")[0],
                                                                  2e-3, 2)]
    # Between sessions (--report-only) the tuning runs are missing: reported at the prior best, and said so
    out, *_ = _study(tmp_path, ["adamw=2e-3", "gwt-adamw:level=2=4e-3,0.1"], tuning_finished=False)
    g = out["contenders"]["gwt-adamw:level=2"]
    assert (g["best_lr"], g["best_wd"], g["prior"]["complete"]) == (4e-3, 0.1, False) and g["mean"] > 2.5
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    assert out["gates"]["a"] == {"adamw": None, "gwt-adamw:level=2": None}  # not tuned yet: no verdict
    out.update(setting=_SETTING, train_tokens=1, beta2s=[0.999], jobs=1, threads=1, command="c", environment={})
    text = B.render({**out, "budget": {**out, "tokens_per_step": 1, "steps": 2, "tune_steps": 1, "regular_lr": 3e-3,
                                        "grids": {}, "tune_seeds": [0], "report_seeds": [1, 2],
                                        "weight_decays": [0.0, 0.1]}})
    assert "(lr 0.004, weight decay 0.1, `--prior-best`): the tuning here has not finished" in text
    assert "weight decay 0 on the lr grid, then tuned on 0, 0.1 at the best lr," in text  # not "weight decay 0"


def test_a_prior_best_is_re_tuned_last_and_adamws_frozen_run_goes_ahead_at_it(tmp_path):
    """The tuning that re-decides a --prior-best repeats figures an earlier tuning measured: a contender without
    a prior tunes and reports first, and gate (b)'s frozen run, which pairs with AdamW's best, runs at AdamW's
    prior best instead of waiting for AdamW's re-tuning (agreeing, it is the same run)."""
    out, started, _, events = _study(tmp_path, ["adamw=2e-3", "gwt-adamw:level=2=4e-3,0.1"], more=["muon"],
                                     gate_seeds=[1])
    prior = [("report", "adamw", 2e-3, 1), ("report", "gwt-adamw", 4e-3, 1), ("report", "adamw", 2e-3, 2),
             ("report", "gwt-adamw", 4e-3, 2)]
    name = [(stage, spec.split(":")[0], lr, seed) for stage, spec, lr, seed in started]
    assert name[:4] == prior
    assert name[4:7] == [("tune", "muon", lr, 0) for lr in (1e-3, 2e-3, 4e-3)]
    retune = [i for i, (stage, n, *_) in enumerate(name) if stage == "tune" and n != "muon"]
    muon = [i for i, (_, n, *_) in enumerate(name) if n == "muon"]
    assert len(retune) == 8 and len(muon) == 6  # 3 lrs and 1 weight decay each
    # No re-tuning run starts while a run of muon waits in the queue. (Which goes first when a muon run is
    # submitted only as the last one finishes is a race with the one worker here, where a run takes no time;
    # the queue's order is what the study decides.)
    waiting = set()
    for kind, (stage, spec, lr, seed) in events:
        if kind == "queued":
            waiting.add((stage, spec, lr, seed))
            continue
        waiting.discard((stage, spec, lr, seed))
        if stage == "tune" and not spec.startswith("muon"):
            assert not any(w[1].startswith("muon") for w in waiting), (spec, lr, sorted(waiting))
    assert name.count(("report", "adamw", B.FROZEN_LR, 1)) == 1 < name.index(("report", "adamw", B.FROZEN_LR, 1)) \
        < min(retune) and out["frozen"]["runs"][0]["val_loss"] > 2.5
    C = out["contenders"]
    assert C["adamw"]["prior"]["agrees"] and not C["gwt-adamw:level=2"]["prior"]["agrees"]
    assert [r["val_loss"] for r in C["muon"]["runs"]] == [2.5, 2.5] and C["muon"]["best_wd"] == 0.0


_SETTING = {"model": "m", "data": "d", "vocab_size": 1, "seq_len": 1, "warmup": 0, "min_lr_ratio": 0.1,
            "grad_clip": 1.0, "weight_decay": 0.0, "precision": "fp32", "device": "cpu"}


@pytest.mark.slow
def test_a_smoke_budget_end_to_end(tmp_path, tiny_model, corpus):
    out = tmp_path / "budget"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--budget", "512", "--data", corpus,
           "--model", tiny_model, "--vocab-size", "320", "--seq-len", "32", "--tokens-per-step", "128",
           "--val-tokens", "256", "--tune-steps", "2", "--evals", "2", "--contenders", "adamw,gwt-adamw:level=2",
           "--grid", "adamw=1e-3,3e-3", "--grid", "gwt-adamw:level=2=3e-3", "--beta2s", "0.95",
           "--report-seeds", "1", "--save-every", "2", "--match-budgets", "0.5", "--out", str(out), "--plot", ""]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "budget.json").read_text())
    C = report["budget"]["contenders"]
    assert report["budget"]["steps"] == 4 and report["budget"]["tune_steps"] == 2
    assert set(C) == {"adamw", "gwt-adamw:level=2"} and all(t["n"] == 1 for t in C.values())
    assert C["adamw"]["runs"][0]["curve"][-1][0] == 512  # validations at 256 and 512 tokens
    assert report["budget"]["frozen"]["runs"][0]["status"] == "ok"
    # The data-to-match run: AdamW at half the budget, on its own 2-step schedule, on the first reporting seed.
    match = report["budget"]["match"]
    assert match["seeds"] == [1] and [x for x, _ in match["points"]] == [256, 512]
    assert match["budgets"][0]["runs"][0]["curve"][-1][0] == 256
    md = (out / "budget.md").read_text()
    assert "Sanity gates" in md and "(b) AdamW's trained matrices" in md and "speedup" in md
    assert "## Data to match" in md
    # GWT-AdamW's one-lr grid (no weight-decay axis) decides nothing on the tuning seed: no tuning run for it,
    # and gate (a) says it was not tuned here rather than passing it.
    assert not [p for p in (out / "tune").rglob("gwt-adamw*") if p.is_dir()]
    assert C["gwt-adamw:level=2"]["best_lr"] == 3e-3 and C["gwt-adamw:level=2"]["best_tune_loss"] is None
    assert "one lr, not tuned here" in md
    assert "Code: reporting runs started from " in md  # this test's code is a checkout: git names it
    assert (out / "loss-vs-tokens.png").stat().st_size > 1000
    img = tmp_path / "img" / "loss-vs-tokens.png"
    assert B.main(["--budget", "512", "--progress", "--out", str(out), "--tokens-per-step", "128", "--plot", str(img)],
                  "") == 0
    assert (out / "progress.png").stat().st_size > 1000 and (img.parent / "budget-progress.png").is_file()
    assert not img.exists()  # the interim picture goes beside the results plot, never over it
    table = B.progress_table(out)  # the interim record: every run folder, finished or not
    assert table.count("| tune |") == 2 and table.count("| report |") == 3 and "| 4 / 4 |" in table
    # The run records (run_records.py) carry a study to another machine: saved (no checkpoints; saving again
    # changes nothing) and loaded into a fresh folder, --resume reuses every run and the report is the same.
    import run_records

    records, moved = tmp_path / "records", tmp_path / "moved"
    finished = list(out.glob("*/runs/*/seed*/*/summary.json"))
    assert len(run_records.save(out, records)) == len(finished) >= 6 and run_records.save(out, records) == []
    assert not [p for p in records.rglob("*") if "checkpoint" in p.name]
    assert len(run_records.load(records, moved)) == len(finished) and run_records.load(records, moved) == []
    again = subprocess.run(cmd[:-4] + ["--out", str(moved), "--plot", "", "--resume"], capture_output=True,
                           text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0 and "'ran': 0" in again.stdout, again.stdout[-2000:]

    def figures(md):
        return [line for line in md.splitlines() if not line.startswith(("Runs:", "Command:"))]

    assert figures((moved / "budget.md").read_text()) == figures(md)
    # --tune-only runs the grids and no reporting or frozen run; the report says what is not run yet.
    # With a weight-decay axis, each contender also runs once at its best lr with weight decay 0.1 (so the
    # one-lr grid now runs its lr too, to compare against); the lr grid's runs keep their folders, so a copy
    # of the tuning above is reused, not run again.
    tuned = tmp_path / "tuned"
    shutil.copytree(out / "tune", tuned / "tune")
    only = subprocess.run(cmd[:-4] + ["--out", str(tuned), "--plot", "", "--tune-only", "--weight-decays", "0,0.1",
                                      "--resume"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert only.returncode == 1, only.stdout[-2000:] + only.stderr[-2000:]  # 1: the budget is not done
    assert not (tuned / "report").exists() and "'ran': 3, 'reused': 2" in only.stdout, only.stdout[-2000:]
    md = (tuned / "budget.md").read_text()
    assert "not run yet" in md and "not reached" not in md and "< 1x" not in md
    assert md.count("weight decay at lr") == 2
    decayed = [p for p in (tuned / "tune").rglob("*weight-decay0.1*") if p.is_dir() and p.parent.name == "seed0"]
    assert len(decayed) == 2
    T = json.loads((tuned / "budget.json").read_text())["budget"]["contenders"]
    assert all(set(t["wd_grid"]) == {"0", "0.1"} and t["best_wd"] in (0.0, 0.1) for t in T.values())
    # Without a weight-decay axis the one-lr contender has nothing to tune: --tune-only says so, rather than
    # running nothing for it without a word.
    quiet = tmp_path / "quiet"
    shutil.copytree(out / "tune", quiet / "tune")
    said = subprocess.run(cmd[:-4] + ["--out", str(quiet), "--plot", "", "--tune-only", "--resume"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "'ran': 0" in said.stdout, said.stdout[-2000:] + said.stderr[-2000:]
    assert "--tune-only: nothing to tune for gwt-adamw:level=2 (one lr" in said.stdout, said.stdout[-2000:]


def test_pysrc_small_is_its_own_corpus_of_a_pinned_slice(sdists, monkeypatch):
    from gwt_optim.toolkit.data import load_texts, sources, tokenizers

    pysrc, pinned, download = sdists
    assert pysrc.SMALL and set(pysrc.SMALL) < set(pysrc.PINNED)
    assert pysrc.corpus_dir(pysrc.SMALL) != pysrc.corpus_dir(pysrc.PINNED)
    assert pysrc.SMALL_NAME in sources.NAMED and tokenizers._default_tokenizer(pysrc.SMALL_NAME) == "bpe"
    monkeypatch.setattr(pysrc, "SMALL", pinned[1:])  # the slice: sdist b only
    monkeypatch.setattr(pysrc, "pip_download", download)
    texts = load_texts(pysrc.SMALL_NAME, "train") + load_texts(pysrc.SMALL_NAME, "validation")
    assert texts and all("other" in t or "licence" in t for t in texts)  # b's modules and the shared licence
    assert (pysrc.corpus_dir(pinned[1:]) / "manifest.json").is_file() and not pysrc.corpus_dir(pinned).exists()


def test_sdists_from_a_carried_folder_are_checked_like_downloads(sdists, tmp_path, monkeypatch):
    pysrc, pinned, download = sdists
    carried = tmp_path / "carried"
    pysrc.build(pinned, download=download, progress=False, keep=carried)  # what `pysrc download DIR` does
    assert sorted(p.name for p in carried.iterdir()) == ["a-1.0.tar.gz", "b-1.0.tar.gz"]
    monkeypatch.setenv("GWT_OPTIM_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("GWT_PYSRC_SDISTS", str(carried))
    monkeypatch.setattr(pysrc, "pip_download", lambda *a: pytest.fail("went to PyPI"))
    folder = pysrc.build(pinned, progress=False)
    assert str(folder).startswith(str(tmp_path / "elsewhere")) and (folder / "manifest.json").is_file()
    (carried / "b-1.0.tar.gz").write_bytes(b"tampered")
    monkeypatch.setenv("GWT_OPTIM_CACHE", str(tmp_path / "third"))
    with pytest.raises(ValueError, match="sha256"):
        pysrc.build(pinned, progress=False)


def test_gate_seeds_and_untuned_contenders_are_not_reported_as_passing():
    assert B.gate_seeds_of(None, [1, 2]) == [1] and B.gate_seeds_of("none", [1, 2]) == []
    assert B.gate_seeds_of("2", [1, 2]) == [2]
    with pytest.raises(ValueError, match="reporting seeds"):
        B.gate_seeds_of("0", [1, 2])
    out = _report(2.5, 3.2)
    out["contenders"]["muon"] = {"runs": [], "mean": None, "best_lr": None, "lrs": [1e-2]}
    out["frozen"] = {}
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    assert out["gates"]["a"]["muon"] is None and out["gates"]["b"]["frozen"] is None
    assert not out["gates"]["b"]["ran"]
    # An interim report (--report-only while runs go on): a grid's only finished point is its edge, and the
    # frozen run has not finished. Neither is a failure yet.
    out["contenders"]["muon"] = {"runs": [], "mean": None, "best_lr": 3e-3, "edge": True, "lrs": [3e-3, 1e-2],
                                 "status": {"0.999:0.003": ["ok"], "0.999:0.01": ["missing"]}}
    out["frozen"] = {"runs": [{"seed": 1, "val_loss": float("nan"), "status": "missing"}]}
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    assert out["gates"]["a"]["muon"] is None and not out["gates"]["b"]["ran"] and not out["gates"]["b"]["pass"]
    out["contenders"]["muon"]["status"]["0.999:0.01"] = ["ok"]
    out["frozen"]["runs"][0]["status"] = "diverged"  # finished, and worse than anything: a failure
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    assert out["gates"]["a"]["muon"] is False and out["gates"]["b"]["ran"] and not out["gates"]["b"]["pass"]
    assert not out["gates"]["b"]["waiting"]
    # The frozen run finished and AdamW's run on its seed has not: no verdict yet either, not a failure.
    out["frozen"]["runs"][0].update(status="ok", val_loss=3.88)
    out["contenders"]["adamw"]["runs"][0].update(status="missing", val_loss=float("nan"))
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    assert out["gates"]["b"]["ran"] and out["gates"]["b"]["waiting"] and not out["gates"]["b"]["pass"]
    # One lr given (a contender reported at a known lr, not tuned in this study): no edge to fail, no grid to pass.
    out["contenders"]["muon"] = {"runs": [], "mean": None, "best_lr": 3e-3, "edge": False, "lrs": [3e-3],
                                 "status": {"0.999:0.003": ["ok"]}}
    out["budget_tokens"] = 2000
    B.analyse(out, 0.3)
    assert out["gates"]["a"]["muon"] is None
    assert B._gate_a_word(None, out["contenders"]["muon"]) == "one lr, not tuned here"
    assert B._gate_a_word(None, {"lrs": [3e-3, 1e-2]}) == "not tuned yet" and B._gate_a_word(False, {}) == "**FAIL** (edge)"


def test_a_signal_stops_every_stage_so_no_queued_run_starts_after_it(tmp_path):
    """SIGTERM to a study aborts the data-to-match runner too: before, the match runs queued behind the
    stopped ones started on the freed slots, and the study went on training after the signal."""
    import signal

    from gwt_optim.toolkit.signals import abort_on_signals

    args = SimpleNamespace(tokens_per_step=128, budget="512", tune_steps=None, regular_lr=3e-3, evals=2,
                           save_every=0, out=str(tmp_path), jobs=1, threads=1, resume=True, report_only=False,
                           deadline=None, grace=5.0, match_budgets="0.5,0.75")
    b = B.Budget(args, {"seq_len": 32, "data": "pysrc"}, windows=64, start=0.0)  # a run folder names its data
    assert len(b.runners) == 4 and all(r.pool is b.tuner.pool for r in b.runners)
    with abort_on_signals(b.runners, "stopping"):
        os.kill(os.getpid(), signal.SIGTERM)
    assert all(r.aborted for r in b.runners)
    job = B.P.Job(128, b.spec("adamw", 2e-3), 2e-3, 1)
    runner = next(iter(b.matchers.values()))
    assert runner.submit(job).result()["status"] == "skipped"  # nothing trains after the signal
    b.tuner.shutdown()


def test_the_report_shows_the_weight_decay_a_label_names():
    """A contender whose label names its weight decay (the transfer study's ``adamw:weight_decay=0.1``) shows it
    in the reporting table; the runs' config, and so the other rows, have 0."""
    out = _report(2.5, 3.2)
    out["contenders"]["adamw:weight_decay=0.1"] = {**out["contenders"]["adamw"]}
    B.analyse(out, 0.3)
    out.update(setting=_SETTING, train_tokens=1, beta2s=[0.999], jobs=1, threads=1, command="c", environment={},
               weight_decay=0.0)
    for t in out["contenders"].values():
        t.setdefault("std", 0.0)
        t.setdefault("n", len(t["runs"]))
    text = B.render({**out, "budget": {**out, "tokens_per_step": 1, "steps": 2, "tune_steps": 1, "regular_lr": 3e-3,
                                        "grids": {}, "tune_seeds": [0], "report_seeds": [1, 2]}})
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[2] for line in text.splitlines()
            if line.startswith("| adamw") and " | 0.003 | " in line}
    assert rows == {"adamw": "0", "adamw:weight_decay=0.1": "0.1"}
