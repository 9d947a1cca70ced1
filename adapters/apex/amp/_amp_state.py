"""``amp._amp_state``: Apex's global amp state, as a read-only view of the default Amp.

Scripts written for Apex read it for logging::

    from apex.amp import _amp_state          # or: amp._amp_state, or
    from apex.amp._amp_state import _amp_state
    print(_amp_state.loss_scalers[0].loss_scale(), _amp_state.opt_properties.opt_level)

Here ``_amp_state`` answers from the latest ``initialize`` of the default
:class:`~adapters.apex.amp.Amp` (the module functions' instance): ``opt_properties``,
``loss_scalers`` (each with Apex's ``loss_scale()``, ``dynamic`` and the private counters
scripts read), ``verbosity``, ``min_loss_scale``/``max_loss_scale``, ``handle`` (the handle
of ``amp.init`` or of an O1 initialize, where there is one) and Apex's constant flags.
Writing to it raises (the state changes through ``initialize`` and ``load_state_dict``),
except Apex's writes its tests and scripts make: ``allow_incoming_model_not_fp32`` and a
scaler's ``_loss_scale`` / ``_unskipped`` (which take effect on that scaler).
Before the first ``initialize`` the attributes Apex set there are missing
(``AttributeError``), as in Apex.

Example:
    >>> from adapters.apex import amp
    >>> _ = amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
    >>> amp._amp_state.loss_scalers[0].loss_scale(), amp._amp_state.opt_properties.opt_level
    (65536.0, 'O1')
"""

from __future__ import annotations

from typing import Any

from adapters.apex.amp._errors import AmpError

_READ_ONLY = ("adapters.apex: amp._amp_state is read-only; change amp's state with "
              "amp.initialize(...) and amp.load_state_dict(...)")


