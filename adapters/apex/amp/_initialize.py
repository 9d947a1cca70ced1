"""``Amp.initialize``: check everything, then cast the models and patch the optimizers.

Part of :class:`~adapters.apex.amp.Amp` (a mixin): the arguments are validated first (a
call that raises changes nothing), each call makes a
:class:`~adapters.apex.amp._session.Session`, and the O1/O4 casts follow the latest call
(:func:`~adapters.apex.amp._o1_install.follow`, then the owner's function registry).
"""

from __future__ import annotations

from typing import Any

import torch

import fmp
from adapters.apex.amp import _functions
from adapters.apex.amp import _o1_install as _o1
from adapters.apex.amp._errors import AmpError
from adapters.apex.amp._log import LOGGER, RateLimitedLog
from adapters.apex.amp._model import WrappedForward, cast_model, register_fp32_state_dict
from adapters.apex.amp._opt_levels import Properties, resolve_properties
from adapters.apex.amp._optimizer import OptimizerRecord, is_dtensor, unwrap_larc
from adapters.apex.amp._scaler import LossScaler
from adapters.apex.amp._session import DISABLED_MARK, MODEL_MARK, Config, Session

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


class InitializeMixin:
    """``initialize`` and its checks (a part of :class:`~adapters.apex.amp.Amp`)."""

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
        O0: float32. O1: torch functions cast by Apex's lists, wherever they are called
        (a torch function mode, ``_o1_mode``), dynamic loss scale. O2: model cast to
        float16 (batch-norm kept float32), float32 master weights in the optimizer,
        dynamic scale. O3: pure float16, scale 1. O4/O5: the
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
            >>> from adapters.apex.amp import Amp
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
            opt_list, one_opt = _as_list(unwrap_larc(optimizers), torch.optim.Optimizer,
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
        mode = _o1.follow(self, props, session.device_type(), new_opts,
                          verbose=log.verbosity == 2)
        if mode is not None:
            _functions.apply_registry(mode, self._registry)
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

