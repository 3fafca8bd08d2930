r"""Node features quantized once per graph, packed per batch.

The whole feature matrix is quantized once, with one range per column taken
over *all* nodes (``dim=0``), so every batch of every epoch sees the same codes
and the same ``lo``/``scale``, and a batch's features are exactly the rows of
``to_bit(x, bits, dim=0)``.  The codes are kept as a ``uint8[N, F]`` matrix in
cluster order: the nodes of a batch are a few contiguous row ranges of it, so
gathering them is a few ``memcpy``\ s; they are then packed in ``layout="col"``
(the layout :func:`pyg_quant.bit_spmm` reads) by the compiled pack op.  Packing
per cluster once instead would not do: in ``"col"`` layout the nodes run along
the bits of a word, so concatenating clusters would shift every bit.
"""
from typing import Sequence, Tuple

import torch

from .. import ops
from ..bit_tensor import BitTensor
from ..layout import check_bits
from ..quantization.affine import affine_params
from ..quantization.ranges import tensor_range


class QuantizedFeatures:
    r"""A feature matrix quantized once: ``x ≈ lo + scale · codes``, one range per column.

    Attributes:
        codes (Tensor): ``uint8[N, F]``, rows in the order of the source matrix.
        lo, scale (Tensor): float32 ``[F]``, the ranges over all ``N`` rows.
        bits (int): 1..8.
    """

    __slots__ = ("codes", "lo", "scale", "bits")

    def __init__(self, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int):
        self.codes, self.lo, self.scale, self.bits = codes, lo, scale, check_bits(bits)

    @classmethod
    def from_tensor(cls, x: torch.Tensor, bits: int, chunk_rows: int = 1 << 16,
                    progress: bool = False) -> "QuantizedFeatures":
        r"""Quantizes ``x`` (float ``[N, F]``) with the float32 steps of :func:`pyg_quant.to_bit` (``dim=0``).

        The codes are computed ``chunk_rows`` rows at a time (quantize + pack in
        ``"row"`` layout, then unpack to ``uint8``, both compiled ops), so the
        temporary memory stays small on products-scale graphs.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor to be quantized, got {x.dtype}")
        if x.dim() != 2 or x.numel() == 0:
            raise ValueError(f"x must be a non-empty 2-D [num_nodes, num_features] tensor, got {tuple(x.shape)}")
        bits = check_bits(bits)
        x = x.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(x).all()):
            raise ValueError("x must be finite (it holds NaN or inf)")
        # The same float32 tensor ops as to_bit(x, bits, dim=0), so the ranges and
        # codes agree with it bit for bit.
        lo, hi = tensor_range(x, 0, keepdim=True)
        scale, inv_scale = affine_params(lo, hi, bits)
        codes = torch.empty(x.shape, dtype=torch.uint8)
        starts = range(0, x.size(0), chunk_rows)
        if progress:
            from tqdm.auto import tqdm
            starts = tqdm(starts, desc=f"quantizing features to {bits} bits", unit="chunk")
        for start in starts:
            chunk = x[start:start + chunk_rows].contiguous()
            planes = ops.quantize_pack(chunk, lo, inv_scale, bits, False, None)
            codes[start:start + chunk.size(0)] = ops.unpack_codes(planes, chunk.size(0), x.size(1), False)
        return cls(codes, lo.reshape(-1), scale.reshape(-1), bits)

    @property
    def num_features(self) -> int:
        return self.codes.size(1)

    def gather(self, ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """The codes of rows ``[start, end)`` for each range, concatenated: ``uint8[Σ(end - start), F]``."""
        return torch.cat([self.codes[start:end] for start, end in ranges])

    def pack(self, codes: torch.Tensor) -> BitTensor:
        r"""A ``layout="col"``, ``dim=0`` BitTensor of the ``uint8[n, F]`` codes (``n >= 1``)."""
        # The pack op takes floats: codes q with lo = 0 and inv_scale = 1 give
        # floor(q + 0.5) = q exactly (q <= 255 is exact in float32).
        zero = torch.zeros(1, 1)
        planes = ops.quantize_pack(codes.to(torch.float32), zero, zero + 1, self.bits, True, None)
        return BitTensor(planes, tuple(codes.shape), self.bits, "col", self.lo, self.scale, 0)
