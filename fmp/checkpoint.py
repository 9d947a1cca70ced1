"""Checkpoints of a :class:`fmp.TrainState`: ``torch.save`` / ``torch.load`` and DCP.

Two ways, both exact (the tensors are saved as they are, bit for bit):

- ``torch.save(state, path)`` then ``torch.load(path)``: fmp registers its records
  (:class:`fmp.TrainState`, the optimizer states of :mod:`fmp.optim`, the loss-scale
  records) with ``torch.serialization.add_safe_globals`` when it is imported, so torch's
  default ``weights_only=True`` loads them (import fmp before loading).
- ``state.state_dict()`` / :meth:`fmp.TrainState.from_state_dict`: a nested dict of
  tensors, Python numbers and strings only (no fmp class in it), which any loader takes,
  and which ``torch.distributed.checkpoint`` (DCP) saves and loads in place, also with
  FSDP2-sharded (DTensor) params and moments::

      dcp.save({"train": state.state_dict()}, checkpoint_id=path)
      ...
      sd = {"train": fresh_state.state_dict()}  # a state of the same shapes and sharding
      dcp.load(sd, checkpoint_id=path)
      state = fmp.TrainState.from_state_dict(sd["train"])

The state dict: ``{"format": "fmp.TrainState/1", "params": ..., "opt_state": ...,
"loss_scale": ..., "step": tensor, "model_state": ..., "skipped_total": tensor}``, with
``"float8": {name: {"__fmp_node__": "Float8LinearScales", ...}}`` where the state holds
float8 records (:mod:`fmp.float8`). Plain
dicts with str keys (params and buffers dicts) stay dicts keyed as they were; any other
node (tuple, list, None, an fmp record) becomes a dict with a ``"__fmp_node__"`` entry
naming it and its children under their field names or positions ("0", "1", ...).
``compute_params`` (a cache) is not saved; the next step rebuilds it, and resumed training
is bit-identical to uninterrupted training.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, get_args

import torch

from fmp import _records
from fmp import loss_scale as _ls
from fmp import optim as _optim
from fmp.float8._scales import Float8LinearScales

__all__ = ["FORMAT", "from_state_dict", "register_safe_globals", "state_dict"]

#: The ``"format"`` entry of a TrainState state dict.
FORMAT = "fmp.TrainState/1"
_NODE = "__fmp_node__"

_RECORDS: dict[str, type] = {c.__name__: c for c in (
    _optim.SgdState, _optim.AdamState, _optim.TraceState, _optim.EmptyState,
    _optim.ScaleByScheduleState, _optim.KahanState, _optim.StochasticRoundingState)}
_LOSS_SCALES: dict[str, type] = {c.__name__: c for c in get_args(_ls.LossScale)}
_SCALARS = (bool, int, float, str)


def _path(path: tuple[str, ...]) -> str:
    return ".".join(path) or "<root>"


def _encode(x: Any, path: tuple[str, ...]) -> Any:
    if x is None:
        return {_NODE: "None"}
    if isinstance(x, (torch.Tensor, *_SCALARS)):
        return x
    if type(x) in _LOSS_SCALES.values():  # its fields: leaves (tensors), then hyper-parameters
        return {_NODE: type(x).__name__, **_records.as_dict(x)}
    if type(x) is Float8LinearScales:  # its two tensors and its recipe's fields
        return {_NODE: "Float8LinearScales", **x.state_dict()}
    if type(x).__name__ in _RECORDS and type(x) is _RECORDS[type(x).__name__]:
        return {_NODE: type(x).__name__,
                **{f: _encode(getattr(x, f), (*path, f)) for f in x._fields}}
    if type(x) in (dict, OrderedDict):
        for k in x:
            if not isinstance(k, str) or k == _NODE:
                raise TypeError(f"TrainState.state_dict: the dict at {_path(path)} has the key "
                                f"{k!r}; only str keys (other than {_NODE!r}) are supported")
        items = {k: _encode(v, (*path, k)) for k, v in x.items()}
        return items if type(x) is dict else {_NODE: "OrderedDict", "items": items}
    if type(x) in (tuple, list):
        return {_NODE: type(x).__name__,
                **{str(i): _encode(v, (*path, str(i))) for i, v in enumerate(x)}}
    raise TypeError(
        f"TrainState.state_dict: {_path(path)} is a {type(x).__name__}; a state dict holds "
        "tensors, numbers, str, None, dicts with str keys, lists, tuples and fmp's records. "
        "Save a state with other tree nodes with torch.save(state) (weights_only=False to "
        "load) or convert them to dicts"
    )


def _children(d: Mapping[str, Any], path: tuple[str, ...]) -> list[Any]:
    keys = [k for k in d if k != _NODE]
    if keys != [str(i) for i in range(len(keys))]:
        raise ValueError(f"TrainState.from_state_dict: the {d[_NODE]} at {_path(path)} must "
                         f"hold the entries '0', '1', ...; got {keys}")
    return [_decode(d[k], (*path, k)) for k in keys]


def _decode(x: Any, path: tuple[str, ...]) -> Any:
    if not isinstance(x, Mapping):
        return x
    kind = x.get(_NODE)
    if kind is None:
        return {k: _decode(v, (*path, k)) for k, v in x.items()}
    if kind == "None":
        return None
    if kind == "OrderedDict":
        return OrderedDict((k, _decode(v, (*path, k))) for k, v in x["items"].items())
    if kind == "tuple":
        return tuple(_children(x, path))
    if kind == "list":
        return _children(x, path)
    if kind in _LOSS_SCALES:  # the saved tensors as they are (no check, no copy)
        return _records.from_dict(_LOSS_SCALES[kind], x)
    if kind == "Float8LinearScales":  # the saved tensors as they are (shapes checked)
        return Float8LinearScales.from_state_dict(x)
    if kind in _RECORDS:
        cls = _RECORDS[kind]
        missing = [f for f in cls._fields if f not in x and f not in cls._field_defaults]
        if missing:
            raise ValueError(f"TrainState.from_state_dict: the {kind} at {_path(path)} lacks "
                             f"the fields {missing}")
        return cls(**{f: _decode(x[f], (*path, f)) for f in cls._fields if f in x})
    raise ValueError(f"TrainState.from_state_dict: unknown node {kind!r} at {_path(path)}")


def state_dict(state: Any) -> dict[str, Any]:
    """A :class:`fmp.TrainState` as a nested dict of tensors and plain values.

    The tensors are the state's own (no copy, no host sync): save the dict, or load into
    it in place (``torch.distributed.checkpoint.load``). ``compute_params`` is left out.

    Args:
        state: a :class:`fmp.TrainState`.

    Returns:
        ``{"format", "params", "opt_state", "loss_scale", "step", "model_state",
        "skipped_total"}``, and ``"float8"`` where the state holds float8 records (see the
        module docstring for the encoding).

    Raises:
        TypeError: ``state`` is not a TrainState, or holds a tree node other than dicts
            with str keys, lists, tuples, None and fmp's records (the message names it).

    Example:
        >>> s = fmp.TrainState.create({"w": torch.ones(2)}, fmp.optim.sgd(0.1))
        >>> sd = s.state_dict()
        >>> sd["params"]["w"] is s.params["w"], sd["opt_state"]["__fmp_node__"]
        (True, 'SgdState')
    """
    from fmp.step import TrainState

    if not isinstance(state, TrainState):
        raise TypeError(f"state_dict needs an fmp.TrainState, got {type(state).__name__}")
    out: dict[str, Any] = {"format": FORMAT}
    for f in ("params", "opt_state", "loss_scale", "step", "model_state", "skipped_total"):
        out[f] = _encode(getattr(state, f), (f,))
    if state.float8 is not None:  # only then: a state without float8 saves as before
        out["float8"] = _encode(state.float8, ("float8",))
    return out


def from_state_dict(d: Mapping[str, Any]) -> Any:
    """Rebuild a :class:`fmp.TrainState` from :func:`state_dict`'s output (exactly).

    The tensors of ``d`` become the state's (no copy); ``compute_params`` is None.

    Args:
        d: a state dict, e.g. ``torch.load(path)`` of a saved one, or one DCP loaded into.

    Returns:
        The :class:`fmp.TrainState`.

    Raises:
        ValueError: ``d`` is not a TrainState state dict (its ``"format"`` is missing or
            another), or a node in it is malformed (the message names where).

    Example:
        >>> s = fmp.TrainState.create({"w": torch.ones(2)}, fmp.optim.adam())
        >>> r = fmp.TrainState.from_state_dict(s.state_dict())
        >>> r.params["w"] is s.params["w"], type(r.opt_state).__name__
        (True, 'AdamState')
    """
    from fmp.step import TrainState

    if not isinstance(d, Mapping) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, Mapping) else type(d).__name__
        raise ValueError(f"TrainState.from_state_dict needs a dict from TrainState.state_dict() "
                         f"with format {FORMAT!r}; got {got!r}")
    fields = {f: _decode(d[f], (f,)) for f in
              ("params", "opt_state", "loss_scale", "step", "model_state", "skipped_total",
               "float8") if f in d}
    missing = {"params", "opt_state", "loss_scale", "step"} - set(fields)
    if missing:
        raise ValueError(f"TrainState.from_state_dict: the state dict lacks {sorted(missing)}")
    return TrainState(**fields)


def register_safe_globals() -> None:
    """Let ``torch.load(weights_only=True)`` (torch's default) load fmp's records.

    Registers :class:`fmp.TrainState`, the optimizer states and the loss-scale records with
    ``torch.serialization.add_safe_globals``; called when fmp is imported.

    Example:
        >>> import io
        >>> buf = io.BytesIO()
        >>> torch.save(fmp.TrainState.create({"w": torch.ones(1)}, fmp.optim.adam()), buf)
        >>> _ = buf.seek(0)
        >>> type(torch.load(buf)).__name__
        'TrainState'
    """
    from fmp.step import TrainState

    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is None:  # torch without the weights_only allowlist
        return
    add([TrainState, *_RECORDS.values(), *_LOSS_SCALES.values(), Float8LinearScales])
