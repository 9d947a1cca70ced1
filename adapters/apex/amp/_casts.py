"""``Amp.autocast``, ``disable_casts`` and the function registry's methods.

Part of :class:`~adapters.apex.amp.Amp` (a mixin). The casts are the O1 mode's
(:mod:`adapters.apex.amp._o1_install`); the decorators and ``register_*_function`` are
:mod:`adapters.apex.amp._functions`'s, which ``amp.init``'s handle uses too.
:func:`deactivate` turns the O1/O4 casts off, whoever installed them.
"""

from __future__ import annotations

import contextlib
from typing import Any

from adapters.apex.amp import _functions
from adapters.apex.amp import _o1_install as _o1
from adapters.apex.amp._functions import Kind


def deactivate() -> None:
    """Turn the O1/O4 casts off, whoever installed them (an fmp extension).

    After an O1/O4 ``amp.initialize`` (or ``amp.init()``) the casts act on the whole
    program, as Apex's patches did. Apex removed them through a private handle
    (``amp._amp_state.handle._deactivate()``, which works here too); this is the public
    way: for a script (or a test suite, a benchmark) that goes on without them. The
    functions registered in place are restored. A no-op when the casts are off.

    Example:
        >>> from adapters.apex import amp
        >>> net = amp.Amp().initialize(torch.nn.Linear(2, 2), opt_level="O4", verbosity=0)
        >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
        >>> amp.deactivate()
        >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """
    _o1.uninstall()


class CastsMixin:
    """The casts and the function registry (a part of :class:`~adapters.apex.amp.Amp`)."""

    def autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """A context running its body under the opt level's autocast (O1: float16, O4: bf16).

        At O0/O2/O3/O5 (the model itself carries its dtype) and when amp is disabled it
        does nothing. ``enabled=False`` turns autocast off inside.

        Args:
            enabled: False gives ``torch.autocast(device, enabled=False)``.

        Returns:
            A context manager.

        Raises:
            AmpError: before initialize.

        Example:
            >>> from adapters.apex.amp import Amp
            >>> amp = Amp()
            >>> net = amp.initialize(torch.nn.Linear(2, 2), opt_level="O4", verbosity=0)
            >>> with amp.autocast():
            ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
            torch.bfloat16
        """
        self._require("amp.autocast")
        props = self.properties
        if not enabled:
            return _o1.no_casts(self._device_type())  # [amp14a]
        if not self.enabled or props is None or not props.patch_torch_functions:
            return contextlib.nullcontext()
        return _o1.casts_on()  # [amp14a] the O1 mode casts (on already, unless disabled)

    def _deactivate(self) -> None:
        """Remove the O1/O4 casts this Amp installed (Apex's ``handle._deactivate()``).

        After an O1 ``initialize`` the casts act on the whole program, as Apex's patches
        did; a script that goes on without them (an evaluation in float32, another run in
        the same process) turns them off here. ``amp._amp_state.handle`` is this Amp then,
        so Apex's ``_amp_state.handle._deactivate()`` works too. A no-op when the casts
        are off or belong to another Amp or handle.

        Example:
            >>> from adapters.apex import amp
            >>> a = amp.Amp()
            >>> net = a.initialize(torch.nn.Linear(2, 2), opt_level="O4", verbosity=0)
            >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
            torch.bfloat16
            >>> a._deactivate()
            >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
            torch.float32
        """
        mode = _o1.current()
        if mode is not None and getattr(mode, "owner", None) is self:
            _o1.uninstall()

    def disable_casts(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which autocast's casts are off (Apex's ``amp.disable_casts()``).

        Returns:
            A context manager.

        Example:
            >>> from adapters.apex.amp import Amp
            >>> amp = Amp()
            >>> net = amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
            >>> with amp.autocast(), amp.disable_casts():
            ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
            torch.float32
        """
        return _o1.no_casts(self._device_type())  # [amp14a]

    half_function = staticmethod(_functions.half_function)
    float_function = staticmethod(_functions.float_function)
    promote_function = staticmethod(_functions.promote_function)

    def _register(self, module: Any, name: str, kind: Kind) -> None:
        _functions.register(self, self._registry, module, name, kind)

    def register_half_function(self, module: Any, name: str) -> None:
        """Have ``module.name`` run in autocast's low dtype (applied at an O1/O4 initialize).

        Args:
            module: a module or any object holding the function.
            name: the attribute name.

        Raises:
            AmpError: ``module`` has no attribute ``name``.

        Example:
            >>> from adapters.apex.amp import Amp
            >>> import types
            >>> ns = types.SimpleNamespace(f=torch.mm)
            >>> amp = Amp()
            >>> amp.register_half_function(ns, "f")
            >>> _ = amp.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
            >>> ns.f.__wrapped__ is torch.mm
            True
        """
        self._register(module, name, "half")

    def register_float_function(self, module: Any, name: str) -> None:
        """Have ``module.name`` run in float32 under autocast (see register_half_function).

        Args:
            module: a module or any object holding the function.
            name: the attribute name.

        Raises:
            AmpError: ``module`` has no attribute ``name``.

        Example:
            >>> from adapters.apex.amp import Amp
            >>> import types
            >>> amp = Amp()
            >>> amp.register_float_function(types.SimpleNamespace(f=abs), "f")
        """
        self._register(module, name, "float")

    def register_promote_function(self, module: Any, name: str) -> None:
        """Have ``module.name`` promote its floating arguments under autocast.

        Args:
            module: a module or any object holding the function.
            name: the attribute name.

        Raises:
            AmpError: ``module`` has no attribute ``name``.

        Example:
            >>> from adapters.apex.amp import Amp
            >>> import types
            >>> amp = Amp()
            >>> amp.register_promote_function(types.SimpleNamespace(f=abs), "f")
        """
        self._register(module, name, "promote")

