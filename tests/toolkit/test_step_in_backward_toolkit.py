"""pretrain --step-in-backward and --gradient-checkpointing, and the bf16 meta-device build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gwt_optim.toolkit.errors import UsageError
from gwt_optim.toolkit.metrics import read_jsonl
from gwt_optim.toolkit.train import train


def _losses(run) -> list[float]:
    return [r["loss"] for r in read_jsonl(Path(run) / "metrics.jsonl") if "loss" in r]


def test_step_in_backward_with_checkpointing_equals_a_normal_run(tiny_config, tmp_path):
    opt = "gwt-adamw:level=2:moment_dtype=int8:backend=eager"
    normal = tiny_config(out=str(tmp_path / "normal"), steps=4, eval_every=0, optimizer=opt)
    inside = tiny_config(out=str(tmp_path / "inside"), steps=4, eval_every=0, optimizer=opt,
                         step_in_backward=True, gradient_checkpointing=True)
    a, b = train(normal), train(inside)
    assert _losses(normal.out) == pytest.approx(_losses(inside.out), abs=1e-6)
    assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-6)


@pytest.mark.parametrize(
    "overrides, match",
    [({"micro_batch_size": 1}, "micro-batch"), ({"grad_clip": 1.0}, "--grad-clip")],
)
def test_step_in_backward_refuses_accumulation_and_global_clipping(tiny_config, overrides, match):
    with pytest.raises(UsageError, match=match):
        train(tiny_config(step_in_backward=True, **overrides).validate())


def test_bf16_build_on_meta_device_has_no_fp32_copy(tiny_model):
    from gwt_optim.toolkit.models import build_model

    torch.manual_seed(0)
    model = build_model(tiny_model, dtype=torch.bfloat16, vocab_size=512)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.device.type == "cpu" for p in model.parameters())
    w = model.model.layers[0].self_attn.q_proj.weight.float()
    assert 0.015 < w.std().item() < 0.025  # initializer_range 0.02, not uninitialized memory
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    x = torch.randint(0, 512, (2, 16))
    assert torch.isfinite(model(input_ids=x, labels=x).loss)
