r"""Every adjacency format PyG accepts, read into one edge list, :class:`EdgeSet`, and checked against the nodes.

Formats (rows of a sparse matrix are message *targets*, as in PyG's ``adj_t``):

* ``edge_index`` (``[2, E]`` integer tensor) with optional ``edge_weight``,
  read in the module's ``flow``;
* ``torch.sparse`` COO, CSR or CSC ``adj_t`` (its values are edge weights);
* ``torch_sparse.SparseTensor`` ``adj_t`` (when torch_sparse is installed);
* :class:`pyg_quant.BitAdjacency` (already in the bit layout; decoded to an edge
  list only where a float path needs one).

All of them become an :class:`EdgeSet` (sources, targets, optional weights and
multiplicities), from which :class:`~pyg_quant.graph.quant_graph.QuantGraph`
aggregates in float or packs bit tiles (:mod:`pyg_quant.graph.packing`).
"""
from dataclasses import dataclass
from typing import Optional

import torch
from torch_geometric.typing import SparseTensor
from torch_geometric.utils import is_torch_sparse_tensor, to_edge_index

from .._utils import is_compiling
from .bit_adjacency import BitAdjacency
from .cache import deferred_index_check, host_read, index_bounds
from .float_csr import csr_matrix, csr_tensor, scaled_csr_pair
from .packing import decode_bit_adjacency


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
        adj = self.bit_adj
        # decoded once per adjacency: every layer of a model reads the same batch's
        src, dst, count = bit_adjacency_entries(adj)
        return EdgeSet(self.num_src, self.num_dst, src, dst, None, count, self.loop_rule, self.bit_adj)


def bit_adjacency_entries(adj: BitAdjacency):
    """``(src, dst, count)`` of ``adj``'s stored entries (its diagonal term apart), decoded once per adjacency: every
    layer of a model reads the same batch's.  The tile-free form's entries are its residual as stored (read, not kept:
    a copy would only double them)."""
    if adj.num_tiles == 0:
        return decode_bit_adjacency(adj)
    return adj.derived("entries", lambda: torch.stack(decode_bit_adjacency(adj))).unbind(0)


def residual_csr(adj: BitAdjacency, values: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The CSR matrix of ``adj``'s residual entries with ``values`` (one per entry, in ``res_col``'s order; None: their
    multiplicities): for an adjacency without tiles, its stored entries as they are, with no decoding, no sort and no
    host synchronization."""
    if values is None:
        values = (torch.ones(adj.res_col.numel(), dtype=dtype, device=adj.device) if adj.res_val is None
                  else adj.res_val)
    return csr_tensor(adj.res_ptr, adj.res_col, values.to(dtype), adj.num_rows, adj.num_cols)


def bit_adjacency_csr(adj: BitAdjacency, dtype: torch.dtype, transpose: bool = False) -> torch.Tensor:
    """``adj``'s stored entries (``Aᵀ`` with ``transpose``; the diagonal term apart) as a CSR matrix of ``dtype``,
    built once per adjacency and dtype (without tiles, from its residual's CSR: ``A`` as it is, ``Aᵀ`` one sort)."""
    def make() -> torch.Tensor:
        if adj.num_tiles == 0 and not transpose:
            return residual_csr(adj, None, dtype)
        src, dst, count = bit_adjacency_entries(adj)  # (Aᵀ without tiles: the residual's entries, one sort)
        if transpose:
            return csr_matrix(src, dst, count.to(dtype), adj.num_cols, adj.num_rows, dtype)
        return csr_matrix(dst, src, count.to(dtype), adj.num_rows, adj.num_cols, dtype)

    return adj.derived(f"csr_{'a_t' if transpose else 'a'}_{dtype}", make)


def bit_adjacency_scaled_csr(adj: BitAdjacency, row_scale: torch.Tensor, dtype: torch.dtype):
    """``(M, Mᵀ)`` of :func:`~pyg_quant.graph.float_csr.scaled_csr_pair` for ``adj`` (its diagonal term folded in)
    with ``row_scale`` (a per-node vector derived from ``adj`` and kept on it, GCN's ``D^-1/2``), built once per
    adjacency and dtype."""
    def make():
        src, dst, count = bit_adjacency_entries(adj)
        return scaled_csr_pair(dst, src, count, row_scale, adj.diag, adj.num_rows, adj.num_cols, dtype)

    return adj.derived(f"scaled_csr_{dtype}", make)


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
