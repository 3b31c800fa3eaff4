"""A new user's first hour (issue 44): what the first commands of someone who
has just installed the toolkit say and do. A mistake is one line on stderr and
exit code 2, before anything is written; the help states the defaults the run
uses; a small local text file trains offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from gwt_optim.cli import main


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("gwt-optim "), err
    return lines[0]


# ----------------------------------------------------------------- --resume with nothing to resume


def _listing(folder: Path) -> list[str] | None:
    """What ``ls`` shows (the run lock, a dot file, may stay in a folder that existed)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.exists() else None


@pytest.mark.parametrize("folder", ["missing", "notes-only", "stopped-before-a-checkpoint"])
def test_resume_with_nothing_to_resume_refuses_in_one_line(tmp_path, capsys, folder):
    run = tmp_path / "notarun"
    if folder != "missing":
        run.mkdir()
        (run / "notes.md").write_text("my notes\n")
    if folder == "stopped-before-a-checkpoint":
        (run / "config.json").write_text("{}")
    before = _listing(run)
    assert main(["pretrain", "--resume", "--out", str(run), "--no-progress"]) == 2
    line = _error(capsys)
    assert line.startswith("gwt-optim pretrain: error: --resume: ") and str(run) in line
    assert "continue" in line  # says there is nothing to continue, and what to do instead
    # Nothing trained or written: a missing folder stays missing, a folder keeps just what it held.
    assert _listing(run) == before
