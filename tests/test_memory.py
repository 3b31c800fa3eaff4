"""Memory accounting: measured state bytes against the analytic estimates.

Every estimate is checked to the byte against the state a real optimizer
allocates on a small LLaMA (fp32), and the quantized states of torchao are
checked to be counted through their inner tensors.
"""

from __future__ import annotations

import json

import pytest
import torch

from gwt_optim import memory
from gwt_optim.groups import split_params
from gwt_optim.memory import estimate, optimizer_state_bytes

transformers = pytest.importorskip("transformers")

CFG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=256,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: with two pytest workers on two cores, intra-op threads
    only contend (a 32x32 matmul goes from microseconds to milliseconds)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG))


def one_step(model, opts):
    """One training step, so that lazily created state exists."""
    opts = opts if isinstance(opts, (list, tuple)) else [opts]
    x = torch.randint(0, CFG["vocab_size"], (2, 12))
    model(x, labels=x).loss.backward()
    for o in opts:
        o.step()
    return opts


def paper_split(model):
    split = split_params(model, "paper")
    return [p for _, p in split.transformed], [p for _, p in split.regular]


# --------------------------------------------------------------- measured --- #


def test_plain_tensors_count_storage_once():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    one_step(model, opt)
    n = sum(p.numel() for p in model.parameters())
    # two fp32 moments + a 4-byte step per tensor
    assert optimizer_state_bytes(opt) == 8 * n + 4 * len(list(model.parameters()))
    # a view of the same storage (as Adam-mini keeps) is not counted twice
    st = opt.state[model.lm_head.weight]
    st["alias"] = st["exp_avg"].view(-1)
    assert optimizer_state_bytes(opt) == 8 * n + 4 * len(list(model.parameters()))


@pytest.mark.parametrize("name,bits", [("AdamW8bit", 8), ("AdamW4bit", 4)])
def test_torchao_quantized_state_counted_through_inner_tensors(monkeypatch, name, bits):
    torchao_optim = pytest.importorskip("torchao.optim")
    # torchao compiles its step with Inductor (~45 s per optimizer on this CPU);
    # the eager step allocates the same state.
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    model = tiny_llama()
    opt = getattr(torchao_optim, name)(model.parameters(), lr=1e-3)
    one_step(model, opt)
    quantized = [v for st in opt.state.values() for v in st.values() if type(v).__name__.startswith("OptimState")]
    assert quantized, "expected torchao to quantize the larger tensors"
    q = quantized[0]
    inner = q.codes.numel() * q.codes.element_size() + q.scale.numel() * 4 + q.qmap.numel() * 4
    assert memory.tensor_bytes(q) == inner
    # the wrapper pretends to be fp32: counting its apparent size would overstate it
    assert memory.tensor_bytes(q) < q.numel() * 4 * bits / 16
    assert optimizer_state_bytes(opt) == estimate(model, name.lower()).state_bytes


