"""Apex's O1, as a ``torch.overrides.TorchFunctionMode``: casts by Apex's lists, everywhere.

After ``amp.initialize(..., opt_level="O1")`` (``"O4"``: bfloat16) or ``amp.init()``, every
torch function the program calls (in any module's forward, a head or criterion in the
loop, functional code, tensor methods and operators) goes through :class:`O1Mode`, which
applies Apex's lists (:mod:`adapters.apex.amp._o1_lists`) to the floating tensors on the
amp device (the device type of the initialized model; Apex: CUDA):

- half list (``mm``, ``matmul``, ``@``, ``F.linear``, convolutions, RNN cells...): every
  floating argument to the low dtype; the output stays low.
- float list (``softmax``, ``layer_norm``, losses, ``exp``, ``sum``, ``pow``...): to float32.
- promote (``add``, ``mul``, ``atan2``, comparisons, operators...): a mix of the low dtype
  and float32 goes to float32 (a half tensor times a float32 0-d tensor gives float32).
- sequence promote (``cat``, ``stack``): the same over the sequence.
- in place: ``x.exp_()`` (float list) on a half ``x`` raises ``NotImplementedError``, as does
  ``torch.exp_`` with any half argument; other in-place methods (``add_``, ``x += y``...)
  cast their arguments to ``x``'s dtype.
- ``F.binary_cross_entropy`` / ``nn.BCELoss`` with a half argument raises
  ``NotImplementedError`` unless ``amp.init(allow_banned=True)`` (then float32).
- ``nn.LSTM``/``GRU``/``RNN`` (packed sequences too) and their cells run in half.
- ``Tensor.cpu()`` of a half CUDA tensor gives float32.
- casts of float32 ``nn.Parameter`` s to half are cached (``enable_caching``).

``amp.disable_casts()`` turns it off inside; ``optimizer.step()`` of an initialized
optimizer runs with casts off (as in Apex); ``register_*_function`` add rules.
While the casts are off the mode leaves this thread's mode stack (and comes back to its
place after, :mod:`adapters.apex.amp._o1_stack`), so those regions, and torch's own
``Optimizer.zero_grad`` (which calls nothing on the lists), cost no Python call per torch
call; functions on no list return from the handler at once.

Differences from Apex that remain:

1. Apex cast CUDA tensors only; here the amp device is the device type of the model at
   ``initialize`` (``amp.init``: CUDA when available, else the CPU), so a CPU model gets
   O1 on the CPU. Tensors on other devices are left alone.
2. The mode is thread-local (torch function modes are): threads started by the program
   (``nn.DataParallel`` replicas, Python ``autograd.Function.backward`` on autograd
   threads) run without casts. Apex patched the functions globally.
3. Functions nested inside a torch function the mode passes through are not seen: e.g.
   inside ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) the linears run
   in the dtype of their inputs (Apex's patched ``F.linear`` was cast there).
4. A promote between dtypes other than {low, float32} (e.g. float32 with float64) is left
   to torch's type promotion; Apex raised ``NotImplementedError``.
5. Operators reach the mode as methods (``a - b`` is ``Tensor.sub``), so ``x.sub(y)``
   promotes like ``x - y``; ``x += y``, ``x **= 2`` are the in-place methods (``add_``,
   ``pow_``): ``x`` keeps its dtype (Apex rebound ``x`` to a new float32 tensor for
   mixed dtypes), and ``x **= 2`` on a half ``x`` raises like ``x.pow_(2)``.
6. The param cache also checks the param's version counter, so a param changed in place
   (a step, ``load_state_dict``) is never served stale; it is also cleared at the end of
   each ``scale_loss``, as Apex's was, so writes through ``.data`` are seen then. The cache
   is skipped while ``torch.compile`` traces and under
   ``torch.inference_mode``.
7. Functions registered with ``register_*_function`` after ``initialize`` apply at once
   (Apex: only at the next ``initialize``/``init``); a torch/``F``/``Tensor`` function is
   handled by the mode, anything else is wrapped in place and restored by ``_deactivate``.
8. One set of casts per thread, and the latest ``initialize`` decides: one at O1/O4
   installs them (O4: bfloat16), one at another level removes them (with a warning), so
   a model initialized at O1 before runs uncast from then on. Apex never removed its
   patches (a later O0/O2 model ran with the O1 casts). ``handle._deactivate()`` removes
   them too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from adapters.apex.amp import _o1_stack
from adapters.apex.amp._o1_lists import BANNED_MESSAGE, build_rules

_RULES: dict[Any, tuple[str, str]] | None = None
_Tensor = torch.Tensor
_F32 = torch.float32


def _rules() -> dict[Any, tuple[str, str]]:
    global _RULES
    if _RULES is None:
        _RULES = build_rules()
    return _RULES


def _short(dt: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dt, str(dt))


def _fp(x: Any) -> bool:
    """Apex's ``is_fp_tensor``: a floating tensor, or a list/tuple of them only."""
    if isinstance(x, _Tensor):
        return x.is_floating_point()
    if isinstance(x, list | tuple):
        return len(x) > 0 and all(_fp(y) for y in x)
    return False


