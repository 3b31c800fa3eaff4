"""Cache location and content keys shared by tokenizers and token streams."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

from gwt_optim._cache import cache_dir as _cache_dir

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Where tokenizers and tokenized corpora are cached: ``data`` under the
    package's cache root (:mod:`gwt_optim._cache`: ``$GWT_OPTIM_CACHE``, else
    ``$XDG_CACHE_HOME/gwt-optim``, else ``~/.cache/gwt-optim``)."""
    return _cache_dir("data")


def _digest(parts: Iterable[str | bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()
