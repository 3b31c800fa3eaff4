"""The pre-training loop behind ``gwt-optim pretrain`` and ``compare``.

One :class:`TrainConfig` describes a run; :func:`train` executes it in the
current process (or in every ``torchrun`` process) and returns the summary
it also writes to ``RUN/summary.json``. A run directory holds

``config.json``       the resolved configuration (every default filled in), and under
                      ``resolved`` what the optimizer's groups run (:data:`RESOLVED`)
``environment.json``  versions, machine, git commit, world size (and, resumed, the earlier processes')
``metrics.jsonl``     one record per optimizer step (``loss``, ``lr``: the largest
                      group's, ``group_lr``: each named group's, ``tokens_per_s``...)
                      and per evaluation (``val_loss``)
``summary.json``      the final numbers ``compare`` and ``report`` tabulate
``checkpoints/``      see :mod:`gwt_optim.toolkit.checkpoint`

Schedule (:mod:`gwt_optim.toolkit.schedules`): linear warm-up over ``warmup``
(a fraction of the steps, 10% by default), then ``cosine`` decay to
``min_lr_ratio`` (0.1) times the peak as in the paper, or ``wsd`` (stable, then
a decay over the last ``decay`` steps), or ``constant``. Each optimizer step consumes ``batch_size`` sequences in
``batch_size / (micro_batch_size * world_size)`` accumulation steps.

Resume (``resume=True``) continues from the newest readable checkpoint with
the run's own settings; only :data:`RESUME_MAY_CHANGE` may differ. A new
``steps`` rebuilds the schedule for the new total: the steps already taken
keep the learning rates they had, the rest follow the new schedule; a WSD run
resumed from a stable-phase checkpoint at step k with ``steps=k+D, decay=D``
decays from there.

Ctrl-C (SIGINT) or SIGTERM (torchrun, Slurm, Kubernetes) asks the loop to
stop at the next step boundary, where the weights, optimizer, schedule and
data position agree; that state is saved and ``--resume`` continues bit for
bit. All ranks stop at the same step. A second Ctrl-C quits at once, saving
nothing (the last checkpoint stays): :mod:`gwt_optim.toolkit.signals`. One
process writes a run folder at a time, and a folder holding an earlier run is
refused unless the run resumes: :mod:`gwt_optim.toolkit.run_folder`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from gwt_optim.toolkit.checks import check_number, check_spec_numbers
from gwt_optim.toolkit.errors import register_user_error
from gwt_optim.toolkit.losses import next_token_losses, perplexity_of
from gwt_optim.toolkit.run_folder import missing_folders, prepare_run_dir, remove_if_unused
from gwt_optim.toolkit.schedules import DECAY_SHAPES, SCHEDULES, make_schedule
from gwt_optim.toolkit.signals import StopAtStep

__all__ = [
    "TrainConfig",
    "Callback",
    "NonFiniteLossError",
    "train",
    "evaluate",
    "PRECISIONS",
    "RESUME_MAY_CHANGE",
    "RESOLVED",
    "group_names",
    "resolved_groups",
    "resume_conflicts",
]


@register_user_error  # errors imports no toolkit module: the type joins it here
class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the run stopped before the
    optimizer could apply the bad step, and no checkpoint was written."""


