"""Run a module's forward with other tensors in its parameter and buffer slots, fast.

``torch.func.functional_call`` resolves every name to its submodule, checks it and swaps
it in, and on exit swaps everything back: on ResNet-50's 320 tensors about 1.9 ms of host
time before the forward's first kernel (2-core CPU), which a step synced each iteration
pays as GPU idle time. :class:`Slots` resolves the names once per module and, per call,
writes the given tensors into the slots' dicts directly (what torch's own swap does), tied
names all at once. Before each call it checks that the module still is what it resolved
(every submodule and tensor where it found them); if not, it resolves again.

Anything the fast path does not take (a name the module lacks, a non-tensor value, two
different tensors for tied names) goes through ``functional_call``, for its behaviour and
errors. Under torch.compile it is what dynamo traces too (a third of functional_call's
lines to trace on GPT-2: 7.7k against 20.5k, loss graph 3.7 s against 4.8 s on CPU); inside
torch.func transforms, callers use ``functional_call`` (see fmp/functional.py).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
from torch.func import functional_call

_Slot = tuple[dict[str, Any], str]

#: sets of names whose plans a Slots keeps (a step gives one or two: params, buffers)
_PLANS_KEPT = 8


class Slots:
    """Where each parameter and buffer of ``model`` lives, resolved once.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> w = {"weight": torch.zeros(1, 2), "bias": torch.ones(1)}
        >>> Slots(net).call(w, None, (torch.ones(1, 2),), {})
        tensor([1.])
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._resolve()

    def _resolve(self) -> None:
        owners: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        names: dict[str, int] = {}
        for prefix, mod in self.model.named_modules(remove_duplicate=False):
            pre = f"{prefix}." if prefix else ""
            for d in (mod._parameters, mod._buffers):
                for k, t in d.items():
                    if t is None:
                        continue
                    owners.append((d, k, t))
                    names[pre + k] = id(t)
        slots: dict[int, list[_Slot]] = {}
        placed: set[tuple[int, str]] = set()  # a shared submodule's slot, under two names
        for d, k, t in owners:
            if (id(d), k) not in placed:
                placed.add((id(d), k))
                slots.setdefault(id(t), []).append((d, k))
        self._where = {n: (g, slots[g]) for n, g in names.items()}
        # every slot dict of every module: their keys and values, to see a change in two
        # list comparisons (a submodule, param or buffer replaced, added or removed)
        mods = list(self.model.named_modules())
        self._dicts = [d for _, m in mods for d in (m._modules, m._parameters, m._buffers)]
        self._keys, self._vals = self._contents()
        self._modules = mods
        self._buffers = list(self.model.named_buffers())
        self._plans: dict[tuple[tuple[str, ...], tuple[str, ...]], Any] = {}

    def _contents(self) -> tuple[list[Any], list[Any]]:
        return (list(itertools.chain.from_iterable(self._dicts)),
                list(itertools.chain.from_iterable(map(dict.values, self._dicts))))

    def _intact(self) -> bool:
        keys, vals = self._contents()
        return (len(vals) == len(self._vals) and keys == self._keys
                and all(map(operator.is_, vals, self._vals)))

    def ensure(self) -> None:
        """Resolve again if the module changed since it was resolved."""
        if not self._intact():
            self._resolve()

    def named_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """``list(model.named_modules())`` as of the last :meth:`ensure`."""
        return self._modules

    def named_buffers(self) -> dict[str, torch.Tensor]:
        """``dict(model.named_buffers())`` as of the last :meth:`ensure`."""
        return dict(self._buffers)

    def call(self, params: dict[str, Any], buffers: dict[str, Any] | None,
             args: tuple[Any, ...], kwargs: dict[str, Any], write_back: bool = False,
             checked: bool = False) -> Any:
        """``functional_call(model, (params, buffers), args, kwargs, tie_weights=True,
        strict=False)``. With ``write_back``, a buffer the forward replaces (assigns
        instead of updating in place) is written into ``buffers``, as torch does for a
        single dict it is given. ``checked``: :meth:`ensure` ran since the module last
        changed."""
        if not checked:
            self.ensure()
        plan = self._plan(params, buffers)
        if plan is None:
            return functional_call(self.model, (params, buffers or {}), args, kwargs,
                                   tie_weights=True, strict=False)  # (no write back)
        done: list[tuple[dict[str, Any], str, Any, Any]] = []
        try:
            for slots, value, _ in plan:
                for d, k in slots:
                    done.append((d, k, d[k], value))
                    d[k] = value
            return self.model(*args, **kwargs)
        finally:
            now = [d[k] for d, k, _, _ in done]  # what the forward left in each slot
            for d, k, orig, _ in reversed(done):
                d[k] = orig
            if write_back and buffers is not None:
                i = 0
                for slots, value, name in plan:
                    cur = now[i]
                    i += len(slots)
                    if cur is not value and name in buffers:
                        buffers[name] = cur

    def _plan(self, params: dict[str, Any], buffers: dict[str, Any] | None
              ) -> list[tuple[list[_Slot], Any, str]] | None:
        """The slots to fill, or None where functional_call must decide.

        What depends on the names alone (which slots, which names are tied, which the
        module lacks) is worked out once per set of names; each call checks the values."""
        buffers = buffers or {}
        if torch.compiler.is_compiling():
            # traced, the cache would be guarded on: its key absent at the first trace and
            # present after it, the loss graph would recompile on the second call
            shape = self._plan_names(params, buffers)
        else:
            key = (tuple(params), tuple(buffers))
            shape = self._plans.get(key)
            if shape is None:
                if len(self._plans) >= _PLANS_KEPT:  # callers whose names vary call by call
                    self._plans.clear()
                shape = self._plans[key] = self._plan_names(params, buffers)
        if shape is False:
            return None
        firsts, ties = shape
        vals = [*params.values(), *buffers.values()]
        if not all(map(isinstance, vals, itertools.repeat(torch.Tensor))):
            return None
        if any(vals[i] is not vals[j] for i, j in ties):
            return None  # tied names given apart: functional_call's error
        return [(slots, vals[i], name) for i, slots, name in firsts]

    def _plan_names(self, params: dict[str, Any], buffers: dict[str, Any]) -> Any:
        """``(firsts, ties)`` for these names: ``firsts`` the (value index, slots, name) of
        the first name of each tied group, ``ties`` the (first, other) value indices that
        must be one tensor; False where functional_call must decide."""
        firsts: list[tuple[int, list[_Slot], str]] = []
        ties: list[tuple[int, int]] = []
        first_of: dict[int, int] = {}
        names = [(n, False) for n in params] + [(n, True) for n in buffers]
        for i, (name, is_buffer) in enumerate(names):
            hit = self._where.get(name)
            if hit is None or (is_buffer and name in params):
                return False
            g, slots = hit
            if g in first_of:
                ties.append((first_of[g], i))
                continue
            first_of[g] = i
            firsts.append((i, slots, name))
        return firsts, ties
