"""One ``amp.initialize`` call: its settings, loss scalers and log, held by its optimizers.

Apex kept the amp state of each optimizer on the optimizer (``optimizer._amp_stash``), so
an optimizer from an earlier ``initialize`` keeps working after a later one. Here each
``initialize`` call makes a :class:`Session`; every optimizer it patches points to it
through its record (``optimizer._amp_stash.session``), and ``scale_loss`` takes the
scalers of the optimizers' session. The :class:`~adapters.apex.amp.Amp` holds only its
latest session (what ``amp.state_dict()``, ``amp.loss_scale()`` and ``amp.autocast()``
read), so earlier models and optimizers are freed with their last reference.

Objects passed again are recognised by their marks: a model by the
:class:`~adapters.apex.amp.Properties` stored on it (``_MODEL_MARK``), an optimizer by its
record, or (``enabled=False``) by ``_DISABLED_MARK``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from adapters.apex.amp._log import RateLimitedLog
from adapters.apex.amp._model import model_device_type
from adapters.apex.amp._opt_levels import Properties

#: The attribute a model initialized (enabled) carries: the :class:`Properties` it got.
MODEL_MARK = "_amp_properties"
#: The attribute an optimizer passed with ``enabled=False`` carries: its session.
DISABLED_MARK = "_amp_disabled_session"


@dataclasses.dataclass(frozen=True)
class Config:
    """What an optimizer was initialized with; passing it again needs the same values.

    Example:
        >>> from adapters.apex.amp._opt_levels import resolve_properties
        >>> Config(resolve_properties("O1"), 1, None, 2.0**24).num_losses
        1
    """

    properties: Properties | None
    num_losses: int
    min_loss_scale: float | None
    max_loss_scale: float

    def differences(self, other: Config) -> list[str]:
        """``name: mine -> other`` for every setting that differs."""
        out = []
        mine = self._flat()
        theirs = other._flat()
        for k, v in mine.items():
            if theirs[k] != v:
                out.append(f"{k}: {v!r} -> {theirs[k]!r}")
        return out

    def _flat(self) -> dict[str, Any]:
        d: dict[str, Any] = {"enabled": self.properties is not None}
        if self.properties is not None:
            d.update(dataclasses.asdict(self.properties))
        d.update(num_losses=self.num_losses, min_loss_scale=self.min_loss_scale,
                 max_loss_scale=self.max_loss_scale)
        return d


class Session:
    """The state one ``initialize`` call made (see the module docstring).

    Args:
        owner: the Amp whose ``initialize`` made it.
        config: the settings (``config.properties`` is None when ``enabled=False``).
        models: the models of that call.
        loss_scalers: one per ``loss_id``.
        log: the call's rate-limited log (its ``verbosity``).

    Example:
        >>> s = Session(None, Config(None, 1, None, 2.0**24), [], [], RateLimitedLog(0))
        >>> s.enabled, s.device_type()
        (False, 'cpu')
    """

    def __init__(self, owner: Any, config: Config, models: list[torch.nn.Module],
                 loss_scalers: list[Any], log: RateLimitedLog) -> None:
        self.owner = owner
        self.config = config
        self.models = models
        self.loss_scalers = loss_scalers
        self.log = log
        self.records: list[Any] = []

    @property
    def enabled(self) -> bool:
        """False for an ``initialize(..., enabled=False)`` call."""
        return self.config.properties is not None

    @property
    def properties(self) -> Properties | None:
        """The resolved settings (None when disabled)."""
        return self.config.properties

    def device_type(self) -> str:
        """The device type of this call's first model (where autocast is turned off)."""
        return model_device_type(self.models[0]) if self.models else "cpu"
