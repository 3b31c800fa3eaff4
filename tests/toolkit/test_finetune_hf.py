"""The Hugging Face integration: target detection, Trainer checkpoints, accelerate."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gwt_optim.integrations import create_gwt_optimizer, default_target_modules, gwt_optimizer_cls_and_kwargs
from gwt_optim.optim import GWTAdamW

VOCAB = 64


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def tiny_roberta_classifier(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        num_labels=3,
    )
    return transformers.RobertaForSequenceClassification(config)


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random sequences; labels = inputs (the model shifts them)."""

    def __init__(self, n: int = 8, length: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gwt_weights(optimizer) -> set[int]:
    return {id(p) for g in optimizer.param_groups if g.get("level", 0) > 0 for p in g["params"]}


def test_roberta_targets_are_the_paper_glue_layers():
    model = tiny_roberta_classifier()
    targets = default_target_modules(model)
    opt, _ = create_gwt_optimizer(model, lr=1e-3)
    chosen = {n for n, p in model.named_parameters() if id(p) in _gwt_weights(opt)}
    expected = set()
    for i in range(2):
        pre = f"roberta.encoder.layer.{i}."
        for mod in ("attention.self.query", "attention.self.key", "attention.self.value",
                    "attention.output.dense", "intermediate.dense", "output.dense"):
            expected.add(pre + mod + ".weight")
    assert chosen == expected, targets
    # The task head, embeddings, norms and biases stay plain AdamW.
    assert not any(n.startswith("classifier") for n in chosen)


def test_llama_targets_are_attention_and_mlp_projections():
    model = tiny_llama()
    opt, _ = create_gwt_optimizer(model, lr=1e-3)
    chosen = {n.split(".")[-2] for n, p in model.named_parameters() if id(p) in _gwt_weights(opt)}
    assert chosen == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_unmatched_targets_fail_with_a_fix():
    with pytest.raises(ValueError, match="target_modules"):
        create_gwt_optimizer(tiny_llama(), lr=1e-3, target_modules=("no_such_layer",))


def test_non_gwt_optimizer_gets_alpha_as_lr_scale():
    opt, sched = create_gwt_optimizer(tiny_llama(), lr=1e-3, optimizer="adamw", scale=2.0)
    assert type(opt) is torch.optim.AdamW
    assert sorted(g["lr"] for g in opt.param_groups) == [1e-3, 2e-3]
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)


def test_scheduler_follows_training_arguments(tmp_path):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), learning_rate=1e-3, max_steps=10, warmup_steps=5, lr_scheduler_type="linear",
        report_to="none", use_cpu=True,
    )
    opt, sched = create_gwt_optimizer(tiny_llama(), args, level=1)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(1e-3) and lrs[9] == pytest.approx(2e-4)


def _trainer(model, tmp_path, max_steps, save_steps, optimizers=None, **kwargs):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=save_steps,
        logging_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if optimizers is None and "optimizer_cls_and_kwargs" not in kwargs:
        optimizers = create_gwt_optimizer(model, args, level=2, scale=2.0)
    if optimizers is not None:
        kwargs["optimizers"] = optimizers
    return transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), **kwargs)


def test_trainer_checkpoint_round_trips_gwt_state(tmp_path):
    """Resuming from step 2 must end exactly where the uninterrupted run ended."""
    full = _trainer(tiny_llama(), tmp_path / "full", max_steps=4, save_steps=2)
    full.train()
    ref_opt = full.optimizer.optimizer if hasattr(full.optimizer, "optimizer") else full.optimizer
    assert isinstance(ref_opt, GWTAdamW)
    # The saved state is GWT's: moments of a transformed 32-column weight hold 32 / 2^2 columns.
    q = full.model.model.layers[0].self_attn.q_proj.weight
    assert ref_opt.state[q]["exp_avg"].shape[-1] == 8

    resumed_model = tiny_llama()
    resumed = _trainer(resumed_model, tmp_path / "resumed", max_steps=4, save_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    opt = resumed.optimizer.optimizer if hasattr(resumed.optimizer, "optimizer") else resumed.optimizer

    ref_state, state = ref_opt.state_dict(), opt.state_dict()
    assert ref_state["state"].keys() == state["state"].keys()
    for idx, ref in ref_state["state"].items():
        for key, value in ref.items():
            if torch.is_tensor(value):
                torch.testing.assert_close(state["state"][idx][key], value, rtol=1e-5, atol=1e-7)
            else:
                assert state["state"][idx][key] == value
    for (name, a), b in zip(full.model.named_parameters(), resumed_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)

    # Control: the same resume without optimizer.pt restarts the moments from
    # zero and ends elsewhere, so the comparison above can see a lost state.
    stripped = tmp_path / "no-optimizer-state"
    shutil.copytree(tmp_path / "full" / "checkpoint-2", stripped)
    (stripped / "optimizer.pt").unlink()
    control_model = tiny_llama()
    _trainer(control_model, tmp_path / "control", max_steps=4, save_steps=10).train(resume_from_checkpoint=str(stripped))
    q_full = full.model.model.layers[0].self_attn.q_proj.weight
    assert not torch.allclose(control_model.model.layers[0].self_attn.q_proj.weight, q_full, rtol=1e-5, atol=1e-7)


def test_optimizer_cls_and_kwargs_form(tmp_path):
    model = tiny_llama()
    trainer = _trainer(model, tmp_path, max_steps=2, save_steps=10,
                       optimizer_cls_and_kwargs=gwt_optimizer_cls_and_kwargs(model, level=3, lr=1e-3))
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, GWTAdamW)
    levels = sorted(g["level"] for g in opt.param_groups)
    assert levels == [0, 3]
    down = model.model.layers[0].mlp.down_proj.weight  # 64 input columns
    assert opt.state[down]["exp_avg"].shape == (32, 8)


def test_accelerate_loop_and_state_round_trip(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = tiny_llama()
    optimizer, scheduler = create_gwt_optimizer(model, lr=3e-3, num_training_steps=4)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    for _ in range(2):
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    accelerator.save_state(str(tmp_path / "state"))
    before = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items() if torch.is_tensor(v)}
    for group in optimizer.optimizer.state.values():
        for v in group.values():
            if torch.is_tensor(v):
                v.zero_()
    accelerator.load_state(str(tmp_path / "state"))
    after = optimizer.state_dict()["state"][0]
    for k, v in before.items():
        torch.testing.assert_close(after[k], v)


def test_importing_the_integration_quiets_what_transformers_prints():
    """A Trainer user imports the integration, then transformers: torchao's ``Failed to load`` lines and
    torch's pytree deprecations stay silent, as under the toolkit (one mechanism, gwt_optim._quiet)."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    code = "from gwt_optim.integrations import create_gwt_optimizer\nfrom transformers import Trainer\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout + done.stderr
    assert "Failed to load" not in said and "register_constant" not in said, said[-2000:]
