"""The :class:`Amp` object: Apex's amp state and functions, held in an instance."""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

import fmp
import fmp.distributed as fd
from adapters.apex.amp import _o1_install as _o1  # [amp14a]
from adapters.apex.amp._casts import Kind, cast_function
from adapters.apex.amp._errors import AmpError
from adapters.apex.amp._log import LOGGER, RateLimitedLog
from adapters.apex.amp._model import (
    WrappedForward,
    cast_model,
    model_device_type,
    register_fp32_state_dict,
)
from adapters.apex.amp._opt_levels import Properties, resolve_properties
from adapters.apex.amp._optimizer import OptimizerRecord, is_dtensor
from adapters.apex.amp._scaler import LossScaler

__all__ = ["Amp"]

_KEY = re.compile(r"loss_scaler(\d+)")
_PARALLEL = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def _as_list(objs: Any, cls: type, what: str) -> tuple[list[Any], bool]:
    """``objs`` as a list, and whether it came as one object."""
    if isinstance(objs, cls):
        return [objs], True
    if isinstance(objs, list | tuple) and all(isinstance(o, cls) for o in objs):
        return list(objs), False
    raise AmpError(f"{what} must be a single {cls.__module__}.{cls.__name__} or a list of "
                   f"them, got {type(objs).__name__}")


def _first_device(models: list[torch.nn.Module]) -> torch.device:
    for m in models:
        for t in m.parameters():
            return t.device
    return torch.device("cpu")


