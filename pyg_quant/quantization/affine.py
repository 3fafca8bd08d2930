r"""The affine parameters of a range: what ``[lo, hi]`` gives for ``bits``-bit codes.

For a range ``[lo, hi]`` (float32; one per tensor, per column or per row, see :mod:`.ranges`) and ``b`` bits:

.. math::
    s = \frac{hi - lo}{2^b - 1}, \qquad
    s^{-1} = \begin{cases} 1 / s & s > 0 \\ 0 & s = 0 \end{cases}, \qquad
    q = \mathrm{clamp}\big(\lfloor (x - lo)\, s^{-1} + u \rfloor,\ 0,\ 2^b - 1\big), \qquad
    \tilde{x} = lo + s\,q,

``u = 1/2`` for round-to-nearest, ``u ~ U[0, 1)`` for stochastic rounding.  Both divisions are tensor by tensor
(correctly rounded on every backend; a division by a Python scalar may become a multiplication by its reciprocal on
the GPU), as in :func:`pyg_quant.to_bit` and the kernels, so that every quantizer makes the same codes.
"""
from typing import Tuple

import torch

from ..layout import MIN_RANGE_WIDTH

#: How a 1-D range (``(1,)``, ``(cols,)`` or ``(rows,)``) of ranges reduced over ``dim`` (None, 0, 1) is viewed to
#: broadcast against its 2-D tensor ``[rows, cols]``.
RANGE_VIEW = {None: (1, 1), 0: (1, -1), 1: (-1, 1)}

# MIN_RANGE_WIDTH (from pyg_quant.layout, which the kernels' csrc/layout.h mirrors): the narrowest range
# collapse_narrow_range keeps, 255 normal float32 steps, so that ``1 / s`` is finite at up to 8 bits.


def affine_scale(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """The step ``s = (hi − lo) / (2**bits − 1)`` of float32 ranges of any (equal) shape, tensor by tensor."""
    return (hi - lo) / torch.full_like(hi, float(2**bits - 1))


def affine_params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(scale, inv_scale)`` of float32 ranges ``[lo, hi]`` of any (equal) shape: :func:`affine_scale` and its
    inverse, 0 where the scale is 0 (a range of one value: every code is 0)."""
    scale = affine_scale(lo, hi, bits)
    inv_scale = torch.where(scale > 0, torch.ones_like(scale) / scale, torch.zeros_like(scale))
    return scale, inv_scale


def collapse_narrow_range(lo: torch.Tensor, hi: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` with every range narrower than :data:`MIN_RANGE_WIDTH` collapsed to zero width (``hi = lo``).

    Such a range has a subnormal scale at up to 8 bits, whose inverse overflows: ``(x − lo)·inf`` is NaN in a fake
    quantizer, while the bit path's codes clamp it to 0.  An EMA range of a channel that stays zero (a dead ReLU)
    shrinks below it in ~830 steps at momentum 0.1; a saved state can hold one too.  At zero width every value
    quantizes to ``lo``.  A NaN range stays NaN."""
    return lo, torch.where(hi - lo < MIN_RANGE_WIDTH, lo, hi)
