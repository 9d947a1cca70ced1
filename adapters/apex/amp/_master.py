"""Float32 master weights (O2/O5): they replace the low-precision params in the optimizer.

The optimizer's ``param_groups`` hold float32 copies of the model's float16/bfloat16
parameters; the model params are refreshed from them after every real step. The masters
travel in ``optimizer.state_dict()`` (per-param key ``"fmp_master"``), so a checkpoint
resumes bit-exactly, whether the optimizer state is loaded before or after initialize.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

import fmp

#: The per-param key under which ``optimizer.state_dict()`` carries a master's value.
MASTER_KEY = "fmp_master"


#: Whether tensors carry the (private) version counter; without it every sync compares.
_HAS_VERSION = isinstance(getattr(torch.empty(0), "_version", None), int)


def _stamps(params: Iterable[torch.Tensor]) -> list[tuple[int, int]] | None:
    """What changes when a param is written: its version counter and its data's address."""
    if not _HAS_VERSION:
        return None
    return [(p._version, p.data_ptr()) for p in params]


def is_low_precision(p: torch.Tensor) -> bool:
    """True for floating tensors narrower than float32 (float16, bfloat16, float8...)."""
    return p.is_floating_point() and p.element_size() < 4


class MasterWeights:
    """The masters of one optimizer and the model params they shadow.

    Args:
        optimizer: the optimizer whose low-precision params get masters (its
            ``param_groups`` are edited in place, its state moved to the masters).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> mw = MasterWeights(opt)
        >>> opt.param_groups[0]["params"][0].dtype
        torch.float32
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._incoming: dict[int, torch.Tensor] = {}
        self.model_of: dict[torch.Tensor, torch.Tensor] = {}  # master -> model param
        # (version, data_ptr) of each model param (in model_of's order) when it last
        # agreed with its master; masters beyond its length are compared by value at the
        # next sync (see sync_from_model)
        self._seen: list[tuple[int, int]] = []
        for group in optimizer.param_groups:
            self.adopt_group(group)
        optimizer.register_state_dict_post_hook(self._state_dict_hook)
        optimizer.register_load_state_dict_pre_hook(self._load_pre_hook)
        optimizer.register_load_state_dict_post_hook(self._load_state_dict_hook)

    # ----------------------------------------------------------------------------------
    def adopt_group(self, group: dict[str, Any]) -> None:
        """Replace the low-precision params of ``group`` by float32 masters.

        A master takes its value from optimizer state loaded before initialize (key
        ``"fmp_master"``) when there is one, else from the model param. The param's
        optimizer state moves to the master (floating entries other than ``step`` are
        cast to float32, as ``Optimizer.load_state_dict`` would).
        """
        state = self.optimizer.state
        params = group["params"]
        for i, p in enumerate(params):
            if not is_low_precision(p):
                continue
            st = state.pop(p, None)
            saved = st.pop(MASTER_KEY, None) if st else None
            with torch.no_grad():
                value = (saved if saved is not None else p.detach()).to(
                    device=p.device, dtype=torch.float32).clone()
            master = torch.nn.Parameter(value, requires_grad=p.requires_grad)
            params[i] = master
            self.model_of[master] = p
            if st:  # (an entry left empty by popping the master is dropped)
                state[master] = {
                    k: (v.to(torch.float32) if k != "step" and isinstance(v, torch.Tensor)
                        and v.is_floating_point() else v)
                    for k, v in st.items()
                }

    @property
    def masters(self) -> list[torch.Tensor]:
        """The masters, in the order they were made."""
        return list(self.model_of)

    @property
    def model_params(self) -> list[torch.Tensor]:
        """The low-precision model params, in the order of :attr:`masters`."""
        return list(self.model_of.values())

    def copy_to_model(self) -> None:
        """Copy every master into its model param (rounded to the param's dtype)."""
        if self.model_of:
            with torch.no_grad():
                fmp.copy_tree_(self.model_params, self.masters)
            self._seen = _stamps(self.model_of.values()) or []

    def sync_from_model(self) -> int:
        """Make the masters follow model params that were written since they last agreed.

        Apex made the masters lazily, at the first backward, from the model as it was then
        (after ``model.load_state_dict``, after DDP's broadcast from rank 0). Here they
        exist from ``initialize`` on, so they are checked instead: a master made (or
        loaded) since the last check is compared by value with its model param; later,
        only masters whose model param was written in place since (its version counter or
        storage moved: ``load_state_dict``, a broadcast, ``p.copy_``) are compared. A
        model param that no longer equals its master rounded to the param's dtype gives
        the master its value. Masters that still agree keep their extra bits (exact
        resume stays exact). One host sync when something is compared, none otherwise.

        Returns:
            How many masters took the model's value.
        """
        now = _stamps(self.model_of.values())
        seen = self._seen
        if now is not None and now == seen:
            return 0
        pairs = [(m, p) for i, (m, p) in enumerate(self.model_of.items())
                 if now is None or i >= len(seen) or seen[i] != now[i]]
        if not pairs:
            return 0
        with torch.no_grad():
            differ = torch.stack([
                torch.ne(p, m.to(device=p.device, dtype=p.dtype)).any()
                if p.shape == m.shape else torch.ones((), dtype=torch.bool, device=p.device)
                for m, p in pairs]).tolist()
            n = 0
            for (m, p), d in zip(pairs, differ, strict=True):
                if d:
                    m.copy_(p.detach().to(torch.float32))
                    n += 1
        self._seen = now or []
        return n

    def drop_master_grads(self) -> None:
        """Set the masters' grads to None (after a step, real or skipped)."""
        for m in self.model_of:
            m.grad = None

    def zero_model_grads(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the model params' grads, as ``optimizer.zero_grad`` does for its own."""
        for p in self.model_of.values():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    # ----------------------------------------------------------------------------------
    def _indices(self) -> Iterable[tuple[int, torch.Tensor]]:
        """(state-dict index, param) over the param groups, as ``Optimizer.state_dict``."""
        seen: dict[int, int] = {}
        start = 0
        for group in self.optimizer.param_groups:
            for j, p in enumerate(group["params"], start):
                if id(p) not in seen:
                    seen[id(p)] = j
                    yield j, p
            start += len(group["params"])

    def _state_dict_hook(self, optimizer: torch.optim.Optimizer,
                         state_dict: dict[str, Any]) -> dict[str, Any]:
        # A master is saved where the param has optimizer state, or where it holds more
        # than its model param (a stateless optimizer such as plain SGD). A param with
        # neither was never stepped: its master equals the model param, nothing to save.
        # (Adam-like optimizers refuse a per-param entry without "step" on load.)
        self.sync_from_model()
        state = dict(state_dict["state"])
        for j, p in self._indices():
            model_p = self.model_of.get(p)
            if model_p is None:
                continue
            if state.get(j) or not torch.equal(p, model_p.float()):
                # A new dict: the packed state shares its per-param dicts with the optimizer.
                state[j] = {**state.get(j, {}), MASTER_KEY: p.detach().clone()}
        state_dict["state"] = state
        return state_dict

    def _load_pre_hook(self, optimizer: torch.optim.Optimizer,
                       state_dict: dict[str, Any]) -> dict[str, Any]:
        state = {}
        self._incoming = {}
        for j, st in state_dict["state"].items():
            if isinstance(st, dict) and MASTER_KEY in st:
                st = dict(st)
                self._incoming[j] = st.pop(MASTER_KEY)
                if not st:
                    continue
            state[j] = st
        return {**state_dict, "state": state}

    def _load_state_dict_hook(self, optimizer: torch.optim.Optimizer) -> None:
        incoming = getattr(self, "_incoming", {})
        self._incoming = {}
        with torch.no_grad():
            for j, p in self._indices():
                model_p = self.model_of.get(p)
                if model_p is None:
                    continue
                saved = incoming.get(j)
                # without a saved master: rebuild it from the model param (as Apex did)
                p.copy_(saved if saved is not None else model_p)
        self.copy_to_model()