class Amp:
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
        self.initialized = False
        self.enabled = True
        self.properties: Properties | None = None
        self.models: list[torch.nn.Module] = []
        self.loss_scalers: list[LossScaler] = []
        self._records: list[OptimizerRecord] = []
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

    # ----------------------------------------------------------------------------------
    # initialize
    # ----------------------------------------------------------------------------------
    def initialize(
        self,
        models: Any,
        optimizers: Any = None,
        enabled: bool = True,
        opt_level: str = "O1",
        cast_model_type: Any = None,
        patch_torch_functions: Any = None,
        keep_batchnorm_fp32: Any = None,
        master_weights: Any = None,
        loss_scale: Any = None,
        cast_model_outputs: Any = None,
        num_losses: int = 1,
        verbosity: int = 1,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> Any:
        """Set up models and optimizers for mixed precision (Apex's signature and defaults).

        The preset of ``opt_level`` is applied, then every keyword that is not None.
        O0: float32. O1: the forward runs under ``torch.autocast(float16)``, dynamic loss
        scale. O2: model cast to float16 (batch-norm kept float32), float32 master
        weights in the optimizer, dynamic scale. O3: pure float16, scale 1. O4/O5: the
        bfloat16 counterparts of O1/O2 (static scale 1 by default: bfloat16 has
        float32's range).

        Args:
            models: a module or a list of modules (not yet wrapped in DDP/DataParallel).
            optimizers: an optimizer, a list of them, or None.
            enabled: False returns the arguments unchanged and makes ``scale_loss`` a
                pass-through.
            opt_level: ``"O0"`` ... ``"O5"``.
            cast_model_type: dtype to cast the model to (``False``: do not cast).
            patch_torch_functions: O1/O4: autocast the forward.
            keep_batchnorm_fp32: keep batch-norm float32 when casting (``"True"`` /
                ``"False"`` accepted).
            master_weights: float32 master copies of low-precision params.
            loss_scale: ``"dynamic"`` or a number.
            cast_model_outputs: dtype for the model's floating outputs.
            num_losses: how many independent loss scalers (``loss_id`` values).
            verbosity: 0 silences the informational log, 2 logs every overflow.
            min_loss_scale: floor of the dynamic scale (default 1.0; 0 means none).
            max_loss_scale: cap of the dynamic scale; it starts at
                ``min(max_loss_scale, 2**16)``.

        Returns:
            The models (and optimizers, when given) in the shape they came in:
            ``model`` or ``(model, optimizer)``, lists for lists.

        Raises:
            AmpError: an unknown opt_level (the valid ones are listed), a combination
                Apex rejected, a model already wrapped in DDP/DataParallel, an optimizer
                already passed through initialize, bad ``num_losses``/scale bounds.

        Example:
            >>> amp = Amp()
            >>> net = torch.nn.Linear(2, 2)
            >>> net = amp.initialize(net, opt_level="O2", verbosity=0)
            >>> net.weight.dtype, net(torch.ones(1, 2)).dtype
            (torch.float16, torch.float32)
        """
        model_list, one_model = _as_list(models, torch.nn.Module, "models")
        for m in model_list:
            if isinstance(m, _PARALLEL):
                raise AmpError(
                    f"the model is already wrapped in {type(m).__name__}; wrap after "
                    f"initialize: call amp.initialize on the bare model, then wrap the model "
                    f"it returns in {type(m).__name__}")
        opt_list: list[torch.optim.Optimizer] = []
        one_opt = False
        if optimizers is not None:
            opt_list, one_opt = _as_list(optimizers, torch.optim.Optimizer, "optimizers")
            for o in opt_list:
                if hasattr(o, "_amp_stash"):
                    raise AmpError("an optimizer was passed through amp.initialize twice; "
                                   "a given optimizer may be initialized only once (make a "
                                   "new optimizer, or reuse the one initialize returned)")
            if len({id(o) for o in opt_list}) != len(opt_list):
                raise AmpError("the same optimizer appears twice in the optimizers list")
        if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
            raise AmpError(f"num_losses must be an int >= 1, got {num_losses!r}")
        self._log = RateLimitedLog(verbosity)

        def result() -> Any:
            ms = model_list[0] if one_model else type(models)(model_list)
            if optimizers is None:
                return ms
            return ms, (opt_list[0] if one_opt else type(optimizers)(opt_list))

        if self.initialized:
            self._log.always("amp.initialize called again on this Amp: its previous state "
                             "is replaced")
        self.models, self._records, self.loss_scalers = model_list, [], []
        if not enabled:
            self.enabled, self.initialized, self.properties = False, True, None
            return result()

        props = resolve_properties(opt_level, cast_model_type, patch_torch_functions,
                                   keep_batchnorm_fp32, master_weights, loss_scale,
                                   cast_model_outputs)
        self._check_bounds(min_loss_scale, max_loss_scale)
        self.enabled, self.properties = True, props
        self._log.always(f"adapters.apex amp: selected optimization level {opt_level}: "
                         f"{props.describe()}")
        if props.cast_model_type not in (None, torch.float32) or props.master_weights:
            for m in model_list:
                if any(is_dtensor(p) for p in m.parameters()):
                    raise AmpError(
                        f"opt_level {opt_level} casts the model and/or keeps float32 master "
                        f"weights, but the model's params are DTensors (FSDP2 fully_shard), "
                        f"whose dtypes FSDP2 manages itself: use O1 or O4 (autocast) with "
                        f"fully_shard, or fully_shard's mp_policy "
                        f"(fmp.distributed.fsdp_mixed_precision)")
        for m in model_list:
            self._setup_model(m, props)
        for o in opt_list:
            self._records.append(OptimizerRecord(o, props.master_weights, self._device_type,
                                                 self._on_skip))
        device = _first_device(model_list)
        self.loss_scalers = [
            LossScaler(i, props.loss_scale, min_loss_scale, max_loss_scale,
                       self.scale_window, device, self._log)
            for i in range(num_losses)
        ]
        self.initialized = True
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self.load_state_dict(pending)
        # [amp14a] Apex's O1 casts (a torch function mode): on at O1/O4, off otherwise
        _o1.follow(self, props, self._device_type(), self._registry, opt_list,
                   verbose=self._log.verbosity == 2)
        return result()

    @staticmethod
    def _check_bounds(min_loss_scale: Any, max_loss_scale: Any) -> None:
        for name, v in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale)):
            if v is None and name == "min_loss_scale":
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0 or \
                    v == float("inf") or (name == "max_loss_scale" and v == 0):
                raise AmpError(f"{name} must be a finite number >= 0 (max > 0), got {v!r}")
        if min_loss_scale is not None and min_loss_scale > max_loss_scale:
            raise AmpError(f"min_loss_scale={min_loss_scale!r} is greater than "
                           f"max_loss_scale={max_loss_scale!r}")

    def _setup_model(self, model: torch.nn.Module, props: Properties) -> None:
        inner = model.__dict__.get("forward")
        out_dtype = props.cast_model_outputs or torch.float32
        if props.cast_model_type is not None:
            dt = props.cast_model_type
            cast_model(model, dt, bool(props.keep_batchnorm_fp32))
            register_fp32_state_dict(model)
            policy = fmp.Policy(dt, dt, out_dtype)
            model.forward = WrappedForward(model, inner, policy, True, True)
        # [amp14a] O1/O4: no forward wrapper (the O1 mode casts); outputs cast only when
        # cast_model_outputs is given, as in Apex
        elif props.cast_model_outputs is not None:
            policy = fmp.Policy(torch.float32, torch.float32, out_dtype)
            model.forward = WrappedForward(model, inner, policy, False, True)

    def _device_type(self) -> str:
        return model_device_type(self.models[0]) if self.models else "cpu"

    def _on_skip(self, rec: OptimizerRecord) -> None:
        LOGGER.debug("optimizer.step() skipped after a gradient overflow")

    def _require(self, what: str) -> None:
        if not self.initialized:
            raise AmpError(f"{what} called before amp.initialize; call amp.initialize(model, "
                           f"optimizer, opt_level=...) first")

    def _record(self, optimizer: Any) -> OptimizerRecord:
        rec = getattr(optimizer, "_amp_stash", None)
        if not isinstance(rec, OptimizerRecord) or rec not in self._records:
            raise AmpError(f"optimizer {type(optimizer).__name__} was not passed through "
                           f"initialize of this Amp; pass every optimizer to amp.initialize")
        return rec

    # ----------------------------------------------------------------------------------
    # scale_loss
    # ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(
        self,
        loss: torch.Tensor,
        optimizers: Any,
        loss_id: int = 0,
        model: Any = None,
        delay_unscale: bool = False,
        delay_overflow_check: bool = False,
    ) -> Iterator[torch.Tensor]:
        """Context manager yielding the scaled loss; on exit unscale, check, maybe skip.

        On entry the grads already on the optimizers' params are set aside; the body
        runs ``scaled_loss.backward()``; on exit the new grads are unscaled and checked
        in one fused pass, the set-aside grads added back (gradient accumulation across
        losses with different scales), the loss scale moved, and after an overflow the
        next ``optimizer.step()`` of each optimizer passed here is skipped. One host
        sync per exit, as in Apex, unless every optimizer is a fused torch optimizer:
        then the skip happens on the device.

        Args:
            loss: the loss tensor.
            optimizers: the optimizer, or a list of them, owning the params that get
                grads from this backward.
            loss_id: which loss scaler (``0 <= loss_id < num_losses``).
            model: ignored (Apex's deprecated argument).
            delay_unscale: leave the grads scaled (no unscale, check or skip); a later
                ``scale_loss`` without it must come before ``step``.
            delay_overflow_check: unscale, but never skip and never move the scale.

        Yields:
            ``loss.float() * loss_scale`` (``loss.float()`` when there is no scaling).

        Raises:
            AmpError: before initialize, ``loss_id`` out of range, or an optimizer that
                this Amp did not initialize.

        Example:
            >>> amp = Amp()
            >>> net = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
            >>> net, opt = amp.initialize(net, opt, opt_level="O1", verbosity=0)
            >>> with amp.scale_loss(net(torch.ones(1, 2)).sum(), opt) as scaled:
            ...     print(scaled.item() / net(torch.ones(1, 2)).sum().item())
            65536.0
        """
        self._require("amp.scale_loss")
        if not self.enabled:
            yield loss
            return
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        recs = [self._record(o) for o in optimizers]
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) or \
                not 0 <= loss_id < len(self.loss_scalers):
            raise AmpError(f"loss_id={loss_id!r} is out of range: initialize was called with "
                           f"num_losses={len(self.loss_scalers)}, so 0 <= loss_id < "
                           f"{len(self.loss_scalers)}")
        scaler = self.loss_scalers[loss_id]
        assert self.properties is not None
        if not self.properties.master_weights and scaler.static_value == 1.0:
            yield loss.float()
            return
        scaler.to(loss.device)
        scaler.poll()
        for rec in recs:
            rec.prepare_backward()
        try:
            yield scaler.record.scale(loss.float())
        except BaseException:
            for rec in recs:
                rec.restore_stash()
            raise
        if delay_unscale:
            for rec in recs:
                rec.has_scaled_grads = True
            return
        found_inf = torch.zeros((), dtype=torch.float32, device=scaler.loss_scale.device)
        inv_scale = scaler.inv_scale()
        meshes: list[Any] = []
        for rec in recs:
            for mesh in rec.post_backward(inv_scale, found_inf):
                if not any(mesh is m for m in meshes):
                    meshes.append(mesh)
        if delay_overflow_check:
            return
        if scaler.dynamic:
            self._agree(found_inf, meshes)
        sync = scaler.dynamic and not all(rec.fused for rec in recs)
        skip = scaler.update(found_inf, sync)
        device_flag = found_inf if scaler.dynamic and not sync else None
        for rec in recs:
            rec.flag_overflow(device_flag, skip)

    def _agree(self, found_inf: torch.Tensor, meshes: list[Any]) -> None:
        """All-reduce (MAX) ``found_inf`` in place, so every rank skips together.

        Over ``process_group`` when one is set; else over every dimension of the meshes of
        the sharded grads (none: nothing to do). On the device: no host sync here.
        """
        if self._process_group is None and not meshes:
            return
        import torch.distributed as dist

        if self._process_group is not None:
            groups = [fd.check_group(self._process_group)]
        else:
            groups = [mesh.get_group(d) for mesh in meshes for d in range(mesh.ndim)]
        flag = found_inf.view(1)
        for pg in groups:
            if dist.get_world_size(pg) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)

    # ----------------------------------------------------------------------------------
    # casts
    # ----------------------------------------------------------------------------------
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

    def disable_casts(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which autocast's casts are off (Apex's ``amp.disable_casts()``).

        Returns:
            A context manager.

        Example:
            >>> amp = Amp()
            >>> net = amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
            >>> with amp.autocast(), amp.disable_casts():
            ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
            torch.float32
        """
        return _o1.no_casts(self._device_type())  # [amp14a]

    @staticmethod
    def half_function(fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: under autocast, run ``fn`` on arguments cast to autocast's low dtype.

        Args:
            fn: the function.

        Returns:
            The wrapper; outside autocast it calls ``fn`` unchanged.

        Example:
            >>> f = Amp.half_function(torch.add)
            >>> with torch.autocast("cpu", dtype=torch.float16):
            ...     f(torch.ones(1), torch.ones(1)).dtype
            torch.float16
        """
        return cast_function(fn, "half")

    @staticmethod
    def float_function(fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: under autocast, run ``fn`` on arguments cast to float32.

        Args:
            fn: the function.

        Returns:
            The wrapper.

        Example:
            >>> f = Amp.float_function(torch.mm)
            >>> with torch.autocast("cpu", dtype=torch.float16):
            ...     f(torch.ones(2, 2), torch.ones(2, 2)).dtype
            torch.float32
        """
        return cast_function(fn, "float")

    @staticmethod
    def promote_function(fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: under autocast, cast floating arguments to the widest of their dtypes.

        Args:
            fn: the function.

        Returns:
            The wrapper.

        Example:
            >>> f = Amp.promote_function(torch.cat)
            >>> with torch.autocast("cpu", dtype=torch.float16):
            ...     f([torch.ones(1, dtype=torch.float16), torch.ones(1)]).dtype
            torch.float32
        """
        return cast_function(fn, "promote")

    def _register(self, module: Any, name: str, kind: Kind) -> None:
        if not hasattr(module, name):
            raise AmpError(f"no function named {name!r} in {module!r}")
        _o1.register(self, self._registry, module, name, kind)  # [amp14a]

    @staticmethod
    def _patch(module: Any, name: str, kind: Kind) -> None:
        fn = getattr(module, name)
        if getattr(fn, "_amp_cast_kind", None) is not None:
            return
        setattr(module, name, cast_function(fn, kind))

    def register_half_function(self, module: Any, name: str) -> None:
        """Have ``module.name`` run in autocast's low dtype (applied at an O1/O4 initialize).

        Args:
            module: a module or any object holding the function.
            name: the attribute name.

        Raises:
            AmpError: ``module`` has no attribute ``name``.

        Example:
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
            >>> import types
            >>> amp = Amp()
            >>> amp.register_promote_function(types.SimpleNamespace(f=abs), "f")
        """
        self._register(module, name, "promote")

    # ----------------------------------------------------------------------------------
    # params, skips, checkpoints
    # ----------------------------------------------------------------------------------
    @staticmethod
    def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The params the optimizer steps: the float32 masters under O2/O5, else the model's.

        Args:
            optimizer: an optimizer (returned by initialize).

        Yields:
            Each param of each param group, in order.

        Example:
            >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)
            >>> len(list(Amp.master_params(opt)))
            1
        """
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

    def state_dict(self, destination: dict[str, Any] | None = None) -> dict[str, Any]:
        """Apex's checkpoint of the loss scalers (reads device values: syncs).

        Args:
            destination: a dict to fill (default: a new ``OrderedDict``).

        Returns:
            ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``.

        Example:
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
            AmpError: a key that is not ``loss_scaler<N>`` (all such keys are named), or a
                malformed entry.

        Example:
            >>> amp = Amp()
            >>> _ = amp.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
            >>> amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}})
            >>> amp.loss_scale()
            8.0
        """
        if not isinstance(state_dict, Mapping):
            raise AmpError(f"amp.load_state_dict needs a dict, got {type(state_dict).__name__}")
        unexpected = [k for k in state_dict if not (isinstance(k, str) and _KEY.fullmatch(k))]
        if unexpected:
            raise AmpError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                           + ", ".join(f'"{k}"' for k in unexpected)
                           + '; expected keys "loss_scaler0", "loss_scaler1", ...')
        if not self.initialized:
            self._pending_state = dict(state_dict)
            return
        n = len(self.loss_scalers)
        if len(state_dict) != n:
            LOGGER.warning("amp.load_state_dict: the state dict has %d loss scalers, this Amp "
                           "uses %d", len(state_dict), n)
        for key, entry in state_dict.items():
            m = _KEY.fullmatch(key)
            assert m is not None
            i = int(m.group(1))
            if i >= n:
                LOGGER.warning("amp.load_state_dict: skipping %s, since num_losses was set to "
                               "%d", key, n)
                continue
            try:
                self.loss_scalers[i].load_state_dict(entry)
            except ValueError as e:
                raise AmpError(str(e)) from None
