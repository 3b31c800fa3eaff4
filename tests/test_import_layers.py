"""The layers point down: the import graph of ``src/gwt_optim``, read with
``ast`` (nothing is imported), has no cycles, the core never imports the
toolkit, and ``toolkit/errors.py`` is a leaf every module may import."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "gwt_optim"

# Packages and modules below the toolkit: the library a user imports without
# the training harness's extras.
CORE = (
    "gwt_optim.optim",
    "gwt_optim.wavelets",
    "gwt_optim._toolchain",
    "gwt_optim._cache",
    "gwt_optim._quiet",
    "gwt_optim.groups",
    "gwt_optim.backward",
    "gwt_optim.memory",
    "gwt_optim.integrations",
    "gwt_optim.registry",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool, known: set[str],
             typing: bool = False) -> tuple[set[str], set[str]]:
    """(module-level, function-level) imports of gwt_optim modules.

    ``from a import b`` counts as an import of ``a.b`` when that is a module.
    Imports under ``if TYPE_CHECKING:`` never run and are left out, unless
    ``typing`` (a reader still follows them: the finetune settings' cycles).
    """
    top: set[str] = set()
    inner: set[str] = set()

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, nested: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing:
            for child in node.orelse:
                visit(child, nested)
            return
        found: list[str] = []
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = resolve(node)
            found = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        for name in found:
            if name == "gwt_optim" or name.startswith("gwt_optim."):
                # ``import a.b.c`` binds an existing module; strip to the longest known one.
                while name not in known and "." in name:
                    name = name.rsplit(".", 1)[0]
                (inner if nested else top).add(name)
        inside = nested or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    for stmt in tree.body:
        visit(stmt, False)
    return top, inner


@functools.lru_cache(maxsize=2)
def _graph(typing: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    known = set(modules)
    top, inner = {}, {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        top[name], inner[name] = _imports(tree, name, path.name == "__init__.py", known, typing)
        top[name].discard(name)
        inner[name].discard(name)
    return top, inner


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# ----------------------------------------------------------------------------- the reader itself


def test_the_reader_resolves_relative_imports_submodules_and_type_checking():
    known = {"gwt_optim", "gwt_optim.a", "gwt_optim.a.b", "gwt_optim.a.c", "gwt_optim.d"}
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from . import c\n"
        "from .. import d\n"
        "from gwt_optim.a import b, something\n"
        "if TYPE_CHECKING:\n"
        "    from gwt_optim import d as hidden\n"
        "def f():\n"
        "    import gwt_optim.d\n"
    )
    top, inner = _imports(tree, "gwt_optim.a.b", False, known)
    assert top == {"gwt_optim.a.c", "gwt_optim.d", "gwt_optim.a.b", "gwt_optim.a"}
    assert inner == {"gwt_optim.d"}
    assert _cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    assert _cycles({"x": {"y"}, "y": set()}) == []


def test_the_graph_sees_the_package():
    top, _ = _graph()
    assert {"gwt_optim.cli", "gwt_optim.registry", "gwt_optim.toolkit.errors"} <= set(top)
    assert "gwt_optim.registry.base" in top["gwt_optim.registry"]


# ----------------------------------------------------------------------------- the rules


def test_no_import_cycles_at_module_level():
    top, _ = _graph()
    assert _cycles(top) == []


# Loops closed only by imports inside functions: they work, because the inner
# import runs after both modules are loaded, but each is a debt to pay, not to
# grow. (pysrc <-> sources was one: DataUnavailable now lives in a leaf.)
KNOWN_FUNCTION_LEVEL_CYCLES: list[list[str]] = []


def test_no_import_cycles_even_through_type_checking_imports():
    """A cycle that only type annotations close still ties the modules together for a reader (issue 55: the
    finetune data and report modules imported their settings from the training modules)."""
    top, inner = _graph(typing=True)
    assert _cycles({m: top[m] | inner[m] for m in top}) == []


def test_no_new_import_cycles_through_function_level_imports():
    top, inner = _graph()
    every = {m: top[m] | inner[m] for m in top}
    new = [c for c in _cycles(every) if c not in KNOWN_FUNCTION_LEVEL_CYCLES]
    assert not new, new


def test_toolkit_errors_is_a_leaf():
    top, inner = _graph()
    name = "gwt_optim.toolkit.errors"
    assert top[name] == set() and inner[name] == set(), (top[name], inner[name])


@pytest.mark.parametrize("package", CORE)
def test_the_core_never_imports_the_toolkit(package):
    top, inner = _graph()
    members = [m for m in top if _in(m, package)]
    assert members, package
    upward = {m: sorted(n for n in top[m] | inner[m] if _in(n, "gwt_optim.toolkit") or n == "gwt_optim.cli")
              for m in members}
    assert not {m: up for m, up in upward.items() if up}, upward


def test_the_registry_is_below_the_integrations():
    top, inner = _graph()
    registry = [m for m in top if _in(m, "gwt_optim.registry")]
    upward = {n for m in registry for n in top[m] | inner[m]
              if _in(n, "gwt_optim.integrations") or _in(n, "gwt_optim.memory")}
    assert not upward, upward


# ----------------------------------------------------------------------------- the same, at run time


def test_the_library_builds_any_registry_optimizer_without_the_toolkit():
    """What the graph promises, in a fresh interpreter: the integration, the
    registry and the memory estimates load no toolkit module, and see every
    name the toolkit sees."""
    import json
    import os
    import subprocess
    import sys

    code = r"""
import json, sys
import torch
from torch import nn
from gwt_optim.integrations import create_gwt_optimizer
from gwt_optim.memory import estimate
from gwt_optim.registry import REGISTRY
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
built = {}
for name in ("adamw", "gwt-adamw", "gwt-adafactor"):
    opt, _ = create_gwt_optimizer(model, lr=1e-3, optimizer=name, target_modules=("0",), scale=1.0)
    built[name] = type(opt).__name__
estimate(model, "adamw")
loaded = sorted(m for m in sys.modules if m.startswith("gwt_optim.toolkit"))
import gwt_optim.toolkit.registry as toolkit_registry
print(json.dumps({"loaded": loaded, "names": sorted(REGISTRY), "built": built,
                  "same": sorted(toolkit_registry.REGISTRY) == sorted(REGISTRY)}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["loaded"] == []
    assert result["same"] and len(result["names"]) >= 10
    assert result["built"] == {"adamw": "AdamW", "gwt-adamw": "GWTAdamW", "gwt-adafactor": "GWTAdafactor"}


# The layers of docs/architecture.md, bottom first: a module imports its own
# layer and the layers below it, never one above.
LAYERS = [
    ("gwt_optim.wavelets", "gwt_optim._cache", "gwt_optim._quiet"),
    ("gwt_optim._toolchain",),  # builds and loads C through the cache rule (as torch.utils.cpp_extension)
    ("gwt_optim.optim",),
    ("gwt_optim.groups", "gwt_optim.backward"),
    ("gwt_optim.registry",),
    ("gwt_optim.memory", "gwt_optim.integrations"),
    ("gwt_optim",),  # the package's own __init__: the public names, re-exported
    ("gwt_optim.toolkit",),
    ("gwt_optim.cli",),
    ("gwt_optim.__main__",),
]


def _layer(module: str) -> tuple[int, str]:
    for rank, names in enumerate(LAYERS):
        for name in names:
            if module == name or (name != "gwt_optim" and _in(module, name)):
                return rank, name
    raise AssertionError(f"{module} is in no layer of LAYERS")


def test_every_import_points_down():
    top, inner = _graph()
    upward = {}
    for m in top:
        rank, home = _layer(m)
        bad = sorted(n for n in top[m] | inner[m]
                     if _layer(n)[0] > rank or (_layer(n)[0] == rank and _layer(n)[1] != home))
        if bad:
            upward[m] = bad
    assert not upward, upward
