"""8-bit GWT moments (moment_dtype="int8"): the quantizer and the optimizer."""

import io

import pytest
import torch
from torch import nn

from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon, gwt_param_groups
from gwt_optim.memory import optimizer_state_bytes
from gwt_optim.optim import _quant


def _roundtrip(x, signed):
    codes, absmax = _quant.zeros(x)
    _quant.quantize_(x, codes, absmax, signed=signed)
    return _quant.dequantize(codes, absmax, signed=signed), absmax


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", [(7, 256), (5, 300), (2, 3, 1000), (4, 1)])
def test_error_is_at_most_half_a_code_step_of_the_block_max(signed, shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-5, 1, shape[-1])
    x = x if signed else x.abs()
    y, absmax = _roundtrip(x, signed)
    qmap = torch.tensor(_quant.dynamic_map(signed))
    # half the widest gap between codes, or the distance from -1 to the lowest code
    half_step = max(((qmap[1:] - qmap[:-1]) / 2).max(), 1 + qmap[0] if signed else 0)
    per_value_max = absmax.repeat_interleave(_quant.BLOCK, -1)[..., : shape[-1]]
    assert ((y - x).abs() <= half_step * per_value_max * (1 + 1e-5)).all()
    # The block's largest value is exact (the map holds +-1), and zeros stay zero.
    padded = torch.nn.functional.pad(x.abs(), (0, -shape[-1] % 256))
    assert torch.equal(absmax, padded.unflatten(-1, (-1, 256)).amax(-1))
    z, _ = _roundtrip(torch.zeros(shape), signed)
    assert torch.equal(z, torch.zeros(shape))


@pytest.mark.parametrize("signed", [True, False])
def test_map_and_rounding_equal_torchao(signed):
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    ao_map = torch.tensor(quant_utils.create_dynamic_map(signed=signed))
    assert torch.equal(torch.tensor(_quant.dynamic_map(signed)), ao_map)
    torch.manual_seed(1)
    x = torch.randn(8, 512) * torch.logspace(-6, 0, 512)
    x = x if signed else x.abs()
    codes, absmax = _quant.zeros(x)
    _quant.quantize_(x, codes, absmax, signed=signed)
    scaled, scale = quant_utils.scale_tensor(x, 256)
    assert torch.equal(absmax.flatten(), scale)
    assert torch.equal(codes, quant_utils.quantize_8bit_with_qmap(scaled, ao_map))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 48)
        self.attn = nn.Linear(48, 300)
        self.mlp = nn.Linear(300, 48)
        self.head = nn.Linear(48, 64, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.mlp(torch.tanh(self.attn(self.emb(x))))))


def _make(moment_dtype, dtype=torch.float32, level=2, backend="eager", **kw):
    torch.manual_seed(0)
    model = Net().to(dtype)
    groups = gwt_param_groups(model, level=level, target_modules=("attn", "mlp"))
    return model, GWTAdamW(groups, lr=3e-3, moment_dtype=moment_dtype, backend=backend, **kw)


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        # a learnable task: predict a token's successor modulo 64
        x = torch.randint(0, 64, (16, 12), generator=g)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 64).float(), ((x + 1) % 64).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_int8_moments_track_fp32_moments():
    ref = _train(*_make(None), 150)
    got = _train(*_make("int8"), 150)
    assert ref[-1] < ref[0] - 1.0  # it learns
    assert max(abs(a - b) for a, b in zip(ref, got)) < 0.05
    tail = lambda losses: sum(losses[-20:]) / 20  # noqa: E731
    assert abs(tail(got) - tail(ref)) < 0.01


def test_int8_state_is_plain_tensors_and_a_quarter_of_fp32():
    model, opt = _make("int8")
    _train(model, opt, 1)
    st = opt.state[model.attn.weight]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_sq"].dtype == torch.uint8
    assert st["exp_avg_absmax"].dtype == torch.float32 and st["exp_avg_absmax"].shape == (300, 1)
    assert opt.state[model.attn.bias]["exp_avg"].dtype == torch.float32  # vectors stay full precision
    ref_model, ref_opt = _make(None)
    _train(ref_model, ref_opt, 1)
    def matrix_bytes(m, o):
        per_param = optimizer_state_bytes(o, per_param=True)
        return sum(per_param[p] for p in (m.emb.weight, m.attn.weight, m.mlp.weight, m.head.weight))

    q8, f32 = matrix_bytes(model, opt), matrix_bytes(ref_model, ref_opt)
    assert q8 < 0.3 * f32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_state_dict_round_trip_is_bitwise(dtype):
    full_model, full_opt = _make("int8", dtype)
    _train(full_model, full_opt, 3, seed=1)
    _train(full_model, full_opt, 3, seed=2)

    model, opt = _make("int8", dtype)
    _train(model, opt, 3, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2 = _make("int8", dtype)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for st in opt2.state.values():
        if "exp_avg_absmax" in st:  # fp32 scales are not cast to a bf16 parameter's dtype
            assert st["exp_avg_absmax"].dtype == torch.float32 and st["exp_avg"].dtype == torch.uint8
    _train(model2, opt2, 3, seed=2)
    for a, b in zip(full_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_int8_ignores_fused_kernels_and_reference_impl_agrees():
    eager = _make("int8")
    _train(*eager, 3)
    auto_model, auto_opt = _make("int8", backend="auto")  # would pick the native kernels for float moments
    _train(auto_model, auto_opt, 3)
    for a, b in zip(eager[0].parameters(), auto_model.parameters()):
        assert torch.equal(a, b)
    ref_model, ref_opt = _make("int8", impl="reference")
    _train(ref_model, ref_opt, 3)
    # A code can round the other way after fp32 differences between the paths.
    for a, b in zip(eager[0].parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("cls", [GWTMuon, GWTAdamMini, GWTAdafactor])
def test_families_without_int8_refuse_it(cls):
    with pytest.raises(ValueError, match="int8"):
        cls([nn.Parameter(torch.zeros(4, 4))], moment_dtype="int8")
    with pytest.raises(ValueError, match="moment_dtype"):
        GWTAdamW([nn.Parameter(torch.zeros(4, 4))], moment_dtype="int4")


def test_int8_moments_step_through_the_one_adamw_moment_rule():
    """The eager int8 step is functional.gwt_adamw on the state's codes behind
    _quant.Quantized: no moment update of its own."""
    from gwt_optim.optim import functional as F

    gen = torch.Generator().manual_seed(3)
    W = nn.Parameter(torch.randn(6, 600, generator=gen))
    opt = GWTAdamW([W], lr=1e-2, moment_dtype="int8", weight_decay=0.1)
    V = W.detach().clone()
    for t in range(1, 4):
        G = torch.randn(6, 600, generator=gen)
        st = {k: v.clone() for k, v in opt.state[W].items()} if opt.state[W] else None
        W.grad = G
        opt.step()
        if st is None:  # the first step: the state the optimizer made, at zero
            st = {k: torch.zeros_like(v) for k, v in opt.state[W].items()}
        F.gwt_adamw(V, G, *_quant.moments(st), st["limiter_norm"], step=t, lr=1e-2, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.1, level=2, alpha=0.25, gamma=1.01, detail_clip=0.5)
        for k in ("exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax", "limiter_norm"):
            assert torch.equal(st[k], opt.state[W][k]), (t, k)
        assert torch.equal(V, W.detach()), t
