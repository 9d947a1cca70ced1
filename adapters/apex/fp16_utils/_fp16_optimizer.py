"""``apex.fp16_utils.FP16_Optimizer``: float32 master weights and loss scaling around any
optimizer, for a model whose params are float16.

The flow is Apex's: ``optimizer.backward(loss)`` backpropagates ``loss.float() * scale``,
copies the float16 grads into the float32 masters divided by the scale and, with a
dynamic scale, checks them for inf/NaN and updates the scale; ``optimizer.step()`` then
skips (an overflow) or steps the wrapped optimizer on the masters and copies them back
into the float16 params.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adapters.apex.fp16_utils._fp16util import clip_grad_norm
from adapters.apex.fp16_utils._loss_scaler import AmpLossScaler

_LOW = (torch.float16, torch.bfloat16)


class FP16_Optimizer:
    """Wrap ``init_optimizer`` (built on the float16 params) with float32 masters.

    Args:
        init_optimizer: a torch optimizer (or ``LARC``) over the model's params.
        static_loss_scale: the scale when not dynamic (1.0).
        dynamic_loss_scale: a dynamic scale (False).
        dynamic_loss_args: keyword arguments of the dynamic scale: ``init_scale`` (2**16),
            ``scale_factor`` (2), ``scale_window`` (2000), ``min_loss_scale`` (None: 1.0),
            ``max_loss_scale`` (2**24).
        verbose: print the params found and each skipped step.

    Raises:
        TypeError: a trainable param neither float16, bfloat16 nor float32.
        ValueError: bad scale arguments.

    Example:
        >>> model = torch.nn.Linear(2, 1).half()
        >>> opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                      dynamic_loss_scale=True, verbose=False)
        >>> opt.backward(model(torch.ones(1, 2, dtype=torch.half)).float().sum())
        >>> opt.step()  # a grad of 2**16 overflows float16: skipped, the scale halved
        >>> opt.overflow, opt.loss_scale, opt.param_groups[0]["params"][0].dtype
        (True, 32768.0, torch.float32)
    """

    def __init__(self, init_optimizer: Any, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None,
                 verbose: bool = True) -> None:
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        for gi, group in enumerate(self.optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {gi}:")
            low, masters, full = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in _LOW:
                    self.maybe_print(f"FP16_Optimizer received {param.dtype} with "
                                     f"{tuple(param.size())}")
                    master = param.detach().clone().float().requires_grad_(True)
                    group["params"][i] = master
                    low.append(param)
                    masters.append(master)
                    if param in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(param)
                elif param.dtype == torch.float32:
                    self.maybe_print(f"FP16_Optimizer received torch.float32 with "
                                     f"{tuple(param.size())}")
                    full.append(param)
                else:
                    raise TypeError(f"FP16_Optimizer wraps float16, bfloat16 or float32 params, "
                                    f"got {param.dtype} of shape {tuple(param.size())}")
            self.fp16_groups.append(low)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(full)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        # recast any existing per-param state (momenta) to the masters' dtype
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        if self.dynamic_loss_scale:
            self.loss_scaler = AmpLossScaler("dynamic", **(dynamic_loss_args or {}))
        else:
            self.loss_scaler = AmpLossScaler(static_loss_scale)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm

    def maybe_print(self, msg: str) -> None:
        if self.verbose:
            print(msg)

    def __getstate__(self) -> Any:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Zero (or set to None) the grads of the masters and of the float16 params."""
        for p in [q for g in self.optimizer.param_groups for q in g["params"]] \
                + self.all_fp16_params:
            if set_grads_to_None:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    @torch.no_grad()
    def _master_params_to_model_params(self) -> None:
        for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params,
                                 strict=True):
            model.copy_(master)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> Any:
        """Clip the float32 master grads with ``torch.nn.utils.clip_grad_norm_``.

        Returns:
            Their total norm before clipping, or -1 after an overflow (nothing clipped).
        """
        if self.overflow:
            return -1
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        """The wrapper's state: scale, flags, the inner optimizer's and the masters.

        Unlike Apex (which pickled its scaler object), ``loss_scaler`` is a dict of
        numbers, so the checkpoint loads with ``torch.load(weights_only=True)``.
        """
        return {"loss_scaler": self.loss_scaler.state_dict(),
                "dynamic_loss_scale": self.dynamic_loss_scale,
                "overflow": self.overflow,
                "first_closure_call_this_step": self.first_closure_call_this_step,
                "optimizer_state_dict": self.optimizer.state_dict(),
                "fp32_from_fp16": self.fp32_from_fp16_groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the masters are copied from the saved ones).

        Raises:
            ValueError: the saved masters do not match this optimizer's (count or shape).
        """
        saved = state_dict["fp32_from_fp16"]
        shapes = [[tuple(p.shape) for p in g] for g in self.fp32_from_fp16_groups]
        if [[tuple(p.shape) for p in g] for g in saved] != shapes:
            raise ValueError("FP16_Optimizer.load_state_dict: the saved float32 masters "
                             "do not match this optimizer's params (groups, count or shapes)")
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for cur_g, saved_g in zip(self.fp32_from_fp16_groups, saved, strict=True):
                for cur, s in zip(cur_g, saved_g, strict=True):
                    cur.copy_(s)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the inner optimizer on the masters and copy them to the model, or skip.

        After an overflow (seen by :meth:`backward`) nothing changes and None is returned.
        With a closure, a step that overflows is retried with the lowered scale.

        Raises:
            RuntimeError: a closure still overflows at the lowest scale.
        """
        if self.overflow:
            self.maybe_print("Gradient overflow.  Skipping step, reducing loss scale to "
                             f"{self.loss_scaler.loss_scale()}")
            return None
        retval = (self._step_with_closure(closure) if closure is not None
                  else self.optimizer.step())
        self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def wrapped() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                self._master_params_to_model_params()
            loss = closure()
            while self.overflow:
                if self.loss_scaler.loss_scale() <= self.loss_scaler._min_loss_scale:
                    raise RuntimeError("FP16_Optimizer.step(closure): the grads overflow "
                                       "even at the lowest loss scale "
                                       f"{self.loss_scaler.loss_scale()}")
                self.maybe_print("OVERFLOW within closure! Skipping step, reducing loss "
                                 f"scale to {self.loss_scaler.loss_scale()}")
                loss = closure()
            return loss

        retval = self.optimizer.step(wrapped)
        self.first_closure_call_this_step = True
        return retval

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True,
                 retain_graph: bool = False) -> None:
        """Backpropagate ``loss.float() * loss_scale``; then :meth:`update_master_grads`
        unless told not to (to accumulate several losses first)."""
        (loss.float() * self.loss_scaler.loss_scale()).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Copy the float16 grads into the masters divided by the scale (the float32 params'
        grads are divided in place); check them and update a dynamic scale."""
        self.loss_scaler.clear_overflow_state()
        model, master = [], []
        for p, m in zip(self.all_fp16_params, self.all_fp32_from_fp16_params, strict=True):
            if p.grad is not None:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
                model.append(p.grad)
                master.append(m.grad)
        self.loss_scaler.unscale(model, master, self.loss_scaler.loss_scale())
        full = [p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None]
        self.loss_scaler.unscale(full, full, self.loss_scaler.loss_scale())
        self.overflow = self.loss_scaler.update_scale()

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """The masters' grads per group, or None after an overflow."""
        if self.overflow:
            self.maybe_print("Warning:  calling FP16_Optimizer.inspect_master_grad_data while "
                             "in an overflow state.  Gradients are currently invalid.")
            return None
        return [[p.grad for p in g["params"]] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        """The current loss scale (settable)."""
        return self.loss_scaler.loss_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler._loss_scale = float(value)

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value
