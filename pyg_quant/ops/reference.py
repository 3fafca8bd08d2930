"""Pure-torch reference implementations of the compiled ops.

They follow :mod:`pyg_quant.layout` exactly and run on any device torch runs
on.  They serve as the fallback when the C++/CUDA extension is missing and as
the independent oracle the tests compare the compiled kernels against, so they
are written for clarity (plane by plane, exact integer products in float64), not speed; their float epilogues
make csrc/epilogue.h's float32 operations in its order, so the kernels give the same bits.
"""
from typing import Optional

import torch

from ..layout import (MIN_RANGE_WIDTH, PACK_ALIGN_BITS, TILE_COLS, TILE_ROWS, container_bits, padded_outer, packed_words,
                      row_code_bytes)


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.arange(32, device=device, dtype=torch.int64)


def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the int32 with the same 32 bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _word_bits(planes: torch.Tensor) -> torch.Tensor:
    """int32[..., words] -> int64 0/1 of shape [..., words * 32] (LSB first)."""
    words = planes.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> _bit_weights(planes.device)) & 1
    return bits.flatten(-2)


def quantize_codes(x, lo, inv_scale, bits: int, noise: Optional[torch.Tensor]):
    """The float32 code computation every backend reproduces bit for bit."""
    v = (x - lo) * inv_scale
    v = v + (noise if noise is not None else 0.5)
    return torch.floor(v).clamp_(0, 2**bits - 1).to(torch.int64)


def pack_codes(codes: torch.Tensor, bits: int, col_layout: bool) -> torch.Tensor:
    """int codes [rows, cols] in ``0 .. 2^bits - 1`` -> planes int32[bits, outer_pad, words]."""
    if col_layout:
        codes = codes.t()
    outer, packed = codes.shape
    outer_pad, words = padded_outer(outer), packed_words(packed)
    padded = codes.new_zeros(outer_pad, words * 32)
    padded[:outer, :packed] = codes
    padded = padded.view(outer_pad, words, 32)
    shifts = _bit_weights(codes.device)
    planes = [(((padded >> p) & 1) << shifts).sum(-1) for p in range(bits)]
    return _to_int32_words(torch.stack(planes))


def quantize_pack(x, lo, inv_scale, bits: int, col_layout: bool, noise=None):
    return pack_codes(quantize_codes(x, lo, inv_scale, bits, noise), bits, col_layout)


def unpack_codes(planes: torch.Tensor, rows: int, cols: int, col_layout: bool):
    bits_per_plane = _word_bits(planes)  # [bits, outer_pad, words*32]
    weights = (1 << torch.arange(planes.size(0), device=planes.device)).view(-1, 1, 1)
    codes = (bits_per_plane * weights).sum(0)
    if col_layout:
        return codes[:cols, :rows].t().to(torch.uint8).contiguous()
    return codes[:rows, :cols].to(torch.uint8).contiguous()


def dequantize(planes: torch.Tensor, rows: int, cols: int, col_layout: bool, lo: torch.Tensor, scale: torch.Tensor,
               dim: int) -> torch.Tensor:
    """``lo + scale · q`` as float32 ``[rows, cols]`` (``to_val``), ranges per tensor (``dim=-1``), column or row."""
    q = unpack_codes(planes, rows, cols, col_layout).to(torch.float32)
    view = {-1: (1, 1), 0: (1, -1), 1: (-1, 1)}[dim]
    return lo.view(view) + scale.view(view) * q


def pack_row_codes(planes: torch.Tensor, cols: int, col_layout: bool) -> torch.Tensor:
    """The packed row codes (:mod:`pyg_quant.layout`, "Row codes") of every padded node of ``planes``."""
    nodes = planes.size(2) * 32 if col_layout else planes.size(1)
    bits = planes.size(0)
    container, row_bytes = container_bits(bits), row_code_bytes(cols, bits)
    per_byte = 8 // container
    codes = torch.zeros(nodes, row_bytes * per_byte, dtype=torch.int32, device=planes.device)
    codes[:, :cols] = unpack_codes(planes, nodes, cols, col_layout).to(torch.int32)
    shifts = torch.arange(per_byte, device=planes.device, dtype=torch.int32) * container
    return (codes.view(nodes, row_bytes, per_byte) << shifts).sum(-1).to(torch.uint8)


def packed_code_sums(planes: torch.Tensor) -> torch.Tensor:
    """Sum of the codes along the packed dimension, for each outer index."""
    counts = _word_bits(planes).sum(-1)  # [bits, outer_pad]
    weights = (1 << torch.arange(planes.size(0), device=planes.device)).view(-1, 1)
    return (counts * weights).sum(0)


def _finish(result_f64: torch.Tensor, wide: bool) -> torch.Tensor:
    result = result_f64.round().to(torch.int64)
    return result if wide else result.to(torch.int32)


def bitmm_int(a_planes, b_planes, rows: int, cols: int, wide: bool):
    """Σ_{p,q} 2**(p+q) · A_p · B_qᵀ over 0/1 planes, computed in float64."""
    a_bits = _word_bits(a_planes).double()  # [s, M_pad, K_pad]
    b_bits = _word_bits(b_planes).double()  # [t, N_pad, K_pad]
    out = torch.zeros(a_bits.size(1), b_bits.size(1), dtype=torch.float64, device=a_planes.device)
    for p in range(a_bits.size(0)):
        for q in range(b_bits.size(0)):
            out += (a_bits[p] @ b_bits[q].t()) * float(2 ** (p + q))
    return _finish(out[:rows, :cols], wide)


# The float epilogues' bound (csrc/epilogue.h): an output is within this many times the sum of the magnitudes of the
# terms it adds of its exact value.
EPILOGUE_BOUND = 8 * 2.0**-24


def bitmm_affine(product, row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k: int, bias, relu: bool):
    """bitmm's affine correction in float32, the operations and order of csrc/epilogue.h (each torch op rounds once,
    as each C++ one does): ``la·c + ra·(lb·rowsum + rb·P)`` with ``c = K·lb + rb·colsum``, then ``+ bias``."""
    la, ra = a_lo.float().view(-1, 1), a_scale.float().view(-1, 1)
    lb, rb = b_lo.float().view(1, -1), b_scale.float().view(1, -1)
    col_term = float(k) * lb + rb * col_sums.float().view(1, -1)
    out = la * col_term + ra * (lb * row_sums.float().view(-1, 1) + rb * product.float())
    if bias is not None:
        out = out + bias.view(1, -1)
    return torch.where(out <= 0, torch.zeros_like(out), out) if relu else out


