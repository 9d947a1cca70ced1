"""Apex's old handle API: ``handle = amp.init(...)``, ``handle.scale_loss``, ``wrap_optimizer``.

``amp.init`` installs the O1 casts (:mod:`adapters.apex.amp._o1_mode`, float16) and returns
an :class:`AmpHandle` (``enabled=False``: a :class:`NoOpHandle`). The loss scale of the
handle and of each :class:`OptimWrapper` is an fmp record (:class:`fmp.DynamicLossScale`,
Apex's start 2**16, window 2000, factor 2; the floor is 1.0 here, Apex had none).

Differences from Apex (e13873de): there ``handle.scale_loss`` raised "The old Amp API is
no longer supported"; here it works as in the releases that had it. ``wrap_optimizer``
uses the handle's ``loss_scale`` (Apex's OptimWrapper was always dynamic).
``OptimWrapper.step`` runs with the casts off (as ``initialize`` does).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

import fmp
from adapters.apex.amp import _functions, _o1_install
from adapters.apex.amp._log import LOGGER
from adapters.apex.amp._o1_mode import O1Mode


def _params(optimizer: Any) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _scaler(loss_scale: Any) -> Any:
    if loss_scale == "dynamic":
        return fmp.DynamicLossScale.create()
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float) or \
            not 0 < loss_scale < float("inf"):
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got "
                         f"{loss_scale!r}")
    return fmp.StaticLossScale(float(loss_scale))


def _unscale_check(scaler: Any, params: list[torch.Tensor]) -> tuple[Any, bool]:
    """Unscale the grads in place (the record's ``unscale_and_check_``: one pass per device
    and dtype, no host sync); the next scaler and whether to skip (syncs once, for the
    skip the handle's ``step`` decides on the host)."""
    grads = [p.grad for p in params if p.grad is not None]
    with torch.no_grad():
        finite = scaler.unscale_and_check_(grads) == 0 if grads else torch.tensor(True)
    ok = bool(finite.item())
    dynamic = isinstance(scaler, fmp.DynamicLossScale)
    return (scaler.adjust(finite) if dynamic else scaler), (dynamic and not ok)


def _skip_once(optimizer: Any) -> None:
    """The next ``optimizer.step()`` does nothing (Apex patched ``step`` for one call)."""
    had = "step" in optimizer.__dict__
    prev = optimizer.__dict__.get("step")

    def skip(self: Any, closure: Any = None) -> None:
        LOGGER.warning("Gradient overflow, skipping update")
        if had:
            self.step = prev
        else:
            del self.step

    optimizer.step = types.MethodType(skip, optimizer)


class AmpHandle:
    """What ``amp.init()`` returns: the O1 casts, a default loss scaler, the cast cache.

    Args:
        loss_scale: ``"dynamic"`` or a positive number.
        enable_caching: cache the half casts of float32 params.
        verbose: print every cast.
        allow_banned: run ``F.binary_cross_entropy`` in float32 instead of refusing it.
        device_type: the device whose tensors are cast (default CUDA when available).

    Example:
        >>> h = AmpHandle(device_type="cpu")
        >>> h.is_active(), torch.mm(torch.ones(1, 1), torch.ones(1, 1)).dtype
        (True, torch.float16)
        >>> h._deactivate()
    """

    def __init__(self, loss_scale: Any = "dynamic", enable_caching: bool = True,
                 verbose: bool = False, allow_banned: bool = False,
                 device_type: str | None = None, patch_type: torch.dtype = torch.float16
                 ) -> None:
        if patch_type not in (torch.float16, torch.bfloat16):
            raise ValueError(f"amp.init: patch_type must be torch.float16 or torch.bfloat16, "
                             f"got {patch_type!r}")
        self._default_scaler: Any = _scaler(loss_scale)
        self._loss_scale = loss_scale
        self._enable_caching = enable_caching
        self._verbose = verbose
        dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        self._mode = O1Mode(patch_type, dev, allow_banned=allow_banned,
                            enable_caching=enable_caching, verbose=verbose)
        self._mode.owner = self
        from adapters.apex.amp import default_amp

        _o1_install.install(self._mode)
        _functions.apply_registry(self._mode, default_amp()._registry)

    @property
    def _is_active(self) -> bool:
        return self._mode.active and _o1_install.current() is self._mode

    def is_active(self) -> bool:
        """Whether the casts are on (installed, and not inside ``disable_casts``)."""
        return self._is_active

    def _disable_casts(self) -> contextlib.AbstractContextManager[Any]:
        """A context with the casts off inside."""
        return self._mode.casts(False)

    disable_casts = _disable_casts

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        """An :class:`OptimWrapper` (then ``handle.scale_loss`` is refused, as in Apex)."""
        self._default_scaler = None
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        """Yield ``loss * scale``; on exit unscale, check, skip the next step on overflow.

        Raises:
            RuntimeError: after ``wrap_optimizer`` (use ``optimizer.scale_loss(loss)``).
        """
        if not self.is_active():
            yield loss
            return
        if self._default_scaler is None:
            raise RuntimeError("After calling `handle.wrap_optimizer()`, you must explicitly "
                               "use `optimizer.scale_loss(loss)`.")
        yield loss * self._default_scaler.loss_scale.to(loss.device)
        self._default_scaler, skip = _unscale_check(self._default_scaler, _params(optimizer))
        if skip:
            _skip_once(optimizer)
        self._clear_cache()

    def loss_scale(self) -> float:
        """The default scaler's scale (``None`` after ``wrap_optimizer``)."""
        s = self._default_scaler
        return None if s is None else float(s.loss_scale)  # type: ignore[return-value]

    def _clear_cache(self) -> None:
        self._mode.clear_cache()

    def _save_func(self, mod: Any, fn: str, func: Any) -> None:
        self._mode.patches.append((mod, fn, func))

    def _deactivate(self) -> None:
        """Remove the casts (and undo the functions wrapped in place)."""
        if _o1_install.current() is self._mode:
            _o1_install.uninstall()
        self._mode.active = False

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def cache(self) -> dict[Any, Any]:
        """The cast cache: ``id(param) -> (param, version, half copy)``."""
        return self._mode.cache

    def remove_cache(self, param: torch.Tensor) -> None:
        """Drop the cached cast of ``param``."""
        if self.has_cache:
            self._mode.cache.pop(id(param), None)

    @property
    def verbose(self) -> bool:
        return self._verbose


class NoOpHandle:
    """What ``amp.init(enabled=False)`` returns: nothing is cast or scaled.

    Example:
        >>> h = NoOpHandle()
        >>> h.is_active(), h.has_cache
        (False, False)
    """

    _default_scaler = None

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    disable_casts = _disable_casts

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        yield loss

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    def remove_cache(self, param: torch.Tensor) -> None:
        pass

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass


class OptimWrapper:
    """Apex's ``OptimWrapper``: one loss scaler per loss, ``scale_loss(loss)``, ``step()``.

    Each ``scale_loss`` of an iteration uses the next scaler (``num_loss`` of them); the
    grads of the earlier losses are set aside and added back after the unscale. ``step``
    skips when any loss overflowed, and starts the next iteration. Other attributes go
    to the optimizer.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> w = NoOpHandle().wrap_optimizer(torch.optim.SGD([p], lr=1.0))
        >>> with w.scale_loss(p.sum()) as s:
        ...     s.backward()
        >>> w.step(); p.tolist()
        [0.0, 0.0]
    """

    def __init__(self, optimizer: torch.optim.Optimizer, amp_handle: Any, num_loss: int) -> None:
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ValueError(f"num_loss must be an int >= 1, got {num_loss!r}")
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._skip_next = [False] * num_loss
        scale = getattr(amp_handle, "_loss_scale", "dynamic")
        self._loss_scaler = [_scaler(scale) for _ in range(num_loss)]

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        """Yield ``loss * scale`` of this loss's scaler; on exit unscale and check.

        Raises:
            RuntimeError: more ``scale_loss`` calls than ``num_loss`` before ``step``.
        """
        if not self._amp_handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise RuntimeError(f"scale_loss called {self._loss_idx + 1} times before step(), "
                               f"but wrap_optimizer(num_loss={self._num_loss}); pass "
                               f"num_loss=<losses per iteration>")
        params = _params(self._optimizer)
        stash = []
        if self._loss_idx > 0:
            stash = [None if p.grad is None else p.grad.detach().clone() for p in params]
            self._optimizer.zero_grad()
        i = self._loss_idx
        yield loss * self._loss_scaler[i].loss_scale.to(loss.device)
        self._loss_scaler[i], self._skip_next[i] = _unscale_check(self._loss_scaler[i], params)
        self._loss_idx += 1
        for p, g in zip(params, stash, strict=False):
            if g is not None:
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)

    def step(self, closure: Any = None) -> Any:
        """Step the optimizer (casts off), or skip after an overflow of any loss.

        Raises:
            NotImplementedError: a closure (as in Apex).
        """
        if not self._amp_handle.is_active():
            return self._optimizer.step(closure=closure)
        self._loss_idx = 0
        for p in _params(self._optimizer):
            self._amp_handle.remove_cache(p)
        if closure is not None:
            raise NotImplementedError("The `closure` argument is unsupported by the amp "
                                      "optimizer wrapper.")
        if any(self._skip_next):
            LOGGER.info("Gradient overflow, skipping update")
            self._skip_next = [False] * self._num_loss
            return None
        with self._amp_handle._disable_casts():
            return self._optimizer.step()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._optimizer, attr)

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        return self._optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        return self._optimizer.add_param_group(param_group)


def init(enabled: bool = True, loss_scale: Any = "dynamic", enable_caching: bool = True,
         verbose: bool = False, allow_banned: bool = False,
         patch_type: torch.dtype = torch.float16) -> AmpHandle | NoOpHandle:
    """Apex's ``amp.init``: turn the O1 casts on (float16) and return the handle.

    Args:
        enabled: False returns a :class:`NoOpHandle` and changes nothing.
        loss_scale: ``"dynamic"`` or a positive number.
        enable_caching: cache the half casts of float32 params.
        verbose: print every cast.
        allow_banned: run ``F.binary_cross_entropy`` in float32 instead of refusing it.
        patch_type: the low dtype of the casts, ``torch.float16`` or ``torch.bfloat16``
            (the later Apex releases' argument).

    Returns:
        The handle.

    Raises:
        ValueError: a bad ``loss_scale`` or ``patch_type``.

    Example:
        >>> h = init(enabled=False)
        >>> h.is_active()
        False
    """
    if not enabled:
        return NoOpHandle()
    return AmpHandle(loss_scale, enable_caching, verbose, allow_banned,
                     patch_type=patch_type)
