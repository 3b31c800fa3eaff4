"""The optimizer registry, where the toolkit has always imported it from.

The registry lives in :mod:`gwt_optim.registry`, below the toolkit and the
integrations, so that :mod:`gwt_optim.integrations.hf` builds optimizers
without importing the toolkit. Every name stays importable from here, the
spec parser's ``_convert`` included (``finetune.common`` uses it).
"""

from __future__ import annotations

from gwt_optim.registry import *  # noqa: F403
from gwt_optim.registry import MissingDependency, __all__
from gwt_optim.registry import validate_optimizer_spec as _validate_names
from gwt_optim.registry.base import _convert  # noqa: F401
from gwt_optim.toolkit.errors import register_user_error

# The registry sits below the toolkit and cannot import errors, so the toolkit
# registers the registry's user error for it.
register_user_error(MissingDependency)


def validate_optimizer_spec(text: str) -> None:
    """Raise ``ValueError`` for an unknown name, option or option kind in ``text`` (the
    registry's checks), or for a shared option out of the bounds its flag has
    (``gwt-adamw:lr=-1`` as ``--lr -1``: :func:`~gwt_optim.toolkit.train.check_spec_numbers`)."""
    from gwt_optim.toolkit.train import check_spec_numbers

    _validate_names(text)
    check_spec_numbers(text)
