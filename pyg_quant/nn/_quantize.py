r"""Quantizers shared by the layers: a bit-plane one for the kernels and a fake one for autograd.

Both follow :func:`pyg_quant.to_bit` step for step (ranges ``lo = min``,
``scale = (max − min) / (2**bits − 1)``, codes ``floor((x − lo)·(1/scale) + u)``
in float32, ``u = 0.5`` or ``u ~ U[0, 1)``), so for the same input and nearest
rounding they produce the same codes.  :func:`quantize` skips ``to_bit``'s
data-dependent input checks, which ``torch.compile`` cannot trace without a
graph break; the layers check their inputs on eager calls where a check costs no
host synchronization (:func:`~pyg_quant._utils.check_finite`).
"""
from typing import NamedTuple, Optional

import torch

from .. import ops
from .._utils import check_finite, is_compiling
from ..bit_tensor import BitTensor, _check_bits, to_val


def check_bits(bits, name: str) -> Optional[int]:
    """``None`` (no quantization) or an int in 1..8; errors name the argument."""
    return None if bits is None else _check_bits(bits, name)


def values_finite(x: BitTensor) -> bool:
    """Whether every value ``lo + scale·q`` of ``x`` is finite, judged from its ranges alone: that float32 recipe is
    monotone in ``q``, so each range's values lie between those of codes 0 and ``2**bits - 1``.  A False may be
    over-cautious (codes that never reach the end of a range); callers then dequantize and :func:`check_finite`.
    True wherever :func:`check_finite` does not check (traced code, a GPU: there non-finite values propagate)."""
    if is_compiling() or x.device.type != "cpu":
        return True  # (x.device: asking x.planes would make a row-code tensor's planes)
    lo, scale = x.lo.detach(), x.scale.detach()
    ends = torch.stack((lo + scale * 0.0, lo + scale * float(2**x.bits - 1)))
    return bool(torch.isfinite(ends).all())


def _ranges_of_extrema(lo: torch.Tensor, hi: torch.Tensor, bits: int):
    """``(lo, scale, inv_scale)`` of float32 extrema: to_bit's steps (``inv_scale`` 0 where ``scale`` is 0)."""
    scale = (hi - lo) / torch.full_like(hi, float(2**bits - 1))
    inv_scale = torch.where(scale > 0, torch.ones_like(scale) / scale, torch.zeros_like(scale))
    return lo, scale, inv_scale


def _ranges(x32: torch.Tensor, bits: int, dim: Optional[int]):
    if dim is None:
        return _ranges_of_extrema(x32.min().view(1, 1), x32.max().view(1, 1), bits)
    return _ranges_of_extrema(x32.amin(dim, keepdim=True), x32.amax(dim, keepdim=True), bits)


def _fake_values(x: torch.Tensor, lo, scale, inv_scale, bits: int, offset) -> torch.Tensor:
    """``lo + scale·q`` (float32) of ``x``'s codes for broadcast ranges, with a straight-through gradient."""
    x32 = x.to(torch.float32)
    detached = x32.detach()
    codes = torch.floor((detached - lo) * inv_scale + offset).clamp_(0, 2**bits - 1)
    # deq + (x − x) is deq exactly (x − x is exactly 0 for finite x), and its gradient is 1.
    return (lo + scale * codes) + (x32 - detached)


def quantize(x: torch.Tensor, bits: int, dim: Optional[int], layout: str,
             col_keys: Optional[torch.Tensor] = None) -> BitTensor:
    """Round-to-nearest :class:`BitTensor` of a 2-D tensor, codes identical to ``pq.to_bit``.  ``col_keys`` (per-column
    ranges in the column layout): the column keys of ``x`` as the kernel that made it gave them
    (:func:`pyg_quant.ops.quant_mlp`'s), which spare the quantizer its own pass over ``x`` for the ranges."""
    x32 = x.detach().to(torch.float32).contiguous()
    if col_keys is not None and (dim != 0 or layout != "col"):
        raise ValueError(f"col_keys needs per-column ranges in the column layout (dim=0, layout='col'), got "
                         f"dim={dim}, layout={layout!r}")
    if dim is None or x32.numel() == 0:
        lo, scale, inv_scale = _ranges(x32, bits, dim)
        planes = ops.quantize_pack(x32, lo, inv_scale, bits, layout == "col", None)
        return BitTensor(planes, (x32.size(0), x32.size(1)), bits, layout, lo.reshape(-1), scale.reshape(-1), dim)
    # Ranges, codes and code sums in one op (one kernel for per-row ranges in row layout on the GPU).  Per-column
    # codes on the GPU are what bit_spmm gathers as row codes: the quantizer writes those in the same pass, and skips
    # the code sums, which bit_spmm never reads (BitTensor.code_sums() makes them if a bitmm asks).
    row_codes = x32.is_cuda and dim == 0 and layout == "col"
    packed = ops.quantize_pack_ranges(x32, bits, dim, layout == "col", None, row_codes, col_keys, not row_codes)
    return bit_tensor_of(packed, (x32.size(0), x32.size(1)), bits, dim)


