"""Reliability of the optimizers: checked state, the kernel cache, non-finite
gradients, parameter and option checks, and the family hooks (issue 9)."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import functional_runs as runs
from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon
from gwt_optim import _toolchain
from gwt_optim.optim import _backends, _native

FAMILIES = {
    "GWTAdamW": lambda p, **kw: GWTAdamW(p, lr=1e-2, **kw),
    "GWTAdamMini": lambda p, **kw: GWTAdamMini(p, lr=1e-2, **kw),
    "GWTAdafactor": lambda p, **kw: GWTAdafactor(p, lr=1e-2, **kw),
    "GWTMuon": lambda p, **kw: GWTMuon(p, lr=1e-2, ns_dtype="float32", **kw),
}
CLASSES = {"GWTAdamW": GWTAdamW, "GWTAdamMini": GWTAdamMini, "GWTAdafactor": GWTAdafactor, "GWTMuon": GWTMuon}
# GWT-AdamW's three CPU paths: the native kernels, the eager fast path, the reference path.
PATHS = {
    "native": dict(backend="native"),
    "eager": dict(backend="eager"),
    "reference": dict(impl="reference", backend="eager"),
}


def _native_or_skip():
    try:
        _native.native_library()
    except _toolchain.KernelUnavailable as exc:
        pytest.skip(f"no C compiler for the native kernels: {exc}")


def _param(shape, seed=0, dtype=torch.float32):
    return torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype))


def _grad(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + seed), dtype=dtype)


def _stepped(shape, steps=2, **kw):
    W = _param(shape)
    opt = GWTAdamW([W], **kw)
    for t in range(steps):
        W.grad = _grad(shape, t)
        opt.step()
    return W, opt


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ------------------------------------------------------- checked state --- #


def test_load_refuses_the_state_of_a_parameter_of_another_shape():
    _, small = _stepped((16, 32))
    big = _param((256, 256))
    opt = GWTAdamW([big])
    with pytest.raises(ValueError, match=r"parameter 0 of group 0 \(shape \(256, 256\)\).*\(16, 8\).*\(256, 64\)"):
        opt.load_state_dict(small.state_dict())
    assert len(opt.state) == 0  # nothing was loaded


def test_load_checks_against_the_saved_level():
    _, level1 = _stepped((16, 32), level=1)  # moments (16, 16)
    opt = GWTAdamW([_param((16, 32))], level=2)
    # The saved group's level (1) comes with the state, so this fits ...
    opt.load_state_dict(level1.state_dict())
    assert opt.param_groups[0]["level"] == 1
    # ... but a level-1 state under a group saved as level 2 does not.
    sd = level1.state_dict()
    sd["param_groups"][0]["level"] = 2
    with pytest.raises(ValueError, match=r"parameter 0 of group 0.*'exp_avg' has shape \(16, 16\).*level 2 needs \(16, 8\)"):
        GWTAdamW([_param((16, 32))]).load_state_dict(sd)


@pytest.mark.parametrize("path", ["native", "eager", "reference"])
@pytest.mark.parametrize("new_level", [1, 3])
def test_changing_the_level_after_loading_is_a_clear_error(path, new_level):
    if path == "native":
        _native_or_skip()
    W, saved = _stepped((16, 32), level=2, **PATHS[path])
    opt = GWTAdamW([W], **PATHS[path])
    opt.load_state_dict(saved.state_dict())
    before = {k: v.clone() for k, v in opt.state[W].items()}
    opt.param_groups[0]["level"] = new_level
    W.grad = _grad((16, 32), 5)
    with pytest.raises(ValueError, match=r"GWTAdamW: parameter 0 of group 0 \(shape \(16, 32\)\): state 'exp_avg' has shape \(16, 8\)"):
        opt.step()
    for k, v in opt.state[W].items():  # nothing changed, not even the step count
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda st: st.__setitem__("exp_avg", torch.zeros(16, 16)), r"'exp_avg' has shape \(16, 16\)"),
        (lambda st: st.__setitem__("exp_avg_sq", torch.zeros(8, 16).t()), "'exp_avg_sq' is not contiguous"),
        (lambda st: st.__setitem__("exp_avg", st["exp_avg"].double()), "moment_dtype"),
        (lambda st: st.pop("exp_avg_sq"), "no tensor 'exp_avg_sq'"),
    ],
)
def test_native_kernels_never_see_unfit_state(corrupt, message):
    _native_or_skip()
    W, opt = _stepped((16, 32), backend="native")
    corrupt(opt.state[W])
    W.grad = _grad((16, 32), 9)
    before = W.detach().clone()
    with pytest.raises(ValueError, match=r"parameter 0 of group 0 .*" + message):
        opt.step()
    assert torch.equal(W.detach(), before)


def test_state_problem_is_the_one_state_check():
    from gwt_optim.optim._saved import state_problem

    W = _param((4, 16))
    good = {"exp_avg": torch.zeros(4, 4), "exp_avg_sq": torch.zeros(4, 4), "limiter_norm": torch.zeros(())}
    spec = {"exp_avg": (4, 4), "exp_avg_sq": (4, 4)}
    for fused in (None, torch.float32):
        assert state_problem(good, spec, 2, W, fused) is None
    assert state_problem(good, spec, 2) is None  # a saved state: shapes only
    assert state_problem(good, {"exp_avg": (4, 8)}, 1, W).startswith(
        "state 'exp_avg' has shape (4, 4), but level 1 needs (4, 8)")
    assert state_problem(good, {"exp_avg": (4, 8)}, 1).startswith("the saved state 'exp_avg' has shape (4, 4)")
    assert "moment_dtype" in state_problem(good, spec, 2, W, torch.bfloat16)
    assert state_problem(good, spec, 2, W, None) is None  # the eager path reads any floating moments
    # A gradient unlike its weight never reaches a fused backend: choose refuses it.
    from gwt_optim.optim._backends import CAPABILITIES

    for bad in (torch.zeros(4, 8), torch.zeros(16, 4).t()):
        assert CAPABILITIES["native"].refusal(W, bad, torch.float32, 2, GWTAdamW([W]).param_groups[0], False)


# -------------------------------------------------------- kernel cache --- #


def _build_in(monkeypatch, directory) -> Path:
    monkeypatch.setenv("GWT_OPTIM_CACHE", str(directory))
    try:
        lib = _native.native_library.__wrapped__()
    except _toolchain.KernelUnavailable as exc:
        pytest.skip(f"no C compiler for the native kernels: {exc}")
    return Path(lib._name)


def _build_in_child(directory: Path) -> Path:
    """Build in a child process: a library this process has loaded must not
    be rewritten under it (and dlopen would hand back the loaded copy)."""
    script = "from gwt_optim.optim import _native; print(_native.native_library()._name)"
    env = {**os.environ, "GWT_OPTIM_CACHE": str(directory)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "KernelUnavailable" in proc.stderr:
        pytest.skip("no C compiler for the native kernels")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A cache holding the native library, built once by a child process; each test changes a copy."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    _build_in_child(cache)
    return cache


def _copy(built: Path, cache: Path) -> Path:
    shutil.copytree(built, cache)
    return cache


def _assert_verified(directory: Path) -> None:
    (pointer,) = directory.glob("adamw_haar_*.sha256")
    digest = pointer.read_text().strip()
    (lib,) = [p for p in directory.glob("adamw_haar_*.so") if digest[:16] in p.name]
    assert hashlib.sha256(lib.read_bytes()).hexdigest() == digest


def test_a_process_that_skips_its_exit_handlers_leaves_nothing_in_tmpdir(tmp_path, built_cache):
    """Each process loads a private copy of the checked library; multiprocessing's workers (gloo tests,
    DataLoader workers) end in os._exit, which runs no atexit handler, so the copy and its folder must be
    gone as soon as the library is loaded: they were left in $TMPDIR, one folder per process."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = ("import os; from gwt_optim.optim import _native; lib = _native.native_library(); "
              "lib2 = _native.native_library.__wrapped__(); print(sorted(os.listdir(os.environ['TMPDIR']))); "
              "os._exit(0)")
    env = {**os.environ, "GWT_OPTIM_CACHE": str(built_cache), "TMPDIR": str(tmp)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"  # two loads, both usable, nothing left even while the process runs
    assert list(tmp.iterdir()) == []


def test_a_truncated_cached_library_is_rebuilt_not_loaded(monkeypatch, tmp_path, built_cache):
    cache = _copy(built_cache, tmp_path / "cache")
    (data,) = {so.read_bytes() for so in (cache / "kernels").glob("*.so")}
    for so in (cache / "kernels").glob("*.so"):
        so.write_bytes(data[: len(data) // 3])
    # In a child: loading a truncated library can kill the process (SIGBUS).
    script = textwrap.dedent(
        """
        import torch
        from gwt_optim import GWTAdamW
        W = torch.nn.Parameter(torch.ones(4, 16))
        opt = GWTAdamW([W], backend="native")
        W.grad = torch.ones(4, 16)
        opt.step()
        assert torch.isfinite(W).all() and not torch.equal(W, torch.ones(4, 16))
        """
    )
    env = {**os.environ, "GWT_OPTIM_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    _assert_verified(cache / "kernels")


def test_a_garbage_cached_library_is_rebuilt(monkeypatch, tmp_path, built_cache):
    cache = _copy(built_cache, tmp_path / "cache")
    for so in (cache / "kernels").glob("*.so"):
        so.write_bytes(b"\x7fELF not a library" * 100)
    lib = _build_in(monkeypatch, cache)
    assert lib.parent == cache / "kernels"  # $GWT_OPTIM_CACHE/kernels: the one cache rule
    _assert_verified(cache / "kernels")


def _assert_private(directory: Path) -> None:
    st = directory.stat()
    assert st.st_uid == os.getuid()
    assert stat.S_IMODE(st.st_mode) == 0o700


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_an_uncreatable_cache_dir_falls_back_to_a_private_directory(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="private temporary directory|for this process only"):
        lib = _build_in(monkeypatch, blocker / "cache")
    assert lib.parent != Path("/tmp/gwt_optim")
    _assert_private(lib.parent)


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_a_cache_dir_other_users_can_write_is_not_used(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    # $GWT_OPTIM_CACHE=shared: its kernels/ folder would be ours, but others could swap it
    with pytest.warns(RuntimeWarning, match="other users can (write|replace)"):
        lib = _build_in(monkeypatch, shared)
    assert shared not in lib.parents
    _assert_private(lib.parent)


def test_a_new_cache_dir_is_private(monkeypatch, tmp_path):
    lib = _build_in(monkeypatch, tmp_path / "a" / "cache")
    assert lib.parent == tmp_path / "a" / "cache" / "kernels"
    _assert_private(lib.parent)


# -------------------------------------------------- non-finite gradients --- #

BAD = {
    "nan": lambda g: g.index_put_((torch.tensor([1]), torch.tensor([5])), torch.tensor(float("nan"), dtype=g.dtype)),
    "inf": lambda g: g.index_put_((torch.tensor([2]), torch.tensor([0])), torch.tensor(float("inf"), dtype=g.dtype)),
    # +inf and -inf in one block: the block sum is NaN, not an infinity
    "inf-inf": lambda g: g.index_put_(
        (torch.tensor([0, 0]), torch.tensor([4, 5])), torch.tensor([float("inf"), -float("inf")], dtype=g.dtype)
    ),
}


def _run_with_bad_step(path, bad, dtype, bad_steps=(2,), steps=5):
    """Two parameters (a matrix and a bias), the matrix's gradient non-finite at ``bad_steps``."""
    W, b = _param((8, 32), 1, dtype), _param((32,), 2, dtype)
    opt = GWTAdamW([W, b], lr=1e-2, weight_decay=0.1, **PATHS[path])
    snapshots = {}
    for t in range(1, steps + 1):
        W.grad, b.grad = _grad((8, 32), t, dtype), _grad((32,), 50 + t, dtype)
        if t in bad_steps:
            BAD[bad](W.grad)
            snapshots[t] = (W.detach().clone(), {k: v.clone() for k, v in opt.state[W].items()}, b.detach().clone())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        snapshots[t, "warnings"] = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    return W, b, opt, snapshots


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_non_finite_gradient_skips_that_parameter(path, bad):
    if path == "native":
        _native_or_skip()
    W, b, opt, snaps = _run_with_bad_step(path, bad, torch.float32, bad_steps=(2, 3))
    # after a skipped step, the weight and every state tensor are as before it
    for t, nxt in ((2, 3), (3, 4)):
        W_before, state_before, b_before = snaps[t]
        if nxt in snaps:
            W_after, state_after, b_after = snaps[nxt]
            assert torch.equal(W_after, W_before)
            for k, v in state_before.items():
                if k == "step":
                    assert state_after[k].item() == v.item() + 1  # the step count advances
                else:
                    assert torch.equal(state_after[k], v), k
            assert not torch.equal(b_after, b_before)  # the other parameter stepped
    assert opt.nonfinite_skips == 2
    warned = snaps[2, "warnings"]
    assert len(warned) == 1 and "parameter 0 of group 0 (shape (8, 32))" in str(warned[0].message)
    assert Path(warned[0].filename) == Path(__file__)  # it names the user's opt.step(), not the library
    assert snaps[3, "warnings"] == []  # once per optimizer
    assert torch.isfinite(W).all() and torch.isfinite(b).all()
    for v in opt.state[W].values():
        assert torch.isfinite(v).all()
    assert opt.state[W]["step"].item() == 5


@pytest.mark.parametrize("how", ["step_param", "step_in_backward"])
def test_the_non_finite_warning_names_the_users_line(how):
    from gwt_optim import step_in_backward

    W = torch.nn.Parameter(torch.randn(8, 32))
    opt = GWTAdamW([W], lr=1e-2, level=2)
    if how == "step_in_backward":
        step_in_backward(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "step_param":
            W.grad = torch.full_like(W, float("nan"))
            line = sys._getframe().f_lineno + 1
            opt.step_param(W)
        else:
            line = sys._getframe().f_lineno + 1
            (W * float("nan")).sum().backward()
    warned = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(warned) == 1 and "NaN or an infinity" in str(warned[0].message)
    assert (Path(warned[0].filename), warned[0].lineno) == (Path(__file__), line)
    assert opt.nonfinite_skips == 1 and torch.isfinite(W).all()


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("bad_steps", [(1,), (2, 4)])
def test_all_paths_agree_after_non_finite_gradients(bad, bad_steps):
    _native_or_skip()
    results = {p: _run_with_bad_step(p, bad, torch.float64, bad_steps=bad_steps) for p in PATHS}
    # What every path must give: functional.gwt_adamw on the same gradients, skipping the same steps.
    grads = [[_grad((8, 32), t, torch.float64), _grad((32,), 50 + t, torch.float64)] for t in range(1, 6)]
    for t in bad_steps:
        BAD[bad](grads[t - 1][0])
    start = [_param((8, 32), 1, torch.float64).detach(), _param((32,), 2, torch.float64).detach()]
    (ref_W, ref_b), (run_W, _) = runs.train(runs.AdamW, start, grads, lr=1e-2, weight_decay=0.1)
    assert run_W.skips == len(bad_steps)
    for path, (W, b, opt, _) in results.items():
        torch.testing.assert_close(W.detach(), ref_W, rtol=1e-10, atol=1e-12, msg=path)
        torch.testing.assert_close(b.detach(), ref_b, rtol=1e-10, atol=1e-12, msg=path)
        s = opt.state[W]["limiter_norm"]
        assert torch.isfinite(s) and s > 0, path
        torch.testing.assert_close(s, run_W.state["limiter_norm"], rtol=1e-10, atol=0, msg=path)
        assert opt.nonfinite_skips == len(bad_steps)


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_skips_non_finite_gradients(family, bad):
    W = _param((8, 32))
    opt = FAMILIES[family]([W], backend="eager")
    W.grad = _grad((8, 32), 0)
    opt.step()
    W_before = W.detach().clone()
    state_before = {k: v.clone() for k, v in opt.state[W].items()}
    W.grad = _grad((8, 32), 1)
    BAD[bad](W.grad)
    with pytest.warns(RuntimeWarning, match=rf"{family}: the gradient of parameter 0 of group 0 \(shape \(8, 32\)\)"):
        opt.step()
    assert torch.equal(W.detach(), W_before)
    for k, v in state_before.items():
        assert torch.equal(opt.state[W][k], v + (k == "step")), k
    assert opt.nonfinite_skips == 1
    W.grad = _grad((8, 32), 2)
    opt.step()
    assert torch.isfinite(W).all() and not torch.equal(W.detach(), W_before)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_eager_path_checks_every_gradient_at_once(family, monkeypatch):
    """On a GPU, reading whether a gradient is finite waits for the device;
    the eager path did that once per parameter, stalling every parameter's
    launches behind the previous one's kernels. It now checks all gradients in
    one foreach norm per step, with the same results. Forced on CPU here (``_check_waits``). GWT-AdamW runs eager here
    (backend="eager"); with its fused kernels, they check gradients themselves."""
    from gwt_optim.optim import _stepper

    def train(at_once: bool):
        calls = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_stepper, "_check_waits", lambda g: at_once)
            foreach_norm = torch._foreach_norm
            mp.setattr(torch, "_foreach_norm", lambda ts, *a, **k: (calls.append(len(ts)), foreach_norm(ts, *a, **k))[1])
            params = [_param((8, 32), 1), _param((6, 16), 2), _param((4, 8, 8), 3), _param((32,), 4)]
            groups = params
            if family == "GWTMuon":  # Muon takes 2-D weights; the rest go to its AdamW groups
                groups = [{"params": params[:2]}, {"params": params[2:], "use_muon": False}]
            opt = FAMILIES[family](groups, backend="eager")
            for t in range(3):
                for i, p in enumerate(params):
                    p.grad = _grad(tuple(p.shape), 10 * t + i)
                if t == 1:
                    BAD["nan"](params[1].grad)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    opt.step()
        return params, opt, calls

    got, opt, calls = train(at_once=True)
    want, ref, ref_calls = train(at_once=False)
    assert calls == [4, 4, 4] and ref_calls == []
    assert opt.nonfinite_skips == ref.nonfinite_skips == 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for sa, sb in zip(opt.state.values(), ref.state.values()):
        for key in sb:
            assert torch.equal(sa[key], sb[key]), key


def test_fused_gwt_adamw_leaves_the_checks_to_its_kernels(monkeypatch):
    from gwt_optim.optim import _stepper

    _native_or_skip()
    monkeypatch.setattr(_stepper, "_check_waits", lambda g: True)
    calls = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **k: (calls.append(len(ts)), foreach_norm(ts, *a, **k))[1])
    params = [_param((8, 32), 1), _param((6, 16), 2)]
    opt = GWTAdamW([{"params": params[:1]}, {"params": params[1:], "moment_dtype": "int8"}], lr=1e-2, backend="native")
    for p in params:
        p.grad = _grad(tuple(p.shape), 0)
    opt.step()
    assert calls == [1]  # the int8 group's weight only: the native kernels check the other


# ------------------------------------------------------------ parameters --- #


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_non_real_floating_parameters_are_refused(family, dtype):
    bad = torch.zeros(4, 8, dtype=dtype)
    if dtype.is_complex:
        bad = torch.nn.Parameter(bad)
    kind = "complex" if dtype.is_complex else str(dtype)
    with pytest.raises(ValueError, match=rf"{family}: parameter 0 of group 0 \(shape \(4, 8\)\) is {kind}"):
        FAMILIES[family]([bad])
    opt = FAMILIES[family]([_param((4, 8))])
    with pytest.raises(ValueError, match=rf"parameter 1 of group 1 \(shape \(4, 8\)\) is {kind}"):
        opt.add_param_group({"params": [_param((4, 8)), bad]})
    assert len(opt.param_groups) == 1  # the bad group was not added


def test_add_param_group_still_takes_generators_and_single_tensors():
    opt = GWTAdamW([_param((4, 8))])
    opt.add_param_group({"params": (p for p in [_param((4, 8), 1)])})
    opt.add_param_group({"params": _param((4, 8), 2)})
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1, 1]


@pytest.mark.parametrize("shape", [(0, 8), (8, 0), (0,)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_zero_size_parameters_are_a_no_op(family, shape):
    W, E = _param((4, 8)), torch.nn.Parameter(torch.zeros(shape))
    use_muon = family == "GWTMuon" and len(shape) != 2
    groups = [{"params": [W]}, {"params": [E], **({"use_muon": False} if use_muon else {})}]
    opt = FAMILIES[family](groups)
    for t in range(2):
        W.grad, E.grad = _grad((4, 8), t), torch.zeros(shape)
        opt.step()
    assert E.shape == shape and torch.isfinite(W).all()


# ---------------------------------------------------------- option values --- #


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_string_learning_rate_is_a_value_error(family):
    with pytest.raises(ValueError, match="Invalid learning rate: '1e-3'"):
        CLASSES[family]([_param((4, 8))], lr="1e-3")
    with pytest.raises(ValueError, match="Invalid weight_decay"):
        GWTAdamW([_param((4, 8))], weight_decay="0.1")


def _saved(family_or_cls, **kw):
    W = _param((8, 32))
    opt = family_or_cls([W], **kw)
    W.grad = _grad((8, 32), 0)
    opt.step()
    return _roundtrip(opt.state_dict())


def test_a_torch_adamw_state_dict_is_refused_by_name():
    sd = _saved(torch.optim.AdamW)
    opt = GWTAdamW([_param((8, 32))])
    with pytest.raises(ValueError, match="saved by torch.optim.AdamW.*cannot be loaded into GWTAdamW"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize(
    "saver, loader",
    [(s, l) for s in ("GWTAdamW", "GWTAdamMini", "GWTMuon") for l in ("GWTAdamW", "GWTAdamMini", "GWTAdafactor") if s != l],
)
def test_another_familys_state_dict_is_refused_by_name(saver, loader):
    sd = _saved(FAMILIES[saver])
    opt = FAMILIES[loader]([_param((8, 32))])
    with pytest.raises(ValueError, match=f"saved by {saver}; it cannot be loaded into {loader}"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_untagged_state_dicts_still_load(family):
    """State dicts saved before the family tag (and through weights_only loads)."""
    sd = _saved(FAMILIES[family])
    assert {g["optimizer"] for g in sd["param_groups"]} == {family}
    for g in sd["param_groups"]:
        del g["optimizer"]
    W = _param((8, 32))
    opt = FAMILIES[family]([W])
    opt.load_state_dict(sd)
    assert "optimizer" not in opt.param_groups[0]
    W.grad = _grad((8, 32), 1)
    opt.step()
    assert opt.state[W]["step"].item() == 2


def test_an_untagged_state_dict_of_another_family_is_refused():
    sd = _saved(FAMILIES["GWTAdamW"])
    for g in sd["param_groups"]:
        del g["optimizer"]
    with pytest.raises(ValueError, match="saved by GWTAdamW; it cannot be loaded into GWTAdamMini"):
        FAMILIES["GWTAdamMini"]([_param((8, 32))]).load_state_dict(sd)


# ------------------------------------------------------------------ hooks --- #


@pytest.mark.parametrize("family", ["GWTAdamW", "GWTMuon", "GWTAdamMini", "GWTAdafactor"])
def test_the_eager_step_is_the_functional_halves(family, monkeypatch):
    """An eager step runs the family's functional.gwt_*_moments and
    gwt_*_apply, once per parameter, and nothing else of the update."""
    from gwt_optim.optim import functional as F

    name = {"GWTAdamW": "adamw", "GWTMuon": "muon", "GWTAdamMini": "adam_mini", "GWTAdafactor": "adafactor"}[family]
    calls = []
    for half in ("moments", "apply"):
        real = getattr(F, f"gwt_{name}_{half}")
        monkeypatch.setattr(F, f"gwt_{name}_{half}",
                            lambda *a, _real=real, _half=half, **k: calls.append((_half, id(a[0]))) or _real(*a, **k))
    W = _param((8, 32))
    opt = FAMILIES[family]([W], **({"backend": "eager"} if family == "GWTAdamW" else {}))
    W.grad = _grad((8, 32), 0)
    opt.step()
    assert calls == [("moments", id(W)), ("apply", id(W))]


def test_families_use_the_hooks_not_the_private_phase():
    from gwt_optim.optim._base import GWTOptimizer

    for cls in (GWTMuon, GWTAdafactor, GWTAdamMini, GWTAdamW):
        for name in ("state_dict", "load_state_dict", "add_param_group", "_count"):
            assert getattr(cls, name) is getattr(GWTOptimizer, name), (cls, name)
    for name in ("_shape_in_step", "_param_in_step"):
        assert not hasattr(GWTMuon([_param((4, 8))]), name)
        assert not hasattr(GWTAdafactor([_param((4, 8))]), name)


def test_the_fused_backend_protocol_is_a_typing_protocol():
    from typing import Protocol

    assert Protocol in _backends.FusedBackend.__mro__
    members = ("prepare", "phase1", "phase2", "step_buckets")
    for name in members:
        assert callable(getattr(_backends.FusedBackend, name))
        assert callable(getattr(_native.NativeBackend, name))
    assert _native.NativeBackend.capabilities.batched is True


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_impl_and_backend(how):
    import copy
    import pickle

    from gwt_optim import GWTAdamW

    p = torch.nn.Parameter(torch.randn(8, 32))
    opt = GWTAdamW([p], lr=1e-2, impl="reference", backend="eager")
    p.grad = torch.randn(8, 32)
    opt.step()
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert (twin._impl, twin._backend) == ("reference", "eager")
    q = next(iter(twin.state))
    q.grad = p.grad.clone()
    twin.step()
    assert twin._kernels.refusal(twin.param_groups[0]) == "impl='reference' runs the eager path"
    assert twin.state[q]["step"].item() == 2
