"""The :class:`Amp` object: Apex's amp state and functions, held in an instance.

Its methods come by concern: :mod:`~adapters.apex.amp._initialize`,
:mod:`~adapters.apex.amp._scale_loss`, :mod:`~adapters.apex.amp._casts` (autocast and the
function registry), :mod:`~adapters.apex.amp._checkpoint`; here are the state of the latest
``initialize`` and the per-optimizer queries.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from adapters.apex.amp._casts import CastsMixin
from adapters.apex.amp._checkpoint import CheckpointMixin
from adapters.apex.amp._errors import AmpError
from adapters.apex.amp._functions import Kind
from adapters.apex.amp._initialize import InitializeMixin
from adapters.apex.amp._log import LOGGER, RateLimitedLog
from adapters.apex.amp._model import model_device_type
from adapters.apex.amp._opt_levels import Properties
from adapters.apex.amp._optimizer import OptimizerRecord, unwrap_larc
from adapters.apex.amp._scale_loss import ScaleLossMixin
from adapters.apex.amp._scaler import LossScaler
from adapters.apex.amp._session import DISABLED_MARK, Session


class Amp(InitializeMixin, ScaleLossMixin, CastsMixin, CheckpointMixin):
    """Apex's amp, as an object: ``initialize``, ``scale_loss``, ``autocast`` and the rest.

    The module functions of :mod:`adapters.apex.amp` are the methods of a default
    instance; make your own to keep several independent set-ups (tests, several models).
    Under the hood each loss scaler is an fmp record (:class:`fmp.DynamicLossScale` or
    :class:`fmp.StaticLossScale`) that this object swaps for the next one.

    Distributed: wrap the model in DDP *after* ``initialize`` (as Apex required); DDP
    all-reduces the grads in backward, so every rank sees the same overflow. With FSDP2
    (``fully_shard``, applied *before* the optimizer is made and before ``initialize``)
    each rank holds only its shard of the grads (DTensors): ``scale_loss`` then unscales
    and checks the local shards and all-reduces the overflow verdict (MAX) over the
    grads' device mesh, so every rank skips together. ``process_group`` makes that
    all-reduce unconditional (e.g. grads edited on one rank after DDP's reduction).

    Args:
        scale_window: clean steps before a dynamic scale doubles. Apex hard-coded 2000;
            this is an extension (``initialize``'s signature stays Apex's).
        process_group: None (default): the verdict is all-reduced only for sharded
            (DTensor) grads, over their mesh. ``"default"`` or a
            ``torch.distributed.ProcessGroup``: it is all-reduced over that group at every
            ``scale_loss`` exit (one one-element collective, no extra host sync). Can be
            set later through the attribute of the same name.

    Example:
        >>> amp = Amp()
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
        >>> with amp.autocast():
        ...     loss = model(torch.ones(3, 4)).float().mean()
        >>> with amp.scale_loss(loss, opt) as scaled_loss:
        ...     scaled_loss.backward()
        >>> opt.step()
        >>> amp.last_step_skipped()
        False
    """

    def __init__(self, scale_window: int = 2000, process_group: Any = None) -> None:
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or \
                scale_window < 1:
            raise AmpError(f"scale_window must be an int >= 1, got {scale_window!r}")
        self.scale_window = scale_window
        self.process_group = process_group
        self._session: Session | None = None
        self._log = RateLimitedLog(1)
        self._pending_state: Mapping[str, Any] | None = None
        self._registry: list[tuple[Any, str, Kind]] = []

    @property
    def process_group(self) -> Any:
        """The group the overflow verdict is all-reduced over (None: sharded grads only)."""
        return self._process_group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        if group is not None and not (isinstance(group, str) and group == "default"):
            import torch.distributed as dist

            if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
                raise AmpError(f"process_group must be None, 'default' or a "
                               f"torch.distributed.ProcessGroup, got {group!r}")
        self._process_group = group

    def _session_of(self, optimizer: Any) -> Session | None:
        """The session of this Amp that ``optimizer`` belongs to, or None."""
        rec = getattr(optimizer, "_amp_stash", None)
        session = getattr(rec, "session", None) if isinstance(rec, OptimizerRecord) else \
            getattr(optimizer, DISABLED_MARK, None)
        if isinstance(session, Session) and session.owner is self:
            return session
        return None

    # The state of the latest initialize call (read-only views of its session).
    @property
    def initialized(self) -> bool:
        """Whether ``initialize`` was called on this Amp."""
        return self._session is not None

    @property
    def enabled(self) -> bool:
        """False when the latest ``initialize`` had ``enabled=False``."""
        return self._session is None or self._session.enabled

    @property
    def properties(self) -> Properties | None:
        """The resolved settings of the latest ``initialize`` (None: disabled, or none)."""
        return None if self._session is None else self._session.properties

    @property
    def models(self) -> list[torch.nn.Module]:
        """The models of the latest ``initialize``."""
        return [] if self._session is None else self._session.models

    @property
    def loss_scalers(self) -> list[LossScaler]:
        """The loss scalers of the latest ``initialize`` (one per ``loss_id``)."""
        return [] if self._session is None else self._session.loss_scalers

    @property
    def _records(self) -> list[OptimizerRecord]:
        return [] if self._session is None else self._session.records

    def _device_type(self) -> str:
        return model_device_type(self.models[0]) if self.models else "cpu"

    def _on_skip(self, rec: OptimizerRecord) -> None:
        LOGGER.debug("optimizer.step() skipped after a gradient overflow")

    def _require(self, what: str) -> None:
        if not self.initialized:
            raise AmpError(f"{what} called before amp.initialize; call amp.initialize(model, "
                           f"optimizer, opt_level=...) first")

    def _record(self, optimizer: Any) -> OptimizerRecord:
        optimizer = unwrap_larc(optimizer)
        rec = getattr(optimizer, "_amp_stash", None)
        if isinstance(rec, OptimizerRecord) and self._session_of(optimizer) is not None:
            return rec
        if isinstance(rec, OptimizerRecord):
            raise AmpError(f"optimizer {type(optimizer).__name__} was initialized by another "
                           f"Amp object; use the scale_loss of that Amp")
        raise AmpError(f"optimizer {type(optimizer).__name__} was not passed through "
                       f"initialize of this Amp; pass every optimizer to amp.initialize")

    @staticmethod
    def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The params the optimizer steps: the float32 masters under O2/O5, else the model's.

        Under O2/O5 the masters first take the value of model params written since they
        last agreed (``model.load_state_dict`` after initialize, DDP's broadcast), as
        Apex's masters, made lazily, did.

        Args:
            optimizer: an optimizer (returned by initialize).

        Yields:
            Each param of each param group, in order.

        Example:
            >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)
            >>> len(list(Amp.master_params(opt)))
            1
        """
        optimizer = unwrap_larc(optimizer)
        rec = getattr(optimizer, "_amp_stash", None)
        if isinstance(rec, OptimizerRecord) and rec.masters is not None:
            rec.masters.sync_from_model()
        for group in optimizer.param_groups:
            yield from group["params"]

    def last_step_skipped(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Whether the last ``step()`` of ``optimizer`` was skipped after an overflow.

        With a fused optimizer the verdict lives on the device and reading it syncs.

        Args:
            optimizer: one of the initialized optimizers; None: any of them.

        Returns:
            True when that step (any of those steps) was skipped.

        Raises:
            AmpError: an optimizer this Amp did not initialize.

        Example:
            >>> Amp().last_step_skipped()
            False
        """
        recs = self._records if optimizer is None else [self._record(optimizer)]
        return any([r.was_skipped() for r in recs])

    def loss_scale(self, loss_id: int = 0) -> float:
        """The current scale of loss scaler ``loss_id`` as a Python float (syncs).

        Example:
            >>> amp = Amp()
            >>> _ = amp.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
            >>> amp.loss_scale()
            65536.0
        """
        self._require("amp.loss_scale")
        return self.loss_scalers[loss_id].loss_scale.item()

