r"""Quantize a 2-D tensor over its own ranges: into a :class:`~pyg_quant.BitTensor` for the kernels, or into its
dequantized values with a straight-through gradient for autograd; and back to floats.

For ``x`` ``[rows, cols]``, ranges reduced over ``dim`` (:func:`.ranges.tensor_range`: ``lo = min``, ``hi = max``)
and ``b`` bits, with :mod:`.affine`'s ``s`` and ``s^{-1}``:

.. math::
    q = \mathrm{clamp}\big(\lfloor (x - lo)\, s^{-1} + u \rfloor,\ 0,\ 2^b - 1\big), \qquad \tilde{x} = lo + s\,q,

in float32 step by step as :func:`pyg_quant.to_bit` (``u = 1/2``, or ``u ~ U[0, 1)`` for stochastic rounding), so
for one input and nearest rounding every function here makes ``to_bit``'s codes.  They skip ``to_bit``'s
data-dependent input checks, which ``torch.compile`` cannot trace without a graph break; callers check their inputs
where a check costs no host synchronization (:func:`pyg_quant._utils.check_finite`).
"""
import math
from typing import Optional

import torch

from .. import ops
from .._utils import is_compiling
from ..bit_tensor import BitTensor, check_dim, to_val
from ..layout import check_bits, check_layout
from .affine import RANGE_VIEW, affine_params
from .ranges import tensor_range


def _own_params(x32: torch.Tensor, bits: int, dim: Optional[int]):
    """``(lo, scale, inv_scale)`` of ``x32``'s own ranges, shaped to broadcast against it."""
    lo, hi = tensor_range(x32, dim, keepdim=True)
    return (lo,) + affine_params(lo, hi, bits)


def quantize(x: torch.Tensor, bits: int, dim: Optional[int], layout: str,
             col_keys: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None) -> BitTensor:
    """The :class:`BitTensor` of a 2-D float ``x`` over its own ranges (reduced over ``dim``), packed in ``layout``,
    rounded to nearest, or stochastically with ``noise`` (``U[0, 1)``, ``x``'s shape): the codes of
    ``pq.to_bit(x, bits, dim, layout=layout)``, without its input checks.

    ``col_keys`` (per-column ranges in the column layout only): the column keys of ``x`` as the kernel that made
    it gave them (:func:`pyg_quant.ops.quant_mlp`'s), which spare the quantizer its own pass over ``x`` for the
    ranges.
    """
    x32 = x.detach().to(torch.float32).contiguous()
    if col_keys is not None and (dim != 0 or layout != "col"):
        raise ValueError(f"col_keys needs per-column ranges in the column layout (dim=0, layout='col'), got "
                         f"dim={dim}, layout={layout!r}")
    if dim is None or x32.numel() == 0:
        lo, scale, inv_scale = _own_params(x32, bits, dim)
        planes = ops.quantize_pack(x32, lo, inv_scale, bits, layout == "col", noise)
        return BitTensor(planes, (x32.size(0), x32.size(1)), bits, layout, lo.reshape(-1), scale.reshape(-1), dim)
    # Ranges, codes and code sums in one op (one kernel for per-row ranges in row layout on the GPU).  Per-column
    # codes on the GPU are what bit_spmm gathers as row codes: the quantizer writes those in the same pass, and skips
    # the code sums, which bit_spmm never reads (BitTensor.code_sums() makes them if a bitmm asks).
    row_codes = x32.is_cuda and dim == 0 and layout == "col"
    packed = ops.quantize_pack_ranges(x32, bits, dim, layout == "col", noise, row_codes, col_keys, not row_codes)
    return BitTensor.from_quantized(packed, (x32.size(0), x32.size(1)), bits, dim, layout)


