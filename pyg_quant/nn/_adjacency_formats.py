r"""Every adjacency format PyG accepts, brought to one edge list and one bit layout.

Formats (rows of a sparse matrix are message *targets*, as in PyG's ``adj_t``):

* ``edge_index`` (``[2, E]`` integer tensor) with optional ``edge_weight``,
  read in the module's ``flow``;
* ``torch.sparse`` COO, CSR or CSC ``adj_t`` (its values are edge weights);
* ``torch_sparse.SparseTensor`` ``adj_t`` (when torch_sparse is installed);
* :class:`pyg_quant.BitAdjacency` (already in the bit layout; decoded to an edge
  list only where a float path needs one).

All of them become an :class:`EdgeSet` (sources, targets, optional weights and
multiplicities), and from there either a float ``index_add`` (training, and
``bits=None``) or bit tiles packed by :func:`pack_entries` in the format of
:mod:`pyg_quant.layout` (evaluation).  Under ``torch.compile`` the packing and
the integer product run as one custom op, :func:`edge_spmm_int`, whose output
shape does not depend on the data, so tracing needs no graph break.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch_geometric.typing import SparseTensor
from torch_geometric.utils import is_torch_sparse_tensor, to_edge_index

from .. import ops
from ..adjacency import BitAdjacency, bit_spmm
from ..bit_tensor import BitTensor
from ..compact_adjacency import DEFAULT_MIN_TILE_NNZ, CompactAdjacency, distinct_entries
from ..layout import TILE_COLS, TILE_ROWS
from ._graph_cache import deferred_index_check, host_read, index_bounds
from ._quantize import is_compiling



@dataclass
class EdgeSet:
    r"""A graph in message direction: edge ``e`` sends from ``src[e]`` to ``dst[e]``.

    ``weight`` (float) are edge weights or None; ``count`` (int) are exact
    multiplicities (from a decoded :class:`BitAdjacency`) or None for ones.
    ``loop_rule`` is how PyG adds self-loops to this format in ``gcn_norm``:
    ``"remaining"`` (edge_index: keep a present loop's weight, add ``fill``
    elsewhere), ``"add"`` (torch.sparse: ``fill`` on top of a present loop) or
    ``"replace"`` (SparseTensor ``fill_diag``: every diagonal entry becomes
    ``fill``).  ``bit_adj`` is the user's :class:`BitAdjacency`, if that was the
    input; ``src``/``dst`` are then decoded from it on demand.
    """
    num_src: int
    num_dst: int
    src: Optional[torch.Tensor] = None
    dst: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    count: Optional[torch.Tensor] = None
    loop_rule: str = "remaining"
    bit_adj: Optional[BitAdjacency] = None

    def decoded(self) -> "EdgeSet":
        """The same graph with ``src``/``dst``/``count`` filled in from ``bit_adj``."""
        if self.src is not None:
            return self
        src, dst, count = decode_bit_adjacency(self.bit_adj)
        return EdgeSet(self.num_src, self.num_dst, src, dst, None, count, self.loop_rule, self.bit_adj)


def _check_index_range(edge_index: torch.Tensor, flow: str, num_src: int, num_dst: int, name: str) -> None:
    if is_compiling() or edge_index.numel() == 0:
        return
    if deferred_index_check(edge_index, lambda tensor: _check_index_range(tensor, flow, num_src, num_dst, name)):
        return  # a captured step: checked on each batch before its replay

    def compute():
        # The four extrema in one reduction and one host synchronisation (a sync per extremum
        # cost three per layer call, each stalling the launch queue on a GPU).
        lows, highs = torch.aminmax(edge_index, dim=1)
        with host_read():
            (low_0, low_1), (high_0, high_1) = torch.stack((lows, highs)).tolist()
        return min(low_0, low_1), high_0, high_1

    low, high_0, high_1 = index_bounds(edge_index, compute)
    high_src, high_dst = (high_0, high_1) if flow == "source_to_target" else (high_1, high_0)
    if low < 0:
        raise ValueError(f"{name} holds negative node indices")
    if high_src >= num_src or high_dst >= num_dst:
        nodes = num_src if num_src == num_dst else f"{num_src} sources and {num_dst} targets"
        raise ValueError(f"{name} holds node indices out of range for a graph of {nodes} nodes "
                         f"(the node count comes from x)")


def _reject_reverse_flow(flow: str, what: str) -> None:
    if flow == "target_to_source":
        raise ValueError(f"flow='target_to_source' is not supported for a {what} adjacency (its rows are the "
                         f"message targets, as in PyG); pass an edge_index instead")


def to_edge_set(adj, edge_weight: Optional[torch.Tensor], num_src: int, num_dst: int, flow: str,
                sparse_tensor_values: bool = True, name: str = "edge_index") -> EdgeSet:
    r"""Reads any supported adjacency into an :class:`EdgeSet`, checking it against the node counts.

    ``sparse_tensor_values=False`` ignores the values of a ``SparseTensor`` (what PyG's
    ``GINConv`` does); torch.sparse values are always edge weights, as in PyG's
    ``spmm``.
    """
    if isinstance(adj, BitAdjacency):
        _reject_reverse_flow(flow, "BitAdjacency")
        if edge_weight is not None:
            raise ValueError("edge_weight cannot be combined with a BitAdjacency (it holds the graph already)")
        if adj.shape != (num_dst, num_src):
            raise ValueError(f"{name} is a BitAdjacency of shape {adj.shape} (targets × sources) but the node "
                             f"features give {(num_dst, num_src)}")
        return EdgeSet(num_src, num_dst, loop_rule="remaining", bit_adj=adj)

    if isinstance(adj, SparseTensor):
        _reject_reverse_flow(flow, "SparseTensor")
        if edge_weight is not None:
            raise ValueError("edge_weight cannot be combined with a SparseTensor: pass the weights as its values")
        if tuple(adj.sparse_sizes()) != (num_dst, num_src):
            raise ValueError(f"{name} is a SparseTensor of size {tuple(adj.sparse_sizes())} but the node "
                             f"features give {(num_dst, num_src)}")
        row, col, value = adj.coo()
        weight = value.to(torch.float32) if (sparse_tensor_values and value is not None) else None
        return EdgeSet(num_src, num_dst, col.long(), row.long(), weight, None, "replace")

    if isinstance(adj, torch.Tensor) and is_torch_sparse_tensor(adj):
        _reject_reverse_flow(flow, "torch.sparse")
        if edge_weight is not None:
            raise ValueError("edge_weight cannot be combined with a sparse adjacency: pass the weights as its values")
        if adj.dim() != 2 or tuple(adj.shape) != (num_dst, num_src):
            raise ValueError(f"{name} is a sparse tensor of shape {tuple(adj.shape)} but the node features "
                             f"give {(num_dst, num_src)} (targets × sources: pass adj.t())")
        if adj.layout == torch.sparse_coo:
            # PyG marks a COO tensor coalesced without coalescing it, which autograd cannot
            # differentiate; coalescing for real keeps the values' gradient (same Â).
            adj = adj if adj.is_coalesced() else adj.coalesce()
            index, value = adj.indices(), adj.values()
        else:
            index, value = to_edge_index(adj)
        weight = value if value.is_floating_point() else value.to(torch.float32)
        return EdgeSet(num_src, num_dst, index[1], index[0], weight, None, "add")

    if not isinstance(adj, torch.Tensor):
        # to_hetero tells edge arguments from node ones by their names: a misnamed one arrives as None or a pair
        hint = (" (torch_geometric.nn.to_hetero passes None or a pair here when the model's argument for the edges "
                "is named with neither 'edge' nor 'adj')" if adj is None or isinstance(adj, tuple) else "")
        raise TypeError(f"{name} must be an edge_index tensor, a torch.sparse tensor, a SparseTensor or a "
                        f"pyg_quant.BitAdjacency, got {type(adj).__name__}{hint}")
    if adj.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{name} must hold integer node indices, got {adj.dtype}")
    if adj.dim() != 2 or adj.size(0) != 2:
        raise ValueError(f"{name} must have shape [2, num_edges], got {tuple(adj.shape)}")
    _check_index_range(adj, flow, num_src, num_dst, name)  # before .long(): an int32 index keeps its identity
    adj = adj.long()
    src, dst = (adj[0], adj[1]) if flow == "source_to_target" else (adj[1], adj[0])
    if edge_weight is not None:
        if not isinstance(edge_weight, torch.Tensor) or not edge_weight.is_floating_point():
            raise TypeError("edge_weight must be a floating-point tensor")
        if edge_weight.dim() == 2 and edge_weight.size(1) == 1:
            edge_weight = edge_weight.view(-1)
        if edge_weight.dim() != 1 or edge_weight.numel() != adj.size(1):
            raise ValueError(f"edge_weight must have shape [num_edges] = [{adj.size(1)}], "
                             f"got {tuple(edge_weight.shape)}")
    return EdgeSet(num_src, num_dst, src, dst, edge_weight, None, "remaining")


# --- the bit layout ---------------------------------------------------------------------
def pack_entries(dst: torch.Tensor, src: torch.Tensor, values: Optional[torch.Tensor], num_rows: int,
                 num_cols: int, min_tile_nnz: int = DEFAULT_MIN_TILE_NNZ,
                 adjacency: Optional[str] = None) -> BitAdjacency:
    r"""Packs ``A[dst[e], src[e]] += values[e]`` (ones when None) into a :class:`BitAdjacency`.

    ``adjacency`` is its form, as in :meth:`BitAdjacency.from_edge_index`: ``"auto"``
    keeps no tiles when the tiles ``min_tile_nnz`` plans would be less than
    :data:`~pyg_quant.compact_adjacency.MIN_TILE_FILL` full (the CSR gather is faster
    then), ``"tiles"`` / ``"csr"`` force one form; None (the default) is
    :data:`~pyg_quant.compact_adjacency.DEFAULT_ADJACENCY`.

    Sums repeated entries and drops zeros, then packs with
    :meth:`CompactAdjacency.from_entries <pyg_quant.compact_adjacency.CompactAdjacency.from_entries>`,
    the packer of :meth:`BitAdjacency.from_edge_index` (for unweighted edges the result is the
    same, field for field); any non-negative integer entry is allowed (one too
    large for 8 bit planes goes to the CSR residual).
    """
    device = dst.device
    keys = dst.long() * num_cols + src.long()
    if values is None:
        keys, sums = distinct_entries(keys)
    else:
        keys, inverse = torch.unique(keys, return_inverse=True)
        sums = torch.zeros(keys.numel(), dtype=torch.int64, device=device).index_add_(0, inverse, values.long())
        stored = sums != 0
        keys, sums = keys[stored], sums[stored]
    if sums.numel() and int(sums.min()) < 0:
        raise ValueError("pack_entries: entries must be non-negative")
    compact = CompactAdjacency.from_entries(keys, sums, num_rows, num_cols, min_tile_nnz)
    return compact.expand(tiles=compact.wants_tiles(adjacency))


def decode_bit_adjacency(adj: BitAdjacency) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(src, dst, count)`` of every stored entry of ``adj`` (tiles and residual; the diagonal term excluded)."""
    device = adj.device
    windows = adj.window_ptr.numel() - 1
    window_of_tile = torch.repeat_interleave(torch.arange(windows, device=device),
                                             adj.window_ptr[1:] - adj.window_ptr[:-1])
    shifts = torch.arange(32, device=device)
    keys, counts = [], []
    for p in range(adj.bits):
        words = adj.tile_bits[p].to(torch.int64) & 0xFFFFFFFF  # [tiles, 16, 8]
        tile, row, word = words.nonzero(as_tuple=True)  # only set words are expanded to bits
        bits = (words[tile, row, word].unsqueeze(-1) >> shifts) & 1
        which, k = bits.nonzero(as_tuple=True)
        dst = window_of_tile[tile[which]] * TILE_ROWS + row[which]
        src = adj.tile_col[tile[which]].long() * TILE_COLS + word[which] * 32 + k
        keys.append(dst * adj.num_cols + src)
        counts.append(torch.full_like(dst, 2**p))
    res_dst = torch.repeat_interleave(torch.arange(adj.num_rows, device=device), adj.res_ptr[1:] - adj.res_ptr[:-1])
    keys.append(res_dst * adj.num_cols + adj.res_col.long())
    counts.append(torch.ones_like(res_dst) if adj.res_val is None else adj.res_val.long())
    keys, inverse = torch.unique(torch.cat(keys), return_inverse=True)
    count = torch.zeros(keys.numel(), dtype=torch.int64, device=device).index_add_(0, inverse, torch.cat(counts))
    return keys % adj.num_cols, keys // adj.num_cols, count


def bit_spmm_codes(adj: BitAdjacency, x_planes: torch.Tensor, x_bits: int, cols: int,
                   x_codes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The integer product ``A · Q`` of ``adj``'s stored entries (diagonal term excluded) and column-layout codes
    (``x_codes``: their cached row codes, see :func:`pyg_quant.adjacency.gathered_codes`)."""
    return ops.bit_spmm_int(adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val,
                            x_planes, adj.num_rows, cols, adj.wide_sums(x_bits), x_codes)


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
