r"""Node features quantized once per graph, packed per batch.

The whole feature matrix is quantized once, with one range per column taken
over *all* nodes (``dim=0``, the default), so every batch of every epoch sees the
same codes and the same ``lo``/``scale``, and a batch's features are exactly the
rows of ``to_bit(x, bits, dim=0)``.  The codes are kept as a ``uint8[N, F]`` matrix in
cluster order: the nodes of a batch are a few contiguous row ranges of it, so
gathering them is a few ``memcpy``\ s; they are then packed in ``layout="col"``
(the layout :func:`pyg_quant.bit_spmm` reads) by the compiled pack op.  Packing
per cluster once instead would not do: in ``"col"`` layout the nodes run along
the bits of a word, so concatenating clusters would shift every bit.

With ``dim=1`` every node is quantized over its own range instead (the rows of
``to_bit(x, bits, dim=1)``, ``lo``/``scale`` one per node, gathered with the
codes) and a batch is packed in ``layout="row"``: the operand a linear layer
multiplies as it is (a QAT layer's per-node input quantizer takes such codes of
at most its width without quantizing them again; see :mod:`pyg_quant.qat.linear`),
but not one an aggregation ``A·X`` reads (that needs ranges per column).
"""
from typing import Optional, Sequence, Tuple

import torch

from .. import ops
from ..bit_tensor import BitTensor
from ..layout import check_bits
from ..quantization.affine import affine_params
from ..quantization.ranges import tensor_range


def check_feature_dim(dim, name: str = "dim") -> int:
    """``dim`` checked to be what feature ranges are reduced over: 0 (a range per feature) or 1 (a range per node)."""
    if isinstance(dim, bool) or dim not in (0, 1):
        raise ValueError(f"{name} must be 0 (a range per feature) or 1 (a range per node), got {dim!r}")
    return dim


class QuantizedFeatures:
    r"""A feature matrix quantized once: ``x ≈ lo + scale · codes``, one range per column (``dim=0``) or per node
    (``dim=1``).

    Attributes:
        codes (Tensor): ``uint8[N, F]``, rows in the order of the source matrix.
        lo, scale (Tensor): float32 ``[F]``, the ranges over all ``N`` rows (``dim=0``), or ``[N]``, each row's own
            (``dim=1``).
        bits (int): 1..8.
        dim (int): 0 or 1, what the ranges are reduced over (as in :func:`pyg_quant.to_bit`).
    """

    __slots__ = ("codes", "lo", "scale", "bits", "dim")

    def __init__(self, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, dim: int = 0):
        check_feature_dim(dim)
        expected = codes.size(1) if dim == 0 else codes.size(0)
        if lo.shape != (expected,) or scale.shape != (expected,):
            raise ValueError(f"lo and scale must have shape ({expected},) for dim={dim}, "
                             f"got {tuple(lo.shape)} and {tuple(scale.shape)}")
        self.codes, self.lo, self.scale, self.bits, self.dim = codes, lo, scale, check_bits(bits), dim

    @classmethod
    def from_tensor(cls, x: torch.Tensor, bits: int, chunk_rows: int = 1 << 16,
                    progress: bool = False, dim: int = 0) -> "QuantizedFeatures":
        r"""Quantizes ``x`` (float ``[N, F]``) with the float32 steps of :func:`pyg_quant.to_bit` (``dim=0``: a range
        per column over all nodes; ``dim=1``: each node over its own range).

        The codes are computed ``chunk_rows`` rows at a time (quantize + pack in
        ``"row"`` layout, then unpack to ``uint8``, both compiled ops), so the
        temporary memory stays small on products-scale graphs.
        """
        check_feature_dim(dim)
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
        # The same float32 tensor ops as to_bit(x, bits, dim), so the ranges and
        # codes agree with it bit for bit.
        lo, hi = tensor_range(x, dim, keepdim=True)
        scale, inv_scale = affine_params(lo, hi, bits)
        codes = torch.empty(x.shape, dtype=torch.uint8)
        starts = range(0, x.size(0), chunk_rows)
        if progress:
            from tqdm.auto import tqdm
            starts = tqdm(starts, desc=f"quantizing features to {bits} bits", unit="chunk")
        for start in starts:
            chunk = x[start:start + chunk_rows].contiguous()
            rows = slice(start, start + chunk.size(0))
            chunk_lo, chunk_inv = (lo, inv_scale) if dim == 0 else (lo[rows], inv_scale[rows])
            planes = ops.quantize_pack(chunk, chunk_lo, chunk_inv, bits, False, None)
            codes[rows] = ops.unpack_codes(planes, chunk.size(0), x.size(1), False)
        return cls(codes, lo.reshape(-1), scale.reshape(-1), bits, dim)

    @property
    def num_features(self) -> int:
        return self.codes.size(1)

    def gather(self, ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """The codes of rows ``[start, end)`` for each range, concatenated: ``uint8[Σ(end - start), F]``."""
        return torch.cat([self.codes[start:end] for start, end in ranges])

    def gather_ranges(self, ranges: Sequence[Tuple[int, int]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(lo, scale)`` of the rows :meth:`gather` takes: the columns' ranges as they are (``dim=0``), else the
        gathered rows' own."""
        if self.dim == 0:
            return self.lo, self.scale
        return (torch.cat([self.lo[start:end] for start, end in ranges]),
                torch.cat([self.scale[start:end] for start, end in ranges]))

    def pack(self, codes: torch.Tensor, lo: Optional[torch.Tensor] = None,
             scale: Optional[torch.Tensor] = None) -> BitTensor:
        r"""The BitTensor of the ``uint8[n, F]`` codes (``n >= 1``): ``layout="col"``, ``dim=0`` with the columns'
        ranges; for ``dim=1``, ``layout="row"``, ``dim=1`` with the rows' ``lo`` / ``scale`` (float32 ``[n]``, from
        :meth:`gather_ranges`), held as the codes themselves (:meth:`BitTensor.from_codes`)."""
        if (lo is None) != (self.dim == 0) or (scale is None) != (self.dim == 0):
            raise ValueError("lo and scale are the gathered rows' ranges: given for dim=1 features, not for dim=0")
        if self.dim == 0:
            return BitTensor(ops.pack_codes(codes, self.bits, True), tuple(codes.shape), self.bits, "col", self.lo,
                             self.scale, 0)
        # Per-node codes are what a QAT layer's CPU product reads as they are: kept as bytes, packed if asked.
        return BitTensor.from_codes(codes.contiguous(), self.bits, lo, scale, 1, "row")

    def batch(self, ranges: Sequence[Tuple[int, int]]) -> BitTensor:
        """The packed features of rows ``[start, end)`` for each range, concatenated (:meth:`gather`, then
        :meth:`pack`)."""
        codes = self.gather(ranges)
        return self.pack(codes) if self.dim == 0 else self.pack(codes, *self.gather_ranges(ranges))
