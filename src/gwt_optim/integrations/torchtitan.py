"""torchtitan (0.3.0): an optimizers container whose param groups may name
the GWT optimizers.

torchtitan builds its optimizers from ``OptimizersContainer.Config``: each
``ParamGroupConfig`` names an optimizer (``optimizer_name``) and its keyword
arguments; the container looks the name up in ``_resolve_optimizer_factory``
(``Adam``, ``AdamW``, ``DistMuon`` in 0.3.0) and builds one optimizer per name
from param groups that carry ``param_names`` and the ``implementation``'s
``fused``/``foreach`` keys. :class:`GWTOptimizersContainer` adds the classes
:mod:`gwt_optim.optim` exports, by class name (``GWTAdamW`` and the other
families of ``docs/families.md``), and changes nothing else: its state dict is
torchtitan's FQN-keyed flat one, built after torchtitan's zero-gradient,
zero-lr step.

The ``implementation`` is a request about kernels that GWT holds to one rule
(``docs/families.md``): ``"fused"`` (torchtitan's default) runs GWT-AdamW's
fused kernels, and is refused for the families that have none;
``"for-loop"`` runs the eager step of any family; ``"foreach"`` is refused.
``docs/scaling-out.md`` has the recipe and says what was tested.

A checkpoint written before a GWT hyperparameter existed loads as torch's own
``load_state_dict`` loads it: the key takes the optimizer's default
(``Optimizer.__setstate__``). torchtitan's flat loader would refuse it
(``KeyError``: it looks every live group key up in the checkpoint).

Importing this module imports torchtitan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer

from gwt_optim import optim as _gwt

__all__ = ["GWTOptimizersContainer"]

# Read off the package's exports: every GWT family, by its class name.
FACTORIES: dict[str, Callable[..., Optimizer]] = {name: getattr(_gwt, name) for name in _gwt.__all__}


class GWTOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer``, whose ``ParamGroupConfig``\\ s may
    name a GWT optimizer (its class name) beside torchtitan's own."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """``OptimizersContainer.Config``, building a :class:`GWTOptimizersContainer`."""

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Optimizer]:
        factory = FACTORIES.get(name)
        return factory if factory is not None else OptimizersContainer._resolve_optimizer_factory(name)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        filled = dict(state_dict)
        gwt = tuple(FACTORIES.values())
        for optim in self.optimizers:
            if not isinstance(optim, gwt):
                continue
            for group in optim.param_groups:
                names = group.get("param_names") or []
                # Only a group the checkpoint holds (its lr saved); a missing group stays torchtitan's error.
                if not names or f"param_groups.{names[0]}.lr" not in filled:
                    continue
                for key in group.keys() & optim.defaults.keys():
                    filled.setdefault(f"param_groups.{names[0]}.{key}", optim.defaults[key])
        super().load_state_dict(filled)
