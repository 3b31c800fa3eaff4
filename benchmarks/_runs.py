"""A study's runs on disk, read without torch: the one reader of the folder layout and of a run's validation
curve, for the budget protocol (``_budget.py``), the records (``run_records.py``) and the plots (``_paired.py``).

A queue's live ``--out`` holds ``OUT/STAGE/runs/SETTING/seedN/RUN``; a record (``run_records.py save``) holds
``RECORDS/STAGE/SETTING/seedN/RUN`` with ``metrics.jsonl`` gzipped.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path


def run_folders(out: Path):
    """(stage, run folder, its config) of every run under ``out`` (``OUT/STAGE/runs/tokens.../seedN/RUN``),
    finished or cut short."""
    for cfg_path in sorted(out.glob("*/runs/*/seed*/*/config.json")):
        yield cfg_path.parts[-6], cfg_path.parent, json.loads(cfg_path.read_text())


def curve(run: Path) -> dict[int, float]:
    """step -> validation loss at each of a run's evaluations, from its record (``metrics.jsonl.gz``) or its live
    metrics; {} where it has neither. A line that is no record (the torn last line of a killed run) and a loss
    that is not finite are skipped, as the toolkit's own reader (``gwt_optim.toolkit.metrics.read_jsonl``) does."""
    gz = run / "metrics.jsonl.gz"
    try:
        if gz.exists():
            with gzip.open(gz, "rt") as f:
                text = f.read()
        else:
            text = (run / "metrics.jsonl").read_text()
    except (OSError, EOFError, UnicodeDecodeError):
        return {}
    out = {}
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        v = r.get("val_loss") if isinstance(r, dict) else None
        if isinstance(v, (int, float)) and math.isfinite(v) and "step" in r:
            out[int(r["step"])] = float(v)
    return out
