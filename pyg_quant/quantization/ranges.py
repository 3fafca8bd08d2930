r"""Where a range comes from: the ``[lo, hi]`` of a 2-D tensor ``x`` ``[rows, cols]``, reduced over ``dim``.

``dim`` follows :func:`pyg_quant.to_bit`: ``None`` one range for the tensor, ``(1,)``; ``0`` one per column,
``(cols,)``; ``1`` one per row, ``(rows,)``.  Every recipe returns float32 ``(lo, hi)`` of that shape and takes no
gradient:

* :func:`tensor_range`: the min/max, :math:`lo = \min x`, :math:`hi = \max x`;
* :func:`masked_tensor_range`: the min/max of the entries a mask keeps;
* :func:`tensor_quantiles`: the ``1 − q`` and ``q`` quantiles (a fraction ``1 − q`` clipped on each side);
* :func:`mse_ranges` / :func:`masked_mse_ranges`: the clipping range whose round-to-nearest codes err least.

What a range gives for ``bits``-bit codes is :mod:`.affine`'s.
"""
import math
from typing import Optional, Tuple

import torch

from .. import ops
from ..ops import reference


@torch.no_grad()  # ranges take no gradient (and no_grad dispatches no detach op, as x.detach() would)
def tensor_range(x: torch.Tensor, dim: Optional[int], keepdim: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``x`` reduced over ``dim``, float32: 1-D, or with ``keepdim`` shaped to broadcast against
    ``x`` (``(1, 1)``, ``(1, cols)``, ``(rows, 1)``)."""
    x = x.to(torch.float32)
    if dim is None:
        lo, hi = torch.aminmax(x)
        shape = (1, 1) if keepdim else (1,)
        return lo.view(shape), hi.view(shape)
    # amin + amax, not aminmax: torch's CPU aminmax along a dim is ~10x slower than the two passes.
    return x.amin(dim, keepdim=keepdim), x.amax(dim, keepdim=keepdim)


def _masked_view(x: torch.Tensor, keep: torch.Tensor, dim: Optional[int]):
    """``x``, ``keep`` and the reduction dimension, a per-tensor range being one row of all values."""
    if dim is None:
        return x.reshape(1, -1), keep.reshape(1, -1), 1
    return x, keep, dim


@torch.no_grad()
def masked_tensor_range(x: torch.Tensor, keep: torch.Tensor, dim: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`tensor_range` over the entries where ``keep`` (bool, ``x``'s shape); ``(0, 0)`` for a range with none."""
    x, keep, reduce = _masked_view(x.to(torch.float32), keep, dim)
    inf = torch.full_like(x, float("inf"))
    lo = torch.where(keep, x, inf).amin(reduce)
    hi = torch.where(keep, x, -inf).amax(reduce)
    empty = ~keep.any(reduce)
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)


def tensor_quantiles(x: torch.Tensor, dim: Optional[int], q: float) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""The ``1 − q`` and ``q`` quantiles of ``x`` reduced over ``dim`` (order statistics, no interpolation).

    With ``n`` values along ``dim``, ``hi`` is the ``⌈q·n⌉``-th smallest and ``lo``
    the ``⌈q·n⌉``-th largest, so ``q = 1`` gives the min/max.  ``kthvalue`` (not
    ``torch.quantile``, which refuses inputs of more than 2**24 elements).
    """
    x = x.detach().to(torch.float32)
    if dim is None:
        x, dim = x.reshape(1, -1), 1
    n = x.size(dim)
    k = min(n, max(1, math.ceil(q * n)))
    hi = torch.kthvalue(x, k, dim).values
    lo = torch.kthvalue(x, n + 1 - k, dim).values
    return lo.reshape(-1), hi.reshape(-1)


#: The shrink factors ``a`` :func:`mse_ranges` tries: 1, 0.8, 0.64, ..., 0.8**11 ≈ 0.086.
MSE_GRID = tuple(0.8 ** k for k in range(12))


def mse_ranges(x: torch.Tensor, dim: Optional[int], bits: int,
               grid=MSE_GRID) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""The clipping ranges of ``x`` (reduced over ``dim``) whose ``bits``-bit round-to-nearest codes err least.

    Candidates ``[c + a(lo − c), c + a(hi − c)]`` for each ``a`` in ``grid``, with ``[lo, hi]``
    the min/max and ``c = clamp(0, lo, hi)``; the error is ``Σ (x − x̃)²`` along ``dim``, the
    first (widest) candidate wins ties.  Float32 1-D, like :func:`tensor_range`.
    """
    with torch.no_grad():  # no gradient, and no detach op dispatched
        return ops.mse_range(x.to(torch.float32), -1 if dim is None else dim, bits, tuple(grid))


def masked_mse_ranges(x: torch.Tensor, keep: torch.Tensor, dim: Optional[int], bits: int,
                      grid=MSE_GRID) -> Tuple[torch.Tensor, torch.Tensor]:
    r""":func:`mse_ranges` over the entries where ``keep`` (bool, ``x``'s shape) only.

    The search of :func:`pyg_quant.ops.reference.mse_search` (which has no kernel of its own) from the kept
    entries' min/max, with the compiled round-to-nearest codes (:func:`pyg_quant.ops.fake_quantize`) and the errors
    of the kept entries only; with every entry kept it equals :func:`mse_ranges`.  ``(0, 0)`` for a range with no
    kept entry.
    """
    with torch.no_grad():
        x = x.to(torch.float32).contiguous()
        lo, hi = masked_tensor_range(x, keep, dim)
        xv, kv, reduce = _masked_view(x, keep, dim)
        return reference.mse_search(
            xv, lo, hi, reduce, grid, lambda c_lo, c_hi: ops.fake_quantize(xv, c_lo, c_hi, bits, reduce, None, False,
                                                                           False, None)[0], kv)
