"""GWT optimizers: one family per module on the shared base in ``_base``."""

from gwt_optim.optim.adafactor import GWTAdafactor
from gwt_optim.optim.adam_mini import GWTAdamMini
from gwt_optim.optim.adamw import GWTAdamW
from gwt_optim.optim.muon import GWTMuon

__all__ = ["GWTAdamW", "GWTMuon", "GWTAdamMini", "GWTAdafactor"]
