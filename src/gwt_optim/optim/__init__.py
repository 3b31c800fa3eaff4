"""GWT optimizers: one family per module on the shared base in ``_base``."""

from gwt_optim.optim.adamw import GWTAdamW

__all__ = ["GWTAdamW"]
