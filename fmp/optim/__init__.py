"""Functional optimizers shaped like optax: pure, branch-free, multi-tensor.

A :class:`GradientTransformation` is a pair of pure functions ``init(params) -> state``
and ``update(grads, state, params=None) -> (updates, new_state)``. Updates are deltas to
*add* to the params (:func:`apply_updates`). Nothing here modifies its inputs, calls
``.item()`` or branches on tensor values, so one update traces under
``torch.compile(fullgraph=True)`` and can be captured in a CUDA graph.

:func:`sgd`, :func:`adam` and :func:`adamw` follow the formulas of ``torch.optim.SGD``,
``torch.optim.Adam`` and ``torch.optim.AdamW`` (tested step by step against them).
:func:`chain` composes the building blocks (:func:`add_decayed_weights`, :func:`trace`,
:func:`scale_by_adam`, :func:`scale_by_learning_rate`, :func:`scale`).

Dtypes. Optimizer moments are stored in ``state_dtype`` (float32 by default, also for
bfloat16 / float16 params; ``None`` keeps each param's own dtype as torch.optim does).
The arithmetic of one leaf runs in its *compute dtype*: the promotion of float32, the
grad's dtype and the state dtype (float32 for bf16 / fp16 / fp32 trees, float64 when
either is float64). After each update the moments are cast back to their state dtype,
so dtypes never drift. Updates come back in the compute dtype; :func:`apply_updates`
adds them in the promoted dtype of param and update and casts the sum to the param's
dtype. Scalar step quantities (bias corrections, scheduled learning rates) are 0-d
float32 tensors on the params' device (bias corrections in float64 where a leaf computes
in float64).

Trees. Params, grads, updates and moments are any optree pytree (params dicts, lists,
NamedTuples); None is an empty subtree (optree's default), so a None entry passes
through. Leaves are flattened into lists and updated with ``torch._foreach_*`` ops: one
update is a handful of multi-tensor kernels, not one kernel per tensor. Leaves whose
dtype differs from the compute dtype are cast one by one (under ``torch.compile`` these
casts fuse). All leaves are expected on one device.

Fast path. The ``update`` of :func:`sgd` (without dampening), :func:`adam` and
:func:`adamw` also knows an in-place fused form: :func:`update_in_place` runs torch's
fused kernel, which unscales the grads, updates params and moments in place and skips on
device in one pass (:func:`fmp.train_step` with ``donate=True`` uses it), and
:func:`in_place_supported` says beforehand whether it applies. Only this package knows the
state layouts the kernels read. A :func:`chain` keeps the form only when it has a single
part that has it; a ``GradientTransformation`` built from plain functions has none.

bf16 without float32 masters. ``sgd`` / ``adam`` / ``adamw(..., bf16_update="kahan")``
(or ``"stochastic"``) end the update with :func:`kahan_summation` (a bf16 compensation
buffer per param) or :func:`stochastic_rounding` (a key in the state): the params stay in
bfloat16 and tiny updates are not lost (:func:`state_bytes_per_param` counts the cost).
"""

from fmp.optim._adam import adam, adamw, scale_by_adam
from fmp.optim._base import GradientTransformation, apply_updates
from fmp.optim._bf16 import (
    BF16_UPDATES,
    KahanState,
    StochasticRoundingState,
    kahan_summation,
    stochastic_rounding,
)
from fmp.optim._chain import chain
from fmp.optim._inplace import in_place_plan, in_place_supported, update_in_place
from fmp.optim._memory import state_bytes_per_param
from fmp.optim._schedules import Schedule, schedule_ok
from fmp.optim._sgd import sgd
from fmp.optim._states import AdamState, EmptyState, ScaleByScheduleState, SgdState, TraceState
from fmp.optim._transforms import add_decayed_weights, scale, scale_by_learning_rate, trace

__all__ = [
    "BF16_UPDATES",
    "AdamState",
    "EmptyState",
    "GradientTransformation",
    "KahanState",
    "ScaleByScheduleState",
    "Schedule",
    "SgdState",
    "StochasticRoundingState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "in_place_plan",
    "in_place_supported",
    "kahan_summation",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "schedule_ok",
    "sgd",
    "state_bytes_per_param",
    "stochastic_rounding",
    "trace",
    "update_in_place",
]
