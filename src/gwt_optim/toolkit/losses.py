"""The language-model losses every toolkit loop reports: next-token cross-entropy
over labels where :data:`IGNORE_INDEX` marks the positions left out (padding, a
fine-tuning prompt), and the perplexity a loss is shown as."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "next_token_losses", "perplexity_of"]

IGNORE_INDEX = -100  # the label torch's cross-entropy (and transformers) skips


def next_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position next-token cross-entropy ``[batch, seq_len - 1]`` in fp32;
    positions labelled :data:`IGNORE_INDEX` are 0."""
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(len(labels), -1)


def perplexity_of(loss: float) -> float:
    """``exp(loss)``, capped at ``exp(50)`` so a diverged run's figure stays a number."""
    return math.exp(min(loss, 50.0))
