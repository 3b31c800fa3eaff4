"""Trajectories of the per-tensor update rules in ``gwt_optim.optim.functional``:
the reference the tests hold the optimizers' fast backends (native C, Triton,
the batched stepper) to.

Each runner keeps one tensor's state as the optimizer creates it (zeros in the
moment dtype, the limiter's ``s`` at 0) and skips the update of a non-finite
gradient with only its step counted, as every optimizer path does. The
keyword arguments and their defaults are the optimizer's own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gwt_optim import wavelets
from gwt_optim.optim import functional as F

_DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class Runner:
    """One tensor stepped by a family's function; ``state`` as the optimizer names it."""

    def __init__(self, W: Tensor, opts: dict, keys: tuple[str, ...]) -> None:
        self.W, self.opts = W, opts
        self.transformed = W.ndim >= 2
        self.level = opts["level"] if self.transformed else 0
        cdt = F.compute_dtype(W)
        self.md = md = _DTYPES[opts.get("moment_dtype")] or cdt
        self.approx_shape = (*W.shape[:-1], wavelets.approx_length(W.shape[-1], self.level)) if W.ndim else ()
        self.state = {k: torch.zeros(self.approx_shape, dtype=md) for k in keys}
        if self.transformed and opts.get("norm_growth_limit") is not None:
            self.state["limiter_norm"] = torch.zeros((), dtype=cdt)
        self.t = 0
        self.skips = 0

    def step(self, G: Tensor, lr: float | None = None) -> None:
        self.t += 1
        if not bool(torch.isfinite(G).all()):
            self.skips += 1
            return
        self._step(G, self.opts["lr"] if lr is None else lr)


class AdamW(Runner):
    DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, level=2, scale=0.25,
                    norm_growth_limit=1.01, detail_clip=0.5, moment_dtype=None, impl="fast", wavelet="haar",
                    detail_clip_units="stored")

    def __init__(self, W: Tensor, **kw) -> None:
        super().__init__(W, {**self.DEFAULTS, **kw}, ("exp_avg", "exp_avg_sq"))

    def _step(self, G, lr):
        o, s = self.opts, self.state
        F.gwt_adamw(self.W, G, s["exp_avg"], s["exp_avg_sq"], s.get("limiter_norm"), step=self.t, lr=lr,
                    beta1=o["betas"][0], beta2=o["betas"][1], eps=o["eps"], weight_decay=o["weight_decay"],
                    level=o["level"], alpha=o["scale"], gamma=o["norm_growth_limit"], detail_clip=o["detail_clip"],
                    impl=o["impl"], wavelet=o["wavelet"], detail_clip_units=o["detail_clip_units"])


class Muon(Runner):
    DEFAULTS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, level=2, scale=0.25,
                    ns_coefficients=F.NS_COEFFICIENTS, ns_steps=5, ns_eps=1e-7, ns_dtype="bfloat16",
                    adjust_lr_fn=None, moment_dtype=None, impl="fast", wavelet="haar")

    def __init__(self, W: Tensor, **kw) -> None:
        super().__init__(W, {**self.DEFAULTS, **kw, "norm_growth_limit": None}, ("momentum_buffer",))

    def _step(self, G, lr):
        o = self.opts
        F.gwt_muon(self.W, G, self.state["momentum_buffer"], lr=lr, momentum=o["momentum"], nesterov=o["nesterov"],
                   weight_decay=o["weight_decay"], level=o["level"], alpha=o["scale"],
                   ns_coefficients=o["ns_coefficients"], ns_steps=o["ns_steps"], ns_eps=o["ns_eps"],
                   ns_dtype=F.NS_DTYPES[o["ns_dtype"]], adjust_lr_fn=o["adjust_lr_fn"], impl=o["impl"],
                   wavelet=o["wavelet"])


class AdamMini(Runner):
    DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, level=2, scale=0.25,
                    norm_growth_limit=1.01, block="neuron", head_dim=None, moment_dtype=None, impl="fast",
                    wavelet="haar")

    def __init__(self, W: Tensor, **kw) -> None:
        super().__init__(W, {**self.DEFAULTS, **kw}, ("exp_avg",))
        mean, _ = F.BLOCKS[self.opts["block"]]
        self.state["vmean"] = torch.zeros_like(mean(torch.zeros(self.approx_shape), self.opts["head_dim"]),
                                               dtype=self.state["exp_avg"].dtype)

    def _step(self, G, lr):
        o, s = self.opts, self.state
        F.gwt_adam_mini(self.W, G, s["exp_avg"], s["vmean"], s.get("limiter_norm"), step=self.t, lr=lr,
                        beta1=o["betas"][0], beta2=o["betas"][1], eps=o["eps"], weight_decay=o["weight_decay"],
                        level=o["level"], alpha=o["scale"], gamma=o["norm_growth_limit"], block=o["block"],
                        head_dim=o["head_dim"], impl=o["impl"], wavelet=o["wavelet"])


class Adafactor(Runner):
    DEFAULTS = dict(lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0, level=2, scale=0.25,
                    norm_growth_limit=None, beta1=None, relative_step=True, detail_norm="clip", moment_dtype=None,
                    impl="fast", wavelet="haar")

    def __init__(self, W: Tensor, **kw) -> None:
        super().__init__(W, {**self.DEFAULTS, **kw}, ("exp_avg",) if kw.get("beta1") is not None else ())
        md, shape = self.md, self.approx_shape
        if len(shape) >= 2:
            self.state["row_var"] = torch.zeros((*shape[:-1], 1), dtype=md)
            self.state["col_var"] = torch.zeros((*shape[:-2], 1, shape[-1]), dtype=md)
        else:
            self.state["variance"] = torch.zeros(shape, dtype=md)

    def _step(self, G, lr):
        o, s = self.opts, self.state
        F.gwt_adafactor(self.W, G, step=self.t, lr=lr, row_var=s.get("row_var"), col_var=s.get("col_var"),
                        variance=s.get("variance"), exp_avg=s.get("exp_avg"), limiter_norm=s.get("limiter_norm"),
                        beta2_decay=o["beta2_decay"], eps=o["eps"], d=o["d"], weight_decay=o["weight_decay"],
                        beta1=o["beta1"], relative_step=o["relative_step"], detail_norm=o["detail_norm"],
                        level=o["level"], alpha=o["scale"], gamma=o["norm_growth_limit"], impl=o["impl"],
                        wavelet=o["wavelet"])


def train(runner: type[Runner], W0: Tensor | list[Tensor], grads, *, lrs=None, snapshots=False, **kw):
    """Each tensor of ``W0`` (one or a list) from its own start through ``grads``
    (per step: a tensor, or one per tensor), by ``runner``'s rule with the
    optimizer's keyword arguments (``backend`` is ignored; ``impl="reference"``
    runs the literal transform). Returns the final weights (as given: one or a
    list), the runners and, with ``snapshots``, the weights after each step."""
    single = isinstance(W0, Tensor)
    kw = {k: v for k, v in kw.items() if k != "backend"}
    runs = [runner(w.detach().clone(), **kw) for w in ([W0] if single else W0)]
    seen = []
    for t, gs in enumerate(grads):
        for run, g in zip(runs, [gs] if single else gs):
            run.step(g.clone(), None if lrs is None else lrs[t])
        if snapshots:
            seen.append([run.W.clone() for run in runs])
    final = runs[0].W if single else [run.W for run in runs]
    return (final, runs, seen) if snapshots else (final, runs)
