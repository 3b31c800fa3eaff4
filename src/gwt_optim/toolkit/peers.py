"""The peers GWT is compared against: moved to :mod:`gwt_optim.registry.peers`,
below the toolkit; kept so that old imports work."""

from __future__ import annotations

from gwt_optim.registry.peers import ChainedOptimizer

__all__ = ["ChainedOptimizer"]
