"""Integrations with training frameworks (Hugging Face ``transformers`` and ``accelerate``;
torchtitan in :mod:`gwt_optim.integrations.torchtitan`, which this package does not import).

Importing this package needs only torch; each helper imports its framework
when it is called. It quiets the third-party noise a ``transformers`` import
makes (:func:`gwt_optim._quiet.quiet_third_party`, as the toolkit does), so
that ``from transformers import Trainer`` after it prints none.
"""

from gwt_optim._quiet import quiet_third_party
from gwt_optim.integrations.hf import (
    create_gwt_optimizer,
    default_target_modules,
    gwt_optimizer_cls_and_kwargs,
)

__all__ = ["create_gwt_optimizer", "gwt_optimizer_cls_and_kwargs", "default_target_modules"]

quiet_third_party()
