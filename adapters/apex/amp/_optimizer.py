"""The adapter's hold on one optimizer: stashed grads, the skip flag and the patched methods.

``initialize`` patches ``step``, ``zero_grad`` and ``add_param_group`` on the optimizer
*instance* (bound methods, so ``torch.optim.lr_scheduler`` can wrap them as usual):

- ``step`` is skipped after an overflow (one shot), refuses closures, runs with autocast
  disabled, and under master weights copies the masters back into the model (first
  taking the value of model params written since: ``MasterWeights.sync_from_model``). With a
  fused torch optimizer (``fused=True``) the overflow flag is handed to the kernel as
  ``found_inf`` and the step is skipped on the device, without a host sync.
- ``zero_grad`` also clears the model params' grads under master weights.
- ``add_param_group`` gives the new group masters under master weights.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

import torch

import fmp.distributed
from adapters.apex.amp._errors import AmpError
from adapters.apex.amp._master import MasterWeights, is_low_precision

is_dtensor = fmp.distributed.is_dtensor


def unwrap_larc(objs: Any) -> Any:
    """``objs`` with each Apex ``LARC`` wrapper replaced by the optimizer it wraps (amp
    patches that one; LARC's ``step``/``zero_grad`` call it, as in Apex)."""
    from adapters.apex.parallel.LARC import LARC

    if isinstance(objs, LARC):
        return objs.optim
    if isinstance(objs, list | tuple):
        return type(objs)(o.optim if isinstance(o, LARC) else o for o in objs)
    return objs


def _all_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _match_state_dtypes(optimizer: torch.optim.Optimizer) -> None:
    """Cast floating optimizer state to its param's dtype (the model may have been cast).

    This is what ``Optimizer.load_state_dict`` does, so state loaded before initialize
    ends up as if it had been loaded after.
    """
    for p in _all_params(optimizer):
        st = optimizer.state.get(p)
        if not st:
            continue
        for k, v in st.items():
            if (k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point()
                    and p.is_floating_point() and v.dtype != p.dtype):
                st[k] = v.to(p.dtype)


class OptimizerRecord:
    """What the adapter knows about one optimizer (also reachable as ``optimizer._amp_stash``).

    Args:
        optimizer: the optimizer (patched in place).
        master_weights: give its low-precision params float32 masters.
        device_type: a callable returning the device type the model runs on (for
            disabling autocast around ``step``).
        on_skip: called with this record when a step is skipped.

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        >>> rec = OptimizerRecord(opt, False, lambda: "cpu", lambda r: None)
        >>> opt._amp_stash is rec
        True
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool,
                 device_type: Callable[[], str], on_skip: Callable[[OptimizerRecord], None]
                 ) -> None:
        self.optimizer = optimizer
        self.device_type = device_type
        self.on_skip = on_skip
        self.fused = bool(optimizer.defaults.get("fused")) and getattr(
            optimizer, "_step_supports_amp_scaling", False)
        self.masters = MasterWeights(optimizer) if master_weights else None
        _match_state_dtypes(optimizer)
        self.skip_next = False
        self.found_inf: torch.Tensor | None = None
        self.last_skipped: bool | torch.Tensor = False
        self.has_scaled_grads = False
        self.warned_scaled = False
        self._stash: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._orig_step = optimizer.step
        self._orig_zero_grad = optimizer.zero_grad
        self._orig_add_param_group = optimizer.add_param_group
        optimizer.step = types.MethodType(_step, optimizer)  # type: ignore[method-assign]
        optimizer.zero_grad = types.MethodType(_zero_grad, optimizer)  # type: ignore[method-assign]
        optimizer.add_param_group = types.MethodType(  # type: ignore[method-assign]
            _add_param_group, optimizer)
        optimizer._amp_stash = self  # type: ignore[attr-defined]

    # ----------------------------------------------------------------------------------
    def prepare_backward(self) -> None:
        """On ``scale_loss`` entry: set the current grads aside so new ones unscale alone.

        Under master weights the model params' grads are dropped (what they held was
        already unscaled into the masters' grads, which stay as the accumulator).
        """
        if self.masters is not None:
            self.masters.sync_from_model()
        if self.has_scaled_grads:
            return
        master_of_model = set(self.masters.model_of.values()) if self.masters else set()
        for p in master_of_model:
            p.grad = None
        self._stash = []
        for p in _all_params(self.optimizer):
            if self.masters is not None and p in self.masters.model_of:
                continue
            self._stash.append((p, p.grad))
            p.grad = None

    def restore_stash(self) -> None:
        """Put the set-aside grads back (the body of ``scale_loss`` raised)."""
        for p, s in self._stash:
            if s is not None:
                p.grad = s if p.grad is None else p.grad + s
        self._stash = []

    def post_backward(self, record: Any, found_inf: torch.Tensor) -> list[Any]:
        """On ``scale_loss`` exit: unscale the new grads (fused check) and add the stash.

        ``record`` (the loss scale the grads were scaled by) unscales them in place and
        raises ``found_inf`` on inf/NaN (``record.unscale_and_check_``).

        DTensor grads (FSDP2) are unscaled and checked through their local shards, so
        ``found_inf`` is this rank's verdict only; the device meshes of such grads are
        returned (distinct, in order) for the caller to all-reduce the verdict over.
        """
        new: list[torch.Tensor] = []
        meshes: list[Any] = []

        def local(g: torch.Tensor) -> torch.Tensor:
            if not is_dtensor(g):
                return g
            if not any(g.device_mesh is m for m in meshes):
                meshes.append(g.device_mesh)
            return g.to_local()

        targets: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        if self.masters is not None:
            pairs = [(master, model_p.grad) for master, model_p in self.masters.model_of.items()
                     if model_p.grad is not None]
            if any(g.is_sparse for _, g in pairs):
                raise AmpError("sparse gradients are not supported with master weights")
            for (master, _), g32 in zip(pairs, _float32_copies([g for _, g in pairs]),
                                        strict=True):
                new.append(local(g32))
                targets.append((master, master.grad, g32))
        stashed = {id(p): s for p, s in self._stash}
        for p in _all_params(self.optimizer):
            if self.masters is not None and p in self.masters.model_of:
                continue
            g = p.grad
            s = stashed.get(id(p))
            if g is None:
                if s is not None:
                    p.grad = s
                continue
            new.append(g._values() if g.is_sparse else local(g))
            if s is not None:
                targets.append((p, s, g))
        with torch.no_grad():
            record.unscale_and_check_(new, found_inf)
            for p, old, g in targets:
                if p in (self.masters.model_of if self.masters else ()):
                    if old is None:
                        p.grad = g
                    else:
                        old.add_(g)
                else:
                    g.add_(old)
        self._stash = []
        self.has_scaled_grads = False
        return meshes

    def flag_overflow(self, found_inf: torch.Tensor | None, skip: bool) -> None:
        """Record an exit's verdict: a host ``skip`` flag, or a device ``found_inf``."""
        if skip:
            self.skip_next = True
        if found_inf is not None:
            self.found_inf = found_inf if self.found_inf is None else torch.maximum(
                self.found_inf, found_inf)

    def was_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped (reads a device flag: may sync)."""
        if isinstance(self.last_skipped, torch.Tensor):
            self.last_skipped = bool(self.last_skipped.item() != 0)
        return self.last_skipped

    def _fused_safe(self) -> bool:
        """torch's fused SGD leaves a garbage momentum buffer when its first step is skipped."""
        opt = self.optimizer
        if not isinstance(opt, torch.optim.SGD):
            return True
        for group in opt.param_groups:
            if group.get("momentum", 0) != 0:
                for p in group["params"]:
                    if p.grad is not None and "momentum_buffer" not in opt.state.get(p, {}):
                        return False
        return True


def _float32_copies(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 copies of the model's half grads, each in its grad's layout.

    One multi-tensor copy kernel (torch's ``_foreach_copy_`` converts dtypes) instead of a
    cast per tensor: at the end of a step the GPU waits on those launches (ResNet-50 has
    161). DTensor grads (FSDP2) are cast one by one.
    """
    if any(is_dtensor(g) for g in grads):
        return [g.detach().to(torch.float32) for g in grads]
    out = [torch.empty_like(g, dtype=torch.float32) for g in grads]
    if out:
        with torch.no_grad():
            fmp.copy_tree_(out, [g.detach() for g in grads])
    return out


def _step(self: torch.optim.Optimizer, closure: Any = None, *args: Any, **kwargs: Any) -> Any:
    rec: OptimizerRecord = self._amp_stash  # type: ignore[attr-defined]
    if closure is not None:
        raise AmpError("adapters.apex: optimizer.step(closure) is not supported after "
                       "amp.initialize (Apex did not support it either); call the closure "
                       "yourself inside amp.scale_loss, then optimizer.step()")
    if rec.has_scaled_grads and not rec.warned_scaled:
        rec.warned_scaled = True
        from adapters.apex.amp._log import LOGGER
        LOGGER.warning("optimizer.step() after scale_loss(..., delay_unscale=True) without a "
                       "later scale_loss that unscales: the gradients are still scaled")
    found_inf, rec.found_inf = rec.found_inf, None
    if found_inf is not None and not (rec.fused and rec._fused_safe()):
        rec.skip_next = rec.skip_next or bool(found_inf.item() != 0)
        found_inf = None
    if rec.skip_next:
        rec.skip_next = False
        rec.last_skipped = True
        if rec.masters is not None:
            rec.masters.drop_master_grads()
        rec.on_skip(rec)
        return None
    if rec.masters is not None:
        rec.masters.sync_from_model()
    device_type = rec.device_type()
    ctx = (torch.autocast(device_type, enabled=False)
           if torch.is_autocast_enabled(device_type) else contextlib.nullcontext())
    with ctx:
        if found_inf is not None:
            had = hasattr(self, "grad_scale")
            if not had:
                self.grad_scale = None  # type: ignore[attr-defined]
            self.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                ret = rec._orig_step(*args, **kwargs)
            finally:
                del self.found_inf  # type: ignore[attr-defined]
                if not had:
                    del self.grad_scale  # type: ignore[attr-defined]
            rec.last_skipped = found_inf
        else:
            ret = rec._orig_step(*args, **kwargs)
            rec.last_skipped = False
    if rec.masters is not None:
        rec.masters.copy_to_model()
        rec.masters.drop_master_grads()
    return ret


def _zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    rec: OptimizerRecord = self._amp_stash  # type: ignore[attr-defined]
    rec._orig_zero_grad(set_to_none)
    if rec.masters is not None:
        rec.masters.zero_model_grads(set_to_none)
        rec.masters.drop_master_grads()


def _add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
    rec: OptimizerRecord = self._amp_stash  # type: ignore[attr-defined]
    rec._orig_add_param_group(param_group)
    if rec.masters is not None and any(is_low_precision(p) for p in
                                       self.param_groups[-1]["params"]):
        rec.masters.adopt_group(self.param_groups[-1])
