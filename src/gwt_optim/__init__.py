"""gwt-optim: Gradient Wavelet Transform optimizers (Wen et al., arXiv 2501.07237).

GWT applies a multilevel Haar wavelet transform to each weight-matrix gradient,
keeps the optimizer moments only for the approximation coefficients (2^-l of
the size), normalizes the detail coefficients with the same denominators and
transforms back, so every step uses the full current gradient while the state
of those weights shrinks by 2^l.
"""

from gwt_optim import wavelets
from gwt_optim.backward import StepInBackward, step_in_backward
from gwt_optim.groups import ParamSplit, gwt_param_groups, lr_scaled_groups, split_params
from gwt_optim.optim import *  # noqa: F401,F403
from gwt_optim.optim import __all__ as _optim_all

__version__ = "0.1.0"

__all__ = [
    "wavelets",
    "ParamSplit",
    "split_params",
    "gwt_param_groups",
    "lr_scaled_groups",
    "step_in_backward",
    "StepInBackward",
    "__version__",
    *_optim_all,
]
