"""Third-party noise, silenced in one place for every entry point a user
imports before ``transformers``: the toolkit (``gwt_optim.toolkit``) and the
Trainer integration (``gwt_optim.integrations``).

``transformers`` imports ``torchao`` for its quantizers, which logs
``Failed to load .../torchao/_C_*.so`` for CUDA kernels a CPU machine (or
another CUDA) cannot load, and trips torch's pytree deprecation warnings
(``... is an Enum subclass ... register_constant() ... is deprecated``).
``bitsandbytes`` (imported by ``peft`` and 8-bit Adam) tries to fetch its CPU
4-bit kernel through the ``kernels`` package, which logs that it could not
verify the ``kernels-community`` repository's publisher, or, offline, that it
skipped the check; gwt-optim never uses that kernel. Those loggers show
errors only, and the pytree warning is filtered; nothing else is touched.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["QUIETED_LOGGERS", "quiet_third_party"]

QUIETED_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes", "kernels")


def quiet_third_party() -> None:
    """Show only errors from :data:`QUIETED_LOGGERS`; ignore the pytree Enum deprecation
    warning. Idempotent; call it before importing transformers, peft or bitsandbytes."""
    for name in QUIETED_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in (FutureWarning, UserWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", message=r".*is an Enum subclass.*register_constant", category=category)
