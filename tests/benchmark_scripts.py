"""A script of benchmarks/ imported as a module, for the tests of its functions (benchmarks/ is no package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """``benchmarks/NAME.py``, executed once per call and registered as ``_NAME`` (dataclasses need it there)."""
    spec = importlib.util.spec_from_file_location(f"_{name}", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