def bit_spmm_int(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, rows: int, cols: int,
                 wide: bool, x_codes=None):
    """out[i, k] = Σ_j A_ij · Q_jk over the stored tiles plus the CSR residual, in float64."""
    device = x_planes.device
    num_windows = window_ptr.numel() - 1
    out = torch.zeros(num_windows * TILE_ROWS, cols, dtype=torch.float64, device=device)
    codes = unpack_codes(x_planes, x_planes.size(2) * 32, cols, True).double()  # [nodes_pad, D]; x_codes unused
    if tile_col.numel() > 0:
        a_bits = _word_bits(tile_bits).double()  # [a_bits, tiles, 16, 256]
        a_weights = (2.0 ** torch.arange(a_bits.size(0), device=device, dtype=torch.float64))
        tiles = (a_bits * a_weights.view(-1, 1, 1, 1)).sum(0)  # [tiles, 16, 256]
        node = tile_col.long().view(-1, 1) * TILE_COLS + torch.arange(TILE_COLS, device=device)
        products = torch.bmm(tiles, codes[node])  # [tiles, 16, D]
        counts = window_ptr[1:] - window_ptr[:-1]
        window_of_tile = torch.repeat_interleave(torch.arange(num_windows, device=device), counts)
        out.view(num_windows, TILE_ROWS, cols).index_add_(0, window_of_tile, products)
    if res_col.numel() > 0:
        res_row = torch.repeat_interleave(torch.arange(rows, device=device), res_ptr[1:] - res_ptr[:-1])
        weight = 1.0 if res_val is None else res_val.double().view(-1, 1)
        out.index_add_(0, res_row, codes[res_col.long()] * weight)
    return _finish(out[:rows], wide)


def affine_epilogue(product, lo, scale, row_sums, self_weight, self_codes, row_scale, bias, relu: bool):
    """csrc/epilogue.h in float32 torch ops, one rounding per operation as in C++."""
    lo, scale = lo.float().view(1, -1), scale.float().view(1, -1)
    v = lo * row_sums.float().view(-1, 1) + scale * product.float()
    if self_weight is not None:
        self_value = lo + scale * self_codes.float()  # as to_val
        v = v + self_weight.float().view(-1, 1) * self_value
    if row_scale is not None:
        v = v * row_scale.float().view(-1, 1)
    if bias is not None:
        v = v + bias.float().view(1, -1)
    return torch.where(v <= 0, torch.zeros_like(v), v) if relu else v


def bit_spmm_affine(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, lo, scale, row_sums,
                    self_weight, row_scale, bias, relu: bool, rows: int, cols: int, wide: bool, x_codes=None):
    """The float aggregation: :func:`bit_spmm_int` followed by :func:`affine_epilogue`."""
    product = bit_spmm_int(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, rows, cols, True)
    self_codes = None
    if self_weight is not None:
        self_codes = unpack_codes(x_planes, x_planes.size(2) * 32, cols, True)[:rows]
    return affine_epilogue(product, lo, scale, row_sums, self_weight, self_codes, row_scale, bias, relu)


assert PACK_ALIGN_BITS % TILE_COLS == 0


_DENSE_BLOCK_INDEX = 1 << 22  # count blocks with bincount below this many, with unique above


def inv_sqrt_degree(deg: torch.Tensor) -> torch.Tensor:
    r"""GCN's :math:`\hat{d}^{-1/2}` of float32 degrees, 0 where a degree is 0.  sqrt and division are correctly
    rounded in float64 everywhere, so eager and compiled code (where ``pow(-0.5)`` may become an approximate rsqrt)
    and the kernels of :func:`degree_inv_sqrt` get the same floats."""
    d = (1.0 / deg.double().sqrt()).to(deg.dtype)
    return d.masked_fill(d == float("inf"), 0.0)


def degree_inv_sqrt(dst, keep, count, diag, num_nodes: int):
    """``(d, d^-1/2)``, float32 ``[num_nodes]``: ``d_i`` the sum of ``count`` (ones where None) over the edges into
    ``i`` that ``keep`` keeps (all where None), in int64, then in float32 plus ``diag_i``; ``d^-1/2`` by
    :func:`inv_sqrt_degree`."""
    values = torch.ones_like(dst, dtype=torch.int64) if count is None else count.to(torch.int64)
    if keep is not None:
        values = torch.where(keep, values, torch.zeros_like(values))
    deg = torch.zeros(num_nodes, dtype=torch.int64, device=dst.device).index_add_(0, dst.long(), values)
    deg = deg.to(torch.float32)
    if diag is not None:
        deg = deg + diag.to(torch.float32)
    return deg, inv_sqrt_degree(deg)


def csr_index_dtype(nnz: int, num_rows: int, num_cols: int) -> torch.dtype:
    """The index dtype of a CSR matrix: int32 where its entries, rows and columns fit."""
    return torch.int32 if max(nnz, num_rows, num_cols) < 2**31 - 1 else torch.int64


def csr_pair(rows, cols, values, keep, row_scale, diag, num_rows: int, num_cols: int, dtype: torch.dtype,
             transpose: bool = True):
    """``(crow, col, val)`` of ``M = diag(row_scale) · (A + diag(diag))`` and, with ``transpose``, of ``Mᵀ`` (else
    three empty tensors), ``A[rows[e], cols[e]] += keep[e] ? values[e] : 0`` (``values``, ``keep``: ones where
    None): each row's entries in edge order, a row's diagonal entry after its edges (a stable sort).  Indices int32
    where they fit (:func:`csr_index_dtype`)."""
    device = rows.device
    edges = rows.numel()
    index_dtype = csr_index_dtype(edges + (num_rows if diag is not None else 0), num_rows, num_cols)
    rows, cols = rows.to(index_dtype), cols.to(index_dtype)
    coef = torch.ones(edges, dtype=dtype, device=device) if values is None else values.to(dtype)
    if keep is not None:
        coef = torch.where(keep, coef, torch.zeros_like(coef))
    if diag is not None:
        nodes = torch.arange(num_rows, dtype=index_dtype, device=device)
        rows, cols, coef = torch.cat((rows, nodes)), torch.cat((cols, nodes)), torch.cat((coef, diag.to(dtype)))
    entries = coef if row_scale is None else row_scale.to(dtype).index_select(0, rows) * coef

    def build(keys, other, n_keys):
        sorted_keys, order = torch.sort(keys, stable=True)
        crow = torch._convert_indices_from_coo_to_csr(sorted_keys, n_keys, out_int32=index_dtype == torch.int32)
        return crow, other.index_select(0, order), entries.index_select(0, order)

    if not transpose:
        empty = rows.new_empty(0)
        return build(rows, cols, num_rows) + (empty, empty, entries.new_empty(0))
    return build(rows, cols, num_rows) + build(cols, rows, num_cols)


