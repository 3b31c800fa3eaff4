r"""GWT-Adam-mini: Adam-mini whose state lives on Haar approximation coefficients.

Its step is :func:`gwt_optim.optim.functional.gwt_adam_mini` (the halves
``gwt_adam_mini_moments`` and ``gwt_adam_mini_apply``): the first moment on
A_l, one second moment per block of A_l (a head, a row, the tensor, or each
entry), the details of a block normalized by its denominator. At level 0 it
is the ``adam-mini`` package's ``Adam_mini`` (version 1.1.1, to fp32
rounding); :func:`adam_mini_param_groups` reproduces its name-based block
partition. ``docs/families.md`` states it in full.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn

from gwt_optim.optim._base import GWTOptimizer
from gwt_optim.optim import functional as F
from gwt_optim.optim._family import check_adam_hyperparameters, group_lr, transform_defaults
from gwt_optim.optim._sharded import Sharding, head_shards_problem, is_dtensor
from gwt_optim.optim.functional import BLOCKS

__all__ = ["GWTAdamMini", "adam_mini_block", "adam_mini_param_groups", "BLOCKS"]

# Name fragments of the adam-mini package (v1.1.1), in the order it tests them.
_BIAS_NAMES = ("bias",)
_QK_NAMES = ("k_proj", "q_proj", "wq", "wk", "query", "key")
_ROW_NAMES = (
    # embeddings and output head: one scalar per token
    "embed", "embd", "wte", "lm_head", "output", "final_layer",
    # values, attention output, MLPs: one scalar per output neuron
    "v_proj", "wv", "value", "o_proj", "wo", "attn.proj", "feed_forward", "linear", "mlp",
)  # fmt: skip
_NO_DECAY_NAMES = ("norm", "ln", "bias")


def adam_mini_block(name: str) -> str:
    """The Adam-mini block kind of a parameter, from its qualified name, as
    ``adam_mini.Adam_mini`` gives it: ``"element"`` (biases), ``"head"``
    (queries and keys), ``"neuron"`` (embeddings, the head, values, attention
    output, MLPs) or ``"tensor"`` (norms and anything else)."""
    name = name.lower()
    for kind, fragments in (("element", _BIAS_NAMES), ("head", _QK_NAMES), ("neuron", _ROW_NAMES)):
        if any(f in name for f in fragments):
            return kind
    return "tensor"


class GWTAdamMini(GWTOptimizer):
    """Adam-mini with Gradient Wavelet Transform state compression.

    Args:
        params: parameters or param-group dicts; a group names its block
            partition with ``block`` (one of :data:`BLOCKS`) and, for
            ``"head"``, ``head_dim`` (:func:`adam_mini_param_groups` builds
            Adam-mini's partition of a transformer from parameter names).
        lr: learning rate (default 1e-3).
        betas: :math:`(\\beta_1, \\beta_2)` (default (0.9, 0.999)).
        eps: :math:`\\epsilon` (default 1e-8), added to the bias-corrected
            :math:`\\sqrt{\\hat v}` as in Adam-mini.
        weight_decay: decoupled weight decay (default 0).
        block: default block kind for groups that do not set one ("neuron").
        head_dim: rows per head for ``"head"`` blocks.
        level, wavelet, scale, norm_growth_limit, moment_dtype, impl, backend:
            as :class:`~gwt_optim.optim.GWTAdamW`.
    """

    _family = "GWTAdamMini"
    _GROUP_KEY = "block"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        level: int = 2,
        wavelet: str = "haar",
        scale: float = 0.25,
        norm_growth_limit: float | None = 1.01,
        *,
        block: str = "neuron",
        head_dim: int | None = None,
        moment_dtype: str | None = None,
        impl: str = "fast",
        backend: str = "auto",
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            **transform_defaults(level, wavelet, scale, norm_growth_limit),
            moment_dtype=moment_dtype, block=block, head_dim=head_dim,
        )
        super().__init__(params, defaults, impl=impl, backend=backend, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)

    def _validate_param(self, p: Tensor, group: dict[str, Any], where: str) -> None:
        super()._validate_param(p, group, where)
        if p.ndim >= 3 and group["block"] in ("head", "neuron") and is_dtensor(p) and Sharding(p).mesh_dims():
            # vmean holds one value per row of the leading axes flattened: no DTensor layout follows those.
            raise ValueError(
                f"{self._family}: a '{group['block']}' block parameter ({where}) has {p.ndim} dimensions and is "
                f"sharded ({tuple(p.placements)}); its flattened row statistics cannot be sharded with it: use "
                "block='element' or 'tensor' for it, or 2-D parameters"
            )
        if group["block"] == "head":
            rows = p.shape[:-1].numel() if p.ndim >= 2 else 1
            if rows % group["head_dim"]:
                raise ValueError(
                    f"a 'head' block parameter ({where}) has {rows} rows, not a "
                    f"multiple of head_dim={group['head_dim']}; check n_heads/dim, or use block='neuron'"
                )
            if p.ndim >= 2 and is_dtensor(p):  # a vector's head is all of it, reduced like a tensor block
                problem = head_shards_problem(p, group["head_dim"])
                if problem is not None:
                    raise ValueError(f"{self._family}: a 'head' block parameter ({where}) {problem}; "
                                     "use block='neuron', or a layout whose shards hold whole heads")

    def _validate_family(self, g: dict[str, Any]) -> None:
        check_adam_hyperparameters(g)
        if g["block"] not in BLOCKS:
            raise ValueError(f"Invalid block: {g['block']!r} (one of {sorted(BLOCKS)})")
        if g["block"] == "head" and not (isinstance(g["head_dim"], int) and g["head_dim"] > 0):
            raise ValueError(
                "block='head' needs head_dim, the rows per attention head (hidden size // n_heads); "
                f"got {g['head_dim']!r}"
            )

    def _init_family_state(self, group, state, approx, moment_dtype, transformed) -> None:
        mean, _ = BLOCKS[group["block"]]
        state["exp_avg"] = torch.zeros_like(approx, dtype=moment_dtype, memory_format=torch.contiguous_format)
        state["vmean"] = torch.zeros_like(mean(approx, group["head_dim"]), dtype=moment_dtype)

    def _moments(self, group, state, W, G, step, *, reduce=None):
        beta1, beta2 = group["betas"]
        return F.gwt_adam_mini_moments(W, G, state["exp_avg"], state["vmean"], step=step, beta1=beta1, beta2=beta2,
                                       eps=group["eps"], block=group["block"], head_dim=group["head_dim"],
                                       level=group["level"], impl=self._impl, wavelet=group["wavelet"],
                                       reduce=reduce)

    def _apply(self, group, W, m, r, step, *, reduce=None):
        beta1, beta2 = group["betas"]
        F.gwt_adam_mini_apply(W, m, r, step=step, lr=group_lr(group), beta1=beta1, beta2=beta2,
                              weight_decay=group["weight_decay"], alpha=group["scale"],
                              detail_clip=group["detail_clip"])


def adam_mini_param_groups(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    *,
    dim: int,
    n_heads: int,
    weight_decay: float = 0.0,
    transformed: Sequence[Tensor] = (),
    transformed_options: dict[str, Any] | None = None,
    regular_options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Param groups with Adam-mini's block partition, split by transform.

    Every parameter gets the block kind :func:`adam_mini_block` gives its name
    and, like Adam-mini, no weight decay when its name contains ``norm``,
    ``ln`` or ``bias``. Parameters in ``transformed`` (for example
    ``gwt_optim.split_params(model).transformed``) get ``transformed_options``
    (``level``, ``scale``, ...); the others get ``regular_options`` (by
    default level 0, scale 1 and no limiter: plain Adam-mini).

    ``dim`` and ``n_heads`` are the model's hidden size and attention heads;
    a head block spans ``dim // n_heads`` rows, which also covers grouped-query
    key projections.
    """
    if dim % n_heads:
        raise ValueError(f"dim={dim} is not divisible by n_heads={n_heads}")
    head_dim = dim // n_heads
    chosen = {id(p) for p in transformed}
    regular = {"level": 0, "scale": 1.0, "norm_growth_limit": None, **(regular_options or {})}
    groups: dict[tuple, dict[str, Any]] = {}
    seen: set[int] = set()
    for name, p in named_parameters:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        block = adam_mini_block(name)
        wd = 0.0 if any(f in name.lower() for f in _NO_DECAY_NAMES) else weight_decay
        is_t = id(p) in chosen
        key = (block, wd, is_t)
        if key not in groups:
            opts = dict(transformed_options or {}) if is_t else dict(regular)
            groups[key] = {"params": [], "block": block, "head_dim": head_dim, "weight_decay": wd, **opts}
        groups[key]["params"].append(p)
    return list(groups.values())
