"""The one rule for sharded (DTensor) parameters (``gwt_optim.optim._sharded``)
on every layout the families meet, against one process.

One launch of 4 CPU processes (gloo, float64) trains each family on each
layout and compares the whole weights with a single-process run of the same
model on the same batches:

* ``fsdp``: FSDP2 on a 1-D mesh of 4 ranks; weights of 5, 7, 3 and 2 rows, so
  shards are uneven and some ranks hold empty ones. A NaN in one rank's shard
  of a gradient at NAN_STEP: every rank skips that weight.
* ``fsdp3``: the same on a 3-rank sub-mesh (rank 3 idles), other empty
  shards, resumed from the ``fsdp`` run's checkpoint (below), the NaN ahead.
* ``hsdp``: HSDP, fully_shard on a 2x2 (replicate, shard) mesh.
* ``tp``: FSDP2 + tensor parallelism on a 2x2 (dp, tp) mesh: ColwiseParallel
  on two layers (FSDP2 then places them (_StridedShard(0), Shard(0))).
* ``dtensor``: parameters placed by hand on a 1-D mesh of 4 ranks: a
  replicated matrix (Replicate()), a 3-D weight (grouped experts) sharded on
  dim 1, a vector sharded on dim 0, and for Adam-mini a head-block matrix
  whose shards hold whole heads.

Each family runs with its limiter on (the norm must sum over the sharding
mesh dimensions only, not the replicated one), and GWT-AdamW also with
``moment_dtype="int8"``. DCP: the ``fsdp`` and ``dtensor`` runs save after
SAVE_AFTER step at 4 ranks; fresh models and optimizers on 3 and 2 ranks load
them (the state must come back whole and bitwise) and run to the end, which
must equal one process. Layouts a family cannot take are refused with one
line, on every rank (REFUSED: GWT-Muon's Muon groups on FSDP2 + TP).

The test costs about 46 s of CPU time in all (the pytest process, the fork server and 4 ranks,
user and system; 53 s when each rank was spawned and imported torch itself, tests/_launch.py):
75-90 s of wall time on 2 cores at a load average of 12-14.
"""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from _launch import launch

from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon

pytestmark = pytest.mark.distributed

WORLD = 4
STEPS = 4
SAVE_AFTER = 1
NAN_STEP = 2  # the fsdp runs' NaN: after the DCP save, so the run resumed at 3 ranks meets it too
BATCH = 12  # splits evenly over 4, 3 and 2 ranks: the mean of the ranks' mean losses is the whole batch's

# Adam-mini's blocks on the model: a whole-tensor block and an element block
# on two biases, one second moment per row elsewhere (a vector's "neuron" is
# the whole vector: both need the shards' sums), whole heads on "heads", and
# elements on the experts (a sharded 3-D weight's rows are refused: see below).
MINI_BLOCKS = {"0.bias": "tensor", "2.bias": "element", "heads": "head", "experts": "element"}
HEAD_DIM = 2


def _mini_groups(named):
    return [{"params": [p], "block": MINI_BLOCKS.get(n, "neuron"), "head_dim": HEAD_DIM} for n, p in named]


def _muon(named):
    """GWT-Muon: the matrices in Muon groups (float64 Newton-Schulz), the rest in an AdamW group."""
    hidden = [p for _, p in named if p.ndim == 2]
    rest = {"params": [p for _, p in named if p.ndim != 2], "use_muon": False, "lr": 1e-2, "norm_growth_limit": 1.01}
    return GWTMuon([{"params": hidden}, rest], lr=0.02, weight_decay=0.1, level=2, ns_dtype="float64")


# name -> optimizer from named parameters
FAMILIES = {
    "adamw": lambda named: GWTAdamW([p for _, p in named], lr=1e-2, weight_decay=0.01, level=2),
    "adamw-int8": lambda named: GWTAdamW([p for _, p in named], lr=1e-2, weight_decay=0.01, level=2,
                                         moment_dtype="int8"),
    "adam-mini": lambda named: GWTAdamMini(_mini_groups(named), lr=1e-2, weight_decay=0.01, level=2),
    "adafactor": lambda named: GWTAdafactor([p for _, p in named], lr=1e-2, level=2, beta1=0.9,
                                            norm_growth_limit=1.01),
    "muon": _muon,
}
# Layouts a family refuses, by design, with a line that says so (docs/scaling-out.md).
REFUSED = {
    # Newton-Schulz gathers a Muon matrix from row shards of one mesh dimension; TP adds a second.
    ("muon", "tp"): "GWT-Muon gathers each Muon-group matrix from its row shards",
}