def bit_tensor_of(packed, shape, bits: int, dim: int) -> BitTensor:
    """The :class:`BitTensor` of ``ops.quantize_pack_ranges``' result ``(planes, lo, scale, code_sums, row_codes)``
    (column layout for ranges per column, ``dim`` 0, row layout per row), with the row codes or the code sums it
    came with (whichever is not empty)."""
    return BitTensor._of_op((int(shape[0]), int(shape[1])), int(bits), dim, *packed)


def fake_quantize(x: torch.Tensor, bits: int, dim: Optional[int], stochastic: bool = False) -> torch.Tensor:
    r"""``lo + scale·q`` of a 2-D tensor with a straight-through gradient (``∂/∂x = 1``).

    The ranges come from the detached input, as in :func:`quantize`; the result
    is float32 (the dtype of the bit kernels' results).
    """
    detached = x.detach().to(torch.float32)
    offset = torch.rand_like(detached) if stochastic else 0.5
    return _fake_values(x, *_ranges(detached, bits, dim), bits, offset)


def fits(x: BitTensor, bits: Optional[int], dims) -> bool:
    """Whether a kernel can take ``x`` as it is: the layer's bit width and a range layout it factors over."""
    return bits is not None and x.bits == bits and x.dim in dims


def dequantize(x: BitTensor) -> torch.Tensor:
    return to_val(x)


class FixedRanges(NamedTuple):
    """Per-column ranges fixed in advance (calibrated, see :mod:`pyg_quant.nn.calibration`) for ``bits``-bit codes:
    float32 ``lo``, ``scale`` and ``inv_scale`` ``[cols]``, made from the extrema by the dynamic quantizer's own steps
    (:func:`_ranges_of_extrema`), so that ranges calibrated on a tensor quantize it exactly as its own per-column
    ranges do."""
    lo: torch.Tensor
    scale: torch.Tensor
    inv_scale: torch.Tensor
    bits: int

    @staticmethod
    def from_extrema(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> "FixedRanges":
        lo32, scale, inv_scale = _ranges_of_extrema(lo.detach().to(torch.float32).reshape(-1).contiguous(),
                                                    hi.detach().to(torch.float32).reshape(-1), bits)
        return FixedRanges(lo32, scale, inv_scale, int(bits))

    def from_row_codes(self, row_codes: torch.Tensor, rows: int) -> BitTensor:
        """The same, held as its packed row codes (:meth:`BitTensor.from_row_codes`)."""
        return BitTensor.from_row_codes(row_codes, (rows, self.lo.numel()), self.bits, self.lo, self.scale, 0)


def quantize_fixed(x: torch.Tensor, ranges: FixedRanges) -> BitTensor:
    """Round-to-nearest column-layout :class:`BitTensor` of a 2-D ``x`` with fixed per-column ranges: codes
    ``clamp(floor((x − lo)·inv_scale + 0.5), 0, 2**bits − 1)``, so values outside a range take its end codes."""
    if x.dim() != 2 or x.size(1) != ranges.lo.numel():
        raise ValueError(f"x must be 2-D with {ranges.lo.numel()} columns (one per calibrated range), got shape "
                         f"{tuple(x.shape)}")
    check_finite(x, "x", always=True)
    x32 = x.detach().to(torch.float32).contiguous()
    planes = ops.quantize_pack(x32, ranges.lo.view(1, -1), ranges.inv_scale.view(1, -1), ranges.bits, True, None)
    return BitTensor(planes, tuple(x32.shape), ranges.bits, "col", ranges.lo, ranges.scale, 0)


def fake_quantize_fixed(x: torch.Tensor, ranges: FixedRanges) -> torch.Tensor:
    r"""``lo + scale·q`` of :func:`quantize_fixed`'s codes, float32, with a straight-through gradient."""
    return _fake_values(x, *(t.view(1, -1) for t in ranges[:3]), ranges.bits, 0.5)
