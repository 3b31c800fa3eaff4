"""Optimizer registry: names map to factories that build an optimizer for a model.

This is the one list of optimizer names. The toolkit (``pretrain``,
``compare``, ``finetune``), the Hugging Face integration and the memory
estimates all read it, so it sits below them and imports neither: only torch,
:mod:`gwt_optim.groups` and :mod:`gwt_optim.optim`. The peers' optional
packages are imported inside their factories.

Every factory receives the model and one :class:`OptimizerConfig`, and must
apply the same module-wise split (``gwt_optim.groups``): the weights chosen by
``recipe`` get the scale ``alpha`` (``config.scale``) -- as the GWT ``scale``
for the GWT families and as ``lr * alpha`` for every other optimizer -- so a
comparison gives every optimizer the same effective step on the same weights.

Options given on the command line as ``name:key=value:key=value`` arrive in
``config.options`` (already converted to int/float/bool/None where they parse).
A peer whose package is missing raises :class:`MissingDependency` naming the
extra to install.

The package is split by job: :mod:`.base` (the machinery, ``adamw`` and
``gwt-adamw``), :mod:`.peers` (the optimizers GWT is compared against) and
:mod:`.families` (the other GWT families). Add an optimizer with::

    @register("my-opt", extra="peers", help="...", memory="my-opt")
    def _my_opt(model, cfg): ...
"""

from __future__ import annotations

# The public names are base's; this package adds its entries.
from gwt_optim.registry.base import *  # noqa: F403
from gwt_optim.registry.base import __all__

# Imported unconditionally: a broken or misspelt module must fail loudly, not
# silently drop its optimizers. Peers first: the registration order of old.
from gwt_optim.registry import peers as _peers  # noqa: F401  (registers its entries)
from gwt_optim.registry import families as _families  # noqa: F401  (registers its entries)
