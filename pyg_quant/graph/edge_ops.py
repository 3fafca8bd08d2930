r"""The packing and the product in one registered op each, for models that ``torch.compile`` traces.

The packed size of an adjacency depends on the data, so tracing the packing would break the graph; the products'
shapes do not.  :func:`edge_spmm_int` (the integer product ``A·Q``) and :func:`edge_bit_spmm` (``bit_spmm`` with its
fused epilogue) take the edge list, pack it (:func:`~pyg_quant.graph.packing.pack_entries`) and multiply inside the
op, so :class:`~pyg_quant.graph.quant_graph.QuantGraph` traces without a graph break (it cannot keep the packed
adjacency between calls there; eager mode with ``cached=True`` can).
"""
from typing import Optional

import torch

from ..bit_tensor import BitTensor
from .packing import pack_entries
from .spmm import bit_spmm, bit_spmm_codes


@torch.library.custom_op("pyg_quant_nn::edge_spmm_int", mutates_args=())
def edge_spmm_int(src: torch.Tensor, dst: torch.Tensor, keep: Optional[torch.Tensor], values: Optional[torch.Tensor],
                  x_planes: torch.Tensor, num_src: int, num_dst: int, x_bits: int, cols: int,
                  min_tile_nnz: int, adjacency: Optional[str] = None) -> torch.Tensor:
    r"""``A · Q`` as int64 ``[num_dst, cols]`` for ``A[dst, src] += values`` over the edges with ``keep``.

    Packs the tiles (:func:`pack_entries`) and runs the bit-plane kernel in one
    op: the packed sizes depend on the data, the result's shape does not, so
    ``torch.compile`` traces it without a graph break (it cannot keep the
    packed adjacency between calls; eager mode with ``cached=True`` can).
    """
    if keep is not None:
        src, dst = src[keep], dst[keep]
        values = values[keep] if values is not None else None
    adj = pack_entries(dst, src, values, num_dst, num_src, min_tile_nnz, adjacency)
    return bit_spmm_codes(adj, x_planes, x_bits, cols).to(torch.int64)


@edge_spmm_int.register_fake
def _(src, dst, keep, values, x_planes, num_src, num_dst, x_bits, cols, min_tile_nnz, adjacency=None):
    return x_planes.new_empty((num_dst, cols), dtype=torch.int64)


@torch.library.custom_op("pyg_quant_nn::edge_bit_spmm", mutates_args=())
def edge_bit_spmm(src: torch.Tensor, dst: torch.Tensor, keep: Optional[torch.Tensor], values: Optional[torch.Tensor],
                  x_planes: torch.Tensor, x_lo: torch.Tensor, x_scale: torch.Tensor, x_dim: int, x_bits: int,
                  num_src: int, num_dst: int, cols: int, min_tile_nnz: int, adjacency: Optional[str],
                  self_weight: Optional[torch.Tensor], row_scale: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
    r""":func:`pyg_quant.bit_spmm` with its fused epilogue on the tiles :func:`edge_spmm_int` packs, in one op.

    The column-layout codes ``x_planes`` with ranges ``x_lo`` / ``x_scale`` (``x_dim`` 0, or -1 for one range) are
    the ``[num_src, cols]`` operand.  Traced models get the eager layers' fused epilogue (the same floats) from it.
    """
    if keep is not None:
        src, dst = src[keep], dst[keep]
        values = values[keep] if values is not None else None
    adj = pack_entries(dst, src, values, num_dst, num_src, min_tile_nnz, adjacency)
    x = BitTensor(x_planes, (num_src, cols), x_bits, "col", x_lo, x_scale, None if x_dim < 0 else x_dim)
    return bit_spmm(adj, x, self_weight=self_weight, row_scale=row_scale, bias=bias)


@edge_bit_spmm.register_fake
def _(src, dst, keep, values, x_planes, x_lo, x_scale, x_dim, x_bits, num_src, num_dst, cols, min_tile_nnz, adjacency,
      self_weight, row_scale, bias):
    return x_planes.new_empty((num_dst, cols), dtype=torch.float32)
