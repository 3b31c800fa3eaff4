"""Full-parameter training of a big LLaMA in little memory: measured peak
against ``gwt-optim memory``'s prediction.

    python benchmarks/big_model.py --model llama_7b --optimizer gwt-adamw:level=3 \\
        --moment-dtype int8 --steps 2 --seq-len 256 --json OUT.json

Trains ``--steps`` real steps on the demo corpus (the cached demo BPE; token
ids index the config's own 32000-entry vocabulary, so the model has LLaMA-7B's
exact shape) with

* weights built on the meta device and materialized straight in bf16 (no fp32
  copy, :func:`gwt_optim.toolkit.models.build_model`);
* the HF model's gradient checkpointing (non-reentrant);
* every parameter stepped inside backward (:func:`gwt_optim.step_in_backward`),
  so at most one gradient is alive;
* GWT-AdamW at level 3 with 8-bit moments on the attention/MLP weights; the
  embeddings, head and norms in the same optimizer at level 0 (plain AdamW
  math) with 8-bit moments for the two matrices (vectors keep fp32 moments).

* glibc's mmap threshold fixed at 128 KiB (``--default-malloc`` leaves it
  sliding): every tensor of that size or more is its own mapping, returned
  when freed. By default glibc raises the threshold up to 32 MB, tensors
  under it live in the heap, and the moments made in the first step among
  freed temporaries keep the heap's freed pages resident: 1.8-2.0 GB of
  slack at llama_1b's peak, the 7B command's growth from 18.6 to 20.7 GiB
  (docs/results/memory-trace-cpu.md).

Before building anything it prints the estimate (:func:`gwt_optim.memory.training_estimate`
plus this process's measured baseline) and refuses, with exit status 2, when
that exceeds the memory available (``--memory-limit-gb``, default: what the
machine has available now; a 24 GiB cap on CUDA through
``torch.cuda.set_per_process_memory_fraction``). So ``--optimizer adamw`` on
7B gets its estimate and a refusal, not an OOM kill.

Writes ``{"peak_rss_bytes", "peak_gpu_bytes", "estimate_bytes", "losses",
"step_seconds", "phases", ...}`` to ``--json`` and prints the per-part
breakdown and the peak RSS by phase (the model's build, each forward, each
backward with its parameter steps: ``benchmarks/_memtrace.py``; every
parameter step's row with ``--trace-json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _memtrace import MemTrace, attach, attach_after, fix_mmap_threshold  # noqa: E402

GIB = 1 << 30


def _available_bytes() -> int:
    """Memory this process may still use: MemAvailable (plus what it holds),
    capped by a cgroup limit when one is set."""
    from gwt_optim.toolkit.metrics import current_rss_bytes

    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        import psutil

        avail = psutil.virtual_memory().available
    limit = avail + current_rss_bytes()
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text != "max":
            limit = min(limit, int(text))
    except (OSError, ValueError):
        pass
    return limit


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama_7b", help="shipped config or local HF config/directory")
    p.add_argument("--pretrained", action="store_true", help="load a local --model directory's weights")
    p.add_argument("--optimizer", default="gwt-adamw:level=3", help="registry spec, e.g. gwt-adamw:level=3, adamw")
    p.add_argument("--moment-dtype", default=None, help="GWT moment dtype: int8, bfloat16, float32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weight dtype")
    p.add_argument("--data", default="demo", help="'demo' (the bundled corpus) or 'synthetic' (random tokens)")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--no-step-in-backward", dest="in_backward", action="store_false",
                   help="normal optimizer.step() after backward (all gradients alive)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="refuse above this many GiB (default: available RAM; on CUDA --gpu-memory-gb)")
    p.add_argument("--gpu-memory-gb", type=float, default=24.0, help="GPU memory cap in GiB (CUDA only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--default-malloc", dest="fixed_mmap", action="store_false",
                   help="keep glibc's sliding mmap threshold (RSS then holds freed heap pages; see the docstring)")
    p.add_argument("--trace-json", default=None,
                   help="write every phase's peak RSS here (each forward, autograd stretch and parameter step)")
    return p.parse_args(argv)


def _estimate(args, spec_name: str, options: dict, vocab: int):
    from gwt_optim.memory import ALIASES, ESTIMATORS, training_estimate

    key = ALIASES.get(spec_name, spec_name)
    if key not in ESTIMATORS:
        return None
    md = options.get("moment_dtype")
    # GWT keeps moments in the compute dtype (fp32) unless told; torch AdamW in the weights' dtype.
    state_dtype = {"int8": "int8", "bfloat16": "bf16", "float32": "fp32"}.get(md) if md else (
        "fp32" if key.startswith("gwt-") else args.dtype)
    return training_estimate(
        args.model if not args.pretrained else str(Path(args.model) / "config.json"), key,
        level=int(options.get("level", 2)), dtype=args.dtype, state_dtype=state_dtype,
        batch_size=args.batch_size, seq_len=args.seq_len, gradient_checkpointing=args.checkpointing,
        step_in_backward=args.in_backward, vocab_size=vocab,
    )


def _table(rows: list[tuple[str, int | None, int | None]]) -> str:
    def gb(v):
        return "" if v is None else f"{v / 1e9:8.3f}"

    lines = ["| part | predicted GB | measured GB |", "|---|---:|---:|"]
    lines += [f"| {name} | {gb(pred)} | {gb(meas)} |" for name, pred, meas in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    # Before torch allocates: every block of 128 KiB or more gets its own
    # mapping, returned to the kernel when freed. glibc's default raises that
    # threshold (up to 32 MB) each time a large block is freed, and blocks
    # under it live in the heap, where the moments made in the first step and
    # the activations, among freed temporaries, keep freed pages resident: 1.8
    # GB of llama_1b's peak (docs/results/memory-trace-cpu.md).
    # (A MALLOC_MMAP_THRESHOLD_ in the environment has set it already.)
    fixed_mmap = os.environ.get("MALLOC_MMAP_THRESHOLD_") or (fix_mmap_threshold() if args.fixed_mmap else False)
    import torch

    from gwt_optim.toolkit.metrics import current_rss_bytes, peak_rss_bytes
    from gwt_optim.toolkit.registry import parse_optimizer_arg
    from gwt_optim.toolkit import quiet_third_party

    quiet_third_party()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    name, options = parse_optimizer_arg(args.optimizer)
    if args.moment_dtype is not None:
        options["moment_dtype"] = args.moment_dtype
    if name.startswith("gwt-"):
        options.setdefault("scale", 0.25)  # the paper's alpha
    options.setdefault("lr", args.lr)

    # The data first: it fixes the token ids, and the process's baseline is measured after it.
    torch.manual_seed(args.seed)
    if args.data == "synthetic":
        gen = torch.Generator().manual_seed(args.seed)
        batches = [torch.randint(0, 4096, (args.batch_size, args.seq_len), generator=gen) for _ in range(args.steps)]
        data_info = {"source": "synthetic", "vocab_size": 4096}
    else:
        from gwt_optim.toolkit.data import build_data

        data = build_data(args.data, seq_len=args.seq_len, val_tokens=args.seq_len, seed=args.seed,
                          progress=args.progress)
        batches = [data.train.next(args.batch_size) for _ in range(args.steps)]
        data_info = {k: v for k, v in data.info.items() if isinstance(v, (int, str))}
        del data
    # The model code's import is part of the baseline (about 0.27 GB of RSS), not of the model.
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    baseline = current_rss_bytes()

    from gwt_optim.toolkit.models import load_model_config

    vocab = max(load_model_config(args.model).vocab_size, int(max(int(b.max()) for b in batches)) + 1)
    est = _estimate(args, name, options, vocab)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        cap = int(args.gpu_memory_gb * GIB)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        limit = int(args.memory_limit_gb * GIB) if args.memory_limit_gb else min(cap, total)
        predicted = est.total if est else None  # on the GPU; the host holds little
    else:
        limit = int(args.memory_limit_gb * GIB) if args.memory_limit_gb else _available_bytes()
        predicted = baseline + est.total if est else None

    mode = ("step in backward" if args.in_backward else "normal step") + (
        ", checkpointing" if args.checkpointing else "")
    print(f"{args.model}, {args.optimizer}" + (f", moments {args.moment_dtype}" if args.moment_dtype else "")
          + f", {args.dtype} weights, batch {args.batch_size} x {args.seq_len}, {mode}, on {device}")
    if est is not None:
        print(f"\ngwt-optim memory predicts (GB = 1e9 bytes):")
        rows = [(k, v, None) for k, v in est.parts().items() if k != "total"]
        if device.type == "cpu":
            rows.append(("process baseline (measured)", baseline, baseline))
        rows.append(("predicted peak", predicted, None))
        print(_table(rows))
    else:
        print(f"(no memory estimate for {name!r}; running without the guard)")
    print(f"memory limit: {limit / GIB:.2f} GiB")
    if predicted is not None and predicted > limit:
        print(
            f"\nrefused: the predicted peak, {predicted / GIB:.2f} GiB, exceeds the {limit / GIB:.2f} GiB this run may "
            f"use; it would be killed for lack of memory. Try gwt-adamw:level=3 --moment-dtype int8 with "
            f"step-in-backward and checkpointing, or a smaller --model.",
            file=sys.stderr,
        )
        if args.json:
            Path(args.json).write_text(json.dumps({
                "refused": True, "estimate_bytes": predicted, "limit_bytes": limit,
                "estimate_parts": est.parts(), "peak_rss_bytes": None, "peak_gpu_bytes": None,
                "losses": [], "step_seconds": [],
            }, indent=2))
        return 2

    from tqdm.auto import tqdm

    from gwt_optim import step_in_backward
    from gwt_optim.memory import optimizer_state_bytes
    from gwt_optim.toolkit.models import build_model, enable_gradient_checkpointing
    from gwt_optim.toolkit.registry import OptimizerConfig, build_optimizer

    trace = MemTrace()  # restarts the peak-RSS counter: the training peak is not the data loading's
    trace.mark("build")
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model = build_model(args.model, pretrained=args.pretrained, dtype=dtype, device=device,
                        max_seq_len=args.seq_len, vocab_size=None if args.pretrained else vocab)
    if args.checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    build_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    optimizer = build_optimizer(name, model, OptimizerConfig(lr=args.lr, options=dict(options)))

    bar = tqdm(total=args.steps * len(params), unit="param", desc="stepping", disable=not args.progress,
               dynamic_ncols=True)
    marks = attach(trace, model, params)  # before the stepping hooks: a step's mark precedes it
    if args.in_backward:
        handle = step_in_backward(optimizer)
        marks += attach_after(trace, params)

        def tick(_param) -> None:
            # Not `lambda p: bar.update(1)`: tqdm's update returns whether it redrew,
            # and autograd rejects a hook that returns anything but None.
            bar.update(1)

        # Registered after the stepping hooks, so each tick follows a finished parameter step.
        ticks = [p.register_post_accumulate_grad_hook(tick) for p in params]
    losses, seconds = [], []
    for i, x in enumerate(batches):
        x = x.to(device)
        start = time.perf_counter()
        bar.set_postfix_str(f"step {i + 1}/{args.steps}: forward", refresh=True)
        loss = model(input_ids=x, labels=x).loss
        if not torch.isfinite(loss):
            print(f"\nstep {i + 1}: the loss is {loss.item()}; stopping before its update", file=sys.stderr)
            losses.append(loss.item())
            break
        bar.set_postfix_str(f"step {i + 1}/{args.steps}: backward (loss {loss.item():.4f})", refresh=True)
        loss.backward()
        if not args.in_backward:
            optimizer.step()
            bar.update(len(params))
        optimizer.zero_grad(set_to_none=True)  # in backward: the next backward is a new step
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        del loss
    bar.close()
    trace.mark(None)
    if args.in_backward:
        handle.remove()
        for t in ticks:
            t.remove()
    for m in marks:
        m.remove()

    state = optimizer_state_bytes(optimizer)
    # The whole process's: the kernel's own maximum forgets what the trace's resets cleared.
    peak_rss = max(peak_rss_bytes(), trace.before, trace.peak())
    train_peak = trace.peak() if trace.enabled else peak_rss  # from the model's build on
    peak_gpu = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    measured_peak = peak_gpu if device.type == "cuda" else train_peak
    print(f"\nlosses: {', '.join(f'{v:.4f}' for v in losses)}; seconds per step: "
          f"{', '.join(f'{s:.1f}' for s in seconds)} (model built in {build_s:.1f} s)")
    rows = [
        ("weights", est.weights if est else None, weight_bytes),
        ("optimizer state", est.state if est else None, state),
    ]
    if est is not None:
        rows += [(k, v, None) for k, v in est.parts().items() if k in ("gradients", "activations", "step workspace")]
    other = measured_peak - weight_bytes - state - (baseline if device.type == "cpu" else 0)
    rows.append(("gradients + activations + workspace (measured: the rest)",
                 est.total - est.weights - est.state if est else None, other))
    if device.type == "cpu":
        rows.append(("process baseline", baseline, baseline))
    rows.append(("peak " + ("GPU allocated" if device.type == "cuda" else "RSS in training"), predicted, measured_peak))
    print(_table(rows))
    if predicted:
        print(f"measured / predicted peak: {measured_peak / predicted:.3f}")
    print(f"peak RSS of the whole process: {peak_rss / GIB:.2f} GiB ({peak_rss / 1e9:.2f} GB)")
    if trace.enabled:
        print("\nby phase (GiB; a phase's transient is its peak over the RSS at its start):")
        print(trace.table())

    result = {
        "peak_rss_bytes": peak_rss,
        "peak_gpu_bytes": peak_gpu,
        "train_peak_rss_bytes": train_peak,
        "estimate_bytes": predicted,
        "losses": losses,
        "step_seconds": seconds,
        "baseline_rss_bytes": baseline,
        "weight_bytes": weight_bytes,
        "state_bytes": state,
        "estimate_parts": est.parts() if est else None,
        "model": args.model,
        "optimizer": args.optimizer,
        "moment_dtype": args.moment_dtype,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "step_in_backward": args.in_backward,
        "gradient_checkpointing": args.checkpointing,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "data": data_info,
        "build_seconds": build_s,
        "malloc_mmap_threshold_fixed": fixed_mmap,
        "phases": trace.summary(),
        "largest_steps": trace.largest_steps(6),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.trace_json:
        trace.dump(args.trace_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
