"""``gwt-optim pretrain``: train one model with one optimizer.

Settings are layered, later wins: the built-in defaults
(:class:`~gwt_optim.toolkit.train.TrainConfig`), then ``--paper SIZE`` (the
paper's C4 recipe), then, with ``--resume``, the run's own ``config.json``,
then ``--config FILE`` (a JSON ``config.json`` of an earlier run), then the
flags given on the command line. On resume only the settings of
:data:`~gwt_optim.toolkit.train.RESUME_MAY_CHANGE` may differ from the run's.

Under ``torchrun --nproc-per-node N -m gwt_optim pretrain ...`` the run is
data parallel (DDP, or FSDP2 with ``--fsdp``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Mapping

from gwt_optim.toolkit.recipes import RECIPE_ALPHA
from gwt_optim.toolkit.schedules import DECAY_SHAPES, SCHEDULES

__all__ = ["register", "add_training_arguments", "run_defaults", "resolve_config", "check_inputs", "run_pretrain"]


def _float_or_none(text: str) -> float | None:
    return None if text.lower() in ("none", "off", "0") else float(text)


def run_defaults(recipe: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every setting a run takes when no flag, ``--paper`` or ``--config`` sets it: the
    built-in :class:`~gwt_optim.toolkit.train.TrainConfig` defaults under ``recipe``
    (default: :data:`~gwt_optim.toolkit.recipes.DEMO`, what ``pretrain`` runs)."""
    from gwt_optim.toolkit.recipes import DEMO
    from gwt_optim.toolkit.train import TrainConfig

    return {**TrainConfig().to_dict(), **(DEMO if recipe is None else recipe)}


