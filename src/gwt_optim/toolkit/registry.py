"""The optimizer registry, where the toolkit has always imported it from.

The registry lives in :mod:`gwt_optim.registry`, below the toolkit and the
integrations, so that :mod:`gwt_optim.integrations.hf` builds optimizers
without importing the toolkit. Every name stays importable from here, the
spec parser's ``_convert`` included (``finetune.common`` uses it).
"""

from __future__ import annotations

from gwt_optim.registry import (
    GWT_OPTIONS,
    REGISTRY,
    SHARED_OPTIONS,
    MissingDependency,
    OptimizerConfig,
    OptimizerSpec,
    build_optimizer,
    format_spec,
    gwt_group_options,
    parse_optimizer_arg,
    register,
    require,
    split_spec,
    validate_optimizer_spec,
)
from gwt_optim.registry import __all__ as _core_names
from gwt_optim.registry.base import _convert  # noqa: F401
from gwt_optim.toolkit.errors import register_user_error

__all__ = list(_core_names)

# The registry sits below the toolkit and cannot import errors, so the toolkit
# registers the registry's user error for it.
register_user_error(MissingDependency)
