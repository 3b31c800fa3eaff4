"""GWT in the Hugging Face ``Trainer`` and in ``accelerate`` loops.

Two equivalent ways to fine-tune any ``transformers`` model with GWT::

    from gwt_optim.integrations import create_gwt_optimizer, gwt_optimizer_cls_and_kwargs

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizers=create_gwt_optimizer(model, args, level=2))

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=gwt_optimizer_cls_and_kwargs(model, args, level=2))

Both give the same optimizer (the same groups, and the same weights after the
same steps). There is no ``TrainingArguments(optim="...")`` name for GWT:
transformers checks ``optim`` against its own ``OptimizerNames`` enum and maps
names to optimizers in a private table, with no public way to add one, and
this package does not patch either (docs/finetuning.md).

And with ``accelerate``::

    optimizer, scheduler = create_gwt_optimizer(model, args=None, lr=5e-6, num_training_steps=1000)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

Which weights get the transform is decided by module name
(:func:`default_target_modules`): for BERT/RoBERTa-style encoders the query,
key, value and the intermediate and output dense layers (the paper's GLUE
recipe), for LLaMA-family decoders the attention and MLP projections. All
other parameters (embeddings, norms, biases, the task head) are trained by the
plain base optimizer. The optimizer is an ordinary ``torch.optim.Optimizer``,
so ``Trainer`` checkpoints save and restore its state with no extra code.

``transformers`` is imported inside the functions: ``gwt_optim`` itself needs
only torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

__all__ = [
    "TargetPreset",
    "TARGET_PRESETS",
    "default_target_modules",
    "create_gwt_optimizer",
    "gwt_optimizer_cls_and_kwargs",
]


@dataclass(frozen=True)
class TargetPreset:
    """Module-name substrings that select the GWT weights of one architecture family.

    A preset applies when some ``nn.Linear`` module's qualified name contains
    ``probe``; ``targets`` are then matched as substrings of module names,
    like ``OptimizerConfig.target_modules`` everywhere else in the toolkit.
    """

    family: str
    probe: str
    targets: tuple[str, ...]


# First match wins, so the more specific probes come first. BERT-style names
# are checked before the generic "attn"/"mlp" so that an encoder whose head
# happens to contain "mlp" does not fall into the decoder preset.
TARGET_PRESETS: tuple[TargetPreset, ...] = (
    TargetPreset(
        "BERT/RoBERTa-style encoder",
        "attention.self.query",
        # "output.dense" covers both the attention output projection
        # (attention.output.dense) and the FFN output (layer.N.output.dense),
        # as in the GLUE recipe of GaLore and GWT.
        ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense", "output.dense"),
    ),
    TargetPreset("T5-style encoder-decoder", "SelfAttention.q", ("SelfAttention", "EncDecAttention", "DenseReluDense")),
    TargetPreset("LLaMA/Mistral/Qwen-style decoder", "self_attn.", ("self_attn", "mlp")),
    TargetPreset("decoder with attn/mlp blocks", "attn", ("attn", "mlp")),
)


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def default_target_modules(model: nn.Module) -> tuple[str, ...]:
    """The module-name substrings whose ``nn.Linear`` weights get the transform.

    Raises ``ValueError`` when no preset recognises the model (GPT-2's
    ``Conv1D`` layers, for instance, are not ``nn.Linear``): pass
    ``target_modules=`` explicitly then.
    """
    names = _linear_names(model)
    for preset in TARGET_PRESETS:
        if any(preset.probe in name for name in names):
            return preset.targets
    sample = ", ".join(names[:6]) or "none"
    raise ValueError(
        f"cannot tell which layers of {type(model).__name__} should get the wavelet transform "
        f"(nn.Linear modules: {sample}, ...); pass target_modules=('q_proj', 'v_proj', ...) "
        "with substrings of the module names"
    )


def _training_hparams(args: Any, lr: float | None, weight_decay: float | None) -> dict[str, Any]:
    """Learning rate, betas, eps and weight decay from ``TrainingArguments`` (or defaults)."""
    if args is None:
        if lr is None:
            raise ValueError("pass lr=... when no TrainingArguments are given")
        return {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": weight_decay or 0.0}
    return {
        "lr": args.learning_rate if lr is None else lr,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay if weight_decay is None else weight_decay,
    }


def _total_steps(args: Any, num_training_steps: int | None) -> int | None:
    if num_training_steps is not None:
        return num_training_steps
    if args is not None and getattr(args, "max_steps", -1) > 0:
        return int(args.max_steps)
    return None


def create_gwt_optimizer(
    model: nn.Module,
    args: Any = None,
    *,
    level: int = 2,
    scale: float | None = None,
    wavelet: str = "haar",
    optimizer: str = "gwt-adamw",
    target_modules: Sequence[str] | None = None,
    norm_growth_limit: float | None = 1.01,
    lr: float | None = None,
    weight_decay: float | None = None,
    num_training_steps: int | None = None,
    options: dict[str, Any] | None = None,
) -> tuple[torch.optim.Optimizer, Any]:
    """Build a GWT optimizer (or any registry optimizer) and its scheduler for ``model``.

    Args:
        model: any ``torch.nn.Module``; ``transformers`` models get their
            target modules detected by name (:func:`default_target_modules`).
        args: ``transformers.TrainingArguments`` supplying the learning rate,
            betas, epsilon, weight decay and the scheduler; ``None`` in a
            plain or ``accelerate`` loop (then pass ``lr``).
        level, wavelet, norm_growth_limit: the GWT settings of the target
            weights. Ignored by optimizers outside the GWT family.
        scale: the module-wise ``alpha`` on the target weights. None (the
            default) is the recipe that keeps AdamW's lr and weight decay
            (:func:`gwt_optim.registry.recipe_scale`): for a GWT family
            :func:`gwt_optim.groups.adamw_scale` of ``level``, 2 at level 2
            (also the paper's GLUE alpha), and 1 for any other optimizer.
            A number applies to every optimizer alike; non-GWT optimizers
            receive it as ``lr * alpha`` on those weights.
        optimizer: a name from :data:`gwt_optim.registry.REGISTRY`
            (``"gwt-adamw"``, ``"adamw"``, ``"galore"``, ...).
        target_modules: module-name substrings to override the detection.
        lr, weight_decay: override the values in ``args``.
        num_training_steps: total optimizer steps for the scheduler; taken
            from ``args.max_steps`` when that is set.
        options: extra optimizer options, as given on the command line
            (``{"moment_dtype": "bfloat16"}``).

    Returns:
        ``(optimizer, scheduler)``, ready for ``Trainer(optimizers=...)`` or
        ``accelerator.prepare``. The scheduler follows
        ``args.lr_scheduler_type`` and warm-up (a constant schedule without
        ``args``); it is ``None`` when the number of steps is not known yet
        (epoch-based ``TrainingArguments``), in which case ``Trainer`` builds
        the same scheduler itself once it knows the dataset length.
    """
    from gwt_optim.registry import REGISTRY, OptimizerConfig, build_optimizer

    if optimizer not in REGISTRY:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(sorted(REGISTRY))}")
    targets = tuple(target_modules) if target_modules is not None else default_target_modules(model)
    hp = _training_hparams(args, lr, weight_decay)
    opts = dict(options or {})
    # GWT families declare a default level; only they accept the wavelet keys.
    if "level" in REGISTRY[optimizer].defaults:
        opts = {"level": level, "wavelet": wavelet, "norm_growth_limit": norm_growth_limit, **opts}
    config = OptimizerConfig(
        lr=hp["lr"],
        weight_decay=hp["weight_decay"],
        betas=hp["betas"],
        eps=hp["eps"],
        scale=scale,
        recipe="paper",
        target_modules=targets,
        options=opts,
    )
    _check_targets_match(model, targets)
    opt = build_optimizer(optimizer, model, config)
    return opt, _make_scheduler(opt, args, _total_steps(args, num_training_steps))


def _check_targets_match(model: nn.Module, targets: Sequence[str]) -> None:
    """Fail early when the substrings select nothing (a typo would silently train plain AdamW)."""
    names = _linear_names(model)
    if not any(t in name for name in names for t in targets):
        raise ValueError(
            f"target_modules={tuple(targets)} match no nn.Linear module of {type(model).__name__}; "
            f"module names look like {', '.join(names[:4]) or '(no nn.Linear modules)'}"
        )


def _make_scheduler(opt: torch.optim.Optimizer, args: Any, total_steps: int | None):
    if args is None:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    if total_steps is None:
        return None
    from transformers import get_scheduler

    return get_scheduler(
        args.lr_scheduler_type,
        optimizer=opt,
        num_warmup_steps=args.get_warmup_steps(total_steps),
        num_training_steps=total_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
    )


def gwt_optimizer_cls_and_kwargs(
    model: nn.Module,
    args: Any = None,
    *,
    level: int = 2,
    scale: float | None = None,
    wavelet: str = "haar",
    target_modules: Sequence[str] | None = None,
    norm_growth_limit: float | None = 1.01,
    lr: float | None = None,
    weight_decay: float | None = None,
    optimizer_cls: type[torch.optim.Optimizer] | None = None,
    **optimizer_kwargs: Any,
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The ``Trainer(optimizer_cls_and_kwargs=...)`` form of :func:`create_gwt_optimizer`.

    Returns ``(GWTAdamW, kwargs)`` whose ``kwargs["params"]`` holds the GWT
    and regular parameter groups; ``Trainer`` builds the optimizer from them
    (and its own scheduler) when training starts. ``optimizer_cls`` selects
    another GWT class taking the same group keys.
    """
    from gwt_optim.groups import gwt_param_groups

    if optimizer_cls is None:
        from gwt_optim.optim import GWTAdamW as optimizer_cls
    targets = tuple(target_modules) if target_modules is not None else default_target_modules(model)
    _check_targets_match(model, targets)
    split = gwt_param_groups(
        model,
        "paper",
        level=level,
        wavelet=wavelet,
        scale=scale,
        norm_growth_limit=norm_growth_limit,
        target_modules=targets,
    )
    kwargs = {"params": list(split), **_training_hparams(args, lr, weight_decay), **optimizer_kwargs}
    return optimizer_cls, kwargs
