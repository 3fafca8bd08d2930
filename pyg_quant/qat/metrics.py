r"""A quantization error metric and a bit-width recommendation from it (after TANGO's accuracy rules).

The error of quantizing ``x`` to ``b`` bits is the relative L2 error

.. math::
    e_b(x) = \frac{\lVert \tilde{x}_b - x \rVert_2}{\lVert x \rVert_2},

measured with round-to-nearest over the ranges of ``x`` reduced over ``dim`` (the
granularity the layer would use).  For uniform quantization
:math:`e_b \approx \frac{s_b}{\sqrt{12}}\frac{\sqrt{n}}{\lVert x\rVert_2}` with
:math:`s_b = (hi - lo)/(2^b - 1)`, so every extra bit roughly halves it.
:func:`recommend_bits` returns the fewest bits whose error stays under a
threshold: measure it on a layer's weights or on its activations from one
forward pass, before training.
"""
from typing import Dict, Iterable, Optional

import torch

from ..layout import check_bits
from ..quantization.quantize import check_matrix
from ..quantization.fake_quantize import FakeQuantize
from ..quantization.observers import check_dim


def quantization_error(x: torch.Tensor, bits: int, dim: Optional[int] = None) -> float:
    r"""``‖x̃ − x‖₂ / ‖x‖₂`` for round-to-nearest ``bits``-bit codes of the 2-D ``x`` (ranges over ``dim``).

    Returns 0.0 for an all-zero ``x``.
    """
    check_matrix(x)
    fq = FakeQuantize(check_bits(bits), "dynamic", check_dim(dim), stochastic=False).eval()
    x64 = x.detach().double()
    norm = float(x64.norm())
    if norm == 0.0:
        return 0.0
    with torch.no_grad():
        return float((fq(x).double() - x64).norm()) / norm


def quantization_errors(x: torch.Tensor, dim: Optional[int] = None,
                        candidates: Iterable[int] = (1, 2, 4, 8)) -> Dict[int, float]:
    """``{bits: quantization_error(x, bits, dim)}`` for every candidate width."""
    return {int(b): quantization_error(x, b, dim) for b in candidates}


def recommend_bits(x: torch.Tensor, threshold: float = 0.05, dim: Optional[int] = None,
                   candidates: Iterable[int] = (1, 2, 4, 8)) -> Optional[int]:
    r"""The fewest candidate bits with ``quantization_error(x, bits, dim) <= threshold``, or None if none qualify.

    Args:
        x (Tensor): ``[rows, cols]``, e.g. a weight or one forward pass's activations.
        threshold (float): the largest acceptable relative L2 error, > 0.
        dim (int, optional): the granularity of the ranges (``None``, ``0`` or ``1``).
        candidates (iterable of int): widths to try, each 1..8.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"threshold must be a positive number, got {threshold!r}")
    widths = sorted({check_bits(b, "candidates") for b in candidates})
    if not widths:
        raise ValueError("candidates must name at least one bit width")
    for bits in widths:
        if quantization_error(x, bits, dim) <= threshold:
            return bits
    return None
