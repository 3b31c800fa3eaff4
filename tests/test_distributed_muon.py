"""GWT-Muon on sharded parameters (4 CPU processes, gloo) equals one process.

Each Muon-group matrix is orthogonalized once, whole, on an owner rank of the
mesh dimension that shards its rows (``_sharded.on_whole_matrices``). Checked
in one launch of four processes:

* DTensor parameters given the gradients of a single-process run: bitwise
  equal to it, at bf16 Newton-Schulz, on a 1-D mesh of 4 (uneven shards, one
  rank's shard of a matrix empty), on 1-D meshes of 2 and on a 2x2 (replicate,
  shard) HSDP mesh; Newton-Schulz runs once per matrix, whole, on its owner,
  and the bytes sent between ranks are the rows off each owner, there and back;
* FSDP2 training (``fully_shard``, 1-D mesh of 4) and HSDP training (2x2),
  float64 with float64 Newton-Schulz, to ~1e-12 of one process, with a NaN
  in a row that some ranks hold (every rank skips that weight);
* DCP: saved after two steps at 4 shards, resumed at 4 (bitwise), on the 2x2
  mesh (2 shards) and in one process, each ends where the uninterrupted run does;
* the layouts that stay refused, each with one line.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from _launch import launch

from gwt_optim import GWTMuon
from gwt_optim.optim import muon
from gwt_optim.optim._sharded import _owners, row_chunks

pytestmark = pytest.mark.distributed

WORLD = 4
STEPS = 4
NAN_STEP = 2  # the first weight's last row gets a NaN here: every rank skips that weight
SAVE_AFTER = 2
SHAPES = [(5, 12), (7, 5), (2, 7), (3, 8), (1, 8)]  # rows 5 over 4 ranks: 2, 2, 1, 0; over 2: 3, 2


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 5), torch.nn.Tanh(), torch.nn.Linear(5, 7), torch.nn.Tanh(),
        torch.nn.Linear(7, 2), torch.nn.Tanh(), torch.nn.Linear(2, 3),
    ).double()


def make_opt(model, ns_dtype="float64"):
    # The hidden weights in Muon groups; the head and the biases in an AdamW group, with the limiter.
    params = list(model.parameters())
    hidden = [p for p in params[:-2] if p.ndim == 2]
    rest = [p for p in params if all(p is not q for q in hidden)]
    adamw = {"params": rest, "use_muon": False, "lr": 3e-3, "level": 1, "norm_growth_limit": 1.01}
    return GWTMuon([{"params": hidden}, adamw], lr=0.02, weight_decay=0.1, level=2, ns_dtype=ns_dtype)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64))
            for _ in range(STEPS)]


def single_process_run(resume_from=None):
    model = make_model()
    opt = make_opt(model)
    first = 0
    if resume_from is not None:
        _dcp_load(model, opt, resume_from)
        first = SAVE_AFTER
    for t, (x, y) in enumerate(batches()):
        if t < first:
            continue
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if t == NAN_STEP:
            model[0].weight.grad[-1, 0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
    assert opt.nonfinite_skips == 1
    return [p.detach().clone() for p in model.parameters()]


def _dcp_load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)  # the fresh run's own layout, which DCP loads into
    with warnings.catch_warnings():  # in one process, DCP says it loads in one process
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def _meshes():
    from torch.distributed.device_mesh import init_device_mesh

    return {"fsdp": init_device_mesh("cpu", (WORLD,)),
            "hsdp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}


def _worker(rank, out_dir):
    meshes = _meshes()
    out = {"refused": _refusals(meshes["hsdp"])}
    # FSDP on 4 ranks, on 2 (each replica's shard dimension alone, a 1-D mesh) and HSDP on 2x2.
    for name, mesh in (*meshes.items(), ("fsdp-2", meshes["hsdp"]["shard"])):
        out[f"given-{name}"] = _given_gradients(mesh)
    dcp_dir = os.path.join(out_dir, "dcp")
    out["fsdp"] = _train(meshes["fsdp"], dcp_dir)
    out["fsdp-resumed"] = _train(meshes["fsdp"], dcp_dir, resume=True)
    out["hsdp"] = _train(meshes["hsdp"])
    out["hsdp-resumed"] = _train(meshes["hsdp"], dcp_dir, resume=True)
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "out.pt"))


def _refusals(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    said = []
    for placements in ((Shard(0), Shard(0)), (Shard(0), Shard(1))):
        w = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 8, dtype=torch.float64), mesh, placements))
        try:
            GWTMuon([{"params": [w]}])
        except ValueError as e:
            said.append(str(e))
    return said


def _given_gradients(mesh):
    """Every rank's DTensor weights and gradients are shards of the same full
    tensors; the bf16 result gathered whole, with the momentum's layout."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    g = torch.Generator().manual_seed(2)
    full = [torch.randn(s, generator=g, dtype=torch.float32) for s in SHAPES]
    grads = [[torch.randn(s, generator=g, dtype=torch.float32) for s in SHAPES] for _ in range(3)]
    params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, placements)) for w in full]
    opt = GWTMuon([{"params": params}], lr=0.02, weight_decay=0.1, level=2, ns_dtype="bfloat16",
                  adjust_lr_fn="match_rms_adamw")
    calls, sent = [], []  # the shapes Newton-Schulz ran on here; the bytes this rank sent to other ranks
    orthogonalize, all_to_all = muon.zeropower_via_newtonschulz, dist.all_to_all_single

    def counted(output, input, output_sizes, input_sizes, group=None):
        me = dist.get_rank(group)
        sent.append(sum(n for r, n in enumerate(input_sizes) if r != me) * input.element_size())
        return all_to_all(output, input, output_sizes, input_sizes, group=group)

    muon.zeropower_via_newtonschulz = lambda X, *a: calls.append(tuple(X.shape)) or orthogonalize(X, *a)
    dist.all_to_all_single = counted
    try:
        for step in grads:
            for p, grad in zip(params, step):
                p.grad = distribute_tensor(grad, mesh, placements)
            opt.step()
    finally:
        muon.zeropower_via_newtonschulz, dist.all_to_all_single = orthogonalize, all_to_all
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (calls, sum(sent)))
    buf = opt.state[params[0]]["momentum_buffer"]
    layout = (type(buf).__name__, tuple(buf.shape), tuple(buf.placements) == tuple(params[0].placements))
    return {"params": [p.full_tensor() for p in params], "full": full, "grads": grads, "layout": layout,
            "calls": everyone, "replicas": dist.get_world_size() // mesh.size(mesh.ndim - 1)}


def _train(mesh, dcp_dir=None, resume=False):
    """FSDP2 (1-D mesh) or HSDP (2-D) training on this rank's quarter of each
    batch: saved through DCP after SAVE_AFTER steps (with ``dcp_dir``), or
    with ``resume`` loaded from there into a fresh model and run to the end."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_opt(model)
    first = 0
    if resume:
        _dcp_load(model, opt, dcp_dir)
        first = SAVE_AFTER
    rank = dist.get_rank()
    for t, (x, y) in enumerate(batches()):
        if t < first:
            continue
        if dcp_dir and t == SAVE_AFTER and not resume:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank]).backward()
        if t == NAN_STEP:
            grad = model[0].weight.grad
            local, shards = grad.to_local(), grad.device_mesh.size(grad.device_mesh.ndim - 1)
            coordinate = grad.device_mesh.get_local_rank(grad.device_mesh.ndim - 1)
            if coordinate == (grad.shape[0] - 1) // -(-grad.shape[0] // shards):  # this rank holds the last row
                local[-1, 0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
    buf = opt.state[model[0].weight]["momentum_buffer"]
    return {"params": [p.full_tensor() for p in model.parameters()], "skips": opt.nonfinite_skips,
            "layout": (type(buf).__name__, tuple(buf.shape), tuple(buf.placements) == tuple(model[0].weight.placements))}


def _given_gradients_single(full, grads):
    params = [torch.nn.Parameter(w.clone()) for w in full]
    opt = GWTMuon([{"params": params}], lr=0.02, weight_decay=0.1, level=2, ns_dtype="bfloat16",
                  adjust_lr_fn="match_rms_adamw")
    for step in grads:
        for p, grad in zip(params, step):
            p.grad = grad.clone()
        opt.step()
    return [p.detach() for p in params]


def test_row_chunks_and_owners():
    """torch.chunk's split (FSDP2's, DTensor's), empty shards included; owners by Newton-Schulz cost."""
    assert [row_chunks(m, 4) for m in (5, 7, 2, 3, 1)] == [[2, 2, 1, 0], [2, 2, 2, 1], [1, 1, 0, 0], [1, 1, 1, 0],
                                                        [1, 0, 0, 0]]
    for m in range(1, 12):
        for k in range(1, 5):
            chunks = [len(c) for c in torch.arange(m).chunk(k)]
            assert row_chunks(m, k) == chunks + [0] * (k - len(chunks))
    # Largest first, each to the least loaded rank: the two big ones apart, the small ones after them.
    assert _owners([(4, 4), (64, 64), (8, 8), (64, 64), (2, 2)], 2) == [1, 0, 0, 1, 1]


def test_sharded_gwt_muon_equals_one_process(tmp_path):
    launch(_worker, WORLD, tmp_path, str(tmp_path))
    out = torch.load(tmp_path / "out.pt", weights_only=True)

    # The layouts an owner cannot reassemble, refused at construction, one line each.
    assert len(out["refused"]) == 2 and all("\n" not in e for e in out["refused"])
    assert "Shard(0) on one mesh dimension" in out["refused"][0]
    assert "transforms along the last axis" in out["refused"][1]

    # The same gradients: one process's bits, through bf16 Newton-Schulz.
    for name in ("given-fsdp", "given-fsdp-2", "given-hsdp"):
        got = out[name]
        expected = _given_gradients_single(got["full"], got["grads"])
        assert all(torch.equal(a, b) for a, b in zip(got["params"], expected, strict=True)), name
        assert got["layout"] == ("DTensor", (5, 3), True), name  # the momentum: a quarter, sharded like the weight
        # Newton-Schulz ran once per matrix and step in each replica group, on the whole matrix, spread over ranks.
        calls = [shape for rank, _ in got["calls"] for shape in rank]
        assert sorted(calls) == sorted(SHAPES * len(got["grads"]) * got["replicas"]), name
        assert sum(bool(rank) for rank, _ in got["calls"]) > got["replicas"], name
        # What crossed between ranks: each matrix's rows off its owner, there and back, in bf16 (2 bytes).
        ranks = WORLD // got["replicas"]
        owners = _owners(SHAPES, ranks)
        per_step = sum(2 * (m - row_chunks(m, ranks)[o]) * n * 2 for (m, n), o in zip(SHAPES, owners))
        assert sum(b for _, b in got["calls"]) == per_step * len(got["grads"]) * got["replicas"], name

    # Training: FSDP2 and HSDP gradients are reduced in another order, so ~1e-12 rather than bits.
    expected = single_process_run()
    for name in ("fsdp", "hsdp", "fsdp-resumed", "hsdp-resumed"):
        assert out[name]["skips"] == 1, name
        assert out[name]["layout"] == ("DTensor", (5, 3), True), name
        for a, b in zip(out[name]["params"], expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    # DCP saved at 4 shards: resumed at 4, bitwise; at 2 (HSDP above) and in one process, as one run.
    assert all(torch.equal(a, b) for a, b in zip(out["fsdp-resumed"]["params"], out["fsdp"]["params"]))
    for a, b in zip(single_process_run(resume_from=str(tmp_path / "dcp")), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
