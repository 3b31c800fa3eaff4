"""benchmarks/gpu_check.py, the Python half of benchmarks/gpu_check.sh, on a CPU.

What can run without a GPU runs here: the argument parsing, the message and
exit status without CUDA, section 3 on the native CPU kernels, and two of
section 1's checks in Triton's interpreter (in a child process: Triton picks
its interpreter when it is first imported, and other tests may have imported
it for real).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
G = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(G)

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")


def _rows(table: str) -> list[list[str]]:
    """The body rows of a markdown table, as cells."""
    lines = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| check ")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def test_the_shell_script_runs_the_module_and_holds_no_python():
    sh = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    # No program on standard input: a heredoc can be neither imported nor linted.
    assert "<<" not in sh and not re.search(r'"\$PY" -(\s|$)', sh, re.M)
    assert 'benchmarks/gpu_check.py triton --device "$DEVICE"' in sh and "benchmarks/gpu_check.py older" in sh
    for script in ("gpu_check.sh", "device_session.sh"):
        done = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
        assert done.returncode == 0, (script, done.stderr)


def test_arguments():
    args = G.parse_args(["triton", "--device", "cpu", "--checks", "level-0, non-finite"])
    assert (args.section, args.device, args.checks) == ("triton", "cpu", ["level-0", "non-finite"])
    args = G.parse_args(["triton"])
    assert args.device == "cuda" and args.checks is None  # None: every check
    assert G.parse_args(["older"]).device == "cuda"
    assert list(G.TRITON_CHECKS)[:2] == ["fp32-level-2", "fp32-level-1"]  # the report's order


@pytest.mark.parametrize("argv", [["triton", "--checks", "level0"], ["triton", "--checks", ","], ["nosuch"], []])
def test_bad_arguments_exit_2_naming_the_choices(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        G.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    if "--checks" in argv:
        assert "known: fp32-level-2, fp32-level-1," in err and "int64-offsets" in err


@no_cuda
@pytest.mark.parametrize("section", ["triton", "older"])
def test_without_cuda_one_line_and_exit_2(section, capsys):
    assert G.main([section]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("gpu_check: CUDA is not available here") and "--device cpu" in err
    assert len(err.strip().splitlines()) == 1


def test_section_3_on_the_native_cpu_kernels():
    with torch.random.fork_rng():
        rows, compile_s = G.run_older("cpu")
    table = G.older_table(rows, compile_s)
    body = _rows(table)
    assert [r[0] for r in body] == [
        "level 0 == torch.optim.AdamW", "fused (native) == reference, level 2", "eager fast == reference, level 2",
        "fused == reference, level 1", "fused == reference, level 3",
        "bf16 params (fp32 moments) vs fp32 on the same gradients", "no recompiles over 6 steps with a changing lr",
    ]
    assert all(r[3] == "ok" for r in body), table
    assert table.endswith(f"torch {torch.__version__}")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)")
def test_section_1_checks_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "triton", "--device", "cpu", "--checks",
                           "non-finite,fp32-level-2"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    body = _rows(done.stdout)
    # In the report's order, whatever the order asked for.
    assert [r[0] for r in body] == [
        "fp32 level 2: triton == eager",
        "non-finite gradients: those parameters keep weight and state, the rest step",
    ], done.stdout
    assert all(r[3] == "ok" for r in body), done.stdout
    assert body[0][4] == "backends ['triton']"
    assert re.search(r"First triton run incl\. compilation: \d+\.\d s; torch .*, triton \d", done.stdout)
