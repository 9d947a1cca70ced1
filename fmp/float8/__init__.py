"""``fmp.float8``: float8 matmuls for ``nn.Linear`` (issue 19), scales kept as records.

::

    model = fmp.float8.convert(model, "delayed")   # nn.Linear -> Float8Linear, in place
    apply_fn, params, buffers = fmp.functional(model)
    state = fmp.TrainState.create(params, opt, float8=fmp.float8.init(model))
    step = fmp.train_step(loss_fn, opt, "bf16-mixed")
    state, metrics = step(state, *batch)            # state.float8: the new scales

Forward: input and weight in e4m3; backward: the grad output in e5m2; ``torch._scaled_mm``
accumulates in float32 and writes the compute dtype. ``"dynamic"`` scaling takes each
scale from the tensor's amax now; ``"delayed"`` (Transformer Engine's recipe) from an amax
history in the layer's :class:`Float8LinearScales` record, which the step updates without
a host sync (and leaves bit-identical when it skips). Outside a train step (evaluation, a
plain module call) the layers scale dynamically.
"""

from fmp.float8._cast import to_float8
from fmp.float8._convert import convert, init
from fmp.float8._linear import Float8Linear, float8_linear
from fmp.float8._recipe import FORMATS, Recipe
from fmp.float8._scales import ROWS, Float8LinearScales

__all__ = ["FORMATS", "ROWS", "Float8Linear", "Float8LinearScales", "Recipe", "convert",
           "float8_linear", "init", "to_float8"]