def tile_plan(keys, sums, num_rows: int, num_cols: int, min_tile_nnz: int, planes: int):
    """The tile plan of sorted distinct entries (see :mod:`pyg_quant.graph.bit_adjacency`): ``(tile_key int32,
    row_count int16 [T, 16], entry_col uint8, entry_val uint8, res_row int32, res_col int32, res_sum int64,
    row_sums int64 [num_rows])``, entries in key (row-major) order."""
    device = keys.device
    rows = torch.div(keys, num_cols, rounding_mode="floor")
    cols = keys - rows * num_cols
    col_tiles = -(-num_cols // TILE_COLS)
    num_blocks = -(-num_rows // TILE_ROWS) * col_tiles
    block = torch.div(rows, TILE_ROWS, rounding_mode="floor") * col_tiles + torch.div(
        cols, TILE_COLS, rounding_mode="floor")
    if num_blocks <= max(_DENSE_BLOCK_INDEX, 4 * keys.numel()):
        block_keys, block_of_entry = None, block  # blocks indexed directly
    else:
        block_keys, block_of_entry = torch.unique(block, return_inverse=True)
    entries_per_block = torch.bincount(block_of_entry, minlength=num_blocks if block_keys is None else 0)
    in_tile = (entries_per_block >= min_tile_nnz)[block_of_entry] & (sums < 2**planes)
    # A block is a tile when it keeps an entry (blocks are ordered window-major, as tiles are).
    is_tile = torch.bincount(block_of_entry[in_tile], minlength=entries_per_block.numel()) > 0
    tile_key = torch.nonzero(is_tile).view(-1)
    if block_keys is not None:
        tile_key = block_keys[tile_key]
    tile_of_block = torch.cumsum(is_tile, 0) - 1
    segment = tile_of_block[block_of_entry[in_tile]] * TILE_ROWS + rows[in_tile] % TILE_ROWS
    row_count = torch.bincount(segment, minlength=tile_key.numel() * TILE_ROWS).view(-1, TILE_ROWS)
    is_res = ~in_tile
    row_sums = torch.zeros(num_rows, dtype=torch.int64, device=device).index_add_(0, rows, sums)
    return (tile_key.to(torch.int32), row_count.to(torch.int16), (cols[in_tile] % TILE_COLS).to(torch.uint8),
            sums[in_tile].to(torch.uint8), rows[is_res].to(torch.int32), cols[is_res].to(torch.int32), sums[is_res],
            row_sums)


def expand_tiles(tile_key, row_count, entry_col, entry_val, res_row, res_val, num_rows: int, num_cols: int,
                 planes: int):
    """The BitAdjacency tensors ``(window_ptr, tile_col, tile_bits, res_ptr, row_sums)`` of a tile plan (the
    inverse of :func:`tile_plan`); torch ops only, every size known on the host."""
    device = tile_key.device
    num_tiles, tile_nnz = tile_key.numel(), entry_col.numel()
    col_tiles = -(-num_cols // TILE_COLS)
    num_windows = -(-num_rows // TILE_ROWS)
    tile_key = tile_key.long()
    tile_window = torch.div(tile_key, col_tiles, rounding_mode="floor")
    window_ptr = torch.searchsorted(tile_window, torch.arange(num_windows + 1, device=device))
    tile_col = (tile_key - tile_window * col_tiles).to(torch.int32)

    # Segment (t, r) = row r of tile t.  Entries arrive row-major: window, row, tile.
    # Position of segment (t, r) in that order: 16·first(w) + r·tiles(w) + (t − first(w)).
    first = window_ptr[tile_window]
    tiles_in_window = window_ptr[tile_window + 1] - first
    r = torch.arange(TILE_ROWS, device=device)
    position = (TILE_ROWS * first + (torch.arange(num_tiles, device=device) - first)).unsqueeze(1) \
        + r * tiles_in_window.unsqueeze(1)
    position = position.view(-1)
    segments = num_tiles * TILE_ROWS
    segment_at = torch.empty(segments, dtype=torch.int64, device=device).scatter_(
        0, position, torch.arange(segments, device=device))
    count_at = torch.empty(segments, dtype=torch.int64, device=device).scatter_(0, position, row_count.view(-1).long())
    segment = segment_at[torch.repeat_interleave(torch.arange(segments, device=device), count_at,
                                                 output_size=tile_nnz)]

    col = entry_col.long()
    word = segment * (TILE_COLS // 32) + torch.div(col, 32, rounding_mode="floor")
    bit = torch.bitwise_left_shift(torch.ones_like(col), col % 32)
    value = None if entry_val is None else entry_val.long()
    tile_planes = []
    for p in range(planes):
        words = torch.zeros(segments * (TILE_COLS // 32), dtype=torch.int64, device=device)
        words.index_add_(0, word, bit if value is None else ((value >> p) & 1) * bit)  # distinct bits: OR
        tile_planes.append(_to_int32_words(words).view(num_tiles, TILE_ROWS, TILE_COLS // 32))
    tile_bits = torch.stack(tile_planes)

    entry_row = tile_window[torch.div(segment, TILE_ROWS, rounding_mode="floor")] * TILE_ROWS + segment % TILE_ROWS
    res_row = res_row.long()
    res_ptr = torch.searchsorted(res_row, torch.arange(num_rows + 1, device=device))
    row_sums = torch.zeros(num_rows, dtype=torch.int64, device=device)
    row_sums.index_add_(0, entry_row, torch.ones_like(entry_row) if value is None else value)
    row_sums.index_add_(0, res_row, torch.ones_like(res_row) if res_val is None else res_val.long())
    return window_ptr, tile_col, tile_bits, res_ptr, row_sums


def expand_csr(tile_key, row_count, entry_col, entry_val, res_row, res_col, res_val, num_rows: int, num_cols: int):
    """The tile-free BitAdjacency tensors ``(res_ptr int64 [R + 1], res_col int32 [nnz], res_val int32 [nnz] (or
    [0] when neither ``entry_val`` nor ``res_val`` is given: every value is 1), row_sums int64 [R])`` of a tile
    plan: its tile entries and its residual merged into one CSR, each row sorted by column; torch ops only,
    every size known on the host."""
    device = tile_key.device
    num_tiles, tile_nnz, num_res = tile_key.numel(), entry_col.numel(), res_row.numel()
    col_tiles = -(-num_cols // TILE_COLS)
    tile_key = tile_key.long()
    tile_window = torch.div(tile_key, col_tiles, rounding_mode="floor")
    tile_col = tile_key - tile_window * col_tiles
    # Entries arrive row-major (window, row in window, tile, column): segment (t, r) precedes (t', r') when
    # r < r', or r == r' and t < t', within a window.  Their order is that of the key (row, tile).
    segment_row = (tile_window * TILE_ROWS).unsqueeze(1) + torch.arange(TILE_ROWS, device=device)  # [T, 16]
    segment_tile = torch.arange(num_tiles, device=device).unsqueeze(1).expand(num_tiles, TILE_ROWS)
    order = torch.argsort(segment_row.reshape(-1) * max(num_tiles, 1) + segment_tile.reshape(-1))
    counts = row_count.reshape(-1).long()[order]
    segment = order[torch.repeat_interleave(torch.arange(num_tiles * TILE_ROWS, device=device), counts,
                                            output_size=tile_nnz)]
    entry_row = segment_row.reshape(-1)[segment]
    entry_cols = tile_col[torch.div(segment, TILE_ROWS, rounding_mode="floor")] * TILE_COLS + entry_col.long()

    rows = torch.cat([entry_row, res_row.long()])
    cols = torch.cat([entry_cols, res_col.long()])
    values = torch.cat([torch.ones(tile_nnz, dtype=torch.int64, device=device) if entry_val is None
                        else entry_val.long(),
                        torch.ones(num_res, dtype=torch.int64, device=device) if res_val is None else res_val.long()])
    order = torch.argsort(rows * num_cols + cols, stable=True)
    rows, cols, values = rows[order], cols[order], values[order]
    res_ptr = torch.searchsorted(rows, torch.arange(num_rows + 1, device=device))
    row_sums = torch.zeros(num_rows, dtype=torch.int64, device=device).index_add_(0, rows, values)
    weighted = entry_val is not None or res_val is not None
    out_val = values.to(torch.int32) if weighted else torch.empty(0, dtype=torch.int32, device=device)
    return res_ptr, cols.to(torch.int32), out_val, row_sums


# expand_wire's argument format (csrc/expand_wire.h): a CompactAdjacency's parts in this order, four integers each:
# byte offset in the buffer (-1: not shipped), wire dtype (its index in WIRE_DTYPES), size of dimension 0, size of
# dimension 1 (0 for a 1-D part).
WIRE_PARTS = ("tile_key", "row_count", "entry_col", "entry_val", "res_row", "res_col", "res_val", "diag")
WIRE_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def wire_layout(parts) -> list:
    """expand_wire's ``parts`` argument from ``{name: (dtype, shape, byte offset)}`` of the parts shipped (the others
    absent); a ValueError naming a part that is not a 1-D or 2-D tensor of a wire dtype."""
    layout = []
    for name in WIRE_PARTS:
        if name not in parts:
            layout += (-1, 0, 0, 0)
            continue
        dtype, shape, offset = parts[name]
        if dtype not in WIRE_DTYPES or not 1 <= len(shape) <= 2:
            raise ValueError(f"part {name} must be a 1-D or 2-D integer tensor of {WIRE_DTYPES}, got {dtype} "
                             f"{list(shape)}")
        layout += (int(offset), WIRE_DTYPES.index(dtype), int(shape[0]), int(shape[1]) if len(shape) == 2 else 0)
    return layout


def wire_field(parts, name: str) -> tuple:
    """``(byte offset or -1, wire dtype code, size 0, size 1)`` of the part ``name`` in expand_wire's ``parts``."""
    at = 4 * WIRE_PARTS.index(name)
    return tuple(parts[at:at + 4])


def tile_free_operands(num_rows: int, planes: int, device):
    """``(window_ptr, tile_col, tile_bits)`` of a BitAdjacency without tiles (every entry in its CSR): no window
    holds a tile."""
    return (torch.zeros(-(-num_rows // TILE_ROWS) + 1, dtype=torch.int64, device=device),
            torch.empty(0, dtype=torch.int32, device=device),
            torch.empty(planes, 0, TILE_ROWS, TILE_COLS // 32, dtype=torch.int32, device=device))


def _wire_part(buffer, parts, name: str, target: torch.dtype) -> Optional[torch.Tensor]:
    """The part ``name`` of ``buffer`` as a tensor of its own of dtype ``target`` (None when not shipped)."""
    offset, code, size0, size1 = wire_field(parts, name)
    if offset < 0:
        return None
    dtype = WIRE_DTYPES[code]
    numel = size0 * (size1 or 1)
    view = buffer[offset:offset + numel * dtype.itemsize].view(dtype)
    return (view.view(size0, size1) if size1 else view).to(target, copy=True)


def mlp_weight_codes(weights, bits):
    """``[codes, lo, scale, code sums]`` of each weight ``W [out, in]`` in turn, as :func:`quant_mlp` takes a layer's
    weight: ``W`` quantized per output row over its own range, rounded to nearest, its codes unpacked to uint8
    ``[out, in]`` (float32 ``lo`` / ``scale`` and int64 sums ``[out]``)."""
    if len(weights) != len(bits):
        raise ValueError(f"weights and bits must have one entry per layer, got {len(weights)} and {len(bits)}")
    out = []
    for w, b in zip(weights, bits):
        rows, cols = w.shape
        planes, lo, scale, sums, _ = quantize_pack_ranges(w.to(torch.float32).contiguous(), b, 1, False)
        out += [unpack_codes(planes, rows, cols, False), lo.contiguous(), scale.contiguous(), sums[:rows].contiguous()]
    return out


def expand_wire(buffer, parts, num_rows: int, num_cols: int, planes: int, tiles: bool):
    """``[window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, diag, row_sums]`` of a CompactAdjacency shipped
    in ``buffer`` (``parts``: see :data:`WIRE_PARTS`): its parts widened to the types :func:`expand_tiles` /
    :func:`expand_csr` take, expanded with tiles or without; ``res_val`` int32[0] where every value is 1, ``diag``
    (the float32 self-loop term) float32[0] where none was shipped."""
    count_type = torch.uint8 if WIRE_DTYPES[wire_field(parts, "row_count")[1]] == torch.uint8 else torch.int16
    part = {name: _wire_part(buffer, parts, name, target) for name, target in (
        ("tile_key", torch.int32), ("row_count", count_type), ("entry_col", torch.uint8), ("entry_val", torch.uint8),
        ("res_row", torch.int32), ("res_col", torch.int32), ("res_val", torch.int32), ("diag", torch.float32))}
    device = buffer.device
    empty_i32 = torch.empty(0, dtype=torch.int32, device=device)
    diag = part["diag"] if part["diag"] is not None else torch.empty(0, dtype=torch.float32, device=device)
    plan = (part["tile_key"], part["row_count"], part["entry_col"], part["entry_val"], part["res_row"])
    if not tiles:
        res_ptr, res_col, res_val, row_sums = expand_csr(*plan, part["res_col"], part["res_val"], num_rows, num_cols)
        return [*tile_free_operands(num_rows, planes, device), res_ptr, res_col, res_val, diag, row_sums]
    window_ptr, tile_col, tile_bits, res_ptr, row_sums = expand_tiles(*plan, part["res_val"], num_rows, num_cols,
                                                                      planes)
    res_val = part["res_val"] if part["res_val"] is not None else empty_i32
    return [window_ptr, tile_col, tile_bits, res_ptr, part["res_col"], res_val, diag, row_sums]


# --- column keys (csrc/ordered_key.h) -------------------------------------------------------
def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """The order-preserving uint32 key of each float32 of ``x`` (as int64): ``a < b`` gives ``key(a) < key(b)``,
    -0 sorts below +0, a positive NaN keys above +inf and a negative one below -inf."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 0x80000000)


def _from_ordered_keys(keys: torch.Tensor) -> torch.Tensor:
    bits = torch.where(keys >= 2**31, keys & 0x7FFFFFFF, keys ^ 0xFFFFFFFF)
    return _to_int32_words(bits).view(torch.float32)


def col_keys_of(x: torch.Tensor) -> torch.Tensor:
    """The column keys of a 2-D float32 ``x`` with at least one row: int64 ``[2·cols]``, the max over each column of
    its values' keys, then the max of their complements ``0xffffffff ^ key`` (so that one max reduces both ends)."""
    keys = ordered_keys(x)
    return torch.cat([keys.amax(0), (keys ^ 0xFFFFFFFF).amax(0)])


def extrema_from_col_keys(col_keys: torch.Tensor):
    """``(lo, hi)`` ``[1, cols]`` that column keys describe: ``x.amin(0)``, ``x.amax(0)`` for the keys of ``x``,
    both NaN in a column that holds a NaN."""
    cols = col_keys.numel() // 2
    hi = _from_ordered_keys(col_keys[:cols])
    lo = _from_ordered_keys(col_keys[cols:] ^ 0xFFFFFFFF)
    nan = torch.isnan(lo) | torch.isnan(hi)
    lo, hi = lo.masked_fill(nan, float("nan")), hi.masked_fill(nan, float("nan"))
    return lo.view(1, cols), hi.view(1, cols)


def check_col_keys(col_keys: torch.Tensor, cols: int, device: torch.device, columns_of: str, name: str) -> None:
    if col_keys.dtype != torch.int64 or col_keys.dim() != 1 or col_keys.numel() != 2 * cols:
        raise ValueError(f"col_keys must be int64 [{2 * cols}] (two keys per column of {columns_of}), got "
                         f"{col_keys.dtype} {tuple(col_keys.shape)}")
    if col_keys.device != device:
        raise ValueError(f"col_keys is on {col_keys.device} but {name} is on {device}")
    if not col_keys.is_contiguous():
        raise ValueError("col_keys must be contiguous")


def quantize_pack_ranges(x, bits: int, dim: int, col_layout: bool, noise: Optional[torch.Tensor] = None,
                         row_codes: bool = False, col_keys: Optional[torch.Tensor] = None, code_sums: bool = True):
    """``to_bit``'s ranges along ``dim`` (one per row for 1, per column for 0), the packed codes, their sums (an empty
    int64 tensor when not ``code_sums``) and, when ``row_codes``, the packed row codes (:func:`pack_row_codes`; else
    an empty uint8 tensor): ``(planes, lo, scale, code_sums, row_codes)``.  ``col_keys`` (dim 0, column layout only):
    the columns' extrema as :func:`col_keys_of` gives them, in place of x's own (the same result when they describe
    ``x``)."""
    if col_keys is not None:
        if dim != 0 or not col_layout:
            raise ValueError(f"col_keys needs per-column ranges in the column layout (dim=0, col_layout=True), got "
                             f"dim={dim}, col_layout={col_layout}")
        check_col_keys(col_keys, x.size(1), x.device, "x", "x")
        lo, hi = extrema_from_col_keys(col_keys)
    else:
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / torch.full_like(hi, float(2**bits - 1))
    inv_scale = torch.where(scale > 0, torch.ones_like(scale) / scale, torch.zeros_like(scale))
    planes = quantize_pack(x, lo, inv_scale, bits, col_layout, noise)
    codes = (pack_row_codes(planes, x.size(1), col_layout) if row_codes
             else torch.empty((0, 0), dtype=torch.uint8, device=x.device))
    sums = packed_code_sums(planes) if code_sums else torch.empty(0, dtype=torch.int64, device=x.device)
    return planes, lo.reshape(-1), scale.reshape(-1), sums, codes


# --- fake quantization (pyg_quant.qat) -------------------------------------------------------
def _group_view(dim: int):
    return {-1: (1, 1), 0: (1, -1), 1: (-1, 1)}[dim]


def _own_range(x: torch.Tensor, dim: int):
    if dim < 0:
        return x.amin().reshape(1), x.amax().reshape(1)
    return x.amin(dim), x.amax(dim)


def _fake_values(x, lo, hi, bits: int, u):
    """``lo + s·clamp(⌊(x − lo)·s⁻¹ + u⌋, 0, 2^b − 1)`` with to_bit's float32 ``s`` and ``s⁻¹``, step by step."""
    levels = float(2**bits - 1)
    scale = (hi - lo) / torch.full_like(hi, levels)
    inv_scale = torch.where(scale > 0, torch.ones_like(scale) / scale, torch.zeros_like(scale))
    out = ((x - lo) * inv_scale + u).floor().clamp(0, levels)
    return out * scale + lo


def fake_quantize(x, lo, hi, bits: int, dim: int, noise: Optional[torch.Tensor], with_mask: bool,
                  random_noise: bool = False, generator: Optional[torch.Generator] = None):
    """``(fq(x), lo <= x <= hi)`` with one range per group (``dim`` -1 / 0 / 1); own min/max where ``lo`` is None.

    ``random_noise`` draws the rounding noise as ``torch.rand(x.shape, generator=generator)`` does.
    """
    if noise is not None and random_noise:
        raise ValueError("pass noise or random_noise=True, not both")
    x = x.contiguous()
    if random_noise:
        noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    if lo is None:
        lo, hi = _own_range(x, dim)
    view = _group_view(dim)
    lo, hi = lo.reshape(view), hi.reshape(view)
    out = _fake_values(x, lo, hi, bits, noise if noise is not None else 0.5)
    mask = (x >= lo) & (x <= hi) if with_mask else torch.empty(0, dtype=torch.bool, device=x.device)
    return out, mask


def mse_range(x, dim: int, bits: int, grid):
    """The MSE-optimal clipping range per group among the shrunk ranges of ``grid`` (see the compiled op).

    Errors in float32 per element, squared and summed in float64; the first smallest wins.
    """
    x = x.contiguous()
    if dim < 0:
        x, dim = x.reshape(-1, 1), 0
    lo, hi = _own_range(x, dim)
    view = _group_view(dim)
    return mse_search(x, lo, hi, dim, grid, lambda c_lo, c_hi: _fake_values(x, c_lo.view(view), c_hi.view(view),
                                                                             bits, 0.5))


def ema_range(x, stored_lo, stored_hi, momentum: float, dim: int, grid, grid_bits: int):
    """``(lo, hi, used_hi)``: ``stored + m·(batch − stored)`` for both ends, the batch's range ``x``'s min/max over
    ``dim`` (-1: the tensor's) for an empty ``grid``, else :func:`mse_range`'s at ``grid_bits``; and the hi that fake
    quantization uses (``lo`` where the range is narrower than ``MIN_RANGE_WIDTH``); float32, no gradient."""
    if dim not in (-1, 0, 1):
        raise ValueError(f"ema_range: dim must be -1 (per tensor), 0 or 1, got {dim}")
    with torch.no_grad():
        x = x.to(torch.float32)
        lo, hi = mse_range(x, dim, grid_bits, grid) if len(grid) else _own_range(x, dim)
        if lo.shape != stored_lo.shape or hi.shape != stored_hi.shape:
            raise ValueError(f"ema_range: x has {lo.numel()} ranges but {stored_lo.numel()} are stored")
        lo, hi = stored_lo + (lo - stored_lo) * momentum, stored_hi + (hi - stored_hi) * momentum
        return lo, hi, torch.where(hi - lo < MIN_RANGE_WIDTH, lo, hi)


def ema_fake_quantize(x, stored_lo, stored_hi, momentum: float, dim: int, grid, grid_bits: int, bits: int,
                      with_mask: bool, random_noise: bool = False, generator: Optional[torch.Generator] = None,
                      fake_quantize=fake_quantize):
    """``(fq(x), mask, lo, hi)``: :func:`ema_range`'s ``(lo, hi)``, and ``fake_quantize`` of ``x`` over it with ranges
    narrower than ``MIN_RANGE_WIDTH`` collapsed to ``hi = lo`` (``fake_quantize`` the differentiable one)."""
    lo, hi, used_hi = ema_range(x, stored_lo, stored_hi, momentum, dim, grid, grid_bits)
    out, mask = fake_quantize(x.to(torch.float32), lo, used_hi, bits, dim, None, with_mask, random_noise, generator)
    return out, mask, lo, hi


_GRID_TENSORS = {}


def _grid_tensors(grid) -> tuple:
    """The factors of ``grid`` as 0-d float32 CPU tensors (the kernels' float32 factors), made once per grid: a 0-d
    CPU tensor is a scalar argument on any device, so no copy to the device is made per candidate."""
    grid = tuple(float(a) for a in grid)
    tensors = _GRID_TENSORS.get(grid)
    if tensors is None:
        tensors = _GRID_TENSORS[grid] = tuple(torch.tensor(a, dtype=torch.float32) for a in grid)
    return tensors


def mse_search(x, lo, hi, dim: int, grid, fake, keep: Optional[torch.Tensor] = None):
    r"""The search of :func:`mse_range` from given extremes: per group, the candidate range with the least error.

    Candidates ``[c + a(lo − c), c + a(hi − c)]`` for each ``a`` in ``grid``, ``c = clamp(0, lo, hi)``;
    ``fake(c_lo, c_hi)`` gives ``x``'s round-to-nearest values over the candidate (1-D ranges, one per
    group); the error is ``Σ (x − x̃)²`` along ``dim``, in float32 per element, squared and summed in
    float64, over the entries where ``keep`` (bool, ``x``'s shape) if given; the first (widest)
    candidate wins ties.  ``x`` is 2-D, ``lo`` / ``hi`` 1-D, one per group along ``dim`` (0 or 1).
    """
    center = torch.minimum(torch.clamp(torch.zeros_like(lo), min=lo), hi)
    lo_span, hi_span = lo - center, hi - center
    best_err = best_lo = best_hi = None
    for a in _grid_tensors(grid):
        c_lo, c_hi = center + a * lo_span, center + a * hi_span
        err = (fake(c_lo, c_hi) - x).double().square()
        if keep is not None:
            err = err * keep
        err = err.sum(dim)
        if best_err is None:
            best_err, best_lo, best_hi = err, c_lo, c_hi
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo, best_hi = torch.where(better, c_lo, best_lo), torch.where(better, c_hi, best_hi)
    return best_lo, best_hi


def quant_mlp(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
              row_scale=None):
    r"""A chain of QuantLinear bit layers: for each layer ``l``, ``h`` quantized per row to ``act_bits[l]``
    (the float32 steps of :func:`pyg_quant.to_bit`), the exact code product with ``weight_codes[l]``
    (``[out, in]`` uint8, one range ``weight_lo/weight_scale[l]`` per output channel, code sums
    ``weight_sums[l]``), :func:`bitmm_affine` with ``bias[l]`` and ``relu[l]``.  This is
    ``quantize(h, act_bits[l], 1, "row")`` followed by ``bitmm_float`` (what ``QuantLinear`` runs), written
    with this module's ops; ``weight_bits`` only bounds the codes (the product must fit in int32).  With
    ``row_scale`` (float32 ``[rows]``), each output row is then multiplied by its scale in float32.
    """
    if len(weight_codes) < 1:
        raise ValueError("weight_codes must hold at least one layer")
    h = x.to(torch.float32)
    for l, codes in enumerate(weight_codes):
        bits = int(act_bits[l])
        if codes.size(1) != h.size(1):
            raise ValueError(f"weight_codes[{l}] has {codes.size(1)} input channels but its input has "
                             f"{h.size(1)} columns")
        lo, hi = h.amin(1, keepdim=True), h.amax(1, keepdim=True)
        scale = (hi - lo) / torch.full_like(hi, float(2**bits - 1))
        inv_scale = torch.where(scale > 0, torch.ones_like(scale) / scale, torch.zeros_like(scale))
        q = quantize_codes(h, lo, inv_scale, bits, None)
        h = _code_product(q, lo.reshape(-1), scale.reshape(-1), codes, weight_sums[l], weight_lo[l], weight_scale[l],
                          bias[l], relu[l])
    return _scaled_rows(h, row_scale)


def _code_product(q, lo, scale, codes, weight_sums, weight_lo, weight_scale, bias, relu):
    """:func:`bitmm_affine` of the exact product of the codes ``q`` (``[rows, in]``, ranges ``lo`` / ``scale``
    ``[rows]``) with ``codes`` (``[out, in]``): one bit layer's product, as ``bitmm_float`` computes it."""
    # exact: every partial sum is an integer below 2**53
    product = (q.double() @ codes.double().t()).round().to(torch.int64)
    return bitmm_affine(product, q.sum(1), weight_sums, lo, scale, weight_lo, weight_scale, codes.size(1), bias,
                        bool(relu))


def _scaled_rows(h, row_scale):
    """``h`` with each row multiplied by its ``row_scale`` in float32 (None: as it is)."""
    if row_scale is None:
        return h
    if row_scale.dim() != 1 or row_scale.numel() != h.size(0) or row_scale.dtype != torch.float32:
        raise ValueError(f"row_scale must be float32 [{h.size(0)}] (one scale per row of x), got "
                         f"{row_scale.dtype} {tuple(row_scale.shape)}")
    return h * row_scale.view(-1, 1)


def quant_mlp_quantized(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale,
                        weight_sums, bias, act_bits, weight_bits, relu, row_scale=None):
    r""":func:`quant_mlp` with its first layer's input the codes of a packed tensor taken as they are (``planes``; or
    the codes themselves, uint8 ``[rows, cols]``): the exact
    product of those codes (row layout, ranges per row, ``dim=1``, or one, ``dim=-1``; at most ``act_bits[0]`` bits)
    with ``weight_codes[0]`` and :func:`bitmm_affine` with their ranges and code sums (``bitmm(x, W)``, what a QAT
    linear layer runs on an input quantized already), then the later layers as :func:`quant_mlp`."""
    if col_layout:
        raise ValueError("planes must be in the row layout (col_layout=False): the codes are the product's operand "
                         "as they are")
    if dim == 0:
        raise ValueError("planes must have ranges per row (dim=1) or one range (dim=-1), got dim=0: ranges per "
                         "column do not factor out of the product")
    if len(weight_codes) < 1:
        raise ValueError("weight_codes must hold at least one layer")
    if weight_codes[0].size(1) != cols:
        raise ValueError(f"weight_codes[0] has {weight_codes[0].size(1)} input channels but its input has {cols} "
                         "columns")
    if planes.dtype == torch.uint8:  # the codes themselves, [rows, cols]
        if tuple(planes.shape) != (rows, cols):
            raise ValueError(f"planes given as codes must be uint8 [rows={rows}, cols={cols}], got "
                             f"{list(planes.shape)}")
        q = planes.to(torch.int64)
        largest = int(q.max()) if q.numel() else 0
        if largest >= 1 << int(act_bits[0]):
            raise ValueError(f"planes holds the code {largest}, more than the first layer's act_bits "
                             f"({int(act_bits[0])}) allow")
    else:
        if planes.size(0) > int(act_bits[0]):
            raise ValueError(f"planes hold {planes.size(0)}-bit codes, more than the first layer's act_bits "
                             f"({int(act_bits[0])})")
        q = unpack_codes(planes, rows, cols, col_layout).to(torch.int64)
    lo, scale = lo.reshape(-1).expand(rows).contiguous(), scale.reshape(-1).expand(rows).contiguous()
    h = _code_product(q, lo, scale, weight_codes[0], weight_sums[0], weight_lo[0], weight_scale[0], bias[0], relu[0])
    if len(weight_codes) == 1:
        return _scaled_rows(h, row_scale)
    return quant_mlp(h, weight_codes[1:], weight_lo[1:], weight_scale[1:], weight_sums[1:], bias[1:], act_bits[1:],
                     weight_bits[1:], relu[1:], row_scale)


def _with_keys(h):
    """``(h, its column keys)``: :func:`col_keys_of` of its rows, zeros ("nothing seen") for none."""
    keys = col_keys_of(h) if h.size(0) > 0 else torch.zeros(2 * h.size(1), dtype=torch.int64, device=h.device)
    return h, keys


def quant_mlp_keys(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
                   row_scale=None):
    r"""``(out, keys)``: :func:`quant_mlp`'s output and its column keys (:func:`col_keys_of`), which
    :func:`quantize_pack_ranges` takes in place of a pass of its own over ``out``."""
    return _with_keys(quant_mlp(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits,
                                relu, row_scale))


def quant_mlp_planes(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale,
                     weight_sums, bias, act_bits, weight_bits, relu, row_scale=None):
    r""":func:`quant_mlp` on the values of a packed tensor: ``quant_mlp(dequantize(planes, rows, cols, col_layout,
    lo, scale, dim), ...)``."""
    x = dequantize(planes, rows, cols, col_layout, lo, scale, dim)
    return quant_mlp(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
                     row_scale)


def quant_mlp_quantized_keys(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale,
                             weight_sums, bias, act_bits, weight_bits, relu, row_scale=None):
    r"""``(out, keys)`` of :func:`quant_mlp_quantized` (see :func:`quant_mlp_keys`)."""
    return _with_keys(quant_mlp_quantized(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo,
                                          weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale))


def quant_mlp_planes_keys(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale,
                          weight_sums, bias, act_bits, weight_bits, relu, row_scale=None):
    r"""``(out, keys)`` of :func:`quant_mlp_planes` (see :func:`quant_mlp_keys`)."""
    return _with_keys(quant_mlp_planes(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo,
                                       weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale))


def _check_out_codes(out_lo, out_inv_scale, out_bits: int, out_cols: int, device) -> None:
    if not 1 <= int(out_bits) <= 8:
        raise ValueError(f"out_bits must be in 1..8, got {out_bits}")
    for name, t in (("out_lo", out_lo), ("out_inv_scale", out_inv_scale)):
        if t.dim() != 1 or t.size(0) != out_cols or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [{out_cols}] (one range per output column), got {t.dtype} "
                             f"{tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the input is on {device}")


def _output_row_codes(out, out_lo, out_inv_scale, out_bits: int):
    _check_out_codes(out_lo, out_inv_scale, out_bits, out.size(1), out.device)
    planes = quantize_pack(out, out_lo.view(1, -1), out_inv_scale.view(1, -1), int(out_bits), True)
    return pack_row_codes(planes, out.size(1), True)


def quant_mlp_row_codes(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
                        row_scale, out_lo, out_inv_scale, out_bits: int):
    r""":func:`quant_mlp`'s output quantized per column with fixed ranges, as packed row codes:
    :func:`pack_row_codes` of ``quantize_pack(out, out_lo[None], out_inv_scale[None], out_bits, col_layout=True)``
    (nearest rounding; values outside a range clamp to its end codes).  Its planes are
    :func:`planes_from_row_codes` of them."""
    out = quant_mlp(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
                    row_scale)
    return _output_row_codes(out, out_lo, out_inv_scale, out_bits)


def quant_mlp_planes_row_codes(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo,
                               weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale, out_lo,
                               out_inv_scale, out_bits: int):
    r""":func:`quant_mlp_row_codes` of :func:`dequantize` ``(planes, rows, cols, col_layout, lo, scale, dim)``."""
    out = quant_mlp_planes(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale,
                           weight_sums, bias, act_bits, weight_bits, relu, row_scale)
    return _output_row_codes(out, out_lo, out_inv_scale, out_bits)


def planes_from_row_codes(row_codes, rows: int, cols: int, bits: int) -> torch.Tensor:
    r"""The column-layout planes of a ``rows`` × ``cols`` tensor of ``bits``-bit codes from its packed row codes
    (:func:`pack_row_codes`' inverse; ``row_codes`` must be exactly ``[packed_words(rows)·32,
    row_code_bytes(cols, bits)]``)."""
    bits, rows, cols = int(bits), int(rows), int(cols)
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if rows < 0 or cols < 1:
        raise ValueError(f"rows must be >= 0 and cols >= 1, got {rows} and {cols}")
    nodes, row_bytes = packed_words(rows) * 32, row_code_bytes(cols, bits)
    if (row_codes.dim() != 2 or row_codes.dtype != torch.uint8 or tuple(row_codes.shape) != (nodes, row_bytes)
            or not row_codes.is_contiguous()):
        raise ValueError(f"row_codes must be the contiguous uint8 packed row codes of {rows} x {cols} {bits}-bit "
                         f"codes ([{nodes}, {row_bytes}]), got {row_codes.dtype} {list(row_codes.shape)}")
    container = container_bits(bits)
    bit = torch.arange(cols, device=row_codes.device) * container
    codes = (row_codes[:, bit // 8].long() >> (bit % 8)) & ((1 << container) - 1)  # [nodes, cols]
    return pack_codes(codes, bits, True)  # padding rows are zero codes in row_codes too


def _conv_output(out, out_bits: int, out_dim: int, col_keys=None):
    """csrc/conv_eval.h's result: ``[out, planes, lo, scale, code_sums, row_codes]``, the quantizer's per-column
    codes (``out_dim`` 0) with row codes on CUDA, code sums elsewhere; ``[out]`` without ``out_bits``."""
    if out_bits == 0:
        return [out]
    if out_dim not in (0, 1):
        raise ValueError(f"out_dim must be 0 or 1 when out_bits is set, got {out_dim}")
    row_codes = out.is_cuda and out_dim == 0
    return [out, *quantize_pack_ranges(out, out_bits, out_dim, out_dim == 0, None, row_codes, col_keys,
                                       not row_codes)]


def gin_conv_eval(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, wide: bool, x_planes, x_codes,
                  lo, scale, self_weight, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits,
                  weight_bits, relu, out_bits: int, out_dim: int):
    """A QGINConv layer's eval forward on a BitAdjacency (csrc/conv_eval.h): :func:`bit_spmm_affine` with the self
    term, :func:`quant_mlp` (with its column keys where the CUDA op takes them) and the output's quantizer."""
    rows, cols = res_ptr.numel() - 1, lo.numel()
    aggregated = bit_spmm_affine(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, lo, scale,
                                 row_sums, self_weight, None, None, False, rows, cols, wide, x_codes)
    chain = (weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu)
    if out_bits != 0 and out_dim == 0 and aggregated.is_cuda:
        out, keys = quant_mlp_keys(aggregated, *chain)
        return _conv_output(out, out_bits, out_dim, keys)
    return _conv_output(quant_mlp(aggregated, *chain), out_bits, out_dim)


def gcn_conv_eval(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, deg_inv_sqrt, bias,
                  act_bits: int, wide: bool, x, x_lo, x_scale, x_rows: int, weight_codes, weight_lo, weight_scale,
                  weight_sums, weight_bias, mlp_act_bits, weight_bits, relu, out_bits: int, out_dim: int):
    """A QGCNConv layer's eval forward on a BitAdjacency that holds its self loops (csrc/conv_eval.h):
    ``D^-1/2 (X W)`` by :func:`quant_mlp` (of codes of ``x`` by :func:`quant_mlp_planes`), quantized per column, then
    :func:`bit_spmm_affine` with the diagonal, the row scale and the bias, and the output's quantizer."""
    chain = (weight_codes, weight_lo, weight_scale, weight_sums, weight_bias, mlp_act_bits, weight_bits, relu,
             deg_inv_sqrt)
    if x_lo is not None:
        h, keys = quant_mlp_planes_keys(x, x_rows, x_lo.numel(), True, x_lo, x_scale, 0, *chain)
    else:
        h, keys = quant_mlp_keys(x, *chain)
    keys = keys if x.is_cuda else None
    _, planes, lo, scale, _, codes = _conv_output(h, act_bits, 0, keys)
    out = bit_spmm_affine(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, planes, lo, scale, row_sums,
                          diag, deg_inv_sqrt, bias, False, res_ptr.numel() - 1, weight_codes[-1].size(0), wide,
                          codes if x.is_cuda else None)
    return _conv_output(out, out_bits, out_dim)


# A column key pair that reads as a NaN range, and the least key of a non-finite value (csrc/conv_eval.h).
NAN_COLUMN_KEY = 0xFFC00000
NON_FINITE_KEY = 0xFF800000


def keys_with_nan_ranges(stored: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """The column keys ``stored`` (int64 ``[2·cols]``) with a NaN range for every column where ``finite`` is
    False."""
    cols = stored.numel() // 2
    return torch.where(finite.reshape(-1), stored.view(2, cols), NAN_COLUMN_KEY).view(-1)


def qat_gcn_conv_eval(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, deg_inv_sqrt, bias,
                      agg_bits: int, wide: bool, agg_keys, x, x_lo, x_scale, x_rows: int, x_cols: int,
                      x_col_layout: bool, x_dim: int, weight_codes, weight_lo, weight_scale, weight_sums, weight_bias,
                      act_bits, weight_bits, relu, x_quantized: bool = False):
    """A converted QATGCNConv layer's eval forward (csrc/conv_eval.h): ``D^-1/2 (X W)`` and its column keys by
    :func:`quant_mlp_keys` (:func:`quant_mlp_planes_keys` for codes of ``x``; :func:`quant_mlp_quantized_keys` for
    codes taken as they are, ``x_quantized``: the op ``qat_gcn_conv_eval_quantized``), quantized per channel over
    ``agg_keys`` (a channel holding NaN/inf over a NaN range) or each channel's own range, :func:`bit_spmm_affine`
    with the diagonal, ``· D^-1/2`` and ``+ bias`` in its epilogue (float32, after the aggregation's rounding)."""
    chain = (weight_codes, weight_lo, weight_scale, weight_sums, weight_bias, act_bits, weight_bits, relu,
             deg_inv_sqrt)
    if x_lo is not None:
        planes_keys = quant_mlp_quantized_keys if x_quantized else quant_mlp_planes_keys
        h, keys = planes_keys(x, x_rows, x_cols, x_col_layout, x_lo, x_scale, x_dim, *chain)
    else:
        h, keys = quant_mlp_keys(x, *chain)
    channels = weight_codes[-1].size(0)
    if agg_keys is not None:
        keys = keys_with_nan_ranges(agg_keys, keys.view(2, channels).amax(0) < NON_FINITE_KEY)
    planes, lo, scale, _, codes = quantize_pack_ranges(h, agg_bits, 0, True, None, h.is_cuda, keys, not h.is_cuda)
    return bit_spmm_affine(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, planes, lo, scale, row_sums,
                           diag, deg_inv_sqrt, bias, False, res_ptr.numel() - 1, channels, wide,
                           codes if h.is_cuda else None)


def qat_gin_conv_eval(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, wide: bool, x,
                      x_lo, x_scale, x_codes, x_cols: int, x_dim: int, agg_bits: int, agg_keys, one_plus_eps,
                      weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu):
    """A converted QATGINConv layer's eval forward (csrc/conv_eval.h): the source features quantized per column
    (over ``agg_keys``, a column holding NaN/inf on CUDA over a NaN range, or each column's own range; codes of
    ``x`` as they are), :func:`bit_spmm_affine` (the adjacency's diagonal only), ``+ (1 + eps)·x`` on the float
    values (:func:`dequantize` of codes; without a diagonal, the epilogue's self term: the same float32 steps), then
    :func:`quant_mlp` with its biases and ReLUs."""
    rows = res_ptr.numel() - 1
    if x_lo is not None and diag is None:
        lo, scale = x_lo.expand(x_cols).contiguous(), x_scale.expand(x_cols).contiguous()
        out = bit_spmm_affine(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, lo, scale, row_sums,
                              one_plus_eps.reshape(-1), None, None, False, rows, x_cols, wide, x_codes)
        return quant_mlp(out, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu)
    if x_lo is not None:
        lo, scale = x_lo.expand(x_cols).contiguous(), x_scale.expand(x_cols).contiguous()
        planes, gathered = x, x_codes
        values = dequantize(x, rows, x_cols, True, x_lo, x_scale, x_dim)
    else:
        keys = agg_keys
        if agg_keys is not None and x.is_cuda:
            mn, mx = torch.aminmax(x, dim=0)
            keys = keys_with_nan_ranges(agg_keys, torch.isfinite(mn) & torch.isfinite(mx))
        planes, lo, scale, _, codes = quantize_pack_ranges(x, agg_bits, 0, True, None, x.is_cuda, keys,
                                                           not x.is_cuda)
        gathered, values = (codes if x.is_cuda else None), x
    out = bit_spmm_affine(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, planes, lo, scale, row_sums,
                          diag, None, None, False, rows, x_cols, wide, gathered)
    out = torch.addcmul(out, one_plus_eps, values)
    return quant_mlp(out, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu)