LAYOUTS = ("fsdp", "hsdp", "tp", "dtensor")
DCP_LAYOUTS = {"fsdp": "fsdp3", "dtensor": "dtensor2"}  # saved at 4 ranks -> loaded on this layout
RESUMED = tuple(f"{target}<-{saved}" for saved, target in DCP_LAYOUTS.items())


# --------------------------------------------------------------- models --- #


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 7), torch.nn.Tanh(),
        torch.nn.Linear(7, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2),
    ).double()


class Hand(torch.nn.Module):
    """The ``dtensor`` layout's parameters: a replicated matrix, grouped
    experts (3-D) sharded on dim 1, a head-block matrix, a sharded vector."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.rep = torch.nn.Parameter(torch.randn(5, 8, generator=g, dtype=torch.float64) / 3)
        self.experts = torch.nn.Parameter(torch.randn(2, 3, 8, generator=g, dtype=torch.float64) / 3)
        self.heads = torch.nn.Parameter(torch.randn(8, 8, generator=g, dtype=torch.float64) / 3)
        self.vec = torch.nn.Parameter(torch.randn(7, generator=g, dtype=torch.float64) / 3)

    def forward(self, x, rep, experts, heads, vec):
        h = torch.tanh(x @ rep.T)
        e = torch.tanh(torch.einsum("bi,eoi->beo", x, experts)).flatten(1)
        z = torch.cat([h, e, torch.tanh(x @ heads.T)], 1)
        return (z[:, :7] * vec).sum(1, keepdim=True)


def hand_placements():
    from torch.distributed.tensor import Replicate, Shard

    return {"rep": [Replicate()], "experts": [Shard(1)], "heads": [Shard(0)], "vec": [Shard(0)]}


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 3, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def loss_of(model, x, y, full=None):
    if isinstance(model, Hand):
        params = full if full is not None else dict(model.named_parameters())
        return torch.nn.functional.mse_loss(model(x, **params), y[:, :1])
    return torch.nn.functional.mse_loss(model(x), y[:, :2])


def _quiet():
    warnings.simplefilter("ignore")  # FSDP2's and DTensor's own warnings, the NaN skip's


@functools.lru_cache(maxsize=None)
def single_process(family, hand, nan, limiter=True):
    """The whole weights and state after STEPS steps in one process, by name: of the
    ``Hand`` model or the Sequential, with the fsdp runs' NaN or not."""
    with warnings.catch_warnings():
        _quiet()
        model = Hand() if hand else make_model()
        named = _named(model, family)
        opt = FAMILIES[family](named)
        for g in opt.param_groups:
            g["norm_growth_limit"] = g["norm_growth_limit"] if limiter else None
        for t, (x, y) in enumerate(batches()):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            if t == NAN_STEP and nan:
                model[0].weight.grad[4, 0] = float("nan")
            opt.step()
    return {n: p.detach().clone() for n, p in named}, _full_state(opt, named)


def oracle(family, layout):
    """The one-process run a layout's run must equal (a resumed run's: its saved run's)."""
    layout = layout.split("<-")[-1]
    return single_process(family, layout.startswith("dtensor"), layout.startswith("fsdp"))


# -------------------------------------------------------------- workers --- #


def _mesh(layout):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if layout in ("hsdp", "tp"):
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard") if layout == "hsdp" else ("dp", "tp"))
    ranks = {"fsdp": [0, 1, 2, 3], "dtensor": [0, 1, 2, 3], "fsdp3": [0, 1, 2], "dtensor2": [0, 1]}[layout]
    return DeviceMesh("cpu", ranks)  # every rank builds it (its group), the ranks outside idle