class _ReadOnly:
    def __setattr__(self, name: str, value: Any) -> None:
        raise AmpError(f"{_READ_ONLY} (tried to set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AmpError(f"{_READ_ONLY} (tried to delete {name!r})")


class LossScalerView(_ReadOnly):
    """Apex's ``LossScaler`` as scripts read it: ``loss_scale()``, ``dynamic``, counters.

    Args:
        scaler: the adapter's :class:`~adapters.apex.amp._scaler.LossScaler`.

    Example:
        >>> from adapters.apex.amp._scaler import LossScaler
        >>> from adapters.apex.amp._log import RateLimitedLog
        >>> v = LossScalerView(LossScaler(0, 128.0, None, 2.0**24, 2000, "cpu",
        ...                               RateLimitedLog(0)))
        >>> v.loss_scale(), v.dynamic, v._unskipped
        (128.0, False, 0)
    """

    def __init__(self, scaler: Any) -> None:
        object.__setattr__(self, "_scaler", scaler)

    def loss_scale(self) -> float:
        """The current scale (a host sync on the GPU, as Apex's ``.item()`` was)."""
        return float(self._scaler.loss_scale.item())

    @property
    def dynamic(self) -> bool:
        """Whether the scale is dynamic."""
        return bool(self._scaler.dynamic)

    def __setattr__(self, name: str, value: Any) -> None:
        # Apex's tests and scripts set these two on a scaler after initialize
        if name == "_loss_scale":
            self._scaler.set_scale(scale=value)
        elif name == "_unskipped":
            self._scaler.set_scale(unskipped=value)
        else:
            super().__setattr__(name, value)

    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @property
    def _unskipped(self) -> int:
        return int(self._scaler.state_dict()["unskipped"])

    @property
    def _max_loss_scale(self) -> float:
        r = self._scaler.record
        return float(r.max_scale) if self._scaler.dynamic else self.loss_scale()

    @property
    def _min_loss_scale(self) -> float | None:
        return float(self._scaler.record.min_scale) if self._scaler.dynamic else None

    @property
    def _scale_seq_len(self) -> int:
        return int(self._scaler.record.period) if self._scaler.dynamic else 2000

    def __repr__(self) -> str:
        return f"LossScalerView(loss_scale={self.loss_scale()}, dynamic={self.dynamic})"


class PropertiesView(_ReadOnly):
    """Apex's ``Properties`` of the latest initialize (``opt_level``, ``options``, ...).

    Args:
        properties: the resolved :class:`~adapters.apex.amp.Properties`, or None when
            that initialize had ``enabled=False``.

    Example:
        >>> from adapters.apex.amp._opt_levels import resolve_properties
        >>> v = PropertiesView(resolve_properties("O2"))
        >>> v.enabled, v.master_weights, v.options["keep_batchnorm_fp32"]
        (True, True, True)
    """

    def __init__(self, properties: Any) -> None:
        object.__setattr__(self, "_props", properties)

    @property
    def options(self) -> dict[str, Any]:
        """Apex's option table: ``enabled``, ``opt_level`` and the property overrides."""
        p = self._props
        if p is None:
            return {"enabled": False, "opt_level": None, "cast_model_type": None,
                    "patch_torch_functions": False, "keep_batchnorm_fp32": None,
                    "master_weights": None, "loss_scale": 1.0}
        return {"enabled": True, "opt_level": p.opt_level, "cast_model_type": p.cast_model_type,
                "patch_torch_functions": p.patch_torch_functions,
                "keep_batchnorm_fp32": p.keep_batchnorm_fp32, "master_weights": p.master_weights,
                "loss_scale": p.loss_scale}

    def __getattr__(self, name: str) -> Any:
        opts = self.options
        if name in opts:
            return opts[name]
        if self._props is not None and hasattr(self._props, name):
            return getattr(self._props, name)
        raise AttributeError(f"opt_properties has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"PropertiesView({self.options})"


class AmpStateView(_ReadOnly):
    """Apex's ``_amp_state`` object, answering from an Amp's latest initialize.

    Args:
        amp: a callable returning the Amp to read (the default one for ``_amp_state``).

    Example:
        >>> from adapters.apex.amp import Amp
        >>> a = Amp()
        >>> s = AmpStateView(lambda: a)
        >>> s.verbosity, s.hard_override
        (1, False)
        >>> _ = a.initialize(torch.nn.Linear(2, 2), opt_level="O2", verbosity=0)
        >>> s.verbosity, s.opt_properties.opt_level, len(s.loss_scalers)
        (0, 'O2', 1)
    """

    def __init__(self, amp: Any) -> None:
        object.__setattr__(self, "_get", amp)
        object.__setattr__(self, "_allow_not_fp32", False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "allow_incoming_model_not_fp32":  # Apex's tests set it around initialize
            if not isinstance(value, bool):
                raise AmpError(f"_amp_state.allow_incoming_model_not_fp32 must be a bool, "
                               f"got {value!r}")
            object.__setattr__(self, "_allow_not_fp32", value)
        else:
            super().__setattr__(name, value)

    def _session(self, name: str) -> Any:
        session = self._get()._session
        if session is None:
            raise AttributeError(f"_amp_state.{name} is set by amp.initialize, which was not "
                                 f"called yet (as in Apex)")
        return session

    @property
    def hard_override(self) -> bool:
        """Apex's unused override flag: always False."""
        return False

    @property
    def allow_incoming_model_not_fp32(self) -> bool:
        """Apex's flag (settable, False until set). In Apex, True let initialize accept
        models whose params are not float32; here initialize accepts them always."""
        return bool(self._allow_not_fp32)

    @property
    def verbosity(self) -> int:
        """The ``verbosity`` of the latest initialize (1 before any)."""
        return int(self._get()._log.verbosity)

    @property
    def opt_properties(self) -> PropertiesView:
        """The settings of the latest initialize (``enabled=False`` there: ``enabled`` False)."""
        return PropertiesView(self._session("opt_properties").properties)

    @property
    def loss_scalers(self) -> list[LossScalerView]:
        """The loss scalers of the latest initialize, one per ``loss_id``."""
        return [LossScalerView(s) for s in self._session("loss_scalers").loss_scalers]

    @property
    def min_loss_scale(self) -> float | None:
        """``min_loss_scale`` as passed to the latest initialize."""
        return self._session("min_loss_scale").config.min_loss_scale

    @property
    def max_loss_scale(self) -> float:
        """``max_loss_scale`` as passed to the latest initialize."""
        return self._session("max_loss_scale").config.max_loss_scale

    @property
    def handle(self) -> Any:
        """The handle of ``amp.init`` / an O1 initialize (``AttributeError`` where none)."""
        handle = getattr(self._get(), "_handle", None)
        if handle is None:  # the owner of the installed O1 mode, when it is amp.init's handle
            from adapters.apex.amp import _o1_install

            mode = _o1_install.current()
            owner = getattr(mode, "owner", None)
            if owner is not None and hasattr(owner, "_deactivate"):
                handle = owner
        if handle is None:
            raise AttributeError("_amp_state.handle is set by amp.init() (and by an O1/O4 "
                                 "amp.initialize), which was not called (as in Apex)")
        return handle

    def __repr__(self) -> str:
        return "AmpStateView(of the default Amp)"


def _default() -> Any:
    from adapters.apex.amp import default_amp

    return default_amp()


#: Apex's ``_amp_state``: read-only, from the default Amp.
_amp_state = AmpStateView(_default)
