"""``apex.amp``: Apex's automatic mixed precision, rebuilt on the fmp core.

The functions here are the methods of a default :class:`Amp` instance, so a legacy loop
runs unchanged::

    from adapters import apex
    model, optimizer = apex.amp.initialize(model, optimizer, opt_level="O1")
    with apex.amp.autocast():
        loss = criterion(model(inputs), labels)
    with apex.amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()  # skipped after an overflow

Make your own ``Amp()`` objects to keep several independent set-ups.

Example:
    >>> from adapters.apex import amp
    >>> isinstance(amp.default_amp(), amp.Amp)
    True
"""

from __future__ import annotations

from adapters.apex.amp._amp import Amp
from adapters.apex.amp._amp_state import _amp_state as _amp_state  # Apex's read-only global state
from adapters.apex.amp._casts import deactivate  # fmp extension: the O1/O4 casts off
from adapters.apex.amp._errors import AmpError
from adapters.apex.amp._handle import init  # [amp14a] the old handle API
from adapters.apex.amp._opt_levels import OPT_LEVELS, Properties

__all__ = [
    "OPT_LEVELS",
    "Amp",
    "AmpError",
    "Properties",
    "autocast",
    "deactivate",
    "default_amp",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "last_step_skipped",
    "load_state_dict",
    "loss_scale",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]

_DEFAULT = Amp()


def default_amp() -> Amp:
    """The :class:`Amp` instance behind the module functions.

    Returns:
        The default instance.

    Example:
        >>> from adapters.apex import amp
        >>> amp.default_amp().initialize == amp.initialize
        True
    """
    return _DEFAULT


initialize = _DEFAULT.initialize
scale_loss = _DEFAULT.scale_loss
autocast = _DEFAULT.autocast
disable_casts = _DEFAULT.disable_casts
master_params = _DEFAULT.master_params
state_dict = _DEFAULT.state_dict
load_state_dict = _DEFAULT.load_state_dict
last_step_skipped = _DEFAULT.last_step_skipped
loss_scale = _DEFAULT.loss_scale
half_function = _DEFAULT.half_function
float_function = _DEFAULT.float_function
promote_function = _DEFAULT.promote_function
register_half_function = _DEFAULT.register_half_function
register_float_function = _DEFAULT.register_float_function
register_promote_function = _DEFAULT.register_promote_function
