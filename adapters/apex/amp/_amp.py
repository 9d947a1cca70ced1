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
from adapters.apex.amp._session import DISABLED_MARK, MODEL_MARK, Config, Session

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


def _unwrap_larc(objs: Any) -> Any:
    """``objs`` with each Apex ``LARC`` wrapper replaced by the optimizer it wraps (amp
    patches that one; LARC's ``step``/``zero_grad`` call it, as in Apex)."""
    from adapters.apex.parallel.LARC import LARC

    if isinstance(objs, LARC):
        return objs.optim
    if isinstance(objs, list | tuple):
        return type(objs)(o.optim if isinstance(o, LARC) else o for o in objs)
    return objs


def _clear_cast_cache() -> None:
    # As Apex at the end of each scale_loss: the O1 casts of params are made again after
    # it (a write through .data, which torch does not count as a new version, is then seen)
    mode = _o1.current()
    if mode is not None:
        mode.clear_cache()


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

        Each call keeps its own settings with its optimizers, as Apex's per-optimizer
        stash did: optimizers of an earlier call keep working with ``scale_loss``. The loss
        scalers are the latest call's for every optimizer (Apex kept them in the global
        ``_amp_state``, which each call replaced); ``state_dict``, ``loss_scale`` and
        ``autocast`` follow the latest call too. A model or optimizer passed again with the
        same settings is returned unchanged (a warning is logged). Everything is checked
        first (a checkpoint given to ``load_state_dict`` before, too): a call that raises
        leaves every model and optimizer as it was.

        Returns:
            The models (and optimizers, when given) in the shape they came in:
            ``model`` or ``(model, optimizer)``, lists for lists.

        Raises:
            AmpError: an unknown opt_level (the valid ones are listed), a combination
                Apex rejected, a model already wrapped in DDP/DataParallel, the same model
                or optimizer twice in one call, a model or optimizer initialized before
                with other settings (or an optimizer initialized by another Amp), bad
                ``num_losses``/``verbosity``/scale bounds, a pending checkpoint that does
                not fit (see :meth:`load_state_dict`).

        Example:
            >>> amp = Amp()
            >>> net = torch.nn.Linear(2, 2)
            >>> net = amp.initialize(net, opt_level="O2", verbosity=0)
            >>> net.weight.dtype, net(torch.ones(1, 2)).dtype
            (torch.float16, torch.float32)
        """
        # Everything is validated first: a failed initialize changes nothing.
        model_list, one_model = _as_list(models, torch.nn.Module, "models")
        for m in model_list:
            if isinstance(m, _PARALLEL):
                raise AmpError(
                    f"the model is already wrapped in {type(m).__name__}; wrap after "
                    f"initialize: call amp.initialize on the bare model, then wrap the model "
                    f"it returns in {type(m).__name__}")
        if len({id(m) for m in model_list}) != len(model_list):
            raise AmpError("the same model appears twice in the models list")
        opt_list: list[torch.optim.Optimizer] = []
        one_opt = False
        if optimizers is not None:
            opt_list, one_opt = _as_list(_unwrap_larc(optimizers), torch.optim.Optimizer,
                                         "optimizers")
            if len({id(o) for o in opt_list}) != len(opt_list):
                raise AmpError("the same optimizer appears twice in the optimizers list")
        if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
            raise AmpError(f"num_losses must be an int >= 1, got {num_losses!r}")
        try:
            log = RateLimitedLog(verbosity)
        except (TypeError, ValueError):
            raise AmpError(f"verbosity must be an int (0, 1 or 2), got {verbosity!r}") from None

        def result() -> Any:
            ms = model_list[0] if one_model else type(models)(model_list)
            if optimizers is None:
                return ms
            outer = [optimizers] if one_opt else list(optimizers)  # LARC comes back as LARC
            return ms, (outer[0] if one_opt else type(optimizers)(outer))

        props: Properties | None = None
        if enabled:
            props = resolve_properties(opt_level, cast_model_type, patch_torch_functions,
                                       keep_batchnorm_fp32, master_weights, loss_scale,
                                       cast_model_outputs)
            self._check_bounds(min_loss_scale, max_loss_scale)
        config = Config(props, num_losses, min_loss_scale, max_loss_scale)
        new_models, new_opts, again = self._classify(model_list, opt_list, config)
        if props is not None and (props.cast_model_type not in (None, torch.float32)
                                  or props.master_weights):
            for m in new_models:
                if any(is_dtensor(p) for p in m.parameters()):
                    raise AmpError(
                        f"opt_level {opt_level} casts the model and/or keeps float32 master "
                        f"weights, but the model's params are DTensors (FSDP2 fully_shard), "
                        f"whose dtypes FSDP2 manages itself: use O1 or O4 (autocast) with "
                        f"fully_shard, or fully_shard's mp_policy "
                        f"(fmp.distributed.fsdp_mixed_precision)")
        if again:
            LOGGER.warning("amp.initialize: %s passed through initialize before with the "
                           "same settings; returned unchanged", ", ".join(again))
            if not new_models and not new_opts and (opt_list or self._session is not None):
                sessions = {id(s): s for s in (self._session_of(o) for o in opt_list)
                            if s is not None}
                if len(sessions) == 1:
                    self._session = next(iter(sessions.values()))
                return result()
        scalers: list[LossScaler] = []
        if props is not None:
            device = _first_device(model_list)
            scalers = [LossScaler(i, props.loss_scale, min_loss_scale, max_loss_scale,
                                  self.scale_window, device, log)
                       for i in range(num_losses)]
        session = Session(self, config, model_list, scalers, log)
        loads: list[tuple[LossScaler, tuple[float, int]]] = []
        if self._pending_state is not None and props is not None:
            loads = self._check_state(self._pending_state, scalers)

        # Validated: from here on, change things.
        if self._session is not None and self._session.enabled:
            log.always("amp.initialize called again on this Amp: amp.state_dict(), "
                       "amp.loss_scale() and amp.autocast() now follow this call, and its "
                       "loss scalers serve the optimizers of earlier calls too (as in Apex)")
        self._log = log
        self._session = session
        if props is None:
            for o in new_opts:
                setattr(o, DISABLED_MARK, session)
            return result()
        log.always(f"adapters.apex amp: selected optimization level {opt_level}: "
                   f"{props.describe()}")
        for m in new_models:
            self._setup_model(m, props)
            setattr(m, MODEL_MARK, props)
        for o in new_opts:
            if hasattr(o, DISABLED_MARK):
                delattr(o, DISABLED_MARK)
            rec = OptimizerRecord(o, props.master_weights, session.device_type,
                                  self._on_skip)
            rec.session = session
            session.records.append(rec)
        for scaler, values in loads:
            scaler.apply_state(*values)
        self._pending_state = None
        # [amp14a] Apex's O1 casts (a torch function mode): on at O1/O4, off otherwise
        _o1.follow(self, props, session.device_type(), self._registry, new_opts,
                   verbose=log.verbosity == 2)
        return result()

    def _classify(self, models: list[torch.nn.Module], opts: list[torch.optim.Optimizer],
                  config: Config) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer],
                                           list[str]]:
        """Split the arguments into new ones and ones initialized before (checked)."""
        props = config.properties
        new_models, new_opts, again = [], [], []
        for i, m in enumerate(models):
            prev = m.__dict__.get(MODEL_MARK)
            if prev is None:
                new_models.append(m)
                continue
            if props is None:  # enabled=False leaves the model as it is
                continue
            if prev != props:
                diff = Config(prev, 1, None, 0).differences(Config(props, 1, None, 0))
                raise AmpError(
                    f"model {i} ({type(m).__name__}) was already initialized at opt_level "
                    f"{prev.opt_level} with other settings ({'; '.join(diff)}); amp cannot "
                    f"re-initialize a model at another level (its weights were cast): "
                    f"rebuild the model (and its optimizer) and initialize those")
            again.append(f"model {i} ({type(m).__name__})")
        for i, o in enumerate(opts):
            rec = getattr(o, "_amp_stash", None)
            if rec is None:
                new_opts.append(o)
                continue
            session = getattr(rec, "session", None)
            if not isinstance(rec, OptimizerRecord) or session is None or \
                    session.owner is not self:
                raise AmpError(
                    f"optimizer {i} ({type(o).__name__}) was passed through the initialize "
                    f"of another Amp (or by Apex) before; a given optimizer may be "
                    f"initialized only once per Amp, it cannot move (initialize twice "
                    f"across Amp objects): make a new optimizer, or use that Amp")
            if session.config != config:
                diff = session.config.differences(config)
                raise AmpError(
                    f"optimizer {i} ({type(o).__name__}) was already initialized with other "
                    f"settings ({'; '.join(diff)}); amp cannot re-initialize an optimizer "
                    f"with new settings: make a new optimizer (and model) and initialize "
                    f"those, or pass the same settings again")
            again.append(f"optimizer {i} ({type(o).__name__})")
        return new_models, new_opts, again

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
        optimizer = _unwrap_larc(optimizer)
        rec = getattr(optimizer, "_amp_stash", None)
        if isinstance(rec, OptimizerRecord) and self._session_of(optimizer) is not None:
            return rec
        if isinstance(rec, OptimizerRecord):
            raise AmpError(f"optimizer {type(optimizer).__name__} was initialized by another "
                           f"Amp object; use the scale_loss of that Amp")
        raise AmpError(f"optimizer {type(optimizer).__name__} was not passed through "
                       f"initialize of this Amp; pass every optimizer to amp.initialize")

    def _optimizer_list(self, optimizers: Any) -> list[torch.optim.Optimizer]:
        optimizers = _unwrap_larc(optimizers)
        if isinstance(optimizers, torch.optim.Optimizer):
            return [optimizers]
        if isinstance(optimizers, list | tuple) and optimizers and \
                all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            return list(optimizers)
        raise AmpError(f"scale_loss needs an optimizer or a non-empty list of optimizers (the "
                       f"ones owning the params this backward reaches), got {optimizers!r}")

    def _session_for(self, opts: list[torch.optim.Optimizer]) -> Session:
        """The one session the optimizers of a scale_loss call belong to."""
        found = [self._session_of(o) for o in opts]
        if all(s is None for s in found) and self._session is not None and \
                not self._session.enabled:
            return self._session  # Apex: amp disabled, scale_loss passes the loss through
        for o, s in zip(opts, found, strict=True):
            if s is None:
                self._record(o)  # raises the precise error
        sessions = {id(s): s for s in found}
        if len(sessions) > 1:
            raise AmpError("scale_loss got optimizers from different amp.initialize calls, "
                           "which keep separate settings; call scale_loss once per "
                           "initialize call (or initialize them together)")
        session = found[0]
        assert session is not None
        return session

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
            AmpError: before initialize, no optimizer (``[]``), ``loss_id`` out of range,
                an optimizer that this Amp did not initialize, or optimizers of different
                ``initialize`` calls (they keep separate settings).

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
        opts = self._optimizer_list(optimizers)
        session = self._session_for(opts)
        if not session.enabled:
            yield loss
            return
        recs = [self._record(o) for o in opts]
        scalers = session.loss_scalers
        latest = self._session
        if latest is not None and latest is not session and latest.enabled:
            scalers = latest.loss_scalers  # Apex: each initialize replaced the (global) scalers
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) or \
                not 0 <= loss_id < len(scalers):
            raise AmpError(f"loss_id={loss_id!r} is out of range: initialize was called with "
                           f"num_losses={len(scalers)}, so 0 <= loss_id < {len(scalers)}")
        scaler = scalers[loss_id]
        props = session.properties
        assert props is not None
        if not props.master_weights and scaler.static_value == 1.0:
            yield loss.float()
            _clear_cast_cache()
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
        _clear_cast_cache()
        if delay_unscale:
            for rec in recs:
                rec.has_scaled_grads = True
            return
        found_inf = torch.zeros((), dtype=torch.float32, device=scaler.loss_scale.device)
        meshes: list[Any] = []
        for rec in recs:
            for mesh in rec.post_backward(scaler.record, found_inf):
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
        optimizer = _unwrap_larc(optimizer)
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
            AmpError: not a dict; a key that is not ``loss_scaler<N>`` (all such keys are
                named) or two keys naming one scaler (``loss_scaler0``, ``loss_scaler00``);
                an entry that is not ``{"loss_scale": number, "unskipped": int}``; a scale
                different from the fixed scale of this opt level (a dynamic-scale
                checkpoint loaded at O3, say). Nothing is loaded then; before initialize,
                the entries are checked by initialize, which then changes nothing.

        Example:
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
