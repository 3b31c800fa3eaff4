"""`compare` never deletes an earlier run: it stops and says what to pass,
--overwrite moves the earlier folders aside, and each run's own output goes to
its log.txt, not between the console's lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gwt_optim.cli import main
from gwt_optim.toolkit.compare import run_dir_name


@pytest.fixture
def compare_argv(tiny_model, corpus, tmp_path):
    def make(*extra: str) -> list[str]:
        return ["compare", "--optimizers", "adamw", "--model", tiny_model, "--data", corpus, "--tokenizer", "bpe:320",
                "--seq-len", "32", "--batch-size", "4", "--steps", "2", "--eval-every", "0", "--val-tokens", "512",
                "--device", "cpu", "--no-progress", "--out", str(tmp_path / "cmp"), *extra]

    return make


def _earlier_run(out: Path, config: dict | None = None) -> Path:
    run = out / run_dir_name(0, "adamw")
    run.mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    (run / "config.json").write_text(json.dumps(config or {}))
    (run / "my-notes.txt").write_text("mine")
    return run


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_an_existing_run_is_kept_and_the_user_told_what_to_pass(compare_argv, tmp_path, capsys):
    run = _earlier_run(tmp_path / "cmp")
    assert main(compare_argv()) == 2
    line = _one_error_line(capsys)
    assert "--resume" in line and "--overwrite" in line and "--out" in line
    assert (run / "my-notes.txt").read_text() == "mine" and (run / "summary.json").is_file()


def test_resume_with_other_settings_is_refused_before_anything_trains(compare_argv, tmp_path, capsys):
    from gwt_optim.cli import build_parser
    from gwt_optim.toolkit.pretrain import resolve_config

    config = resolve_config(build_parser().parse_args(compare_argv())).to_dict()
    run = _earlier_run(tmp_path / "cmp", {**config, "optimizer": "adamw", "lr": 0.5})
    assert main(compare_argv("--resume")) == 2
    assert "lr: 0.5 -> " in _one_error_line(capsys)
    assert (run / "my-notes.txt").is_file() and not (run / "log.txt").exists()


def test_overwrite_moves_earlier_runs_aside_and_logs_each_run(compare_argv, tmp_path, capfd):
    out = tmp_path / "cmp"
    _earlier_run(out)
    assert main(compare_argv("--overwrite")) == 0
    console = capfd.readouterr()
    kept = list(out.glob("replaced-*/" + run_dir_name(0, "adamw") + "/my-notes.txt"))
    assert len(kept) == 1 and kept[0].read_text() == "mine"
    run = out / run_dir_name(0, "adamw")
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    # The run's own prints are in its log.txt; the console has compare's lines and the table once.
    assert "run directory:" in (run / "log.txt").read_text()
    assert "run directory:" not in console.out + console.err
    assert console.out.count("| optimizer |") == 1 and "moved 1 earlier run folder" in console.out


def test_overwrite_is_documented_and_excludes_resume(compare_argv, capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "never deleted" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as exc:
        main(compare_argv("--resume", "--overwrite"))
    assert exc.value.code == 2


def test_resume_with_new_steps_needs_every_run_finished(compare_argv, tmp_path, capsys):
    from gwt_optim.cli import build_parser
    from gwt_optim.toolkit.pretrain import resolve_config

    config = resolve_config(build_parser().parse_args(compare_argv())).to_dict()
    run = _earlier_run(tmp_path / "cmp", {**config, "optimizer": "adamw", "steps": 1})
    (run / "summary.json").unlink()  # interrupted: its first steps followed the 1-step schedule
    assert main(compare_argv("--resume")) == 2
    assert "every run has finished" in _one_error_line(capsys)


def test_the_demo_trains_in_its_setting_and_a_list_of_yours_at_pretrains_defaults(tmp_path, monkeypatch):
    from gwt_optim.toolkit import compare, recipes

    planned: dict[str, list[dict]] = {}

    def record(plan, out, args, base):
        planned[Path(out).name] = [config for _, _, config in plan]
        return 0

    monkeypatch.setattr(compare, "_run_plan", record)
    assert main(["compare", "--out", str(tmp_path / "demo")]) == 0
    assert main(["compare", "--optimizers", "adamw", "--out", str(tmp_path / "mine")]) == 0
    demo, mine = planned["demo"], planned["mine"]
    assert [c["optimizer"] for c in demo] == recipes.DEMO_OPTIMIZERS
    assert all(c["data"] == "pysrc-small" and c["grad_clip"] == 1.0 for c in demo)
    assert all(c[k] == v for c in demo for k, v in recipes.DEMO_SETTING.items() if k not in ("tokenizer",))
    assert mine[0]["data"] == recipes.DEMO["data"] == "demo" and mine[0]["grad_clip"] is None