def _visit(x: Any, out: set[torch.dtype]) -> None:
    if isinstance(x, list | tuple):
        for y in x:
            _visit(y, out)
    else:
        out.add(x.dtype)


def _types(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[torch.dtype]:
    """The dtypes of the floating args (top level, or lists/tuples of them only)."""
    out: set[torch.dtype] = set()
    for a in args:
        if isinstance(a, _Tensor):
            if a.is_floating_point():
                out.add(a.dtype)
        elif _fp(a):
            _visit(a, out)
    if kwargs:
        for a in kwargs.values():
            if _fp(a):
                _visit(a, out)
    return out


class O1Mode(TorchFunctionMode):
    """The O1 casts (see the module docstring for what each list does).

    Args:
        low: the low dtype (float16 for O1, bfloat16 for O4).
        device_type: the device type whose tensors are cast (``"cuda"``, ``"cpu"``...).
        allow_banned: run ``F.binary_cross_entropy`` in float32 instead of refusing it.
        enable_caching: cache the half casts of float32 params.
        verbose: print every cast (``Float->Half (mm)``), as Apex did.

    Example:
        >>> mode = O1Mode(torch.float16, "cpu")
        >>> with mode:
        ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float16
    """

    def __init__(self, low: torch.dtype = torch.float16, device_type: str = "cuda",
                 allow_banned: bool = False, enable_caching: bool = True,
                 verbose: bool = False) -> None:
        super().__init__()
        if low not in (torch.float16, torch.bfloat16):
            raise ValueError(f"low must be torch.float16 or torch.bfloat16, got {low!r}")
        self.low = low
        self.device_type = device_type
        self.allow_banned = allow_banned
        self.enable_caching = enable_caching
        self.verbose = verbose
        self.active = True
        self.cache: dict[Any, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.user_rules: dict[Any, tuple[str, str]] = {}
        self.patches: list[tuple[Any, str, Any]] = []
        self._table = _rules()

    # -- casting helpers ------------------------------------------------------------------
    def _cast(self, x: torch.Tensor, dt: torch.dtype, name: str) -> torch.Tensor:
        if x.dtype == dt:
            return x
        dev = self.device_type
        if not (x.is_cuda if dev == "cuda" else x.is_cpu if dev == "cpu"
                else x.device.type == dev):
            return x
        if self.verbose:
            print(f"{'Float' if x.dtype == torch.float32 else x.dtype}->"
                  f"{'Half' if dt == self.low else 'Float'} ({name})")
        return x.to(dt)

    def _cached(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A half cast of a float32 param, from the cache when still valid."""
        if x.dtype == self.low:  # nothing to cast (and never cached)
            return x
        if (not self.enable_caching or not isinstance(x, torch.nn.Parameter)
                or x.dtype != _F32 or torch.is_inference_mode_enabled()
                or torch.compiler.is_compiling()):
            return self._cast(x, self.low, name)
        version = getattr(x, "_version", None)
        entry = self.cache.get(id(x))
        if entry is not None:
            p, v, c = entry
            # Apex: with grad on, a cast made under no_grad (or vice versa) is remade
            if p is x and v == version and not c.is_inference() and not (
                    x.requires_grad != c.requires_grad and torch.is_grad_enabled()):
                return c
        c = self._cast(x, self.low, name)
        self.cache[id(x)] = (x, version, c)
        return c

    def _one(self, a: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        if isinstance(a, _Tensor):
            return fn(a) if a.is_floating_point() else a
        if isinstance(a, list | tuple) and _fp(a):
            return type(a)(self._one(y, fn) for y in a)
        return a

    def _map(self, args: tuple[Any, ...], kwargs: dict[str, Any],
             fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Apply ``fn`` to the floating args (top level, or lists/tuples of them only)."""
        one = self._one
        return (tuple([one(a, fn) for a in args]),
                {k: one(v, fn) for k, v in kwargs.items()} if kwargs else kwargs)

    def half_args(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str,
                  cache: bool = True) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Every floating argument in the low dtype (params through the cache)."""
        if not cache:
            return self._map(args, kwargs, lambda t: self._cast(t, self.low, name))
        low, cached = self.low, self._cached

        def one(a: Any) -> Any:  # _map's walk with _cached inlined (the hot path)
            if isinstance(a, _Tensor):
                return a if a.dtype == low or not a.is_floating_point() else cached(a, name)
            if isinstance(a, list | tuple) and _fp(a):
                return type(a)(one(y) for y in a)
            return a

        return (tuple([one(a) for a in args]),
                {k: one(v) for k, v in kwargs.items()} if kwargs else kwargs)

    def float_args(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                   name: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Every floating argument in float32."""
        return self._map(args, kwargs, lambda t: self._cast(t, torch.float32, name))

    def _mixed(self, dtypes: set[torch.dtype]) -> bool:
        return dtypes == {self.low, torch.float32}

    def _rnn_weights(self, ws: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        """Half weights; on CUDA laid out in one buffer like the float32 ones (cuDNN)."""
        same = (len(ws) > 0 and all(w.is_cuda and w.dtype == torch.float32 for w in ws)
                and len({w.untyped_storage().data_ptr() for w in ws}) == 1
                and not torch.compiler.is_compiling())
        if not same:
            return [self._cached(w, name) for w in ws]
        base = min(w.data_ptr() for w in ws)
        offs = [(w.data_ptr() - base) // w.element_size() for w in ws]
        buf = torch.empty(max(o + w.numel() for o, w in zip(offs, ws, strict=True)),
                          dtype=self.low, device=ws[0].device)
        out = []
        for o, w in zip(offs, ws, strict=True):
            v = buf.as_strided(w.shape, w.stride(), o)
            v.copy_(w)
            out.append(v)
        return out

    # -- the mode -------------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        # the common case first, with the least work: casts off, or a function on no list
        if kwargs is None:
            kwargs = {}
        if not self.active:
            return func(*args, **kwargs)
        user = self.user_rules
        rule = (user.get(func) if user else None) or self._table.get(func)
        if rule is None:
            return func(*args, **kwargs)
        kind, name = rule
        if kind == "half":
            args, kwargs = self.half_args(args, kwargs, name)
        elif kind == "float":
            args, kwargs = self.float_args(args, kwargs, name)
        elif kind == "promote":
            if self._mixed(_types(args, kwargs)):
                args, kwargs = self.float_args(args, kwargs, name)
        elif kind == "sequence":
            seq = args[0] if args else kwargs.get("tensors")
            if isinstance(seq, list | tuple) and self._mixed(
                    {t.dtype for t in seq if isinstance(t, torch.Tensor)}):
                seq = [self._cast(t, torch.float32, name) for t in seq]
                if args:
                    args = (seq, *args[1:])
                else:
                    kwargs = {**kwargs, "tensors": seq}
        elif kind == "banned":
            if self.allow_banned:
                args, kwargs = self.float_args(args, kwargs, name)
            elif self.low in _types(args, kwargs):
                raise NotImplementedError(BANNED_MESSAGE.format(dtype=self.low))
        elif kind == "inplace_any":
            if self.low in _types(args, kwargs):
                raise NotImplementedError(
                    f"Cannot call in-place function {name} with {_short(self.low)} arguments.")
        elif kind in ("inplace_self", "match_self"):
            this = args[0] if args else None
            if isinstance(this, torch.Tensor):
                if kind == "inplace_self" and this.dtype == self.low:
                    raise NotImplementedError(
                        f"Cannot call in-place method {name} on {_short(self.low)} Tensors.")
                dt = torch.float32 if kind == "inplace_self" else this.dtype
                if dt in (self.low, torch.float32):
                    rest, kwargs = self._map(args[1:], kwargs,
                                             lambda t: self._cast(t, dt, name))
                    args = (this, *rest)
        elif kind == "cpu":
            this = args[0] if args else None
            if isinstance(this, torch.Tensor) and this.is_floating_point() and \
                    this.device.type != "cpu":
                args = (self._cast(this, torch.float32, name), *args[1:])
        elif kind == "rnn":
            idx = 2 if len(args) > 6 and isinstance(args[6], bool) else 3
            new = []
            for i, a in enumerate(args):
                if i == idx and isinstance(a, list | tuple):
                    new.append(self._rnn_weights(list(a), name))
                elif _fp(a):
                    new.append(self.half_args((a,), {}, name)[0][0])
                else:
                    new.append(a)
            args = tuple(new)
        return func(*args, **kwargs)

    # -- switches -------------------------------------------------------------------------
    @contextlib.contextmanager
    def casts(self, on: bool) -> Iterator[None]:
        """A context with the casts on (``True``) or off (``False``) inside."""
        was, self.active = self.active, on
        # off: the mode leaves this thread's stack (no Python call per torch call); on
        # inside an off region: it goes back (see adapters.apex.amp._o1_stack)
        undo = _o1_stack.put_back(self) if on else _o1_stack.take_off(self)
        try:
            yield
        finally:
            self.active = was
            if undo is not None:
                undo()

    def clear_cache(self) -> None:
        """Drop every cached cast (Apex did this at the end of each ``scale_loss``)."""
        self.cache.clear()
