"""``Amp.scale_loss``: scale the loss; on exit unscale, check, move the scale, maybe skip.

Part of :class:`~adapters.apex.amp.Amp` (a mixin). The optimizers of one call must come
from one ``initialize`` (one :class:`~adapters.apex.amp._session.Session`); under FSDP2 or
with a ``process_group`` the overflow verdict is all-reduced so every rank skips together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import fmp.distributed as fd
from adapters.apex.amp import _o1_install as _o1
from adapters.apex.amp._errors import AmpError
from adapters.apex.amp._optimizer import unwrap_larc
from adapters.apex.amp._session import Session


def _clear_cast_cache() -> None:
    # As Apex at the end of each scale_loss: the O1 casts of params are made again after
    # it (a write through .data, which torch does not count as a new version, is then seen)
    mode = _o1.current()
    if mode is not None:
        mode.clear_cache()


class ScaleLossMixin:
    """``scale_loss`` and its argument checks (a part of :class:`~adapters.apex.amp.Amp`)."""

    def _optimizer_list(self, optimizers: Any) -> list[torch.optim.Optimizer]:
        optimizers = unwrap_larc(optimizers)
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
            >>> from adapters.apex.amp import Amp
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

