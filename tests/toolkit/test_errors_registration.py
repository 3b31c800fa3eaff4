"""toolkit/errors.py is a leaf: the modules that define a user error register
it there, and run_command prints any registered one as one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _waiting import CAP_S

from gwt_optim.toolkit import errors

SRC = Path(__file__).resolve().parents[2] / "src"


def test_the_toolkits_user_errors_are_registered_where_they_are_defined():
    from gwt_optim.registry import MissingDependency
    from gwt_optim.toolkit.data import DataUnavailable
    from gwt_optim.toolkit.train import NonFiniteLossError

    import gwt_optim.toolkit.registry  # noqa: F401  (registers the registry's, which cannot import errors)

    kinds = errors.user_error_types()
    assert {DataUnavailable, MissingDependency, NonFiniteLossError} <= set(kinds)
    assert {ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
            PermissionError} <= set(kinds)
    assert len(kinds) == len(set(kinds))


def test_a_registered_type_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(errors, "_USER_ERRORS", list(errors._USER_ERRORS))  # noqa: SLF001

    class Oops(RuntimeError):
        pass

    def fail(_args):
        raise Oops("the flag --x wants a number")

    with pytest.raises(Oops):
        errors.run_command("cmd", fail, None)
    assert errors.register_user_error(Oops) is Oops
    errors.register_user_error(Oops)  # twice: harmless
    assert errors.user_error_types().count(Oops) == 1
    assert errors.run_command("cmd", fail, None) == errors.EXIT_USAGE
    assert capsys.readouterr().err == "gwt-optim cmd: error: the flag --x wants a number\n"


def test_register_user_error_takes_exception_classes_only():
    with pytest.raises(TypeError, match="exception class"):
        errors.register_user_error(ValueError("an instance"))
    with pytest.raises(TypeError, match="exception class"):
        errors.register_user_error(int)


def test_errors_loads_no_other_toolkit_module():
    code = ("import sys, gwt_optim.toolkit.errors as e; "
            "print(sorted(m for m in sys.modules if m.startswith('gwt_optim.toolkit.')), len(e.user_error_types()))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=CAP_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["['gwt_optim.toolkit.errors']", "6"]


def test_the_cli_registers_the_registrys_error_itself(monkeypatch, capsys):
    """cli.main counts MissingDependency as the user's even where no toolkit
    module registered it (the torch-only ``memory`` command)."""
    from gwt_optim import cli
    from gwt_optim.registry import MissingDependency

    monkeypatch.setattr(errors, "_USER_ERRORS", [k for k in errors._USER_ERRORS if k is not MissingDependency])  # noqa: SLF001

    def run(_args):
        raise MissingDependency("'x' is not installed; install it with `pip install 'gwt-optim[peers]'`")

    import gwt_optim.memory.cli as memory_cli

    real = memory_cli.register

    def register(sub):
        real(sub)
        sub.choices["memory"].set_defaults(func=run)

    monkeypatch.setattr(sys.modules["gwt_optim.memory"], "register", register)
    assert cli.main(["memory"]) == errors.EXIT_USAGE
    assert capsys.readouterr().err.startswith("gwt-optim memory: error: 'x' is not installed")