def _shown(value: Any, none: str = "none") -> str:
    if value is None:
        return none
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def add_training_arguments(p: argparse.ArgumentParser, *, single_optimizer: bool,
                           defaults: Mapping[str, Any] | None = None,
                           otherwise: tuple[str, Mapping[str, Any]] | None = None) -> None:
    """The flags shared by ``pretrain`` and ``compare``. Only flags actually given
    reach the namespace; the run's defaults come from its recipe
    (:func:`resolve_config`), and the help states them from that same recipe
    (``defaults``, :func:`run_defaults` of :data:`~gwt_optim.toolkit.recipes.DEMO`
    unless given), so the two cannot disagree. ``otherwise``: ``(when, recipe)``,
    another recipe's value, shown beside each default it changes."""
    S = argparse.SUPPRESS
    d = run_defaults() if defaults is None else dict(defaults)
    alt_when, alt = otherwise if otherwise is not None else ("", {})

    def default(key: str, none: str = "none") -> str:
        """``(default: VALUE)``, with ``none`` for a value of None."""
        text = f"(default: {_shown(d[key], none)}"
        if otherwise is not None and key in alt and alt[key] != d[key]:
            text += f"; {alt_when}: {_shown(alt[key], none)}"
        return text + ")"

    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=S, help="shipped config (llama_9m ... llama_7b, or 60m) or a local HF "
                   f"model directory / config.json {default('model')}")
    g.add_argument("--pretrained", action="store_true", default=S,
                   help="load the weights of a local --model directory instead of fresh ones")
    g.add_argument("--data", default=S, help="'demo' (bundled KJV corpus), 'pysrc' (~50M tokens built from pinned "
                   "PyPI sdists), 'pysrc-small' (5.3M tokens of it, the compare demo's), 'c4' (streamed "
                   "allenai/c4) or a path to a .txt (documents separated by blank lines), .jsonl or .parquet file "
                   f"or folder {default('data')}")
    g.add_argument("--tokenizer", default=S, help="'bpe' or 'bpe:VOCAB' (a byte-level BPE trained here on the "
                   "training split, offline), 't5-base' (the paper's), or a HF name or folder "
                   + default("tokenizer", "bpe, t5-base for c4"))
    g.add_argument("--vocab-size", type=int, default=S,
                   help=f"vocabulary of a BPE trained here {default('vocab_size')}")
    g.add_argument("--seq-len", type=int, default=S, help=f"tokens per packed sequence {default('seq_len')}")

    g = p.add_argument_group("optimization")
    if single_optimizer:
        g.add_argument("--optimizer", default=S, help="registry name with options, e.g. 'adamw', "
                       f"'gwt-adamw:level=3:wavelet=haar' (see `compare --list`) {default('optimizer')}")
    g.add_argument("--lr", type=float, default=S, help="peak learning rate; 'name:lr=...' overrides it per "
                   f"optimizer {default('lr')}")
    g.add_argument("--scale", "--alpha", dest="scale", type=float, default=S,
                   help="module-wise alpha on attention/MLP weights, for every optimizer "
                   + default("scale", RECIPE_ALPHA))
    g.add_argument("--weight-decay", type=float, default=S,
                   help=f"decoupled weight decay {default('weight_decay')}")
    g.add_argument("--recipe", choices=("paper", "hidden"), default=S,
                   help=f"which weights get alpha and the transform (paper: attention + MLP) {default('recipe')}")
    g.add_argument("--steps", type=int, default=S, help=f"optimizer steps {default('steps')}")
    g.add_argument("--batch-size", type=int, default=S,
                   help=f"sequences per optimizer step, all ranks {default('batch_size')}")
    g.add_argument("--micro-batch-size", type=int, default=S,
                   help="sequences per forward pass and rank; gradient accumulation makes up the rest "
                   + default("micro_batch_size", "the whole batch"))
    g.add_argument("--warmup", type=float, default=S,
                   help=f"warm-up: a fraction of the steps if < 1, else steps {default('warmup')}")
    g.add_argument("--schedule", choices=SCHEDULES, default=S,
                   help="lr after the warm-up: cosine (to --min-lr-ratio), wsd (warmup-stable-decay: the peak, then "
                   f"a --decay-shape decay over the last --decay steps) or constant {default('schedule')}")
    g.add_argument("--decay", type=float, default=S,
                   help="wsd: the decay's length, a fraction of the steps if < 1, else steps; to decay a stable-phase "
                   f"checkpoint at step K over D steps: --resume --steps K+D --decay D {default('decay')}")
    g.add_argument("--decay-shape", choices=DECAY_SHAPES, default=S,
                   help=f"wsd: 1-sqrt (1 - sqrt of the decay's progress) or linear {default('decay_shape')}")
    g.add_argument("--min-lr-ratio", type=float, default=S,
                   help=f"cosine and wsd decay to this times the peak {default('min_lr_ratio')}")
    g.add_argument("--grad-clip", type=_float_or_none, default=S, help="clip the gradient norm at this value, or "
                   f"'off' {default('grad_clip', 'off')}")
    g.add_argument("--precision", choices=("auto", "bf16", "fp32"), default=S,
                   help=f"auto: bf16 autocast on CUDA GPUs that support it, fp32 otherwise {default('precision')}")
    g.add_argument("--seed", type=int, default=S, help=f"weights and data order {default('seed')}")

    g = p.add_argument_group("evaluation, checkpoints, hardware")
    g.add_argument("--eval-every", type=int, default=S,
                   help=f"validate every N steps, and at the end {default('eval_every')}")
    g.add_argument("--val-tokens", type=int, default=S, help=f"validation token budget {default('val_tokens')}")
    g.add_argument("--eval-batch-size", type=int, default=S,
                   help=f"sequences per validation forward pass {default('eval_batch_size')}")
    g.add_argument("--save-every", type=int, default=S,
                   help=f"checkpoint every N steps; 0: at the end only {default('save_every')}")
    g.add_argument("--keep-last", type=int, default=S, help=f"checkpoints to keep {default('keep_last')}")
    g.add_argument("--fsdp", action="store_true", default=S, help="under torchrun: FSDP2 instead of DDP")
    g.add_argument("--gradient-checkpointing", action="store_true", default=S,
                   help="recompute each layer's activations in backward (less memory, about 1/3 more compute)")
    g.add_argument("--step-in-backward", action="store_true", default=S,
                   help="step each parameter inside backward and free its gradient at once (one process; no "
                   "gradient accumulation, no --grad-clip)")
    g.add_argument("--device", default=S, help=f"auto, cpu or cuda {default('device')}")
    g.add_argument("--dist-timeout", type=float, metavar="SECONDS", default=S,
                   help="under torchrun: how long a rank waits for the others (a stopped or dead rank) before the "
                   "run fails " + default("dist_timeout", "300 on CPU/gloo, 1800 on GPUs/NCCL"))
    g.add_argument("--no-progress", dest="progress", action="store_false", default=S, help="no progress bar")
    g.add_argument("--paper", metavar="SIZE", help="the paper's C4 recipe for LLaMA SIZE: 60m, 130m, 350m, 1b "
                   "(GPUs); it replaces the defaults above")
    g.add_argument("--config", metavar="FILE", help="start from a run's config.json; flags given override it")


_NOT_TRAIN_FIELDS = {"func", "command", "paper", "config", "optimizers", "list", "nproc_per_node", "overwrite",
                     "decay_from"}


def _read_config(path: str | Path, what: str) -> dict[str, Any]:
    from gwt_optim.toolkit.errors import UsageError

    try:
        loaded = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"{what} {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{what} {path}: not a readable JSON file ({exc})") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"{what} {path}: expected a JSON object of settings")
    return loaded


def resolve_config(args: argparse.Namespace, recipe: dict[str, Any] | None = None):
    """Defaults < ``recipe`` (default: the demo recipe), or ``--paper SIZE`` < the
    run's own config.json (with ``--resume``) < ``--config`` < given flags; validated."""
    from gwt_optim.toolkit.recipes import DEMO, paper_recipe
    from gwt_optim.toolkit.train import TrainConfig

    paper = getattr(args, "paper", None)
    base: dict[str, Any] = paper_recipe(paper) if paper else dict(DEMO if recipe is None else recipe)
    given = _read_config(args.config, "--config") if getattr(args, "config", None) else {}
    given.update({k: v for k, v in vars(args).items() if k not in _NOT_TRAIN_FIELDS})
    resume = given.get("resume", False)
    run_config = Path(given.get("out", base.get("out", TrainConfig.out))) / "config.json"
    if resume and run_config.is_file():
        base.update(_read_config(run_config, "--resume:"))
    return TrainConfig.from_dict({**base, **given}).validate()


