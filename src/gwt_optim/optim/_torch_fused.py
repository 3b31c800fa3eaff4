"""The ``"fused_adamw"`` backend: torch's own ``torch._fused_adamw_`` for the
plain level-0 step on CPU (1-D parameters and level-0 groups), which is
plain AdamW. Like the other backends it imports only the shared types
(:mod:`._backends`); which parameters it takes is the dispatcher's
(:mod:`._dispatch`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gwt_optim.optim._backends import CAPABILITIES, Bucket, all_finite, check_pointers

__all__ = ["FusedAdamWBackend"]


class FusedAdamWBackend:
    """Level-0 and 1-D parameters of a GWT-AdamW group on CPU: that is plain
    AdamW, so ``torch._fused_adamw_`` steps all of them in one call per set of
    hyperparameters instead of about fifteen eager operations each. A
    parameter whose gradient has a NaN or an Inf is left out of the call: on
    CPU that check costs no synchronization."""

    name = "fused_adamw"
    capabilities = CAPABILITIES["fused_adamw"]

    def prepare(self, w: Tensor, G: Tensor, moment_dtype: torch.dtype, level: int) -> None:
        """Nothing to build: the kernel ships with torch."""

    def step_buckets(self, buckets: list[Bucket], limiter_eps: float, table: dict | None = None) -> list[Tensor]:
        skipped = []
        calls: dict[tuple, list[tuple[Tensor, Tensor, dict]]] = {}
        for b in buckets:
            g = b.group
            lr = g["lr"].item() if isinstance(g["lr"], Tensor) else g["lr"]
            for w, grad, st in zip(b.params, b.grads, b.states):
                calls.setdefault((w.dtype, lr, *g["betas"], g["eps"], g["weight_decay"]), []).append((w, grad, st))
        for (_, lr, beta1, beta2, eps, wd), items in calls.items():
            finite = all_finite([grad for _, grad, _ in items])
            if not all(finite):
                skipped += [w for (w, _, _), ok in zip(items, finite) if not ok]
                items = [item for item, ok in zip(items, finite) if ok]
                if not items:
                    continue
            for w, grad, st in items:
                check_pointers(self.name, w, grad, st, 0)
            torch._fused_adamw_(
                [w for w, _, _ in items], [grad for _, grad, _ in items], [st["exp_avg"] for _, _, st in items],
                [st["exp_avg_sq"] for _, _, st in items], [],
                # The stepper has advanced the step counts (CPU float32 tensors,
                # as fused AdamW keeps them on CPU) before this call.
                [st["step"] for _, _, st in items],
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
            )
        return skipped
