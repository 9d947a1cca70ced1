"""``Amp.state_dict`` / ``Amp.load_state_dict``: Apex's checkpoint of the loss scalers.

Part of :class:`~adapters.apex.amp.Amp` (a mixin). The format is Apex's:
``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``; every entry is checked
before anything is loaded.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from adapters.apex.amp._errors import AmpError
from adapters.apex.amp._log import LOGGER
from adapters.apex.amp._scaler import LossScaler

_KEY = re.compile(r"loss_scaler(\d+)")


class CheckpointMixin:
    """The amp checkpoint (a part of :class:`~adapters.apex.amp.Amp`)."""

    def state_dict(self, destination: dict[str, Any] | None = None) -> dict[str, Any]:
        """Apex's checkpoint of the loss scalers (reads device values: syncs).

        Args:
            destination: a dict to fill (default: a new ``OrderedDict``).

        Returns:
            ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``.

        Example:
            >>> from adapters.apex.amp import Amp
            >>> amp = Amp()
            >>> _ = amp.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
            >>> dict(amp.state_dict())
            {'loss_scaler0': {'loss_scale': 65536.0, 'unskipped': 0}}
        """
        out: dict[str, Any] = OrderedDict() if destination is None else destination
        for i, s in enumerate(self.loss_scalers):
            out[f"loss_scaler{i}"] = s.state_dict()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the loss scalers from :meth:`state_dict` (by the index in each key).

        Before initialize the dict is kept and applied by initialize. A count of scalers
        different from ``num_losses`` is logged; entries beyond it are skipped.

        Args:
            state_dict: Apex's format.

        Raises:
            AmpError: not a dict; a key that is not ``loss_scaler<N>`` (all such keys are
                named) or two keys naming one scaler (``loss_scaler0``, ``loss_scaler00``);
                an entry that is not ``{"loss_scale": number, "unskipped": int}``; a scale
                different from the fixed scale of this opt level (a dynamic-scale
                checkpoint loaded at O3, say). Nothing is loaded then; before initialize,
                the entries are checked by initialize, which then changes nothing.

        Example:
            >>> from adapters.apex.amp import Amp
            >>> amp = Amp()
            >>> _ = amp.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
            >>> amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}})
            >>> amp.loss_scale()
            8.0
        """
        self._check_keys(state_dict)
        if not self.initialized:
            self._pending_state = dict(state_dict)
            return
        for scaler, values in self._check_state(state_dict, self.loss_scalers):
            scaler.apply_state(*values)

    @staticmethod
    def _check_keys(state_dict: Any) -> dict[int, str]:
        """The scaler index of each key of Apex's amp state dict (validated)."""
        if not isinstance(state_dict, Mapping):
            raise AmpError(f"amp.load_state_dict needs a dict (what amp.state_dict() "
                           f"returned), got {type(state_dict).__name__}")
        unexpected = [k for k in state_dict if not (isinstance(k, str) and _KEY.fullmatch(k))]
        if unexpected:
            raise AmpError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                           + ", ".join(f'"{k}"' if isinstance(k, str) else repr(k)
                                       for k in unexpected)
                           + '; expected keys "loss_scaler0", "loss_scaler1", ...')
        index: dict[int, str] = {}
        for key in state_dict:
            m = _KEY.fullmatch(key)
            assert m is not None
            i = int(m.group(1))
            if i in index:
                raise AmpError(f"amp.load_state_dict: keys {index[i]!r} and {key!r} both name "
                               f"loss scaler {i}; a state dict holds one entry per scaler")
            index[i] = key
        return index

    def _check_state(self, state_dict: Mapping[str, Any], scalers: list[LossScaler]
                     ) -> list[tuple[LossScaler, tuple[float, int]]]:
        """Validate every entry against ``scalers`` (nothing changes); the values to set."""
        index = self._check_keys(state_dict)
        n = len(scalers)
        if len(state_dict) != n:
            LOGGER.warning("amp.load_state_dict: the state dict has %d loss scalers, this Amp "
                           "uses %d", len(state_dict), n)
        out = []
        for i, key in sorted(index.items()):
            if i >= n:
                LOGGER.warning("amp.load_state_dict: skipping %s, since num_losses was set to "
                               "%d", key, n)
                continue
            try:
                out.append((scalers[i], scalers[i].check_state(state_dict[key])))
            except ValueError as e:
                raise AmpError(str(e)) from None
        return out
