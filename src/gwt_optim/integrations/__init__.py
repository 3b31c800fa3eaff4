"""Integrations with training frameworks (Hugging Face ``transformers`` and ``accelerate``).

Importing this package needs only torch; each helper imports its framework
when it is called.
"""

from gwt_optim.integrations.hf import (
    create_gwt_optimizer,
    default_target_modules,
    gwt_optimizer_cls_and_kwargs,
)

__all__ = ["create_gwt_optimizer", "gwt_optimizer_cls_and_kwargs", "default_target_modules"]
