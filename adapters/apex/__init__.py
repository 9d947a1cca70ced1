"""The NVIDIA Apex interface, rebuilt on the fmp core.

``from adapters import apex`` gives ``apex.amp``, so a legacy loop written for Apex
(``from apex import amp``) runs with only its import line changed, on CUDA and on CPU.

Example:
    >>> from adapters import apex
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> amp = apex.amp.Amp()
    >>> model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
"""

from adapters.apex import amp, amp_C, fp16_utils, multi_tensor_apply, optimizers, parallel

__all__ = ["amp"]
__all__ += ["amp_C", "fp16_utils", "multi_tensor_apply", "optimizers", "parallel"]
