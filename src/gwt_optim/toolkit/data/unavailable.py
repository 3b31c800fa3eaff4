"""The one exception every data source raises when it cannot be reached: a
leaf, so that the sources and the corpora they load can all raise it."""

from __future__ import annotations

__all__ = ["DataUnavailable"]


class DataUnavailable(RuntimeError):
    """A data source or tokenizer cannot be reached (offline, not installed)."""