def test_dtensor_state_counts_the_local_shard(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # a one-process gloo group through a file store: no ports
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
        assert memory.tensor_bytes(d) == 8 * 4 * 4
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------ analytic = measured --- #


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _galore(model):
    galore_torch = pytest.importorskip("galore_torch")
    t, r = paper_split(model)
    groups = [{"params": r}, {"params": t, "rank": 8, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}]
    return galore_torch.GaLoreAdamW(groups, lr=1e-3)


def _apollo(rank, scale_type):
    def make(model):
        apollo_torch = pytest.importorskip("apollo_torch")
        t, r = paper_split(model)
        extra = dict(rank=rank, proj="random", scale_type=scale_type, update_proj_gap=200, scale=1.0, proj_type="std")
        return apollo_torch.APOLLOAdamW([{"params": r}, {"params": t, **extra}], lr=1e-3)

    return make


def _adam_mini(model):
    adam_mini = pytest.importorskip("adam_mini")
    return adam_mini.Adam_mini(model.named_parameters(), lr=1e-3, dim=64, n_heads=4, n_kv_heads=2, verbose=False)


def _muon(model):
    t, r = paper_split(model)
    return [torch.optim.Muon(t, lr=1e-3), torch.optim.AdamW(r, lr=1e-3)]


def _adafactor(model):
    return torch.optim.Adafactor(model.parameters(), lr=1e-2)


def _registry(name, level):
    def make(model):
        from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer

        opts = {"level": level, **({"ns_dtype": "float32"} if name == "gwt-muon" else {})}
        return build_optimizer(name, model, OptimizerConfig(lr=1e-3, scale=0.25, options=opts))

    return make


CASES = [
    ("adamw", 2, None, _adamw),
    ("galore", 2, 8, _galore),
    ("apollo", 2, 8, _apollo(8, "channel")),
    ("apollo-mini", 2, None, _apollo(1, "tensor")),
    ("adam-mini", 2, None, _adam_mini),
    ("muon", 2, None, _muon),
    ("adafactor", 2, None, _adafactor),
    *[
        (f"gwt-{family}", lv, None, _registry(f"gwt-{family}", lv))
        for family in ("adamw", "muon", "adam-mini", "adafactor")
        for lv in (1, 2, 3)
    ],
]


@pytest.mark.parametrize("name,level,rank,make", CASES, ids=[f"{c[0]}-l{c[1]}" for c in CASES])
def test_estimate_equals_measured_bytes(name, level, rank, make):
    model = tiny_llama()
    opts = one_step(model, make(model))
    measured = optimizer_state_bytes(opts)
    est = estimate(model, name, level=level, rank=rank)
    assert est.weight_bytes == 4 * sum(p.numel() for p in model.parameters())
    assert measured == est.state_bytes


class _ConvNet(torch.nn.Module):
    """What the "hidden" recipe transforms beyond matrices: conv kernels, one of
    them 1x1 (its last axis too short for any level, so it steps at level 0)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 8, 1)
        self.fc = torch.nn.Linear(8, 16)
        self.classifier = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.classifier(self.fc(self.conv2(self.conv1(x)).mean((2, 3))))


@pytest.mark.parametrize("name", ["adamw", "muon", "gwt-adamw", "gwt-muon", "gwt-adam-mini", "gwt-adafactor"])
@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.filterwarnings("ignore:.*too short for the group's level")
def test_estimate_equals_measured_bytes_with_conv_kernels(name, level):
    # Muon orthogonalizes matrices only: the registry steps a conv kernel with AdamW, which the estimate must count.
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer

    torch.manual_seed(0)
    model = _ConvNet()
    opts = {"level": level} if name.startswith("gwt-") else {}
    opts.update({"ns_dtype": "float32"} if name == "gwt-muon" else {})
    opts.update({"dim": 8, "n_heads": 2} if name.endswith("adam-mini") else {})
    opt = build_optimizer(name, model, OptimizerConfig(lr=1e-3, recipe="hidden", options=opts))
    model(torch.randn(2, 3, 6, 6)).square().mean().backward()
    for o in opt if isinstance(opt, (list, tuple)) else [opt]:
        o.step()
    est = estimate(model, name, level=level, recipe="hidden", dim=8, n_heads=2)
    assert optimizer_state_bytes(opt) == est.state_bytes


def test_gwt_state_on_transformed_weights_shrinks_by_2_pow_l():
    model = tiny_llama()
    plain = estimate(model, "adamw")
    for level in (1, 2, 3):
        gwt = estimate(model, "gwt-adamw", level=level)
        # moments only: drop the 4-byte step and the limiter's 4-byte norm per tensor
        n_t = sum(1 for name in gwt.per_tensor if "attn" in name or "mlp" in name)
        moments = gwt.transformed_state_bytes - 8 * n_t
        assert moments * 2**level == plain.transformed_state_bytes - 4 * n_t


# ----------------------------------------------------------- model sources --- #


def test_skeleton_matches_transformers_llama():
    from gwt_optim.memory import llama_skeleton, load_config_json

    cfg = load_config_json("60m")
    with torch.device("meta"):
        real = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    ours = llama_skeleton(cfg)
    assert [(n, tuple(p.shape)) for n, p in real.named_parameters()] == [
        (n, tuple(p.shape)) for n, p in ours.named_parameters()
    ]


def test_config_sources_agree(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(CFG))
    by_path = estimate(path, "gwt-muon", level=2, dtype=torch.float32)
    by_dict = estimate(CFG, "gwt-muon", level=2, dtype=torch.float32)
    by_model = estimate(tiny_llama(), "gwt-muon", level=2)
    assert by_path.state_bytes == by_dict.state_bytes == by_model.state_bytes
    assert by_path.weight_bytes == by_model.weight_bytes
    with pytest.raises(FileNotFoundError, match="packaged"):
        estimate("no-such-model", "adamw")
    with pytest.raises(ValueError, match="known"):
        estimate(CFG, "sgd-with-dreams")


def test_llama_60m_adamw_bf16_is_six_bytes_per_parameter():
    est = estimate("60m", "adamw")
    # 2 x 32000 x 512 embeddings + 8 x (4 x 512^2 + 3 x 512 x 1376 + 2 x 512) + 512
    assert est.n_params == 58_073_600
    # bf16 weights + two bf16 moments, plus a 4-byte step per tensor
    assert est.total_bytes == 6 * est.n_params + 4 * 8 * 9 + 4 * 3


# ------------------------------------------------------------------- table --- #


def test_memory_cli_prints_the_table_and_paper_figures(capsys, tmp_path):
    from gwt_optim.cli import main

    out = tmp_path / "memory.md"
    assert main(["memory", "--models", "60m,1b", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.strip() == out.read_text().strip()
    for label in ("adamw8bit", "galore (rank r)", "apollo-mini", "adam-mini", "muon", "gwt-muon (l=2)"):
        assert f"| {label} |" in text
    assert "| share transformed | 43.6% | 90.2% |" in text
    # 75% at level 2 is the state saving on the transformed weights ...
    assert "| 1B | 2 | -75.0% |" in text
    # ... and "up to 52%" the weights + state saving of the largest setting (1B, level 3)
    one_b_l3 = next(line for line in text.splitlines() if line.startswith("| 1B | 3 |"))
    assert one_b_l3.endswith("-52.6% |")
