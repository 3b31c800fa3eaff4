"""Registry entries for the GWT families beyond Adam: GWT-Muon, GWT-Adam-mini
and GWT-Adafactor.

Each takes ``level``, ``wavelet`` and the shared ``scale`` (alpha) like
``gwt-adamw``, and applies the same module-wise split
(:func:`gwt_optim.groups.gwt_param_groups`): the weights chosen by the recipe
get the transform at ``level`` with scale alpha, everything else the plain
family at level 0. Family options arrive as ``name:key=value``, e.g.
``gwt-muon:level=3:ns_dtype=float32`` or ``gwt-adafactor:detail_norm=second_moment``.
"""

from __future__ import annotations

from torch import nn

from gwt_optim.toolkit.registry import OptimizerConfig, register


def _take(cfg: OptimizerConfig, keys: tuple[str, ...]) -> dict:
    """Pop the given family options the user set, leaving the rest to be
    reported as unknown by ``build_optimizer``."""
    return {k: cfg.pop(k) for k in keys if k in cfg.options}


@register(
    "gwt-muon",
    help="GWT-Muon: Muon momentum on Haar approximation coefficients, AdamW for embeddings/head/norms "
    "(level, wavelet, momentum, nesterov, ns_dtype, ns_steps, adjust_lr_fn, adamw_lr)",
    defaults={"level": 2},
)
def _gwt_muon(model: nn.Module, cfg: OptimizerConfig):
    from gwt_optim.groups import gwt_param_groups
    from gwt_optim.optim import GWTMuon

    adamw_lr = cfg.pop("adamw_lr", cfg.lr)
    split = gwt_param_groups(
        model,
        cfg.recipe,
        level=cfg.pop("level", 2),
        wavelet=cfg.pop("wavelet", "haar"),
        scale=cfg.scale,
        norm_growth_limit=None,  # a no-op under Newton-Schulz; see GWTMuon
        target_modules=cfg.target_modules,
        transformed_options={"use_muon": True},
        regular_options={"use_muon": False, "lr": adamw_lr},
    )
    groups = list(split)
    # The usual Muon recipe: only matrices are orthogonalized; anything else the
    # recipe chose (conv kernels, ...) joins the AdamW group at level 0.
    muon = next((g for g in groups if g["use_muon"]), None)
    if muon is not None and any(p.ndim != 2 for p in muon["params"]):
        others = [p for p in muon["params"] if p.ndim != 2]
        muon["params"] = [p for p in muon["params"] if p.ndim == 2]
        plain = next((g for g in groups if not g["use_muon"]), None)
        if plain is None:
            plain = {"params": [], "use_muon": False, "lr": adamw_lr}
            plain.update(level=0, scale=1.0, norm_growth_limit=None)
            groups.append(plain)
        plain["params"] = [*plain["params"], *others]
        groups = [g for g in groups if g["params"]]
    kwargs = _take(cfg, ("momentum", "nesterov", "ns_dtype", "ns_steps", "impl", "moment_dtype"))
    # Moonshot's scaling lets Muon reuse the AdamW learning rate of a comparison.
    kwargs["adjust_lr_fn"] = cfg.pop("adjust_lr_fn", "match_rms_adamw")
    return GWTMuon(
        groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps, **kwargs
    )


def _attention_dims(model: nn.Module, cfg: OptimizerConfig) -> tuple[int, int]:
    config = getattr(model, "config", None)
    dim = cfg.pop("dim", getattr(config, "hidden_size", None))
    n_heads = cfg.pop("n_heads", getattr(config, "num_attention_heads", None))
    if dim is None or n_heads is None:
        raise ValueError(
            "gwt-adam-mini needs the hidden size and attention heads for its per-head blocks; the model has no "
            "config.hidden_size/num_attention_heads, so pass them: gwt-adam-mini:dim=512:n_heads=8"
        )
    return dim, n_heads


@register(
    "gwt-adam-mini",
    help="GWT-Adam-mini: first moment on Haar approximation coefficients, one second moment per block "
    "(level, wavelet, norm_growth_limit, dim, n_heads)",
    defaults={"level": 2},
)
def _gwt_adam_mini(model: nn.Module, cfg: OptimizerConfig):
    from gwt_optim.groups import split_params
    from gwt_optim.optim import GWTAdamMini
    from gwt_optim.optim.adam_mini import adam_mini_param_groups

    dim, n_heads = _attention_dims(model, cfg)
    split = split_params(model, cfg.recipe, target_modules=cfg.target_modules)
    groups = adam_mini_param_groups(
        model.named_parameters(),
        dim=dim,
        n_heads=n_heads,
        weight_decay=cfg.weight_decay,
        transformed=[p for _, p in split.transformed],
        transformed_options={
            "level": cfg.pop("level", 2),
            "wavelet": cfg.pop("wavelet", "haar"),
            "scale": cfg.scale,
            "norm_growth_limit": cfg.pop("norm_growth_limit", 1.01),
        },
    )
    kwargs = _take(cfg, ("impl", "moment_dtype"))
    return GWTAdamMini(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **kwargs)


@register(
    "gwt-adafactor",
    help="GWT-Adafactor: factored second moment of Haar approximation coefficients "
    "(level, wavelet, beta1, detail_norm=clip|second_moment, relative_step, d)",
    defaults={"level": 2},
)
def _gwt_adafactor(model: nn.Module, cfg: OptimizerConfig):
    from gwt_optim.groups import gwt_param_groups
    from gwt_optim.optim import GWTAdafactor

    split = gwt_param_groups(
        model,
        cfg.recipe,
        level=cfg.pop("level", 2),
        wavelet=cfg.pop("wavelet", "haar"),
        scale=cfg.scale,
        norm_growth_limit=cfg.pop("norm_growth_limit", None),
        target_modules=cfg.target_modules,
    )
    kwargs = _take(cfg, ("beta1", "detail_norm", "relative_step", "d", "beta2_decay", "impl", "moment_dtype"))
    return GWTAdafactor(list(split), lr=cfg.lr, weight_decay=cfg.weight_decay, **kwargs)
