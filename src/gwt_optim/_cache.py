"""The one rule for gwt-optim's on-disk caches.

Every cache lives under one root: ``$GWT_OPTIM_CACHE`` when set, else
``$XDG_CACHE_HOME/gwt-optim``, else ``~/.cache/gwt-optim``. Each kind of
cache has its own folder below it (``data`` for tokenizers and tokenized
corpora, ``kernels`` for built native kernels), so one variable moves all of
them and no kind can read another's files.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root", "cache_dir"]


def cache_root() -> Path:
    env = os.environ.get("GWT_OPTIM_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gwt-optim"


def cache_dir(kind: str) -> Path:
    """``cache_root() / kind``; not created here (each user creates what it writes)."""
    return cache_root() / kind
