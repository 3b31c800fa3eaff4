"""PyTorch's own generic optimizer tests, run against the gwt-optim optimizers.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/torch_optim_suite.py /tmp/pytorch_test_optim/test_optim.py \\
        --source "kdrozd-dev/pytorch@81a0cdd28efad45c9f40120bf7768340ebcad641:test/test_optim.py" \\
        > /tmp/torch_suite_before.txt

    # the same against a commit rather than the working tree:
    mkdir -p /tmp/gwt_head && git archive HEAD src | tar -x -C /tmp/gwt_head
    git rev-parse HEAD > /tmp/gwt_head/COMMIT
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/torch_optim_suite.py /tmp/pytorch_test_optim/test_optim.py \\
        --gwt-src /tmp/gwt_head/src > /tmp/torch_suite_before.txt

Needs ``expecttest`` (``torch.testing._internal`` imports it; not a
gwt-optim dependency): ``.venv/bin/python -m pip install expecttest``.
That test_optim.py (closest to torch 2.13 found: it raises ``AssertionError``
as the installed ``common_optimizers.py`` does, and has Muon without foreach)
is ``kdrozd-dev/pytorch`` at 81a0cdd, 102065 characters, sha256 prefix
c1cf7e5c49a1a75d; any other version whose ``TestOptimRenewed`` reads
``optim_db`` works the same way.

An outside check, not part of the test suite: it takes a copy of PyTorch's
``test/test_optim.py`` (not shipped here: PyTorch's source stays out of this
repository; pass the path of one that matches the installed torch, or the
closest version), registers ``OptimizerInfo`` entries for the GWT optimizers
the way ``torch/testing/_internal/common_optimizers.py`` registers torch's own,
and runs the ``TestOptimRenewed`` tests on CPU, restricted to those entries,
with pytest in this process (one process, no xdist). It prints the torch
version and commit, this repository's commit, the test file's hash, a
markdown table of outcomes per entry and every failing test id with a
one-line reason and the deepest ``gwt_optim`` frame of its traceback.

The entries (``optim_inputs_func`` mirrors torch's entry for the same
algorithm, keeping only the hyperparameters our constructor accepts: a key it
does not take, such as ``amsgrad``, or an implementation keyword (below), is dropped from the input
and inputs that become duplicates are dropped):

=================  ===========  =========================================
entry              mirrors      fixed kwargs
=================  ===========  =========================================
``GWTAdamW``       AdamW        (none: ``backend="auto"``, fused CPU kernel)
``GWTAdamW_eager`` AdamW        ``backend="eager"``
``GWTMuon``        Muon         (none: ``use_muon=True``, 2-D only)
``GWTMuon_adamw``  AdamW        ``use_muon=False`` (its AdamW groups)
``GWTAdamMini``    AdamW        (none)
``GWTAdafactor``   Adafactor    (none)
=================  ===========  =========================================

The flags: ``supported_impls=()`` (the constructors take torch's ``foreach``,
``fused``, ``maximize``, ``capturable`` and ``differentiable``, but map them
onto ``backend=`` or refuse them, as ``docs/families.md`` says: torch's inputs
and error inputs with those keys are left out, as before the constructors took
them), ``not_og_supported_flags=()``,
``supports_complex=False`` (GWT rejects complex parameters at construction,
documented), the default schedulers (StepLR, ReduceLROnPlateau), as torch's
AdamW/Muon/Adafactor entries. Error inputs are torch's for the mirrored entry,
minus those whose kwargs our constructor does not take; torch's inputs for
complex parameters (Muon, Adafactor: a ``RuntimeError`` on ``step``) and for
Muon's 3-D parameter are adapted to GWT's documented contract (a
``ValueError`` at construction naming the cause); every other regex is
torch's, unchanged.

Two edits make the copy importable and let the Muon entry get the treatment
torch's Muon gets (written to ``--workdir``, listed in the output):

* the three ``from optim.test_* import ...`` lines (other test classes, not
  ``TestOptimRenewed``) are dropped;
* ``optim_cls.__name__ == "Muon"`` / ``"AdamW"`` (the tests' special cases:
  weight only, no bias, for Muon; a small lr in the zero-grad test for the
  optimizers whose default weight decay is non-zero) become
  ``_torch_name(optim_info) == ...``, the name of the torch optimizer the
  entry mirrors.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import platform
import re
import subprocess
import sys
import time
from collections import defaultdict
from copy import deepcopy
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENTRY_ORDER = ("GWTAdamW", "GWTAdamW_eager", "GWTMuon", "GWTMuon_adamw", "GWTAdamMini", "GWTAdafactor")


# --------------------------------------------------------------------------- #
# The patched copy of test_optim.py


_DROP_IMPORT = re.compile(r"^from optim\.test_\w+ import .*\n", re.M)
_NAME_CMP = re.compile(r'optim_cls\.__name__ (==|!=) "(Muon|AdamW)"')
_PRELUDE = '''

# --- added by gwt-optim's benchmarks/torch_optim_suite.py ---------------------
def _torch_name(optim_info):
    """The torch optimizer an entry mirrors, for the tests' name-based special cases."""
    return getattr(optim_info, "torch_name", None) or optim_info.optim_cls.__name__