def _build(layout, mesh):
    """The model on ``layout``; its data-parallel rank and size (the batch split)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    if layout.startswith("dtensor"):
        model = Hand()
        for name, pl in hand_placements().items():
            full = getattr(model, name).detach()
            setattr(model, name, torch.nn.Parameter(distribute_tensor(full, mesh, pl, src_data_rank=None)))
        return model, 0, 1  # every rank computes the whole batch's gradient: the layout is the parameters'
    model = make_model()
    if layout == "tp":
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        plan = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, mesh["tp"], {"0": plan, "4": plan})
        fsdp_mesh = mesh["dp"]
    else:
        fsdp_mesh = mesh
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    if layout == "tp":  # the tp ranks of a dp rank share its batch
        return model, mesh["dp"].get_local_rank(), mesh["dp"].size()
    index = 0
    for c, n in zip(mesh.get_coordinate(), mesh.shape):
        index = index * n + c
    return model, index, mesh.size()


def _named(model, family):
    named = list(model.named_parameters())
    if family != "adam-mini" and isinstance(model, Hand):
        named = [(n, p) for n, p in named if n != "heads"]
    return named


def _full_state(opt, named):
    return {f"{n}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for n, p in named for k, v in opt.state[p].items()}


def _train(family, layout, mesh, out, *, save=None, load=None, key=None):
    """``family`` on ``layout`` for STEPS steps (from SAVE_AFTER after ``load``),
    saving through DCP after SAVE_AFTER steps to ``save``. Rank 0 records the
    whole weights (and around DCP the whole state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model, dp_rank, dp_size = _build(layout, mesh)
    named = _named(model, family)
    try:
        opt = FAMILIES[family](named)
    except ValueError as e:
        if (family, layout) not in REFUSED:
            raise
        if dist.get_rank() == 0:
            out[(family, layout, "refused")] = str(e)
        return
    group = mesh.get_group() if mesh.ndim == 1 else None
    first = 0
    if load is not None:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=load, process_group=group)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        first = SAVE_AFTER
        loaded = _full_state(opt, named)
        if dist.get_rank() == 0:
            out[(family, key, "loaded")] = loaded
    for t, (x, y) in enumerate(batches()):
        if t < first:
            continue
        if save is not None and t == SAVE_AFTER:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=save, process_group=group)
            saved = _full_state(opt, named)
            if dist.get_rank() == 0:
                out[(family, layout, "saved")] = saved
        xs, ys = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        opt.zero_grad()
        if isinstance(model, Hand):
            from torch.distributed.tensor import distribute_tensor

            full = {n: p.full_tensor().detach().requires_grad_() for n, p in model.named_parameters()}
            loss_of(model, xs, ys, full).backward()
            for n, p in model.named_parameters():
                p.grad = distribute_tensor(full[n].grad, mesh, p.placements, src_data_rank=None)
        else:
            loss_of(model, xs, ys).backward()
        if t == NAN_STEP and layout.startswith("fsdp"):
            w = model[0].weight
            shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
            if offset[0] <= 4 < offset[0] + shape[0]:  # the rank holding row 4 alone sees it
                w.grad.to_local()[4 - offset[0], 0] = float("nan")
        opt.step()
    full = {n: p.full_tensor().detach().clone() for n, p in named}
    state_types = {type(v).__name__ for p in opt.state.values() for k, v in p.items() if v.ndim}
    state = _full_state(opt, named)
    if dist.get_rank() == 0:
        key = key or layout
        out[(family, key)] = full
        out[(family, key, "state")] = state
        out[(family, key, "skips")] = opt.nonfinite_skips
        out[(family, key, "state types")] = state_types