@dataclass
class TrainConfig:
    """Everything that defines a pre-training run (the CLI flags, one to one)."""

    out: str = "runs/pretrain"
    model: str = "llama_9m"
    data: str = "demo"
    tokenizer: str | None = None  # None: t5-base for C4, else a BPE trained on the training split
    vocab_size: int = 4096  # for a BPE tokenizer trained here
    pretrained: bool = False  # load the weights of a local model directory
    optimizer: str = "adamw"  # "name" or "name:key=value:..."
    lr: float = 1e-3
    scale: float | None = None  # module-wise alpha on attention/MLP weights; None: the recipe (registry.recipe_scale)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    recipe: str = "paper"  # which weights get alpha / the transform (gwt_optim.groups)
    steps: int = 200
    seq_len: int = 256
    batch_size: int = 8  # sequences per optimizer step, all ranks together
    micro_batch_size: int | None = None  # per rank and forward pass; None: batch_size / world
    warmup: float = 0.1  # < 1: fraction of steps; >= 1: number of steps
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"  # cosine, wsd or constant (gwt_optim.toolkit.schedules)
    decay: float = 0.2  # wsd: the decay's length, read as warmup is
    decay_shape: str = "1-sqrt"  # wsd: 1-sqrt or linear
    grad_clip: float | None = None
    precision: str = "auto"  # auto (bf16 on CUDA if supported, else fp32), bf16, fp32
    eval_every: int = 25
    val_tokens: int = 16384
    eval_batch_size: int = 16
    seed: int = 0
    save_every: int = 0  # 0: checkpoint only at the end (and on Ctrl-C or SIGTERM)
    keep_last: int = 2
    resume: bool = False
    fsdp: bool = False
    gradient_checkpointing: bool = False  # recompute layer activations in backward (HF's switch)
    step_in_backward: bool = False  # step each parameter inside backward (gwt_optim.step_in_backward)
    device: str = "auto"
    dist_timeout: float | None = None  # seconds a rank waits in a collective; None: 300 on gloo, 1800 on NCCL
    progress: bool = True
    timing_warmup: int = 3  # steps left out of ms/step and tokens/s

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        d = {k: v for k, v in d.items() if k != RESOLVED}  # a run's record of what it ran, not a setting
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown training option(s): {sorted(unknown)}")
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> "TrainConfig":
        """Raise :class:`~gwt_optim.toolkit.errors.UsageError` naming the flag
        of the first value no run could use (checked before anything is loaded)."""
        from gwt_optim.toolkit.errors import UsageError

        def number(name: str, value: Any, *, minimum: float, integer: bool, strict: bool = False) -> None:
            check_number("--" + name.replace("_", "-"), value, minimum=minimum, integer=integer, strict=strict)

        for name in ("steps", "seq_len", "batch_size", "eval_batch_size", "val_tokens"):
            number(name, getattr(self, name), minimum=1, integer=True)
        # A byte-level BPE starts from its 256 bytes and 3 special tokens; it cannot be smaller.
        number("vocab_size", self.vocab_size, minimum=259, integer=True)
        for name in ("eval_every", "save_every", "keep_last", "timing_warmup"):
            number(name, getattr(self, name), minimum=0, integer=True)
        if self.micro_batch_size is not None:
            number("micro_batch_size", self.micro_batch_size, minimum=1, integer=True)
        from gwt_optim.registry.base import SHARED_BOUNDS

        for name in ("lr", "scale", "weight_decay", "eps"):
            minimum, strict = SHARED_BOUNDS[name]
            if name == "scale" and self.scale is None:
                continue
            number(name, getattr(self, name), minimum=minimum, integer=False, strict=strict)
        number("warmup", self.warmup, minimum=0, integer=False)
        number("decay", self.decay, minimum=0, integer=False)
        if self.schedule not in SCHEDULES:
            raise UsageError(f"--schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.decay_shape not in DECAY_SHAPES:
            raise UsageError(f"--decay-shape {self.decay_shape!r}: choose one of {', '.join(DECAY_SHAPES)}")
        if isinstance(self.optimizer, str):
            check_spec_numbers(self.optimizer)  # gwt-adamw:lr=-1 by the rule of --lr
        if self.grad_clip is not None:
            number("grad_clip", self.grad_clip, minimum=0, integer=False, strict=True)
        if self.dist_timeout is not None:
            number("dist_timeout", self.dist_timeout, minimum=0, integer=False, strict=True)
        if not (isinstance(self.min_lr_ratio, (int, float)) and 0 <= self.min_lr_ratio <= 1):
            raise UsageError(f"--min-lr-ratio must be between 0 and 1, got {self.min_lr_ratio!r}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise UsageError(f"betas must be two numbers in [0, 1), got {list(self.betas)!r}")
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.seq_len < 2:
            raise UsageError(f"--seq-len must be at least 2 (a token and the next one to predict), got {self.seq_len}")
        if self.step_in_backward and self.grad_clip is not None:
            raise UsageError(
                "--step-in-backward cannot clip the global gradient norm (--grad-clip): each parameter is "
                "stepped before the other gradients exist"
            )
        return self


# config.json's record of what each optimizer group runs (:func:`resolved_groups`): written by the run
# beside its settings, never read as one (a setting decides it), so resume and reuse compare the rest.
RESOLVED = "resolved"


# What ``--resume`` may change: how long to train, how often to evaluate and
# save, where and how verbosely to run. Every other setting shapes the
# trajectory, and a different value would silently splice two runs together.
RESUME_MAY_CHANGE = frozenset({
    "out", "resume", "steps", "decay", "eval_every", "eval_batch_size", "save_every", "keep_last", "progress",
    "timing_warmup", "device", "micro_batch_size", "dist_timeout",
})


# How a run is driven, not what it trains: a finished run whose value of one of
# these differs is still the same run, so a runner reuses it (compare, quality.py).
DRIVING_ONLY = frozenset({"out", "resume", "progress", "dist_timeout"})


def resume_conflicts(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``"optimizer: 'adamw' -> 'gwt-adamw'"`` for each setting ``--resume`` may not change."""
    def norm(v: Any) -> Any:
        return json.loads(json.dumps(v))  # tuples and lists alike

    return [
        f"{key}: {saved[key]!r} -> {wanted[key]!r}"
        for key in sorted(saved)
        if key in wanted and key not in RESUME_MAY_CHANGE and norm(saved[key]) != norm(wanted[key])
    ]


def _resume_check(cfg: TrainConfig):
    """``check_saved`` for :func:`~gwt_optim.toolkit.run_folder.prepare_run_dir`: refuse to continue a run
    saved with settings that ``--resume`` may not change."""
    from gwt_optim.toolkit.errors import UsageError

    def check(saved: dict[str, Any]) -> None:
        conflicts = resume_conflicts(saved, cfg.to_dict())
        if conflicts:
            raise UsageError(
                f"--resume: {Path(cfg.out)} was trained with other settings ({'; '.join(conflicts)}). Only "
                f"{', '.join('--' + k.replace('_', '-') for k in sorted(RESUME_MAY_CHANGE - {'out', 'resume'}))} "
                "may change on resume; start a new run with another --out"
            )

    return check


class Callback:
    """Hooks into the loop (tests use them to inject faults; users to log)."""

    def on_step_start(self, step: int, model: nn.Module) -> None:
        """Before the forward passes of optimizer step ``step`` (1-based)."""

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        """After step ``step`` was applied and logged."""


class DetailClipAnneal:
    """A zero-state remedy candidate (issues 18 and 54): every GWT group's ``detail_clip`` moves from its value
    at the start to ``end`` as the run's lr schedule decays: at the spec's value while the lr is at its peak
    (warm-up, WSD's stable phase, a constant schedule), at ``end`` where the lr reaches the schedule's floor.
    The value depends on the step alone, so a resumed run recomputes it; the kernels read the clip afresh at
    every step."""

    def __init__(self, optimizer: torch.optim.Optimizer, end: float, schedule):
        # By index: load_state_dict replaces the group dicts, and the start values
        # must be the spec's, not a checkpoint's (already annealed) ones.
        self.optimizer = optimizer
        self.starts = {i: float(g["detail_clip"]) for i, g in enumerate(optimizer.param_groups)
                       if g.get("level") and g.get("detail_clip") is not None}
        if not self.starts:
            raise ValueError("detail_clip_end: no GWT group has a detail_clip to anneal")
        self.schedule = schedule
        self.end = end

    def apply(self, step: int) -> None:
        """Set the clip for the step after ``step`` finished steps."""
        floor = getattr(self.schedule, "min_ratio", 0.0)
        s = 1.0 if step < self.schedule.warmup_steps or floor >= 1 else (self.schedule(step) - floor) / (1 - floor)
        s = min(1.0, max(0.0, s))
        for i, start in self.starts.items():
            self.optimizer.param_groups[i]["detail_clip"] = self.end + (start - self.end) * s


PRECISIONS = ("auto", "bf16", "fp32")


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: choose one of {PRECISIONS}")
    if precision == "fp32":
        return None
    if precision == "auto":
        # bf16 pays off on GPUs with bf16 units; CPU autocast is slower than fp32 on most CPUs.
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else None
    return torch.bfloat16


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    ctx=None,
) -> float:
    """Mean next-token cross-entropy (nats) over ``windows`` ``[n, seq_len]``.

    Distributed: each rank scores a contiguous share and the sums are
    all-reduced. Every rank runs the same number of forward passes (short
    shares are padded with zero-weight rows) because FSDP gathers parameters
    collectively in each forward.
    """
    from gwt_optim.toolkit.distributed import DistContext, all_reduce

    ctx = ctx or DistContext(device=device)
    was_training = model.training
    model.eval()
    per_rank = -(-len(windows) // ctx.world_size)
    mine = windows[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    for start in range(0, per_rank, batch_size):
        rows = mine[start : start + batch_size]
        n_valid = len(rows)
        want = min(batch_size, per_rank - start)
        if n_valid < want:  # pad so every rank does the same forward passes
            pad = windows[:1].expand(want - n_valid, -1)
            rows = torch.cat([rows, pad]) if n_valid else pad
        x = rows.to(device)
        with _autocast(device, autocast_dtype):
            logits = model(input_ids=x).logits
        loss = next_token_losses(logits, x)
        total[0] += loss[:n_valid].double().sum()
        total[1] += loss[:n_valid].numel()
    all_reduce(total, ctx)
    model.train(was_training)
    return float(total[0] / total[1])


def build_optimizer_for(model: nn.Module, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """The optimizer of ``cfg.optimizer`` and what it resolved to (name, lr, alpha, options)."""
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer, parse_optimizer_arg, recipe_scale

    name, opts = parse_optimizer_arg(cfg.optimizer)
    scale = opts.get("scale", cfg.scale)
    resolved = {"name": name, "lr": opts.get("lr", cfg.lr),
                "scale": recipe_scale(name, opts) if scale is None else scale, "options": dict(opts)}
    ocfg = OptimizerConfig(
        lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), eps=cfg.eps, scale=cfg.scale,
        recipe=cfg.recipe, options=opts,
    )
    return build_optimizer(name, model, ocfg), resolved


def _no_sync(model: nn.Module, last: bool):
    """Skip the gradient all-reduce on all but the last accumulation step."""
    if last:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2

        @contextlib.contextmanager
        def fsdp_no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return fsdp_no_sync()
    return contextlib.nullcontext()


def _current_lr(optimizer: torch.optim.Optimizer) -> float:
    return max(float(g["lr"]) for g in optimizer.param_groups)


def group_names(optimizer: torch.optim.Optimizer, model: nn.Module, recipe: str) -> list[str]:
    """A name for each of ``optimizer``'s groups by the weights it holds (:func:`gwt_optim.groups.split_params`):
    ``transformed`` (attention/MLP matrices), ``regular`` (the rest) or ``mixed``; a repeated name gets the
    group's index (``regular-2``)."""
    from gwt_optim.groups import split_params

    transformed = {id(p) for _, p in split_params(model, recipe).transformed}
    names: list[str] = []
    for i, g in enumerate(optimizer.param_groups):
        inside = [id(p) in transformed for p in g["params"]]
        name = "transformed" if inside and all(inside) else "regular" if not any(inside) else "mixed"
        names.append(f"{name}-{i}" if name in names else name)
    return names


def resolved_groups(optimizer: torch.optim.Optimizer, names: list[str]) -> list[dict[str, Any]]:
    """What each group runs, as JSON: its name, parameter and value counts, and every hyperparameter
    (``lr`` at the schedule's peak)."""
    out = []
    for name, g in zip(names, optimizer.param_groups):
        settings = {k: v for k, v in g.items() if k not in ("params", "initial_lr")}
        settings["lr"] = g.get("initial_lr", g["lr"])
        out.append({"name": name, "params": len(g["params"]), "values": sum(p.numel() for p in g["params"]),
                    **json.loads(json.dumps(settings, default=lambda v: v.item() if torch.is_tensor(v) else str(v)))})
    return out


def _is_eval_step(step: int, cfg: TrainConfig) -> bool:
    """A validation follows this step inside the loop (the last step's comes after it)."""
    return bool(cfg.eval_every) and 0 < step < cfg.steps and step % cfg.eval_every == 0


def _load_resume_state(run: Path, cfg: TrainConfig, dctx, restore) -> tuple[Path | None, int]:
    """Put in place the newest checkpoint every rank can read and use
    (``restore(payload)`` loads it and returns its step); that checkpoint and step.

    A checkpoint damaged after it was written (a truncated copy, a file of
    text, a payload that does not fit the run) is set aside as
    ``unreadable-step_N`` once an older one is in place, with one line each:
    losing some steps beats refusing to resume. When none can be used, none is
    moved: the cause may be outside them (the data changed), and they stay
    where a fix would look for them."""
    from gwt_optim.toolkit import checkpoint as ckpt
    from gwt_optim.toolkit.distributed import all_reduce
    from gwt_optim.toolkit.errors import UsageError

    candidates = list(reversed(ckpt.list_checkpoints(run)))
    failed: list[tuple[Path, str]] = []
    for path in candidates:
        try:
            meant = ckpt.read_meta(path).get("optimizer")
            if meant is not None and meant != cfg.optimizer:
                raise UsageError(f"--resume: {path} is a checkpoint of --optimizer {meant!r}, not {cfg.optimizer!r}")
            step, why = restore(ckpt.load_checkpoint(path, rank=dctx.rank, world_size=dctx.world_size)), ""
        except ckpt.CheckpointUnreadable as exc:
            step, why = None, str(exc)
        ok = torch.tensor([1.0 if step is not None else 0.0], device=dctx.device)
        all_reduce(ok, dctx, op=torch.distributed.ReduceOp.MIN)
        if ok.item() == 1.0:
            break
        failed.append((path, why or "another rank could not use it"))
    else:
        if candidates:
            newest, why = failed[0]
            raise UsageError(f"--resume: no readable checkpoint in {run / ckpt.CHECKPOINT_DIR} "
                             f"(the newest, {newest.name}: {why})")
        return None, 0
    dctx.barrier()
    if dctx.is_main:
        for n, (bad, why) in enumerate(failed, 1):
            aside = bad.with_name("unreadable-" + bad.name)
            k = 1
            while aside.exists():
                k += 1
                aside = bad.with_name(f"unreadable{k}-{bad.name}")
            os.replace(bad, aside)
            then = f"; resuming from the previous checkpoint, {path.name}" if n == len(failed) else ""
            print(f"--resume: {bad.name} is unreadable ({why}); moved it to {aside.name}{then}", file=sys.stderr)
    dctx.barrier()
    return path, step


def _use_schedule(scheduler, schedule) -> None:
    """Put this run's schedule back after ``LambdaLR.load_state_dict``, which
    restores the saved one's fields (its old total), and set the current lr
    from it: a resume with more ``steps`` follows the rebuilt schedule, and an
    unchanged one gets the very same value ``scheduler.step()`` had set."""
    scheduler.lr_lambdas = [schedule] * len(scheduler.base_lrs)
    lrs = [base * schedule(scheduler.last_epoch) for base in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def train(cfg: TrainConfig, callbacks: Iterable[Callback] = (), *, must_resume: bool = False) -> dict[str, Any]:
    """Run ``cfg`` to the end and return its summary (also in ``summary.json``).

    Raises :class:`NonFiniteLossError` when the loss stops being finite.
    On ``KeyboardInterrupt`` (a SIGINT or SIGTERM stops at the next step
    boundary and raises :class:`Stopped`) a checkpoint of the last finished
    step is saved first, so ``--resume`` continues exactly from there. The run
    folder is locked against a second writer until this returns or raises.

    ``cfg.resume`` with no checkpoint in ``cfg.out`` starts from step 0 (what
    ``compare --resume`` wants of a run that never started), unless
    ``must_resume`` (``pretrain --resume``): then it is refused. A run that
    fails before writing anything leaves no folder it created behind.
    """
    made = missing_folders(Path(cfg.out))
    try:
        with contextlib.ExitStack() as held:
            return _train(cfg, callbacks, held, must_resume=must_resume)
    except BaseException:
        if made and os.environ.get("RANK", "0") == "0":
            remove_if_unused(made)
        raise


def _train(cfg: TrainConfig, callbacks: Iterable[Callback], held: contextlib.ExitStack, *,
           must_resume: bool = False) -> dict[str, Any]:
    # _setup builds a _Run; _Loop drives _train_step, _validate and _Checkpoints over it.
    cfg.validate()
    callbacks = list(callbacks)
    return _Loop(_setup(cfg, held, must_resume=must_resume), callbacks).run()


# --------------------------------------------------------------------------- #
# Setup: everything before the first step
# --------------------------------------------------------------------------- #


@dataclass(eq=False)
class _Run:
    """A run ready for its first step: what :func:`_setup` built, and what the
    step, the evaluation and the checkpoints read."""

    cfg: TrainConfig
    dctx: Any  # gwt_optim.toolkit.distributed.DistContext
    folder: Path
    micro: int  # sequences per rank and forward pass
    accum: int  # forward passes per rank and optimizer step
    amp: torch.dtype | None  # autocast dtype; None: fp32
    data: Any  # gwt_optim.toolkit.data.DataBundle: .train (a stream with a position), .validation, .info
    model: nn.Module  # wrapped for DDP or FSDP2 when distributed
    n_params: int
    optimizer: torch.optim.Optimizer
    opt_info: dict[str, Any]  # what cfg.optimizer resolved to (build_optimizer_for)
    scheduler: torch.optim.lr_scheduler.LambdaLR
    clip_anneal: DetailClipAnneal | None
    log: Any = None  # gwt_optim.toolkit.metrics.MetricsLog, rank 0's only writes
    start_step: int = 0
    resumed_from: Path | None = None  # the checkpoint this run continues
    eval_first: bool = False  # resumed at a validation step that a stop left unmade

    @property
    def device(self) -> torch.device:
        return self.dctx.device

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len


def _setup(cfg: TrainConfig, held: contextlib.ExitStack, *, must_resume: bool = False) -> _Run:
    """Join the ranks, lock the run folder, build data, model, optimizer and
    schedule, put a resumed run's checkpoint in place and write the run's files.
    The order is the trajectory's: the seed is set after the data and before the model."""
    from gwt_optim.toolkit.data import build_data
    from gwt_optim.toolkit.distributed import init_distributed

    dctx = init_distributed(cfg.device, timeout_s=cfg.dist_timeout)
    folder = prepare_run_dir(Path(cfg.out), resume=cfg.resume, is_main=dctx.is_main, held=held,
                             check_saved=_resume_check(cfg), must_resume=must_resume)
    dctx.barrier()
    micro, accum = _micro_batches(cfg, dctx)
    amp = _autocast_dtype(cfg.precision, dctx.device)
    data = build_data(
        cfg.data, seq_len=cfg.seq_len, val_tokens=cfg.val_tokens, seed=cfg.seed, tokenizer=cfg.tokenizer,
        vocab_size=cfg.vocab_size, progress=cfg.progress and dctx.is_main,
    )
    r = _Run(cfg=cfg, dctx=dctx, folder=folder, micro=micro, accum=accum, amp=amp, data=data,
             **_build_training(cfg, dctx, data))
    if cfg.resume:
        _resume(r)
    if r.clip_anneal is not None:
        r.clip_anneal.apply(r.scheduler.last_epoch)
    _write_run_files(r)
    return r


def _micro_batches(cfg: TrainConfig, dctx) -> tuple[int, int]:
    """Sequences per forward pass and forward passes per step, on each rank."""
    per_rank = cfg.batch_size // dctx.world_size
    micro = cfg.micro_batch_size or per_rank
    if cfg.batch_size % dctx.world_size or per_rank % micro:
        raise ValueError(
            f"--batch-size {cfg.batch_size} must split into {dctx.world_size} rank(s) x whole micro-batches "
            f"of {micro}; pick --micro-batch-size dividing {per_rank}"
        )
    accum = per_rank // micro
    if cfg.step_in_backward and (dctx.distributed or accum > 1):
        from gwt_optim.toolkit.errors import UsageError

        raise UsageError(
            "--step-in-backward runs in one process without gradient accumulation: every backward steps "
            + (f"(this run is data parallel over {dctx.world_size} ranks; their gradient reduction comes after "
               "the step)" if dctx.distributed else
               f"(--micro-batch-size {micro} makes {accum} micro-batches per step; use --batch-size {micro}, "
               "or --gradient-checkpointing to fit the whole batch)")
        )
    return micro, accum


def _schedule(cfg: TrainConfig):
    return make_schedule(cfg.schedule, cfg.steps, cfg.warmup, min_ratio=cfg.min_lr_ratio, decay=cfg.decay,
                         decay_shape=cfg.decay_shape)


def _build_training(cfg: TrainConfig, dctx, data) -> dict[str, Any]:
    """The model (seeded, so every rank and every optimizer starts from the same
    weights), its optimizer and their schedules, as :class:`_Run` fields."""
    from gwt_optim.toolkit.checkpoint import seed_all
    from gwt_optim.toolkit.distributed import unwrap, wrap_model
    from gwt_optim.toolkit.models import build_model, count_parameters, enable_gradient_checkpointing

    seed_all(cfg.seed)
    model = build_model(cfg.model, tokenizer=data.tokenizer, max_seq_len=cfg.seq_len, pretrained=cfg.pretrained)
    model.to(dctx.device)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    n_params = count_parameters(model)
    model = wrap_model(model, dctx, fsdp=cfg.fsdp)
    optimizer, opt_info = build_optimizer_for(unwrap(model), cfg)
    opt_info["groups"] = group_names(optimizer, unwrap(model), cfg.recipe)
    if cfg.step_in_backward:
        from gwt_optim.backward import step_in_backward

        step_in_backward(optimizer)  # for the life of this optimizer: no handle to keep
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg))
    clip_end = getattr(optimizer, "detail_clip_end", None)
    clip_anneal = None
    if clip_end is not None:
        clip_anneal = DetailClipAnneal(optimizer, clip_end, _schedule(cfg))
    return dict(model=model, n_params=n_params, optimizer=optimizer, opt_info=opt_info, scheduler=scheduler,
                clip_anneal=clip_anneal)


def _resume(r: _Run) -> None:
    """Load the newest usable checkpoint into the model, optimizer, schedule and
    data position; set ``start_step`` and ``resumed_from`` (None: there was none)."""
    from gwt_optim.toolkit import checkpoint as ckpt
    from gwt_optim.toolkit.distributed import unwrap

    cfg = r.cfg

    def restore(state: dict[str, Any]) -> int:
        return ckpt.restore_training_state(state, model=unwrap(r.model), optimizer=r.optimizer,
                                           scheduler=r.scheduler, data=r.data.train)

    r.resumed_from, r.start_step = _load_resume_state(r.folder, cfg, r.dctx, restore)
    if r.resumed_from is None:
        if r.dctx.is_main:
            print(f"--resume: no checkpoint in {r.folder}; starting from step 0")
        return
    if r.start_step > cfg.steps:
        from gwt_optim.toolkit.errors import UsageError

        raise UsageError(f"--steps {cfg.steps} is below step {r.start_step} of the checkpoint {r.resumed_from}")
    _use_schedule(r.scheduler, _schedule(cfg))


def _write_run_files(r: _Run) -> None:
    """``config.json``, ``environment.json`` and ``metrics.jsonl`` (emptied, or on
    resume cut back to the checkpoint's step); sets ``log`` and ``eval_first``."""
    from gwt_optim.toolkit.metrics import MetricsLog, atomic_write_json, environment, process_environments

    cfg, dctx, run = r.cfg, r.dctx, r.folder
    if dctx.is_main:
        atomic_write_json(run / "config.json", {**cfg.to_dict(), RESOLVED: {
            "optimizer": r.opt_info["name"], "groups": resolved_groups(r.optimizer, r.opt_info["groups"])}})
        env = environment(packages=("bitsandbytes", "torchao", "galore-torch", "apollo-torch", "adam-mini"))
        env.update(world_size=dctx.world_size, fsdp=cfg.fsdp, device=str(r.device),
                   autocast=str(r.amp) if r.amp else "fp32")
        if r.resumed_from is not None:
            # A run may span code versions: the processes before this one stay on record, oldest first.
            env.update(resumed_at_step=r.start_step, earlier=process_environments(run / "environment.json"))
        atomic_write_json(run / "environment.json", env)
    r.log = MetricsLog(run / "metrics.jsonl", enabled=dctx.is_main)
    # A stop lands before its step's validation (see _Loop), so a run resumed at a validation step makes
    # that validation first. The weights are the checkpoint's and a validation draws no random number, so it
    # logs the figure the uninterrupted run logged; one already made (a periodic save) is made again, once.
    r.eval_first = r.resumed_from is not None and _is_eval_step(r.start_step, cfg)
    if dctx.is_main and r.resumed_from is not None:
        # Drop the records of steps this run will redo, and a validation it redoes.
        r.log.truncate_after(r.start_step, redo_eval=r.start_step == cfg.steps or r.eval_first)
    elif dctx.is_main:
        (run / "metrics.jsonl").unlink(missing_ok=True)


# --------------------------------------------------------------------------- #
# The step, evaluation, checkpoints
# --------------------------------------------------------------------------- #


@dataclass
class _StepResult:
    loss: float  # the mean over the step's micro-batches and ranks
    grad_norm: float | None  # before clipping; None without --grad-clip
    lr: float  # the step's (largest) learning rate
    group_lr: dict[str, float]  # each named group's
    stop: bool  # some rank was asked to stop


def _train_step(r: _Run, batch: torch.Tensor, sigint: StopAtStep, meter, *, step: int,
                last_ckpt: Path | None) -> _StepResult:
    """Optimizer step ``step + 1`` on this rank's ``batch``: accumulate the
    micro-batches' gradients, agree on the loss and on a stop, then clip, step,
    advance the schedules and clear the gradients. Timed by ``meter``.

    Raises :class:`NonFiniteLossError` before the optimizer applies a bad loss."""
    from gwt_optim.toolkit.distributed import all_reduce

    cfg = r.cfg
    # [loss, stop]: the stop request rides on the loss all-reduce, so every rank
    # learns of a Ctrl-C or SIGTERM that reached any of them at the same step, for free.
    reduced = torch.zeros(2, dtype=torch.float64, device=r.device)
    with meter.step(r.tokens_per_step):
        for i in range(r.accum):
            x = batch[i * r.micro : (i + 1) * r.micro].to(r.device, non_blocking=True)
            with _no_sync(r.model, last=i == r.accum - 1), _autocast(r.device, r.amp):
                loss = r.model(input_ids=x, labels=x).loss / r.accum
                # backward steps in that mode: a bad loss must stop before it
                if not (cfg.step_in_backward and not torch.isfinite(loss)):
                    loss.backward()
            reduced[0] += loss.detach().double()
        reduced[1] = float(sigint.requested)
        all_reduce(reduced, r.dctx)
        loss_value = float(reduced[0]) / r.dctx.world_size
        if not math.isfinite(loss_value):
            raise NonFiniteLossError(
                f"training loss is {loss_value} at step {step + 1}; stopped before applying it. "
                + (f"The last good checkpoint, {last_ckpt}, is intact (resume with --resume). "
                   if last_ckpt else "No checkpoint was saved yet (use --save-every N). ")
                + "Lower --lr, set --grad-clip 1.0, or check the data."
            )
        grad_norm = None
        if cfg.grad_clip:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(r.model.parameters(), cfg.grad_clip))
        lr_now = _current_lr(r.optimizer)
        group_lr = {name: float(g["lr"]) for name, g in zip(r.opt_info["groups"], r.optimizer.param_groups)}
        if not cfg.step_in_backward:  # else every parameter was stepped in backward
            r.optimizer.step()
        r.scheduler.step()
        if r.clip_anneal is not None:
            r.clip_anneal.apply(r.scheduler.last_epoch)
        r.optimizer.zero_grad(set_to_none=True)
    return _StepResult(loss_value, grad_norm, lr_now, group_lr, bool(reduced[1] > 0))


def _validate(r: _Run, step: int) -> float:
    """The validation loss after ``step`` steps, also logged to ``metrics.jsonl``."""
    val = evaluate(r.model, r.data.validation, batch_size=r.cfg.eval_batch_size, device=r.device,
                   autocast_dtype=r.amp, ctx=r.dctx)
    r.log.write({"step": step, "val_loss": val, "val_ppl": perplexity_of(val)})
    return val


class _Checkpoints:
    """Saves the whole training state at a step boundary and remembers the
    newest checkpoint (``last``) and the step it holds (``saved_step``, -1: none)."""

    def __init__(self, r: _Run):
        self.r = r
        self.last = r.resumed_from
        self.saved_step = r.start_step if r.resumed_from is not None else -1

    def save(self, step: int) -> None:
        from gwt_optim.toolkit import checkpoint as ckpt
        from gwt_optim.toolkit.distributed import unwrap

        r = self.r
        payload = {
            "model": unwrap(r.model).state_dict(),
            "optimizer": r.optimizer.state_dict(),
            "scheduler": r.scheduler.state_dict(),
            "data": r.data.train.state_dict(),
            "rng": ckpt.rng_state(),
            "step": step,
        }
        self.last = ckpt.save_checkpoint(
            r.folder, step, payload, keep_last=r.cfg.keep_last, rank=r.dctx.rank, world_size=r.dctx.world_size,
            sharded=r.cfg.fsdp and r.dctx.distributed, barrier=r.dctx.barrier,
            meta={"optimizer": r.cfg.optimizer},
        )
        self.saved_step = step


# --------------------------------------------------------------------------- #
# The loop
# --------------------------------------------------------------------------- #


class _Loop:
    """Steps a set-up run to its end, or to a stop on a signal (saved at the
    step boundary), then makes the final validation, checkpoint and summary."""

    def __init__(self, r: _Run, callbacks: list[Callback]):
        from tqdm.auto import tqdm

        from gwt_optim.toolkit.metrics import Throughput

        self.r, self.callbacks = r, callbacks
        self.checkpoints = _Checkpoints(r)
        self.meter = Throughput(warmup=r.cfg.timing_warmup, device=r.device)
        self.bar = tqdm(total=r.cfg.steps, initial=r.start_step, desc=r.opt_info["name"], unit="step",
                        disable=not (r.cfg.progress and r.dctx.is_main), dynamic_ncols=True)
        self.step = r.start_step
        self.recent: list[float] = []  # the last ten steps' losses
        # True from drawing a batch until its step is applied and logged: a
        # checkpoint taken then would pair the new data position with old weights.
        self.in_step = False

    def run(self) -> dict[str, Any]:
        from gwt_optim.toolkit.metrics import atomic_write_json

        self.r.model.train()
        wall0 = time.perf_counter()
        # the log closes after the final validation, whose record comes after the last step's
        with StopAtStep() as sigint, self.r.log:
            try:
                self._steps(sigint)
            except KeyboardInterrupt:
                self._save_on_stop()
                raise
            finally:
                self.bar.close()
            # A signal from here on waits for the finished run to be evaluated and saved.
            final = self._finish()
        summary = self._summary(final, wall_s=time.perf_counter() - wall0)
        if self.r.dctx.is_main:
            atomic_write_json(self.r.folder / "summary.json", summary)
        return summary

    def _steps(self, sigint: StopAtStep) -> None:
        from gwt_optim.toolkit.distributed import shard_rows

        r, cfg = self.r, self.r.cfg
        if r.eval_first:
            _validate(r, self.step)
        while self.step < cfg.steps:
            for cb in self.callbacks:
                cb.on_step_start(self.step + 1, r.model)
            self.in_step = True
            batch = shard_rows(r.data.train.next(cfg.batch_size), r.dctx)
            result = _train_step(r, batch, sigint, self.meter, step=self.step, last_ckpt=self.checkpoints.last)
            self.step += 1
            self._log_step(result)
            # Before this step's evaluation: a launcher's grace period (torchrun's 30 s) may not
            # cover one. One process reads its own flag, which may have been set after the reduction.
            if (result.stop if r.dctx.distributed else sigint.requested) and self.step < cfg.steps:
                raise sigint.stopped()
            if _is_eval_step(self.step, cfg):
                val_loss = _validate(r, self.step)
                if r.dctx.is_main:
                    self.bar.write(f"step {self.step}: val_loss {val_loss:.4f} (ppl {perplexity_of(val_loss):.2f})")
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                self.checkpoints.save(self.step)

    def _log_step(self, result: _StepResult) -> None:
        """Write the finished step's record, advance the bar, call ``on_step_end``."""
        step, tokens_per_step, seconds = self.step, self.r.tokens_per_step, self.meter.last_seconds
        record = {"step": step, "loss": result.loss, "lr": result.lr, "group_lr": result.group_lr,
                  "tokens": step * tokens_per_step,
                  "ms": 1000 * seconds, "tokens_per_s": tokens_per_step / seconds}
        if result.grad_norm is not None:
            record["grad_norm"] = result.grad_norm
        self.r.log.write(record)
        self.in_step = False
        self.recent = (self.recent + [result.loss])[-10:]
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        for cb in self.callbacks:
            cb.on_step_end(step, record)

    def _save_on_stop(self) -> None:
        """On KeyboardInterrupt: save the last finished step unless the stop came mid-step."""
        is_main, last = self.r.dctx.is_main, self.checkpoints.last
        if self.in_step:
            if is_main:
                kept = f"the last checkpoint, {last}, is intact" if last else "no checkpoint was saved"
                print(f"\ninterrupted mid-step: nothing saved; {kept}", file=sys.stderr)
        elif self.step > self.r.start_step:
            if self.checkpoints.saved_step != self.step:
                self.checkpoints.save(self.step)
            if is_main:
                print(f"\ninterrupted: checkpoint of step {self.step} saved in {self.checkpoints.last}; "
                      "continue with --resume", file=sys.stderr)

    def _finish(self) -> dict[str, Any]:
        """The final validation and checkpoint, and the memory figures; measured
        after training, when every state tensor exists."""
        from gwt_optim.toolkit.distributed import all_reduce
        from gwt_optim.toolkit.metrics import peak_rss_bytes, state_bytes

        r = self.r
        val_loss = _validate(r, self.step)
        sbytes = torch.tensor([state_bytes(r.optimizer)], dtype=torch.float64, device=r.device)
        per_rank_state = int(sbytes.item())
        all_reduce(sbytes, r.dctx)
        rss = torch.tensor([peak_rss_bytes()], dtype=torch.float64, device=r.device)
        all_reduce(rss, r.dctx, op=torch.distributed.ReduceOp.MAX)
        self.checkpoints.save(self.step)
        return {"val_loss": val_loss, "state_bytes": int(sbytes.item()), "state_bytes_per_rank": per_rank_state,
                "peak_rss_bytes": int(rss.item())}

    def _summary(self, final: dict[str, Any], *, wall_s: float) -> dict[str, Any]:
        """``summary.json``: what ``compare`` and ``report`` tabulate."""
        from gwt_optim.toolkit.metrics import cuda_peak_bytes

        r, cfg, step = self.r, self.r.cfg, self.step
        return {
            "optimizer": cfg.optimizer,
            "optimizer_name": r.opt_info["name"],
            "lr": r.opt_info["lr"],
            "scale": r.opt_info["scale"],
            "options": r.opt_info["options"],
            "val_loss": final["val_loss"],
            "val_ppl": perplexity_of(final["val_loss"]),
            "train_loss": sum(self.recent) / len(self.recent) if self.recent else None,
            "state_bytes": final["state_bytes"],
            "state_bytes_per_rank": final["state_bytes_per_rank"],
            "peak_rss_bytes": final["peak_rss_bytes"],
            "peak_gpu_bytes": cuda_peak_bytes(r.device),
            "ms_per_step": self.meter.ms_per_step,
            "tokens_per_s": self.meter.tokens_per_s,
            "steps": step,
            "tokens": step * r.tokens_per_step,
            "epochs": r.data.train.epochs_done,
            "params": r.n_params,
            "model": cfg.model,
            "data": cfg.data,
            "seed": cfg.seed,
            "world_size": r.dctx.world_size,
            "fsdp": cfg.fsdp,
            "wall_s": wall_s,
            "data_info": r.data.info,
        }
