"""The one owner of unscaling: every way fmp turns scaled grads into unscaled ones.

Every loss-scale record inherits these methods; a record says only what it divides by
(``_scale_or_none``: its 0-d float32 scale, or None for scale 1). Three numerics exist, and
each caller keeps its own bit for bit:

- the pure path (:meth:`Unscaling.unscale`, :meth:`Unscaling.unscale_and_check`): every
  floating leaf times the float32 reciprocal of the scale (narrow leaves multiplied in
  float32), then, over ``k`` micro-batches, times the Python float ``1/k``; nothing is
  written; traceable, vmappable, capturable;
- the one in-place pass on grads the caller hands over (``in_place=True``, and
  :meth:`Unscaling.unscale_for_fused`): torch's amp kernel multiplies once by the
  reciprocal of ``scale x k`` and checks in the same pass;
- ``torch.amp.GradScaler.unscale_``'s contract on the caller's own tensors
  (:meth:`Unscaling.unscale_and_check_`), grouped per device and dtype.

Every reciprocal is taken as GradScaler takes it: in float64, rounded once to float32.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import optree
import torch

from fmp.loss_scale._inplace import check_and_unscale_owned_, owned, unscale_and_check_
from fmp.loss_scale._scaling import (
    finite_after_unscale,
    inverse,
    per_micro_batch,
    unscale_tree,
)
from fmp.tree import all_finite, floating_leaves, to_dtypes_of

T = TypeVar("T")


def _micro_batches(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {k!r}")
    return int(k)


def _device_of(tree: Any) -> torch.device:
    leaves = floating_leaves(tree)
    return leaves[0].device if leaves else torch.device("cpu")


def _own(grads: Any, protect: Any) -> tuple[Any, list[torch.Tensor]]:
    """``grads`` with a private copy of each leaf that may not be written, and its leaves."""
    leaves, spec = optree.tree_flatten(grads)
    mine = owned(leaves, protect)
    return optree.tree_unflatten(spec, mine), mine


class Unscaling:
    """The unscale methods shared by :class:`fmp.NoOpLossScale`, :class:`fmp.StaticLossScale`
    and :class:`fmp.DynamicLossScale` (a mixin without fields)."""

    __slots__ = ()

    def _scale_or_none(self) -> torch.Tensor | None:
        """The 0-d scale the grads were multiplied by; None where it is 1 (no scaling)."""
        raise NotImplementedError

    def grad_divisor(self, grads: Any, *, micro_batches: int = 1) -> torch.Tensor | None:
        """What the summed, scaled grads of ``micro_batches`` micro-batches are divided by.

        ``scale x micro_batches`` as a 0-d float32 tensor (the product rounded to float32),
        the ``grad_scale`` that torch's fused optimizer kernels divide by; None when it is
        1 (no scaling, one micro-batch).

        Args:
            grads: the grads (only the device of their first floating leaf is read, for
                a record without a scale tensor).
            micro_batches: how many micro-batches were summed, an int >= 1.

        Returns:
            A 0-d float32 tensor, or None.

        Example:
            >>> fmp.StaticLossScale(8.0).grad_divisor({"w": torch.ones(1)}, micro_batches=2)
            tensor(16.)
        """
        k = _micro_batches(micro_batches)
        s = self._scale_or_none()
        if s is None:
            if k == 1:
                return None
            return torch.full((), float(k), dtype=torch.float32, device=_device_of(grads))
        s = s.to(torch.float32)
        return s if k == 1 else s * float(k)

    def unscale(self, tree: T, *, micro_batches: int = 1) -> T:
        """Multiply every floating-point tensor leaf of ``tree`` by ``1/scale`` (pure).

        The reciprocal and each product are computed in float32 (narrow leaves are widened
        for the multiplication), then rounded to the leaf's own dtype, which is kept;
        ``torch._foreach_mul`` per device and dtype. Over ``micro_batches`` > 1 every leaf
        is then multiplied by the Python float ``1/micro_batches`` (the mean of a sum).
        Non-floating leaves pass through; the input is not modified; without a scale
        (:class:`fmp.NoOpLossScale`) and one micro-batch ``tree`` itself is returned.

        Args:
            tree: any pytree, usually the gradients.
            micro_batches: how many micro-batches' grads were summed, an int >= 1.

        Returns:
            A tree of the same structure and dtypes (the same object if nothing changes).

        Raises:
            ValueError: ``micro_batches`` is not an int >= 1.

        Example:
            >>> fmp.StaticLossScale(4.0).unscale([torch.tensor([8.0]), torch.tensor([3])])
            [tensor([2.]), tensor([3])]
            >>> g = {"w": torch.ones(2)}
            >>> fmp.NoOpLossScale().unscale(g) is g
            True
        """
        k = _micro_batches(micro_batches)
        s = self._scale_or_none()
        return per_micro_batch(tree if s is None else unscale_tree(tree, s), k)

    def _one_pass(self, tree: Any, leaves: list[torch.Tensor], k: int) -> torch.Tensor | None:
        divisor = self.grad_divisor(tree, micro_batches=k)
        inv = (torch.ones((), device=_device_of(tree)) if divisor is None
               else inverse(divisor))
        return check_and_unscale_owned_(leaves, inv, owned_already=True)

    def _finite(self, grads: Any, like: Any, unscaled: Any) -> torch.Tensor:
        """:func:`fmp.all_finite` of ``unscaled`` (the pure unscale of ``grads``, converted
        to ``like``'s dtypes), read from ``grads`` where they are real floating tensors
        on one device (see :func:`finite_after_unscale`)."""
        leaves: list[Any] = []
        pairs: list[tuple[torch.Tensor, torch.dtype]] = []

        def pair(x: Any, p: Any = None) -> Any:  # a tree_map: cheap for dynamo to trace
            leaves.append(x)
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                pairs.append((x, p.dtype if isinstance(p, torch.Tensor) else x.dtype))
            return x

        if like is None:
            optree.tree_map(pair, grads)
        else:
            optree.tree_map(pair, grads, like)
        if (not pairs or any(isinstance(x, torch.Tensor) and x.is_complex() for x in leaves)
                or len({x.device for x, _ in pairs}) != 1):
            return all_finite(unscaled)  # its own answer (or its error) for these trees
        device = pairs[0][0].device
        pairs = [(x, d) for x, d in pairs if x.numel() != 0]
        if not pairs:  # only empty leaves: nothing to check, as all_finite says
            return torch.ones((), dtype=torch.bool, device=device)
        return finite_after_unscale([x for x, _ in pairs], [d for _, d in pairs],
                                    self._scale_or_none())

    def unscale_and_check(self, grads: T, *, in_place: bool = False, micro_batches: int = 1,
                          protect: Any = None, like: Any = None) -> tuple[T, torch.Tensor]:
        """Unscale the (summed) grads and say whether they are all finite.

        ``in_place=False`` is the pure path: :meth:`unscale`, and the verdict
        :func:`fmp.all_finite` gives on its result, read from the given grads (their
        largest magnitudes, unscaled: exactly that verdict) so that a compiled step need
        not write the unscaled grads out for the check (nothing is written; traceable by
        ``torch.compile(fullgraph=True)``).

        ``in_place=True``: the caller hands the grads over (fresh from autograd, or its own
        accumulation sum) and the unscaled values may be written into them: one pass of
        torch's amp kernel multiplies by the reciprocal of ``scale x micro_batches`` and
        checks at once (eager mode; compiled or transformed code should use the pure
        path). A grad that is a view, is not dense, shares storage with another grad or
        with a tensor of ``protect`` is never written: it gets a private copy first. When
        the kernel does not take every grad (float64 grads, grads on several devices,
        bfloat16 grads on CUDA, no grads) the pure path runs instead and nothing is
        written. Each path keeps its own numerics: over several micro-batches the pure
        path multiplies by ``1/scale`` then by ``1/micro_batches``, the in-place pass once
        by ``1/(scale x micro_batches)``.

        Args:
            grads: a pytree of gradient tensors, still multiplied by the scale.
            in_place: allow the one in-place pass (see above).
            micro_batches: how many micro-batches' grads were summed into ``grads``
                (their mean is returned), an int >= 1.
            protect: a pytree of the caller's tensors (params, batch, state) that no grad
                may be written through (only with ``in_place``).
            like: a tree of the grads' structure (the params) whose tensor leaves' dtypes
                the grads are converted to before unscaling (grads of a compute copy
                turned into their params' dtypes); None: no conversion.

        Returns:
            ``(unscaled grads, finite)``: a tree of the same structure and dtypes (with
            ``in_place``, the given tensors where they were written), and a 0-d bool
            tensor, False when any grad holds an inf or a NaN. No host synchronisation.

        Raises:
            ValueError: ``micro_batches`` is not an int >= 1.

        Example:
            >>> ls = fmp.StaticLossScale(4.0)
            >>> g = {"w": torch.tensor([8.0, 2.0])}
            >>> ls.unscale_and_check(g, micro_batches=2)
            ({'w': tensor([1.0000, 0.2500])}, tensor(True))
            >>> out, ok = ls.unscale_and_check(g, in_place=True)
            >>> out["w"] is g["w"], g["w"].tolist(), bool(ok)
            (True, [2.0, 0.5], True)
        """
        k = _micro_batches(micro_batches)
        conv = grads if like is None else to_dtypes_of(grads, like)
        if in_place:
            tree, leaves = _own(conv, protect)
            finite = self._one_pass(tree, leaves, k)
            if finite is not None:
                return tree, finite
        out = self.unscale(conv, micro_batches=k)
        return out, self._finite(grads, like, out)

    def unscale_for_fused(self, grads: T, *, micro_batches: int = 1, protect: Any = None,
                          check: Callable[[Any], torch.Tensor] | None = None,
                          read_from: Any = None,
                          ) -> tuple[T, torch.Tensor | None, torch.Tensor]:
        """Grads for torch's fused optimizer kernels (``torch._fused_adamw_`` and kin).

        Those kernels divide the grads by a ``grad_scale`` on the way and write them, so
        the grads are first made the caller's own as with ``unscale_and_check(...,
        in_place=True, protect=protect)``. Where there is a divisor, the amp kernel takes
        the grads and no ``check`` is given, they are unscaled and checked in place in one
        pass and ``grad_scale`` is None; otherwise they stay scaled, ``grad_scale`` is
        :meth:`grad_divisor` (None when it is 1: then nothing is written) and the verdict
        is a read-only check (of ``read_from`` where given and nothing is divided).

        Args:
            grads: a pytree of gradient tensors, still multiplied by the scale.
            micro_batches: how many micro-batches' grads were summed, an int >= 1.
            protect: a pytree of the caller's tensors no grad may be written through.
            check: the verdict to use instead of :func:`fmp.all_finite` (e.g. one agreed
                over data-parallel ranks); the grads then stay scaled (the one-pass
                kernel's verdict is this process's only).
            read_from: ``grads`` before their conversion to its dtypes (the grads of a
                compute copy, e.g. bfloat16 for float32 params), or None. Where nothing
                is divided and no ``check`` is given, the verdict on ``grads`` is read from
                these (as :meth:`unscale_and_check` with ``like`` reads it): fewer bytes.

        Returns:
            ``(grads, grad_scale, finite)``: the grads to hand to the fused kernel, the
            0-d float32 divisor or None, and the 0-d bool verdict.

        Raises:
            ValueError: ``micro_batches`` is not an int >= 1.

        Example:
            >>> g = {"w": torch.tensor([8.0])}
            >>> out, grad_scale, ok = fmp.StaticLossScale(4.0).unscale_for_fused(
            ...     g, check=fmp.all_finite)
            >>> grad_scale, out["w"], bool(ok)
            (tensor(4.), tensor([8.]), True)
        """
        k = _micro_batches(micro_batches)
        tree, leaves = _own(grads, protect)
        divisor = self.grad_divisor(tree, micro_batches=k)
        if check is not None:
            return tree, divisor, check(tree)
        if divisor is None:  # nothing to divide: a read-only check, of read_from if given
            return tree, None, (all_finite(tree) if read_from is None
                                else self._finite(read_from, tree, tree))
        finite = self._one_pass(tree, leaves, k)
        if finite is not None:
            return tree, None, finite
        return tree, divisor, all_finite(tree)

    def unscale_and_check_(self, grads: Sequence[torch.Tensor],
                           found_inf: torch.Tensor | None = None) -> torch.Tensor:
        """Unscale the caller's own grad tensors in place, as ``GradScaler.unscale_`` does.

        Every tensor given is written (views included: e.g. the local shards of DTensor
        grads, the values of sparse grads), so no two may share memory. Per (device,
        dtype) group one pass of torch's amp kernel (the reciprocal of the scale, in
        float32); where the kernel does not take the dtype (bfloat16 on CUDA) a multiply
        in place, then a read-only check. No host synchronisation.

        Args:
            grads: dense floating gradient tensors (modified in place).
            found_inf: a 0-d float32 tensor, 0.0 or 1.0, raised to 1.0 when any grad is
                non-finite and never reset (several calls accumulate); None: a new one on
                the scale's device (on the first grad's, without a scale).

        Returns:
            ``found_inf``.

        Example:
            >>> g = [torch.tensor([2.0, float("inf")])]
            >>> fmp.StaticLossScale(2.0).unscale_and_check_(g)
            tensor(1.)
            >>> g[0]
            tensor([1., inf])
        """
        s = self._scale_or_none()
        if found_inf is None:
            device = (s.device if s is not None
                      else grads[0].device if grads else torch.device("cpu"))
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
        inv = (torch.ones((), dtype=torch.float32, device=found_inf.device) if s is None
               else inverse(s))
        unscale_and_check_(grads, inv, found_inf)
        return found_inf