def _refusals(out):
    """Layouts refused at construction, on every rank, with one line each."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh("fsdp")
    w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 8, dtype=torch.float64), mesh, [Shard(1)],
                                             src_data_rank=None))
    for family in FAMILIES:
        try:
            FAMILIES[family]([("w", w)])
        except ValueError as e:
            out[("refused", family, "last axis")] = str(e)
    # Adam-mini's heads of 5 rows on 4 ranks: rows split [2, 2, 1, 0] cut the head.
    model, _, _ = _build("fsdp", mesh)
    try:
        GWTAdamMini([{"params": [model[0].weight], "block": "head", "head_dim": 5}])
    except ValueError as e:
        out[("refused", "adam-mini", "head")] = str(e)
    experts = torch.nn.Parameter(distribute_tensor(torch.zeros(2, 3, 8, dtype=torch.float64), mesh, [Shard(1)],
                                                   src_data_rank=None))
    try:
        GWTAdamMini([experts], block="neuron")
    except ValueError as e:
        out[("refused", "adam-mini", "3-D rows")] = str(e)


def _worker(rank, out_dir):
    out: dict = {}
    try:
        with warnings.catch_warnings():
            _quiet()
            _refusals(out)
            meshes = {layout: _mesh(layout) for layout in (*LAYOUTS, *DCP_LAYOUTS.values())}
            for family in FAMILIES:
                for layout in LAYOUTS:
                    mesh = meshes[layout]
                    if mesh.get_coordinate() is None:
                        continue  # outside this sub-mesh
                    save = os.path.join(out_dir, f"{family}-{layout}") if layout in DCP_LAYOUTS else None
                    _train(family, layout, mesh, out, save=save)
                for saved, target in DCP_LAYOUTS.items():
                    if meshes[target].get_coordinate() is not None:
                        _train(family, target, meshes[target], out, load=os.path.join(out_dir, f"{family}-{saved}"),
                               key=f"{target}<-{saved}")
                    dist.barrier()
    finally:
        if rank == 0:
            torch.save(out, os.path.join(out_dir, "out.pt"))
        else:
            refused = {k: v for k, v in out.items() if k[0] == "refused"}
            torch.save(refused, os.path.join(out_dir, f"refused{rank}.pt"))


# ---------------------------------------------------------------- tests --- #


def test_every_family_on_every_layout(tmp_path):
    """One launch for every check (one test: pytest-xdist would run a shared
    fixture's launch once per worker)."""
    launch(_worker, WORLD, tmp_path, str(tmp_path))
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    others = [torch.load(tmp_path / f"refused{r}.pt", weights_only=False) for r in range(1, WORLD)]
    for family in FAMILIES:
        _every_layout_equals_one_process(out, family)
        _dcp_saved_at_4_ranks_loads_whole_at_3_and_2(out, family)
    _layouts_the_transform_cannot_take_are_refused_on_every_rank(out, others)


def _close(got, expected, what):
    assert got.keys() == expected.keys(), what
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-9, atol=1e-12, msg=lambda m: f"{what} {n}: {m}")


def _every_layout_equals_one_process(out, family):
    for layout in (*LAYOUTS, *RESUMED):
        if (family, layout) in REFUSED:
            msg = out[(family, layout, "refused")]
            assert REFUSED[family, layout] in msg and "\n" not in msg
            continue
        weights, state = oracle(family, layout)
        _close(out[(family, layout)], weights, f"{family} on {layout}")
        # The whole state too: the limiter's norm (summed over the sharding mesh dimensions only; a constant
        # factor would leave the weights alone until a resume at another world size), the statistics.
        got = out[(family, layout, "state")]
        assert got.keys() == state.keys()
        for k, v in state.items():
            if v.dtype == torch.uint8:  # int8 codes: a rounding tie may fall either way
                assert (got[k].int() - v.int()).abs().max() <= 1, f"{family} on {layout} {k}"
            else:
                torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-12, msg=lambda m: f"{family} {layout} {k}: {m}")
        # The state of a weight is a DTensor on every layout (DCP saves and reshards it whole).
        assert "DTensor" in out[(family, layout, "state types")]
        # The NaN in one rank's shard was skipped, once, on every rank.
        assert out[(family, layout, "skips")] == (1 if layout.startswith("fsdp") else 0)
    # The limiter engaged, so matching needs the norms summed over exactly the sharding mesh dimensions.
    runs_with_and_without = [(single_process(family, hand, False)[0], single_process(family, hand, False, False)[0])
                             for hand in (False, True)]
    assert any(not torch.allclose(a[n], b[n], rtol=1e-6) for a, b in runs_with_and_without for n in a), family


def _dcp_saved_at_4_ranks_loads_whole_at_3_and_2(out, family):
    for key in RESUMED:
        target, saved = key.split("<-")
        before, after = out[(family, saved, "saved")], out[(family, key, "loaded")]
        assert before.keys() == after.keys() and before
        for k in before:
            assert torch.equal(before[k], after[k]), f"{family} {key}: {k} changed"


def _layouts_the_transform_cannot_take_are_refused_on_every_rank(out, others):
    for refused in [out, *others]:
        for family in FAMILIES:
            msg = refused[("refused", family, "last axis")]
            assert "last axis" in msg and "Shard(dim=1)" in msg and "\n" not in msg
        msg = refused[("refused", "adam-mini", "head")]
        assert "cuts heads" in msg and "block='neuron'" in msg
        msg = refused[("refused", "adam-mini", "3-D rows")]
        assert "cannot be sharded" in msg and "block='element'" in msg
