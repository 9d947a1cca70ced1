"""``apex.optimizers``: Apex's fused optimizers, mapped onto torch.

- :class:`FusedAdam`: ``torch.optim.Adam(decoupled_weight_decay=adam_w_mode)``, AdamW by
  default, ``fused=True`` on CUDA and ``foreach=True`` on CPU;
- :class:`FusedSGD`: ``torch.optim.SGD`` (fused/foreach), plus ``wd_after_momentum``;
- :class:`FusedLAMB`, :class:`FusedNovoGrad`: torch has neither; written on foreach ops
  after Apex's kernels.

Example:
    >>> from adapters.apex.optimizers import FusedAdam
    >>> opt = FusedAdam(torch.nn.Linear(2, 1).parameters(), lr=1e-3)
    >>> opt.param_groups[0]["decoupled_weight_decay"]
    True
"""

from adapters.apex.optimizers._fused_adam import FusedAdam
from adapters.apex.optimizers._fused_lamb import FusedLAMB
from adapters.apex.optimizers._fused_novograd import FusedNovoGrad
from adapters.apex.optimizers._fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedSGD"]
