r"""Any-bitwidth GEMM on bit planes (QGTC's bitMM2Int / bitMM2Bit).

For ``a ≈ la + ra·Qa`` (``M×K``, scaled per tensor or per row) and
``b ≈ lb + rb·Qb`` (``K×N``, scaled per tensor or per column)::

    a @ b = K·la·lbᵀ + la·(rb ∘ 1ᵀQb) + (ra ∘ Qa1)·lbᵀ + (ra·rbᵀ) ∘ (Qa·Qb)

``Qa·Qb = Σ_{p,q} 2^(p+q) · popc(A_p AND B_q)`` runs on the bit planes in int32
(int64 when ``K·(2^s−1)·(2^t−1)`` would not fit); the affine terms are added in
float32, within ``8·2^-24`` of the sum of their magnitudes (``csrc/epilogue.h``).
"""
from typing import Optional

import torch

from . import ops
from ._utils import INT32_MAX
from .bit_tensor import BitTensor
from .quantization.quantize import to_bit


def _check_operands(a, b):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, BitTensor):
            raise TypeError(f"{name} must be a BitTensor, got {type(t).__name__}")
    if a.cols != b.rows:
        raise ValueError(f"a is {a.shape} and b is {b.shape}: a's columns must equal b's rows")
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} but b is on {b.device}")
    if a.dim not in (None, 1):
        raise ValueError("a must be scaled per tensor (dim=None) or per row (dim=1) for the "
                         "product to factor exactly; got per-column ranges (dim=0)")
    if b.dim not in (None, 0):
        raise ValueError("b must be scaled per tensor (dim=None) or per column (dim=0) for the "
                         "product to factor exactly; got per-row ranges (dim=1)")


def product_bound(k: int, a_bits: int, b_bits: int) -> int:
    """The largest possible entry of a code product with reduction length ``k``."""
    return k * (2**a_bits - 1) * (2**b_bits - 1)


def bitmm_int(a: BitTensor, b: BitTensor) -> torch.Tensor:
    """The int32 code product ``Qa · Qb`` (``[M, N]``), computed on bit planes.

    Raises ValueError if ``K·(2^s−1)·(2^t−1)`` exceeds int32 (use :func:`bitmm`,
    which widens, instead).
    """
    _check_operands(a, b)
    bound = product_bound(a.cols, a.bits, b.bits)
    if bound > INT32_MAX:
        raise ValueError(f"bitmm_int: K·(2^s−1)·(2^t−1) = {bound} overflows int32 "
                         f"(K={a.cols}, bits {a.bits}×{b.bits}); use bitmm, which accumulates in int64")
    return ops.bitmm_int(a.as_layout("row").planes, b.as_layout("col").planes, a.rows, b.cols, False)


def bitmm_float(a: BitTensor, b: BitTensor, bias: Optional[torch.Tensor] = None,
                relu: bool = False) -> torch.Tensor:
    r"""``relu?(to_val(a) @ to_val(b) + bias)``, float32; operands already checked by the caller.

    The integer product, the code sums and one fused epilogue kernel
    (``bitmm_affine``: the affine correction and the bias in float32) -- four launches whatever the widths.
    """
    a_row, b_col = a.as_layout("row"), b.as_layout("col")
    wide = product_bound(a.cols, a.bits, b.bits) > INT32_MAX
    product = ops.bitmm_int(a_row.planes, b_col.planes, a.rows, b.cols, wide)
    return ops.bitmm_affine(product, a_row.code_sums(), b_col.code_sums(), a.lo.expand(a.rows).contiguous(),
                            a.scale.expand(a.rows).contiguous(), b.lo.expand(b.cols).contiguous(),
                            b.scale.expand(b.cols).contiguous(), a.cols, bias, relu)


def bitmm(a: BitTensor, b: BitTensor, out_bits: Optional[int] = None, out_dim: Optional[int] = None,
          out_layout: str = "row", stochastic: bool = False,
          generator: Optional[torch.Generator] = None):
    r"""``to_val(a) @ to_val(b)`` computed on bit planes, as float32 ``[M, N]``.

    Equals the float64 product of the dequantized operands up to a few float32
    roundings of its terms (``csrc/epilogue.h``).  With ``out_bits`` the product is requantized (ranges over
    ``out_dim``, packed in ``out_layout``, optionally stochastic) and a
    :class:`BitTensor` is returned (QGTC's bitMM2Bit).
    """
    _check_operands(a, b)
    out = bitmm_float(a, b)
    if out_bits is None:
        return out
    return to_bit(out, out_bits, dim=out_dim, stochastic=stochastic, generator=generator, layout=out_layout)
