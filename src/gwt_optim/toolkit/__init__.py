"""The training harness: pre-train and fine-tune LLaMA-style models with GWT and
its peers, and compare quality, memory and speed side by side.

Needs the ``train`` extra (from a checkout: ``pip install -e '.[train,peers,demo]'``).

Third-party noise (torchao's ``Failed to load`` lines, torch's pytree
deprecation warnings, the ``kernels`` package's publisher check) is silenced
here, once for the whole toolkit, by :func:`gwt_optim._quiet.quiet_third_party`:
importing any toolkit module runs this first, so before any of them imports
transformers. The Trainer integration (``gwt_optim.integrations``) does the same.
"""

from __future__ import annotations

from gwt_optim._quiet import QUIETED_LOGGERS, quiet_third_party

__all__ = ["QUIETED_LOGGERS", "quiet_third_party"]

quiet_third_party()
