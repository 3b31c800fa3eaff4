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

from gwt_optim.registry.base import GWT_OPTIONS, OptimizerConfig, gwt_group_options, register


def _given(cfg: OptimizerConfig, keys: tuple[str, ...]) -> dict:
    """Pop family options; those left at None take the optimizer class's own
    default, so each default is declared once, in the class."""
    values = {k: cfg.pop(k) for k in keys}
    return {k: v for k, v in values.items() if v is not None}


_MUON_KEYS = ("momentum", "nesterov", "ns_dtype", "ns_steps", "impl", "moment_dtype", "backend")


@register(
    "gwt-muon",
    help="GWT-Muon: Muon momentum on Haar approximation coefficients, AdamW for embeddings/head/norms "
    "(level, wavelet, momentum, nesterov, ns_dtype, ns_steps, adjust_lr_fn; regular_lr sets the AdamW part's lr)",
    # Newton-Schulz normalizes the update, so the norm-growth limiter is a no-op: off.
    options={**GWT_OPTIONS, "norm_growth_limit": None, "adjust_lr_fn": "match_rms_adamw",
             **dict.fromkeys(_MUON_KEYS)},
)
def _gwt_muon(model: nn.Module, cfg: OptimizerConfig):
    from gwt_optim.groups import gwt_param_groups
    from gwt_optim.optim import GWTMuon

    regular = {"use_muon": False, **cfg.regular_options()}
    split = gwt_param_groups(
        model,
        cfg.recipe,
        scale=cfg.scale,
        target_modules=cfg.target_modules,
        regular_options=regular,
        **_with(gwt_group_options(cfg), use_muon=True),
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
            plain = {"params": [], **regular}
            plain.update(level=0, scale=1.0, norm_growth_limit=None)
            groups.append(plain)
        plain["params"] = [*plain["params"], *others]
        groups = [g for g in groups if g["params"]]
    kwargs = _given(cfg, _MUON_KEYS)
    # Moonshot's scaling lets Muon reuse the AdamW learning rate of a comparison.
    kwargs["adjust_lr_fn"] = cfg.pop("adjust_lr_fn")
    return GWTMuon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps, **kwargs)


def _with(options: dict, **transformed) -> dict:
    """``gwt_group_options`` with more keys for the transformed group."""
    return {**options, "transformed_options": {**options["transformed_options"], **transformed}}


def _attention_dims(model: nn.Module, cfg: OptimizerConfig) -> tuple[int, int]:
    config = getattr(model, "config", None)
    dim = cfg.pop("dim") or getattr(config, "hidden_size", None)
    n_heads = cfg.pop("n_heads") or getattr(config, "num_attention_heads", None)
    if dim is None or n_heads is None:
        raise ValueError(
            "gwt-adam-mini needs the hidden size and attention heads for its per-head blocks; the model has no "
            "config.hidden_size/num_attention_heads, so pass them: gwt-adam-mini:dim=512:n_heads=8"
        )
    return dim, n_heads


@register(
    "gwt-adam-mini",
    help="GWT-Adam-mini: first moment on Haar approximation coefficients, one second moment per block "
    "(level, wavelet, norm_growth_limit, detail_clip, dim, n_heads)",
    options={**GWT_OPTIONS, "dim": None, "n_heads": None, "backend": None},
)
def _gwt_adam_mini(model: nn.Module, cfg: OptimizerConfig):
    from gwt_optim.groups import split_params
    from gwt_optim.optim import GWTAdamMini
    from gwt_optim.optim.adam_mini import adam_mini_param_groups

    dim, n_heads = _attention_dims(model, cfg)
    split = split_params(model, cfg.recipe, target_modules=cfg.target_modules)
    transform = gwt_group_options(cfg)
    groups = adam_mini_param_groups(
        model.named_parameters(),
        dim=dim,
        n_heads=n_heads,
        weight_decay=cfg.weight_decay,
        transformed=[p for _, p in split.transformed],
        transformed_options={
            "level": transform["level"],
            "wavelet": transform["wavelet"],
            "scale": cfg.scale,
            "norm_growth_limit": transform["norm_growth_limit"],
            **transform["transformed_options"],
        },
        regular_options=cfg.regular_options(eps=False) or None,
    )
    kwargs = _given(cfg, ("impl", "moment_dtype", "backend"))
    return GWTAdamMini(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **kwargs)


_ADAFACTOR_KEYS = ("beta1", "detail_norm", "relative_step", "d", "beta2_decay", "impl", "moment_dtype", "backend")


@register(
    "gwt-adafactor",
    help="GWT-Adafactor: factored second moment of Haar approximation coefficients "
    "(level, wavelet, beta1, detail_norm=clip|second_moment, relative_step (default false: the lr in AdamW's "
    "units), d)",
    # relative_step=False, unlike the class (torch's default): every toolkit lr is in AdamW's units, and a step
    # relative to each weight's RMS leaves embeddings (RMS ~0.02) all but frozen at AdamW's regular lr
    # (docs/results/transfer-cpu.md, section 3).
    options={**GWT_OPTIONS, "norm_growth_limit": None, **dict.fromkeys(_ADAFACTOR_KEYS), "relative_step": False},
)
def _gwt_adafactor(model: nn.Module, cfg: OptimizerConfig):
    from gwt_optim.groups import gwt_param_groups
    from gwt_optim.optim import GWTAdafactor

    split = gwt_param_groups(
        model,
        cfg.recipe,
        scale=cfg.scale,
        target_modules=cfg.target_modules,
        regular_options=cfg.regular_options(eps=False),  # Adafactor's eps is a pair
        **gwt_group_options(cfg),
    )
    return GWTAdafactor(list(split), lr=cfg.lr, weight_decay=cfg.weight_decay, **_given(cfg, _ADAFACTOR_KEYS))