# -------------------------------------------------------------------------------
'''


def patch_test_file(text: str) -> tuple[str, list[str]]:
    notes = []
    text, n = _DROP_IMPORT.subn("", text)
    notes.append(f"dropped {n} `from optim.test_* import` line(s) (other test classes)")
    text, n = _NAME_CMP.subn(lambda m: f'_torch_name(optim_info) {m.group(1)} "{m.group(2)}"', text)
    notes.append(f'{n} `optim_cls.__name__ ==/!= "Muon"/"AdamW"` comparisons -> `_torch_name(optim_info)`')
    anchor = "\n\nFP16_REDUCED_PRECISION"
    if anchor not in text:
        raise SystemExit("test_optim.py: no FP16_REDUCED_PRECISION line to anchor the prelude; a different layout")
    text = text.replace(anchor, _PRELUDE + anchor, 1)
    if "class TestOptimRenewed" not in text:
        raise SystemExit("test_optim.py: no TestOptimRenewed class")
    return text, notes


# --------------------------------------------------------------------------- #
# The OptimizerInfo entries


def build_entries():
    import torch
    from torch.testing._internal import common_optimizers as co

    import gwt_optim

    class GWTOptimizerInfo(co.OptimizerInfo):
        """An OptimizerInfo whose test-name part is its label (two entries share a class)."""

        def __init__(self, optim_cls, *, label, torch_name, **kwargs):
            super().__init__(optim_cls, **kwargs)
            self.label = label
            self.torch_name = torch_name

        @property
        def name(self):
            return self.label

    def accepted(cls):
        # torch's implementation keywords are taken, but only as their rule allows (tests/test_torch_keywords.py):
        # left out here, as before the constructors took them, so that torch's inputs run as they did.
        from gwt_optim.optim._base import TORCH_KEYWORDS

        return set(inspect.signature(cls.__init__).parameters) - {"self", "params"} - set(TORCH_KEYWORDS)

    def mirror_inputs(torch_func, cls, fixed):
        keys = accepted(cls)

        def optim_inputs_func(device, dtype=None):
            out, seen = [], set()
            for oi in torch_func(device, dtype):
                kwargs = {k: v for k, v in oi.kwargs.items() if k in keys}
                dropped = sorted(set(oi.kwargs) - set(kwargs))
                kwargs.update(deepcopy(fixed))
                sig = repr(sorted(kwargs.items(), key=lambda kv: kv[0]))
                if sig in seen:
                    continue
                seen.add(sig)
                desc = oi.desc + (f" (without {', '.join(dropped)})" if dropped else "")
                out.append(co.OptimizerInput(params=None, kwargs=kwargs, desc=desc))
            return out

        return optim_inputs_func

    def mirror_errors(torch_func, cls, fixed, *, muon=False):
        keys = accepted(cls)

        def optim_error_inputs_func(device, dtype):
            out = []
            for ei in torch_func(device, dtype):
                oi = ei.optimizer_error_input
                if set(oi.kwargs) - keys:
                    continue  # a flag our constructor does not have (foreach, fused, ...)
                params = oi.params if isinstance(oi.params, list) else None
                complex_params = bool(params) and any(
                    isinstance(p, torch.Tensor) and p.is_complex() for p in params
                )
                kwargs = {**oi.kwargs, **deepcopy(fixed)}
                new = co.OptimizerInput(params=oi.params, kwargs=kwargs, desc=oi.desc)
                if complex_params:
                    # GWT's documented contract: complex parameters are refused at construction.
                    out.append(co.ErrorOptimizerInput(new, error_type=ValueError, error_regex="is complex"))
                elif muon and ei.error_regex == "Muon only supports 2D parameters":
                    out.append(co.ErrorOptimizerInput(new, error_type=ValueError, error_regex="Muon groups take 2-D"))
                else:
                    out.append(co.ErrorOptimizerInput(new, error_on=ei.error_on, error_type=ei.error_type,
                                                      error_regex=ei.error_regex))
            return out

        return optim_error_inputs_func

    common = dict(supported_impls=(), not_og_supported_flags=(), supports_complex=False)
    specs = [
        # label, class, torch name, torch inputs, torch error inputs, fixed kwargs
        ("GWTAdamW", gwt_optim.GWTAdamW, "AdamW", co.optim_inputs_func_adamw, co.optim_error_inputs_func_adamw, {}),
        ("GWTAdamW_eager", gwt_optim.GWTAdamW, "AdamW", co.optim_inputs_func_adamw,
         co.optim_error_inputs_func_adamw, {"backend": "eager"}),
        ("GWTMuon", gwt_optim.GWTMuon, "Muon", co.optim_inputs_func_muon, co.optim_error_inputs_func_muon, {}),
        ("GWTMuon_adamw", gwt_optim.GWTMuon, "AdamW", co.optim_inputs_func_adamw, co.optim_error_inputs_func_adamw,
         {"use_muon": False}),
        ("GWTAdamMini", gwt_optim.GWTAdamMini, None, co.optim_inputs_func_adamw, co.optim_error_inputs_func_adamw,
         {}),
        ("GWTAdafactor", gwt_optim.GWTAdafactor, "Adafactor", co.optim_inputs_func_adafactor,
         co.optim_error_inputs_func_adafactor, {}),
    ]
    entries = []
    for label, cls, torch_name, inputs, errors, fixed in specs:
        entries.append(GWTOptimizerInfo(
            cls, label=label, torch_name=torch_name,
            optim_inputs_func=mirror_inputs(inputs, cls, fixed),
            optim_error_inputs_func=mirror_errors(errors, cls, fixed, muon=torch_name == "Muon"),
            **common,
        ))
    return entries


# --------------------------------------------------------------------------- #
# Results


class Collector:
    """A pytest plugin: keeps only the GWT entries' tests and records outcomes."""

    def __init__(self, labels):
        self.labels = labels
        self.pattern = re.compile(r"_(" + "|".join(sorted(labels, key=len, reverse=True)) + r")_cpu(?:_|$)")
        self.results = {}  # nodeid -> (outcome, reason)
        self.deselected = []

    def label_of(self, name):
        m = self.pattern.search(name)
        return m.group(1) if m else None

    def pytest_collection_modifyitems(self, session, config, items):
        keep, drop = [], []
        for item in items:
            (keep if self.label_of(item.name) else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            self.deselected = [i.nodeid for i in drop]
        items[:] = keep

    def pytest_runtest_logreport(self, report):
        nodeid = report.nodeid
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if report.passed:
                self.results[nodeid] = ("passed", "")
            elif report.skipped:
                self.results[nodeid] = ("skipped", _skip_reason(report))
            else:
                kind = "failed" if report.when == "call" else "error"
                self.results[nodeid] = (kind, _reason(report))
        elif report.when == "teardown" and report.failed and self.results.get(nodeid, ("",))[0] == "passed":
            self.results[nodeid] = ("error", "teardown: " + _reason(report))


def _one_line(s, n=230):
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _skip_reason(report):
    lr = report.longrepr
    return _one_line(lr[2] if isinstance(lr, tuple) and len(lr) == 3 else lr)


def _reason(report, copy_name="test_optim_gwt.py"):
    lr = report.longrepr
    msg, where = None, None
    crash = getattr(lr, "reprcrash", None)
    if crash is not None:
        msg = crash.message
    entries = getattr(getattr(lr, "reprtraceback", None), "reprentries", None) or []
    for e in entries:  # the deepest frame inside gwt_optim, else the test's own last line
        loc = getattr(e, "reprfileloc", None)
        if loc is None:
            continue
        path = str(loc.path).replace(os.sep, "/")
        if "/gwt_optim/" in path:
            where = path[path.index("gwt_optim/"):] + f":{loc.lineno}"
        elif where is None or "gwt_optim/" not in where:
            if "test_optim_gwt" in path:
                where = f"{copy_name}:{loc.lineno}"
    if msg is None:
        msg = report.longreprtext.strip().splitlines()[-1] if report.longreprtext else "?"
    msg = msg.split("To execute this test, run the following")[0]  # torch's repro hint
    # torch's assertEqual messages put the useful part on the first lines
    msg = _one_line(msg)
    return msg + (f"  [at {where}]" if where else "")


# --------------------------------------------------------------------------- #


def _git(*args):
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


def _backend_note():
    """Which backend GWTAdamW's default (backend="auto") takes for a small matrix here."""
    try:
        import torch
        import gwt_optim
        from gwt_optim.optim._dispatch import choose
        from gwt_optim.optim.functional import step_level

        w = torch.nn.Parameter(torch.randn(10, 8))
        w.grad = torch.randn_like(w)
        opt = gwt_optim.GWTAdamW([w])
        g = opt.param_groups[0]
        r = choose(opt._kernels, g, w, w.grad, False, True, *step_level(w.shape, g["level"], g["scale"]))
        backend = type(r.backend).__name__ if r.backend is not None else None
        return f"backend={backend}" + (f" ({r.reason})" if r.reason else "")
    except Exception as e:  # noqa: BLE001
        return f"? ({type(e).__name__}: {e})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("test_optim", type=Path, help="path of a pytorch test/test_optim.py")
    ap.add_argument("--source", default="(not given)", help="where the test file came from (logged)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gwt_torch_suite"),
                    help="where the patched copy and a pytest.ini are written (default %(default)s)")
    ap.add_argument("--gwt-src", type=Path, default=None,
                    help="import gwt_optim from this src/ folder instead of the installed one\n"
                         "(e.g. a clean `git archive HEAD src | tar -x -C DIR` of a commit: DIR/src)")
    ap.add_argument("--entries", default=",".join(ENTRY_ORDER), help="comma-separated entries to run")
    ap.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset)")
    ap.add_argument("--pytest-arg", action="append", default=[], help="extra pytest argument (repeatable)")
    args = ap.parse_args(argv)

    os.environ.setdefault("PYTORCH_TESTING_DEVICE_ONLY_FOR", "cpu")
    src = args.test_optim.read_text()
    patched, notes = patch_test_file(src)
    args.workdir.mkdir(parents=True, exist_ok=True)
    copy = args.workdir / "test_optim_gwt.py"
    copy.write_text(patched)
    ini = args.workdir / "pytest.ini"
    ini.write_text("[pytest]\naddopts =\nfilterwarnings =\n    ignore::DeprecationWarning\n")

    if args.gwt_src is not None:
        sys.path.insert(0, str(args.gwt_src.resolve()))
    # torch's common_utils parses sys.argv when a test module imports it: give it none of ours.
    sys.argv = [sys.argv[0]]
    try:
        import expecttest  # noqa: F401  (torch.testing._internal needs it; not a gwt-optim dependency)
    except ImportError:
        raise SystemExit("torch.testing._internal needs expecttest: .venv/bin/python -m pip install expecttest")
    import pytest
    import torch
    from torch.testing._internal import common_optimizers as co

    import gwt_optim

    wanted = [e.strip() for e in args.entries.split(",") if e.strip()]
    unknown = set(wanted) - set(ENTRY_ORDER)
    if unknown:
        raise SystemExit(f"unknown entries: {sorted(unknown)} (known: {ENTRY_ORDER})")
    entries = [e for e in build_entries() if e.label in wanted]
    co.optim_db[:] = entries  # the test module's @optims(optim_db) read this list when it is imported

    dirty = _git("status", "--porcelain", "--", "src")
    print("# torch's TestOptimRenewed against gwt-optim\n")
    print(f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"- torch {torch.__version__}, commit {torch.version.git_version}")
    print(f"- gwt-optim {gwt_optim.__version__} at {REPO}, commit {_git('rev-parse', 'HEAD')}"
          f"{' (src/ has uncommitted changes)' if dirty else ''}")
    print(f"- gwt_optim imported from {Path(gwt_optim.__file__).parent}")
    if args.gwt_src is not None and (args.gwt_src.parent / "COMMIT").exists():
        print(f"  (its COMMIT file says {(args.gwt_src.parent / 'COMMIT').read_text().strip()})")
    print(f"- python {platform.python_version()}, pytest {pytest.__version__}, {platform.machine()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}, torch threads {torch.get_num_threads()}")
    print(f"- test file: {args.test_optim} ({len(src)} chars, sha256 {hashlib.sha256(src.encode()).hexdigest()[:16]}),"
          f" source: {args.source}")
    print(f"- patched copy: {copy}")
    for n in notes:
        print(f"  - {n}")
    print(f"- GWTAdamW default route on CPU for a 10x8 matrix: {_backend_note()}")
    print("- entries (inputs on cpu):")
    for e in entries:
        ins = e.optim_inputs_func("cpu", torch.float32)
        errs = e.optim_error_inputs_func("cpu", torch.float32)
        print(f"  - {e.label}: {e.optim_cls.__name__} mirroring {e.torch_name or 'AdamW inputs'}; "
              f"{len(ins)} inputs, {len(errs)} error inputs")
        for oi in ins:
            kw = {k: (f"tensor({v.item():g})" if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
                  for k, v in oi.kwargs.items()}
            print(f"    - {oi.desc}: {kw}")
    print()
    sys.stdout.flush()

    collector = Collector([e.label for e in entries])
    pytest_args = [str(copy), "-c", str(ini), "--rootdir", str(args.workdir), "-p", "no:xdist",
                   "-p", "no:cacheprovider", "-q", "--no-header", "-rN", "--tb=long", *args.pytest_arg]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    print(f"pytest {' '.join(pytest_args)}\n")
    sys.stdout.flush()
    t0 = time.time()
    rc = pytest.main(pytest_args, plugins=[collector])
    elapsed = time.time() - t0

    # ------------------------------------------------------------ report --- #
    counts = defaultdict(lambda: defaultdict(int))
    failing = defaultdict(list)
    for nodeid, (outcome, reason) in collector.results.items():
        label = collector.label_of(nodeid.split("::")[-1]) or "?"
        counts[label][outcome] += 1
        if outcome in ("failed", "error"):
            failing[label].append((nodeid.split("::", 1)[-1], outcome, reason))
        elif outcome == "skipped":
            failing.setdefault("_skipped", []).append((nodeid.split("::", 1)[-1], outcome, reason))

    print(f"\n## Results (pytest exit code {rc}, {elapsed:.0f} s; "
          f"{len(collector.deselected)} tests of no GWT entry deselected)\n")
    print("| entry | class | fixed kwargs | passed | failed | errors | skipped | total |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    total = defaultdict(int)
    fixed = {"GWTAdamW_eager": "backend='eager'", "GWTMuon_adamw": "use_muon=False"}
    for e in entries:
        c = counts.get(e.label, {})
        row = [c.get(k, 0) for k in ("passed", "failed", "error", "skipped")]
        for k, v in zip(("passed", "failed", "error", "skipped"), row):
            total[k] += v
        print(f"| {e.label} | {e.optim_cls.__name__} | {fixed.get(e.label, '-')} | "
              + " | ".join(str(v) for v in row) + f" | {sum(row)} |")
    print(f"| **all** | | | {total['passed']} | {total['failed']} | {total['error']} | {total['skipped']} | "
          f"{sum(total.values())} |")

    print("\n## Failing tests\n")
    if not any(failing.get(e.label) for e in entries):
        print("(none)")
    for e in entries:
        for test_id, outcome, reason in sorted(failing.get(e.label, [])):
            print(f"- `{test_id}`{' (error)' if outcome == 'error' else ''}: {reason}")
    if failing.get("_skipped"):
        print("\n## Skipped\n")
        for test_id, _, reason in sorted(failing["_skipped"]):
            print(f"- `{test_id}`: {reason}")
    return 0 if rc in (0, 1) else int(rc)


if __name__ == "__main__":
    sys.exit(main())