def check_matrix(x, name: str = "x") -> torch.Tensor:
    """``x`` if it is a non-empty 2-D floating-point tensor (what every quantizer takes), else a TypeError or
    ValueError naming the argument ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(x.shape)}")
    return x


def to_bit(x: torch.Tensor, bits: int, dim: Optional[int] = None, stochastic: bool = False,
           generator: Optional[torch.Generator] = None, layout: str = "row") -> BitTensor:
    r"""Quantizes a 2-D float tensor to ``bits`` bits and packs its bit planes.

    ``x ≈ lo + scale · q``, ``q ∈ [0, 2**bits − 1]``, ``lo = min``,
    ``scale = (max − min) / (2**bits − 1)``, the ranges reduced over ``dim``
    (``None``: the whole tensor; ``0``: over rows, one range per column; ``1``:
    over columns, one per row).  Rounding is to nearest, or stochastic
    (``q = floor(v + u)``, ``u ~ U[0, 1)`` drawn from ``generator``: unbiased,
    ``E[to_val(to_bit(x))] = x``, and the same seed gives the same codes).

    Args:
        x (Tensor): ``[rows, cols]`` floating point, finite, non-empty.
        bits (int): 1..8.
        dim (int, optional): the reduction dimension of the ranges.
        stochastic (bool): stochastic instead of nearest rounding.
        generator (torch.Generator, optional): the noise source for stochastic rounding.
        layout (str): ``"row"`` or ``"col"``, the packing (see :mod:`pyg_quant.layout`).

    Raises a ValueError if ``x`` holds NaN or inf, judged from the ranges (a NaN or an inf makes the range that
    holds it non-finite), so the check costs no pass over ``x`` but one host synchronization on a GPU.
    """
    check_matrix(x)
    bits, dim, layout = check_bits(bits), check_dim(dim), check_layout(layout)
    if generator is not None and not stochastic:
        raise ValueError("generator is only used with stochastic=True")
    x32 = x.detach().to(torch.float32)
    noise = None
    if stochastic:
        if generator is not None and generator.device.type != x32.device.type:
            raise ValueError(f"generator is on {generator.device} but x is on {x32.device}")
        noise = torch.rand(x32.shape, generator=generator, device=x32.device, dtype=torch.float32)
    codes = quantize(x32, bits, dim, layout, noise=noise)
    if not bool(torch.isfinite(codes.lo).all() & torch.isfinite(codes.scale).all()):
        if not bool(torch.isfinite(x32).all()):
            raise ValueError("x must be finite (it holds NaN or inf)")
        raise ValueError("x's range max - min overflows float32; rescale x before quantizing")
    return codes


def fake_values(x: torch.Tensor, lo, scale, inv_scale, bits: int, offset) -> torch.Tensor:
    """``lo + scale·q`` (float32, ``x``'s shape) of ``x``'s codes ``q = clamp(floor((x − lo)·inv_scale + offset), 0,
    2**bits − 1)`` for ranges that broadcast against ``x`` (``offset``: 0.5, or ``U[0, 1)`` noise of ``x``'s shape),
    with a straight-through gradient: ``∂/∂x = 1`` everywhere."""
    x32 = x.to(torch.float32)
    detached = x32.detach()
    codes = torch.floor((detached - lo) * inv_scale + offset).clamp_(0, 2**bits - 1)
    # deq + (x − x) is deq exactly (x − x is exactly 0 for finite x), and its gradient is 1.
    return (lo + scale * codes) + (x32 - detached)


def fake_quantize(x: torch.Tensor, bits: int, dim: Optional[int], stochastic: bool = False) -> torch.Tensor:
    r"""A 2-D ``x`` fake-quantized over its own ranges (those of :func:`quantize`, from the detached input): float32
    ``x̃ = lo + s·q`` with ``∂x̃/∂x = 1``, rounded to nearest, or stochastically (``u ~ U[0, 1)`` from torch's global
    generator).  The one op a ``"dynamic"`` :class:`~pyg_quant.qat.FakeQuantize` runs (:func:`pyg_quant.ops.fake_quantize`
    without a range): the layers' built-in quantizer and QAT's dynamic one are the same computation."""
    return ops.fake_quantize(x.to(torch.float32), None, None, bits, -1 if dim is None else dim, None, False,
                             stochastic)[0]


def dequantize(x: BitTensor) -> torch.Tensor:
    """``lo + scale·q`` of ``x``, float32 ``[rows, cols]`` (:func:`pyg_quant.to_val`)."""
    return to_val(x)


def exact_values(codes: BitTensor) -> torch.Tensor:
    r"""``lo + scale·q`` of ``codes`` in float64, ``[rows, cols]``: the values :func:`~pyg_quant.to_val` rounds to
    float32, here unrounded (exact while ``|lo|`` and ``scale`` are within a factor 2^20 of each other, or lo is 0).

    The bit kernels' affine epilogues sum and multiply these values (``lo·Σ1 + scale·Σq``), not their float32
    roundings, so a float path that is to give the exact value of the kernels' results must compute with them.
    """
    view = RANGE_VIEW[codes.dim]
    return codes.lo.double().view(view) + codes.scale.double().view(view) * codes.codes().double()


def term_magnitudes(codes: BitTensor) -> torch.Tensor:
    r"""``|lo| + |scale|·q`` of ``codes`` in float64, ``[rows, cols]``: what each value contributes to the magnitudes of
    the terms the bit kernels' float32 epilogues add.  A product's error is measured against the same product of
    these (``pyg_quant.ops.reference.EPILOGUE_BOUND`` times it bounds the error of each output)."""
    view = RANGE_VIEW[codes.dim]
    return codes.lo.double().abs().view(view) + codes.scale.double().abs().view(view) * codes.codes().double()


def values_finite(x: BitTensor) -> bool:
    """Whether every value ``lo + scale·q`` of ``x`` is finite, judged from its ranges alone: that float32 recipe is
    monotone in ``q``, so each range's values lie between those of codes 0 and ``2**bits - 1``.  A False may be
    over-cautious (codes that never reach the end of a range); callers then dequantize and check the values.
    True wherever :func:`pyg_quant._utils.check_finite` does not check (traced code, a GPU: there non-finite values
    propagate)."""
    if is_compiling() or x.device.type != "cpu":
        return True  # (x.device: asking x.planes would make a row-code tensor's planes)
    # lo + scale·(2**bits - 1) is finite only where lo and scale both are; a sum that overflows from finite ends
    # only makes the answer over-cautious.
    top = x.lo.detach() + x.scale.detach() * float(2**x.bits - 1)
    return math.isfinite(top.sum().item())


def ranges_finite(x: BitTensor) -> bool:
    """Whether ``x``'s ranges (``lo`` and ``scale``) are finite: for ranges reduced over the values themselves (their
    min/max, which NaN and inf reach), whether those values were, at the cost of a few small ops.  True wherever
    :func:`pyg_quant._utils.check_finite` does not check (traced code, a GPU: there non-finite values propagate)."""
    if is_compiling() or x.lo.device.type != "cpu":
        return True
    return bool(torch.isfinite((x.lo + x.scale).sum()))


def fits(x: BitTensor, bits: Optional[int], dims) -> bool:
    """Whether a kernel can take the codes ``x`` as they are: ``bits``-bit (``None``: never) with ranges reduced over
    one of ``dims``."""
    return bits is not None and x.bits == bits and x.dim in dims
