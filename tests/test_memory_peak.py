"""The peak RSS of the in-backward step against its prediction (issue 29).

``benchmarks/big_model.py``'s documented 7B command crept from 18.6 to
20.7 GiB without any test noticing: the growth was glibc's heap holding freed
pages (docs/results/memory-trace-cpu.md), which scales with the model. This
runs the same script, as documented (progress bar on, its allocator setting),
on a small LLaMA whose head dominates the step, and bounds what its trace
measures by what ``gwt_optim.memory.training_estimate`` predicts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gwt_optim.memory import load_config_json

ROOT = Path(__file__).resolve().parents[1]

# The model's part of the peak: RSS over the RSS when the model's build
# started, less the growth of file-backed pages (libraries loaded lazily on
# first use: 23.5 MB here, about 40 MB in a fresh venv; not the model's).
# Over 5 runs each on the 2-core machine at load average 15
# (docs/results/memory-trace-cpu.md), against a prediction of 67.7 MB:
# 78.7-79.0 MB with the script's allocator setting, 120-140 MB with glibc's
# default (--default-malloc: freed heap pages kept resident). The limit,
# 67.7 * 1.10 + 20 = 94.5 MB, is 15 MB (50 times the spread of the runs)
# above the worst run as documented and 26 MB below the best run without the
# setting: the next such regression, or a temporary the estimate does not
# know, fails here; load does not move it.
PEAK_MARGIN = 0.10
# What the runtime keeps besides the model (the autograd graph, torch's
# caches, thread stacks): 11 MB here.
RUNTIME_ALLOWANCE = 20e6
# The largest parameter step's own temporaries (its peak over the RSS at its
# start): 1.012-1.015 of the predicted step workspace in the same runs.
STEP_MARGIN = 0.10


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_in_backward_step_peak_stays_within_its_prediction(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**load_config_json("llama_20m"), "num_hidden_layers": 2, "vocab_size": 8000}))
    out = tmp_path / "out.json"
    # One thread: on a loaded machine two spinning OpenMP threads make it ten times slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # the script's own setting is what is tested
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "big_model.py"), "--model", str(config), "--data", "synthetic",
         "--optimizer", "gwt-adamw:level=3", "--moment-dtype", "int8", "--steps", "2", "--seq-len", "128",
         "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    parts = r["estimate_parts"]
    phases = {p["phase"]: p for p in r["phases"]}
    # The second backward: the state exists and every library is loaded.
    build, second = phases["build"], phases["backward 2"]
    measured = (second["peak"] - second["file_before_peak"]) - (build["rss_start"] - build["file_start"])
    assert measured <= parts["total"] * (1 + PEAK_MARGIN) + RUNTIME_ALLOWANCE, (
        f"the in-backward peak is {measured / 1e6:.1f} MB over the RSS before the model, predicted "
        f"{parts['total'] / 1e6:.1f} MB (at {second['peak_at']}); the phases: {r['phases']}")
    steps = [s for s in r["largest_steps"] if s["phase"].startswith("backward 2:")]
    assert steps, r["largest_steps"]
    worst = steps[0]
    assert worst["transient"] <= parts["step workspace"] * (1 + STEP_MARGIN), (
        f"{worst['phase']} needed {worst['transient'] / 1e6:.1f} MB of temporaries, predicted "
        f"{parts['step workspace'] / 1e6:.1f} MB")
    assert worst["phase"].endswith(("lm_head.weight", "embed_tokens.weight"))  # the largest matrices