def check_inputs(cfg) -> None:
    """Fail now, not after loading a tokenizer, on a --model or --data that is not there."""
    from gwt_optim.toolkit.data import check_source
    from gwt_optim.toolkit.models import check_model_spec

    check_model_spec(cfg.model)
    check_source(cfg.data)


def _print_summary(summary: dict[str, Any]) -> None:
    from gwt_optim.toolkit.report import summary_table

    print()
    print(summary_table([summary]))


def branch_run(checkpoint: Path, out: Path | None) -> None:
    """Start ``out`` as the run ``checkpoint`` belongs to, up to that checkpoint: its config.json and
    environment.json, its metrics up to the checkpoint's step and the checkpoint itself, so that a resume in
    ``out`` continues from there (``--decay-from``: a WSD run's stable-phase checkpoint decayed on demand, the
    run itself untouched). Written under a temporary name and renamed into place."""
    import os
    import shutil

    from gwt_optim.toolkit.errors import UsageError
    from gwt_optim.toolkit.metrics import read_jsonl

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--decay-from copies a checkpoint into a new run folder from one process; under torchrun, "
                         "copy the run folder with only that checkpoint in it and pass --resume")
    if out is None:
        raise UsageError("--decay-from needs --out, the new run's folder (the run it branches from is left as it is)")
    if checkpoint.is_symlink() or not (checkpoint / "meta.json").is_file():
        raise UsageError(f"--decay-from {checkpoint}: not a checkpoint folder (RUN/checkpoints/step_N, no links)")
    run = checkpoint.resolve().parent.parent
    match = re.fullmatch(r"step_(\d+)", checkpoint.name)
    if match is None or not (run / "config.json").is_file():
        raise UsageError(f"--decay-from {checkpoint}: not a checkpoint of a run folder (RUN/checkpoints/step_N)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--decay-from: --out {out} already holds files; choose a new folder")
    if any(p.is_symlink() for p in checkpoint.rglob("*")):
        raise UsageError(f"--decay-from {checkpoint}: holds a symbolic link; a checkpoint is plain files")
    step = int(match.group(1))
    staging = out.with_name(f".{out.name}.branching")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in ("config.json", "environment.json"):
        if (run / name).is_file():
            shutil.copyfile(run / name, staging / name)
    if (run / "metrics.jsonl").is_file():
        kept = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("step", 0) <= step]
        (staging / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    shutil.copytree(checkpoint, staging / "checkpoints" / checkpoint.name)
    if out.exists():
        out.rmdir()
    os.replace(staging, out)


def run_pretrain(args: argparse.Namespace) -> int:
    from gwt_optim.toolkit.registry import validate_optimizer_spec
    from gwt_optim.toolkit.train import train

    if getattr(args, "decay_from", None):
        branch_run(Path(args.decay_from), Path(args.out) if hasattr(args, "out") else None)
        args.resume = True
    cfg = resolve_config(args)
    validate_optimizer_spec(cfg.optimizer)
    check_inputs(cfg)
    # --resume on the command line means a run to continue: with no checkpoint it is refused, not begun
    # afresh (a config file's "resume", which compare writes, may start a run that never saved one).
    must_resume = bool(vars(args).get("resume"))
    summary = train(cfg, must_resume=must_resume)  # user errors become one line in gwt_optim.toolkit.errors
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        _print_summary(summary)
        print(f"\nrun directory: {cfg.out}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pretrain",
        help="pre-train a LLaMA model with one optimizer",
        description=(
            "Pre-train a causal LM (a shipped LLaMA config or a local HF model) on the bundled demo corpus, "
            "C4 or local text with any registered optimizer. Writes config.json, environment.json, "
            "metrics.jsonl, summary.json and checkpoints under --out. Resume with --resume; run data "
            "parallel under torchrun (add --fsdp for FSDP2)."
        ),
    )
    p.add_argument("--out", default=argparse.SUPPRESS, help=f"run directory (default: {run_defaults()['out']})")
    p.add_argument("--resume", action="store_true", default=argparse.SUPPRESS,
                   help="continue the run in --out from its latest checkpoint, exactly where it stopped, with "
                   "the run's own config.json; only --steps, --decay, --eval-every, --eval-batch-size, "
                   "--save-every, --keep-last, --micro-batch-size, --device, --dist-timeout and progress flags may "
                   "change. A new --steps or --decay rebuilds the schedule for the new total (steps already taken "
                   "keep their lr)")
    p.add_argument("--decay-from", metavar="CHECKPOINT", default=argparse.SUPPRESS,
                   help="start --out as a copy of the run CHECKPOINT (RUN/checkpoints/step_K) belongs to, up to step "
                   "K, and continue it: with --schedule wsd, --steps K+D --decay D decays a stable-phase checkpoint "
                   "over D steps, as a run planned so from the start would (the run itself is left as it is)")
    add_training_arguments(p, single_optimizer=True)
    p.set_defaults(func=run_pretrain)
