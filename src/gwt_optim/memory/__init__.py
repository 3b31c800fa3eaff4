r"""Optimizer memory: measured bytes of a live optimizer, and analytic estimates.

:func:`optimizer_state_bytes` counts the bytes an optimizer's state really
holds: every tensor reachable from ``optimizer.state`` (through dicts, lists
and helper objects such as GaLore's projector), with tensor subclasses such as
torchao's 8-/4-bit ``OptimState8bit``/``OptimState4bit`` and ``DTensor``
counted through their inner tensors (``__tensor_flatten__``), and each storage
counted once.

:func:`estimate` gives the analytic bytes of weights plus optimizer state for a
model -- a ``nn.Module``, a Hugging Face LLaMA config (dict or JSON path) or
the name of a packaged config (``"60m"`` ... ``"7b"``) -- under one optimizer,
tensor by tensor, following what each implementation allocates:

==================  =======================================================
``adamw``           ``torch.optim.AdamW``: 2 moments + a 4-byte step
``adamw8bit``       torchao ``AdamW8bit``: 1-byte codes, an fp32 scale per
                    256 values and a 256-entry code map per moment, for
                    tensors of >= 4096 values (others stay full precision)
``adamw4bit``       torchao ``AdamW4bit``: 4-bit codes, blocks of 128
``galore``          GaLore rank r: projector r x min(m, n) and moments
                    r x max(m, n) on the transformed weights
``apollo``          APOLLO rank r: the same layout (random projector) plus
                    the limiter's scalar
``apollo-mini``     APOLLO with rank 1 (tensor-wise scaling)
``adam-mini``       full first moment, one second-moment scalar per block
``muon``            one momentum buffer per hidden matrix, AdamW elsewhere
``adafactor``       ``torch.optim.Adafactor``: row + column statistics
``gwt-*``           each GWT family at level l: its state on the
                    approximation coefficients (ceil(n / 2^l) columns)
==================  =======================================================

The *transformed* weights are those the recipe of :mod:`gwt_optim.groups`
chooses (the paper's: attention and MLP linear weights); low-rank methods
(GaLore, APOLLO) project the same weights, Muon orthogonalizes them, and every
other parameter gets the family's plain form (AdamW for Muon). The package
imports only torch; it needs no transformers for a config.

The package is split by job: :mod:`.measure` (live optimizers),
:mod:`.skeleton` (configs and the meta-device LLaMA), :mod:`.estimate` (the
per-tensor rules and the training peak) and :mod:`.cli`
(``gwt-optim memory``); every public name is importable from here.
"""

from __future__ import annotations

from gwt_optim.memory.cli import (
    PAPER_RANKS,
    TABLE_MODELS,
    TABLE_OPTIMIZERS,
    memory_table,
    register,
    training_table,
)
from gwt_optim.memory.estimate import (
    ALIASES,
    ESTIMATORS,
    MAX_LEVEL,
    Estimator,
    MemoryEstimate,
    Settings,
    TrainingEstimate,
    _activation_bytes,  # the training-peak tests check it directly
    estimate,
    estimator_key,
    training_estimate,
)
from gwt_optim.memory.measure import optimizer_state_bytes, tensor_bytes
from gwt_optim.memory.skeleton import TensorSpec, llama_skeleton, load_config_json, tensor_specs

__all__ = [
    "optimizer_state_bytes",
    "tensor_bytes",
    "estimate",
    "MemoryEstimate",
    "TensorSpec",
    "ESTIMATORS",
    "estimator_key",
    "load_config_json",
    "llama_skeleton",
    "memory_table",
    "TrainingEstimate",
    "training_estimate",
    "register",
]
