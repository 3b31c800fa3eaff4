"""The registry entries of the GWT families beyond Adam: moved to
:mod:`gwt_optim.registry.families`, below the toolkit; kept so that importing
this module still registers them."""

from __future__ import annotations

from gwt_optim.registry import families as _families  # noqa: F401
