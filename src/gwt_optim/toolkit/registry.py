"""The optimizer registry, where the toolkit has always imported it from.

The registry lives in :mod:`gwt_optim.registry`, below the toolkit and the
integrations, so that :mod:`gwt_optim.integrations.hf` builds optimizers
without importing the toolkit. Every name stays importable from here, the
spec parser's ``_convert`` included (``finetune.common`` uses it).
"""

from __future__ import annotations

from gwt_optim.registry import *  # noqa: F403
from gwt_optim.registry import MissingDependency, __all__
from gwt_optim.registry.base import _convert  # noqa: F401
from gwt_optim.toolkit.errors import register_user_error

# The registry sits below the toolkit and cannot import errors, so the toolkit
# registers the registry's user error for it.
register_user_error(MissingDependency)
