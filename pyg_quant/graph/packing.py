r"""Edge lists to a :class:`~pyg_quant.BitAdjacency` and back: :func:`pack_entries` and :func:`decode_bit_adjacency`.

The layers pack the adjacency they build from an ``edge_index`` (or any other input format) with
:func:`pack_entries`, which sums repeated entries and plans the tiles with the same packer as
:meth:`BitAdjacency.from_edge_index <pyg_quant.BitAdjacency.from_edge_index>`; a float path given a BitAdjacency
decodes it to an edge list with :func:`decode_bit_adjacency`.
"""
from typing import Optional, Tuple

import torch

from ..layout import TILE_COLS, TILE_ROWS
from .adjacency_form import DEFAULT_MIN_TILE_NNZ
from .bit_adjacency import BitAdjacency, CompactAdjacency, distinct_entries


def pack_entries(dst: torch.Tensor, src: torch.Tensor, values: Optional[torch.Tensor], num_rows: int,
                 num_cols: int, min_tile_nnz: int = DEFAULT_MIN_TILE_NNZ,
                 adjacency: Optional[str] = None) -> BitAdjacency:
    r"""Packs ``A[dst[e], src[e]] += values[e]`` (ones when None) into a :class:`BitAdjacency`.

    ``adjacency`` is its form, as in :meth:`BitAdjacency.from_edge_index`: ``"auto"``
    keeps no tiles when the tiles ``min_tile_nnz`` plans would be less than
    :data:`~pyg_quant.graph.adjacency_form.MIN_TILE_FILL` full (the CSR gather is faster
    then), ``"tiles"`` / ``"csr"`` force one form; None (the default) is
    :data:`~pyg_quant.graph.adjacency_form.DEFAULT_ADJACENCY`.

    Sums repeated entries and drops zeros, then packs with
    :meth:`CompactAdjacency.from_entries <pyg_quant.graph.bit_adjacency.CompactAdjacency.from_entries>`,
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
    """``(src, dst, count)`` of every stored entry of ``adj`` (tiles and residual; the diagonal term excluded), in
    row-major order."""
    device = adj.device
    if adj.num_tiles == 0:
        # The CSR form's entries are distinct and row-major already (the packers' sorted keys): no decoding and no
        # sort, which torch.compile would otherwise run at every call of a traced layer.
        res_dst = adj.residual_rows()
        count = torch.ones_like(res_dst) if adj.res_val is None else adj.res_val.long()
        return adj.res_col.long(), res_dst, count
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
    res_dst = adj.residual_rows()
    keys.append(res_dst * adj.num_cols + adj.res_col.long())
    counts.append(torch.ones_like(res_dst) if adj.res_val is None else adj.res_val.long())
    keys, inverse = torch.unique(torch.cat(keys), return_inverse=True)
    count = torch.zeros(keys.numel(), dtype=torch.int64, device=device).index_add_(0, inverse, torch.cat(counts))
    return keys % adj.num_cols, keys // adj.num_cols, count
