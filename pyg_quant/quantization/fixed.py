r"""Quantize with ranges fixed in advance (static, calibrated: :func:`pyg_quant.nn.calibrate`) rather than each
tensor's own.

:class:`FixedRanges` holds per-column ranges for ``bits``-bit codes, made from extrema ``[lo, hi]`` by
:mod:`.affine`'s steps, so that ranges calibrated on a tensor quantize it exactly as its own per-column ranges do
(:func:`.quantize.quantize` with ``dim=0``).  Values outside a range take its end codes:

.. math::
    q = \mathrm{clamp}\big(\lfloor (x - lo)\, s^{-1} + 1/2 \rfloor,\ 0,\ 2^b - 1\big), \qquad \tilde{x} = lo + s\,q.
"""
from typing import NamedTuple

import torch

from .. import ops
from .._utils import check_finite
from ..bit_tensor import BitTensor
from .affine import affine_params
from .quantize import fake_values


class FixedRanges(NamedTuple):
    """Per-column ranges fixed in advance for ``bits``-bit codes: float32 ``lo``, ``scale`` and ``inv_scale``
    ``[cols]``."""
    lo: torch.Tensor
    scale: torch.Tensor
    inv_scale: torch.Tensor
    bits: int

    @staticmethod
    def from_extrema(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> "FixedRanges":
        """The ranges ``[lo, hi]`` (any float dtype, ``cols`` entries each) for ``bits``-bit codes."""
        lo32 = lo.detach().to(torch.float32).reshape(-1).contiguous()
        scale, inv_scale = affine_params(lo32, hi.detach().to(torch.float32).reshape(-1), bits)
        return FixedRanges(lo32, scale, inv_scale, int(bits))

    def from_row_codes(self, row_codes: torch.Tensor, rows: int) -> BitTensor:
        """The BitTensor ``[rows, cols]`` of codes in these ranges held as packed row codes
        (:meth:`BitTensor.from_row_codes`)."""
        return BitTensor.from_row_codes(row_codes, (rows, self.lo.numel()), self.bits, self.lo, self.scale, 0)


def quantize_fixed(x: torch.Tensor, ranges: FixedRanges) -> BitTensor:
    """Round-to-nearest column-layout :class:`BitTensor` of a finite 2-D ``x`` ``[rows, cols]`` in fixed per-column
    ``ranges`` (a ValueError for other shapes, or NaN / inf values: their codes would hide them)."""
    if x.dim() != 2 or x.size(1) != ranges.lo.numel():
        raise ValueError(f"x must be 2-D with {ranges.lo.numel()} columns (one per calibrated range), got shape "
                         f"{tuple(x.shape)}")
    check_finite(x, "x", always=True)
    x32 = x.detach().to(torch.float32).contiguous()
    planes = ops.quantize_pack(x32, ranges.lo.view(1, -1), ranges.inv_scale.view(1, -1), ranges.bits, True, None)
    return BitTensor(planes, tuple(x32.shape), ranges.bits, "col", ranges.lo, ranges.scale, 0)


def fake_quantize_fixed(x: torch.Tensor, ranges: FixedRanges) -> torch.Tensor:
    r"""``lo + scale·q`` of :func:`quantize_fixed`'s codes, float32 ``[rows, cols]``, with a straight-through
    gradient (:func:`.quantize.fake_values`)."""
    return fake_values(x, *(t.view(1, -1) for t in ranges[:3]), ranges.bits, 0.5)
