"""Thin Python faces of the compiled ops.

Each function calls ``torch.ops.pyg_quant.<op>`` when the extension has a kernel
for the input's device, and the pure-torch reference (:mod:`.reference`)
otherwise.  Fake kernels registered here give ``torch.compile`` the output
shapes without running anything.
"""
from typing import Optional

import torch

from .._extension import LOADED, use_compiled
from ..layout import TILE_COLS, TILE_ROWS, packed_words, padded_outer, row_code_bytes
from . import reference
# expand_wire's argument format, and the operands of a BitAdjacency without tiles
from .reference import WIRE_DTYPES, WIRE_PARTS, tile_free_operands, wire_layout  # noqa: F401


def quantize_pack(x, lo, inv_scale, bits: int, col_layout: bool, noise: Optional[torch.Tensor] = None):
    if use_compiled("quantize_pack", x.device):
        return torch.ops.pyg_quant.quantize_pack(x, lo, inv_scale, bits, col_layout, noise)
    return reference.quantize_pack(x, lo, inv_scale, bits, col_layout, noise)


def quantize_pack_ranges(x, bits: int, dim: int, col_layout: bool, noise: Optional[torch.Tensor] = None,
                         row_codes: bool = False, col_keys: Optional[torch.Tensor] = None, code_sums: bool = True):
    """``(planes, lo, scale, code_sums, row_codes)``: see :func:`reference.quantize_pack_ranges`."""
    if use_compiled("quantize_pack_ranges", x.device):
        return torch.ops.pyg_quant.quantize_pack_ranges(x, bits, dim, col_layout, noise, row_codes, col_keys,
                                                        code_sums)
    return reference.quantize_pack_ranges(x, bits, dim, col_layout, noise, row_codes, col_keys, code_sums)


class _ReferenceFakeQuantize(torch.autograd.Function):
    """The reference's straight-through gradient (the compiled op carries its own, a C++ autograd kernel): the
    incoming gradient, zeroed outside the range when ``with_mask``."""

    @staticmethod
    def forward(ctx, x, lo, hi, bits, dim, noise, with_mask, random_noise, generator):
        out, inside = reference.fake_quantize(x, lo, hi, bits, dim, noise, with_mask, random_noise, generator)
        ctx.mark_non_differentiable(inside)
        ctx.with_mask = with_mask
        if with_mask:
            ctx.save_for_backward(inside)
        return out, inside

    @staticmethod
    def backward(ctx, grad, _):
        if ctx.with_mask and grad is not None:
            grad = grad * ctx.saved_tensors[0]
        return grad, None, None, None, None, None, None, None, None


def fake_quantize(x, lo: Optional[torch.Tensor], hi: Optional[torch.Tensor], bits: int, dim: int,
                  noise: Optional[torch.Tensor] = None, with_mask: bool = False, random_noise: bool = False,
                  generator: Optional[torch.Generator] = None):
    """``(fq(x), inside)``, the gradient to ``x`` straight through (zeroed outside the range when ``with_mask``)."""
    if use_compiled("fake_quantize", x.device):
        return torch.ops.pyg_quant.fake_quantize(x, lo, hi, bits, dim, noise, with_mask, random_noise, generator)
    if x.requires_grad and torch.is_grad_enabled():
        return _ReferenceFakeQuantize.apply(x, lo, hi, bits, dim, noise, with_mask, random_noise, generator)
    return reference.fake_quantize(x, lo, hi, bits, dim, noise, with_mask, random_noise, generator)


def qat_linear(x, weight, bias: Optional[torch.Tensor], x_bits: int, x_random: bool,
               x_generator: Optional[torch.Generator], weight_bits: int, weight_random: bool,
               weight_generator: Optional[torch.Generator]):
    """``fq(x) · fq(W)ᵀ + b``, both fake-quantized per row over their own ranges (see ``csrc/qat_linear.h``)."""
    if use_compiled("qat_linear", x.device):
        return torch.ops.pyg_quant.qat_linear(x, weight, bias, x_bits, x_random, x_generator, weight_bits,
                                              weight_random, weight_generator)
    xq = fake_quantize(x.to(torch.float32), None, None, x_bits, 1, None, False, x_random, x_generator)[0]
    wq = fake_quantize(weight.to(torch.float32), None, None, weight_bits, 1, None, False, weight_random,
                       weight_generator)[0]
    return torch.nn.functional.linear(xq, wq, bias)


class _ReferenceCsrProduct(torch.autograd.Function):
    """The reference of ``csr_product`` (the compiled op's autograd node is C++): ``A · y``, gradient ``Aᵀ · dY``,
    itself differentiable (double backward)."""

    @staticmethod
    def forward(ctx, y, adj, adj_t):
        ctx.adj, ctx.adj_t = adj, adj_t
        return torch.mm(adj, y)  # one op (torch.sparse.mm dispatches two: zeros, then _sparse_addmm)

    @staticmethod
    def backward(ctx, grad):
        return _ReferenceCsrProduct.apply(grad, ctx.adj_t, ctx.adj), None, None


def csr_product(y, adj, adj_t=None):
    """``A · y`` for a constant sparse CSR ``adj`` ``[M, N]`` and dense ``y`` ``[N, F]``, its gradient to ``y`` the
    product with ``adj_t`` (``Aᵀ`` in CSR, prebuilt: autograd's own backward of ``torch.mm`` on a CSR matrix
    transposes and coalesces it at every call).  Without ``adj_t`` the product takes no gradient (a ValueError where
    ``y`` requires one); on a GPU it is one launch of pyg_quant's kernel either way, where ``torch.mm`` takes three
    of cuSPARSE's and a buffer."""
    if use_compiled("csr_product", y.device):
        return torch.ops.pyg_quant.csr_product(y, adj, adj_t)
    if adj_t is None:
        if y.requires_grad and torch.is_grad_enabled():
            raise ValueError("csr_product: y requires a gradient, which needs adj_t (Aᵀ in CSR)")
        return torch.mm(adj, y)
    return _ReferenceCsrProduct.apply(y, adj, adj_t)


def csr_pair(rows, cols, values, keep, row_scale, diag, num_rows: int, num_cols: int, dtype: torch.dtype,
             transpose: bool = True):
    """``(crow, col, val)`` of ``M = diag(row_scale) · (A + diag(diag))`` and of ``Mᵀ``: see
    :func:`reference.csr_pair`.  The kernels take matrices with int32 indices (and on the GPU fewer than 2^30 rows and
    columns: a sort key's top bit tells the directions apart); larger ones take the reference."""
    nnz = rows.numel() + (num_rows if diag is not None else 0)
    if (use_compiled("csr_pair", rows.device)
            and reference.csr_index_dtype(nnz, num_rows, num_cols) == torch.int32
            and max(num_rows, num_cols) < 2**30):
        return torch.ops.pyg_quant.csr_pair(rows, cols, values, keep, row_scale, diag, num_rows, num_cols, dtype,
                                            transpose)
    return reference.csr_pair(rows, cols, values, keep, row_scale, diag, num_rows, num_cols, dtype, transpose)


def degree_inv_sqrt(dst, keep, count, diag, num_nodes: int):
    """``(d, d^-1/2)``: GCN's degrees of an unweighted edge list (see :func:`reference.degree_inv_sqrt`)."""
    if use_compiled("degree_inv_sqrt", dst.device):
        return torch.ops.pyg_quant.degree_inv_sqrt(dst, keep, count, diag, num_nodes)
    return reference.degree_inv_sqrt(dst, keep, count, diag, num_nodes)


def ema_range(x, stored_lo, stored_hi, momentum: float, dim: int, grid, grid_bits: int):
    """``(lo, hi, used_hi)``: a static observer's step in one op, the stored 1-D range moved toward ``x``'s, and the
    hi that fake quantization uses (see ``csrc/ema_range.h``); ``grid`` a list of floats (empty: the min/max)."""
    if use_compiled("ema_range", x.device):  # (x detached: the op has no gradient, its range takes none)
        return torch.ops.pyg_quant.ema_range(x.detach(), stored_lo, stored_hi, momentum, dim, grid, grid_bits)
    return reference.ema_range(x, stored_lo, stored_hi, momentum, dim, grid, grid_bits)


def ema_fake_quantize(x, stored_lo, stored_hi, momentum: float, dim: int, grid, grid_bits: int, bits: int,
                      with_mask: bool, random_noise: bool = False, generator: Optional[torch.Generator] = None):
    """``(fq(x), inside, lo, hi)``: :func:`ema_range` and :func:`fake_quantize` over the new range in one op (see
    ``csrc/ema_range.h``)."""
    if use_compiled("ema_fake_quantize", x.device):
        return torch.ops.pyg_quant.ema_fake_quantize(x, stored_lo, stored_hi, momentum, dim, grid, grid_bits, bits,
                                                     with_mask, random_noise, generator)
    return reference.ema_fake_quantize(x, stored_lo, stored_hi, momentum, dim, grid, grid_bits, bits, with_mask,
                                       random_noise, generator, fake_quantize)


def mse_range(x, dim: int, bits: int, grid):
    if use_compiled("mse_range", x.device):
        return torch.ops.pyg_quant.mse_range(x, dim, bits, [float(a) for a in grid])
    return reference.mse_range(x, dim, bits, grid)


def pack_codes(codes, bits: int, col_layout: bool):
    """The bit planes of ``uint8[rows, cols]`` codes (each below ``2^bits``), as :func:`quantize_pack` packs them; a
    code out of range is a ValueError on the CPU, a device-side assert on a GPU (where a check on the host would wait
    for the device)."""
    if use_compiled("pack_codes", codes.device):
        return torch.ops.pyg_quant.pack_codes(codes, bits, col_layout)
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise TypeError("pack_codes: codes must be a 2-D uint8 tensor")
    if codes.numel():  # (the kernel checks each code as it reads it)
        fits = codes.max() <= 2**bits - 1
        if codes.device.type != "cpu":
            torch._assert_async(fits)  # a device-side assert: no host synchronization
        elif not bool(fits):
            raise ValueError(f"pack_codes: codes must lie in 0..{2**bits - 1} for {bits} bits")
    return reference.pack_codes(codes.to(torch.int64), bits, col_layout)


def unpack_codes(planes, rows: int, cols: int, col_layout: bool):
    if use_compiled("unpack_codes", planes.device):
        return torch.ops.pyg_quant.unpack_codes(planes, rows, cols, col_layout)
    return reference.unpack_codes(planes, rows, cols, col_layout)


def dequantize(planes, rows: int, cols: int, col_layout: bool, lo, scale, dim: int):
    # The compiled op has no backward: ranges that carry a gradient take the (differentiable) torch steps.
    plain = not (lo.requires_grad or scale.requires_grad) and lo.dtype == scale.dtype == torch.float32
    if plain and use_compiled("dequantize", planes.device):
        return torch.ops.pyg_quant.dequantize(planes, rows, cols, col_layout, lo, scale, dim)
    return reference.dequantize(planes, rows, cols, col_layout, lo, scale, dim)


def packed_code_sums(planes):
    if use_compiled("packed_code_sums", planes.device):
        return torch.ops.pyg_quant.packed_code_sums(planes)
    return reference.packed_code_sums(planes)


def pack_row_codes(planes, cols: int, col_layout: bool):
    if use_compiled("pack_row_codes", planes.device):
        return torch.ops.pyg_quant.pack_row_codes(planes, cols, col_layout)
    return reference.pack_row_codes(planes, cols, col_layout)


def bitmm_int(a_planes, b_planes, rows: int, cols: int, wide: bool):
    if use_compiled("bitmm_int", a_planes.device):
        return torch.ops.pyg_quant.bitmm_int(a_planes, b_planes, rows, cols, wide)
    return reference.bitmm_int(a_planes, b_planes, rows, cols, wide)


def bitmm_affine(product, row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k: int, bias, relu: bool):
    args = (product, row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k, bias, relu)
    if use_compiled("bitmm_affine", product.device):
        return torch.ops.pyg_quant.bitmm_affine(*args)
    return reference.bitmm_affine(*args)


def bit_spmm_int(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, rows: int, cols: int,
                 wide: bool, x_codes: Optional[torch.Tensor] = None):
    args = (window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, rows, cols, wide, x_codes)
    if use_compiled("bit_spmm_int", x_planes.device):
        return torch.ops.pyg_quant.bit_spmm_int(*args)
    return reference.bit_spmm_int(*args)


def bit_spmm_affine(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, lo, scale, row_sums,
                    self_weight, row_scale, bias, relu: bool, rows: int, cols: int, wide: bool,
                    x_codes: Optional[torch.Tensor] = None):
    args = (window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, lo, scale, row_sums, self_weight,
            row_scale, bias, relu, rows, cols, wide, x_codes)
    if use_compiled("bit_spmm_affine", x_planes.device):
        return torch.ops.pyg_quant.bit_spmm_affine(*args)
    return reference.bit_spmm_affine(*args)


def tile_plan(keys, sums, num_rows: int, num_cols: int, min_tile_nnz: int, planes: int):
    if use_compiled("tile_plan", keys.device):
        return torch.ops.pyg_quant.tile_plan(keys, sums, num_rows, num_cols, min_tile_nnz, planes)
    return reference.tile_plan(keys, sums, num_rows, num_cols, min_tile_nnz, planes)


def expand_tiles(tile_key, row_count, entry_col, entry_val, res_row, res_val, num_rows: int, num_cols: int,
                 planes: int):
    args = (tile_key, row_count, entry_col, entry_val, res_row, res_val, num_rows, num_cols, planes)
    if use_compiled("expand_tiles", tile_key.device):
        return torch.ops.pyg_quant.expand_tiles(*args)
    return reference.expand_tiles(*args)


def quant_mlp(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
              row_scale=None, col_keys: bool = False):
    """A chain of QuantLinear bit layers in one op (see :func:`reference.quant_mlp` for the definition); with
    ``col_keys``, ``(out, keys)``: the output's column keys too (see :func:`reference.col_keys_of`)."""
    args = (x, list(weight_codes), list(weight_lo), list(weight_scale), list(weight_sums), list(bias),
            [int(b) for b in act_bits], [int(b) for b in weight_bits], [bool(r) for r in relu], row_scale)
    name = "quant_mlp_keys" if col_keys else "quant_mlp"
    if use_compiled(name, x.device):
        return getattr(torch.ops.pyg_quant, name)(*args)
    return getattr(reference, name)(*args)


def quant_mlp_planes(planes, rows: int, cols: int, col_layout: bool, lo, scale, dim: int, weight_codes, weight_lo,
                     weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale=None,
                     col_keys: bool = False):
    """:func:`quant_mlp` of :func:`dequantize` ``(planes, rows, cols, col_layout, lo, scale, dim)`` in one op (the GPU
    kernel decodes the codes as it loads the rows)."""
    args = (planes, int(rows), int(cols), bool(col_layout), lo, scale, int(dim), list(weight_codes), list(weight_lo),
            list(weight_scale), list(weight_sums), list(bias), [int(b) for b in act_bits],
            [int(b) for b in weight_bits], [bool(r) for r in relu], row_scale)
    name = "quant_mlp_planes_keys" if col_keys else "quant_mlp_planes"
    if use_compiled(name, planes.device):
        return getattr(torch.ops.pyg_quant, name)(*args)
    return getattr(reference, name)(*args)


def quant_mlp_quantized(planes, rows: int, cols: int, col_layout: bool, lo, scale, dim: int, weight_codes,
                        weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale=None):
    """:func:`quant_mlp` with the first layer's input the codes of a packed tensor taken as they are (row layout,
    ranges per row or one; see :func:`reference.quant_mlp_quantized`); ``planes`` may be the codes themselves, uint8
    ``[rows, cols]``; compiled for the CPU only."""
    args = (planes, int(rows), int(cols), bool(col_layout), lo, scale, int(dim), list(weight_codes), list(weight_lo),
            list(weight_scale), list(weight_sums), list(bias), [int(b) for b in act_bits],
            [int(b) for b in weight_bits], [bool(r) for r in relu], row_scale)
    if use_compiled("quant_mlp_quantized", planes.device):
        return torch.ops.pyg_quant.quant_mlp_quantized(*args)
    return reference.quant_mlp_quantized(*args)


def quant_mlp_row_codes(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
                        row_scale, out_lo, out_inv_scale, out_bits: int):
    """:func:`quant_mlp` with its output quantized per column with fixed ranges, as packed row codes (see
    :func:`reference.quant_mlp_row_codes`; the GPU kernel writes them as it stores the rows)."""
    args = (x, list(weight_codes), list(weight_lo), list(weight_scale), list(weight_sums), list(bias),
            [int(b) for b in act_bits], [int(b) for b in weight_bits], [bool(r) for r in relu], row_scale, out_lo,
            out_inv_scale, int(out_bits))
    if use_compiled("quant_mlp_row_codes", x.device):
        return torch.ops.pyg_quant.quant_mlp_row_codes(*args)
    return reference.quant_mlp_row_codes(*args)


def quant_mlp_planes_row_codes(planes, rows: int, cols: int, col_layout: bool, lo, scale, dim: int, weight_codes,
                               weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale,
                               out_lo, out_inv_scale, out_bits: int):
    """:func:`quant_mlp_row_codes` of :func:`dequantize` ``(planes, rows, cols, col_layout, lo, scale, dim)``."""
    args = (planes, int(rows), int(cols), bool(col_layout), lo, scale, int(dim), list(weight_codes), list(weight_lo),
            list(weight_scale), list(weight_sums), list(bias), [int(b) for b in act_bits],
            [int(b) for b in weight_bits], [bool(r) for r in relu], row_scale, out_lo, out_inv_scale, int(out_bits))
    if use_compiled("quant_mlp_planes_row_codes", planes.device):
        return torch.ops.pyg_quant.quant_mlp_planes_row_codes(*args)
    return reference.quant_mlp_planes_row_codes(*args)


def planes_from_row_codes(row_codes, rows: int, cols: int, bits: int):
    """The column-layout planes of packed row codes (:func:`pack_row_codes`' inverse)."""
    if use_compiled("planes_from_row_codes", row_codes.device):
        return torch.ops.pyg_quant.planes_from_row_codes(row_codes, int(rows), int(cols), int(bits))
    return reference.planes_from_row_codes(row_codes, rows, cols, bits)


def expand_csr(tile_key, row_count, entry_col, entry_val, res_row, res_col, res_val, num_rows: int, num_cols: int):
    """``(res_ptr, res_col, res_val, row_sums)`` of a tile plan decoded without tiles (every entry in one CSR,
    rows sorted by column); ``res_val`` is None when neither ``entry_val`` nor ``res_val`` is given (all ones)."""
    args = (tile_key, row_count, entry_col, entry_val, res_row, res_col, res_val, num_rows, num_cols)
    if use_compiled("expand_csr", tile_key.device):
        out_ptr, out_col, out_val, row_sums = torch.ops.pyg_quant.expand_csr(*args)
    else:
        out_ptr, out_col, out_val, row_sums = reference.expand_csr(*args)
    return out_ptr, out_col, out_val if entry_val is not None or res_val is not None else None, row_sums


def expand_wire(buffer, parts, num_rows: int, num_cols: int, planes: int, tiles: bool):
    """``[window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, diag, row_sums]`` of a CompactAdjacency shipped
    in the uint8 ``buffer`` at the places ``parts`` gives (see :data:`reference.WIRE_PARTS`), in one op (see
    :func:`reference.expand_wire`)."""
    args = (buffer, parts, int(num_rows), int(num_cols), int(planes), bool(tiles))
    if use_compiled("expand_wire", buffer.device):
        return torch.ops.pyg_quant.expand_wire.default(*args)
    return reference.expand_wire(*args)


def mlp_weight_codes(weights, bits):
    """``[(codes, lo, scale, code sums), ...]``: each weight ``W [out, in]`` of ``weights`` quantized per output row
    to its ``bits`` as :func:`quant_mlp` takes a layer's weight, in one op (see :func:`reference.mlp_weight_codes`)."""
    weights, bits = list(weights), [int(b) for b in bits]
    if weights and use_compiled("mlp_weight_codes", weights[0].device):
        flat = torch.ops.pyg_quant.mlp_weight_codes.default(weights, bits)
    else:
        flat = reference.mlp_weight_codes(weights, bits)
    return [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]


def gin_conv_eval(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, wide: bool, x_planes, x_codes,
                  lo, scale, self_weight, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits,
                  weight_bits, relu, out_bits: int, out_dim: int):
    """A QGINConv layer's eval forward on a BitAdjacency in one op: ``[out, planes, lo, scale, code_sums, row_codes]``,
    ``[out]`` with ``out_bits`` 0 (see :func:`reference.gin_conv_eval`)."""
    args = (window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, bool(wide), x_planes, x_codes, lo,
            scale, self_weight, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
            int(out_bits), int(out_dim))
    if use_compiled("gin_conv_eval", x_planes.device):
        return torch.ops.pyg_quant.gin_conv_eval.default(*args)
    return reference.gin_conv_eval(*args)


def gcn_conv_eval(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, deg_inv_sqrt, bias,
                  act_bits: int, wide: bool, x, x_lo, x_scale, x_rows: int, weight_codes, weight_lo, weight_scale,
                  weight_sums, weight_bias, mlp_act_bits, weight_bits, relu, out_bits: int, out_dim: int):
    """A QGCNConv layer's eval forward on a BitAdjacency that holds its self loops, in one op (see
    :func:`reference.gcn_conv_eval`); ``x`` float32 ``[N, C]``, or the planes of per-column codes with ``x_lo`` /
    ``x_scale``."""
    args = (window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, deg_inv_sqrt, bias,
            int(act_bits), bool(wide), x, x_lo, x_scale, int(x_rows), weight_codes, weight_lo, weight_scale,
            weight_sums, weight_bias, mlp_act_bits, weight_bits, relu, int(out_bits), int(out_dim))
    if use_compiled("gcn_conv_eval", x.device):
        return torch.ops.pyg_quant.gcn_conv_eval.default(*args)
    return reference.gcn_conv_eval(*args)


def qat_gcn_conv_eval(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, deg_inv_sqrt, bias,
                      agg_bits: int, wide: bool, agg_keys, x, x_lo, x_scale, x_rows: int, x_cols: int,
                      x_col_layout: bool, x_dim: int, weight_codes, weight_lo, weight_scale, weight_sums, weight_bias,
                      act_bits, weight_bits, relu, x_quantized: bool = False):
    """A converted QATGCNConv layer's eval forward on a BitAdjacency that holds its self loops, in one op (see
    :func:`reference.qat_gcn_conv_eval`); ``x`` float32 ``[N, C]``, or the planes of codes with ``x_lo`` /
    ``x_scale``; ``agg_keys`` the aggregation quantizer's stored range as column keys (None: each channel's own).
    ``x_quantized``: the codes of ``x`` are the product's operand as they are (row layout, ranges per row or one:
    the op ``qat_gcn_conv_eval_quantized``, compiled for the CPU only)."""
    args = (window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, deg_inv_sqrt, bias,
            int(agg_bits), bool(wide), agg_keys, x, x_lo, x_scale, int(x_rows), int(x_cols), bool(x_col_layout),
            int(x_dim), weight_codes, weight_lo, weight_scale, weight_sums, weight_bias, act_bits, weight_bits, relu)
    name = "qat_gcn_conv_eval_quantized" if x_quantized else "qat_gcn_conv_eval"
    if use_compiled(name, x.device):
        return getattr(torch.ops.pyg_quant, name).default(*args)
    return reference.qat_gcn_conv_eval(*args, x_quantized=x_quantized)


def qat_gin_conv_eval(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, wide: bool, x,
                      x_lo, x_scale, x_codes, x_cols: int, x_dim: int, agg_bits: int, agg_keys, one_plus_eps,
                      weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu):
    """A converted QATGINConv layer's eval forward on a square BitAdjacency in one op (see
    :func:`reference.qat_gin_conv_eval`), and a QGINConv's on float features (each column's own range, no
    ``agg_keys``); ``x`` float32 ``[N, C]`` (quantized here with ``agg_keys`` or each column's own range), or the
    planes of per-column / per-tensor codes with ``x_lo`` / ``x_scale``."""
    args = (window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, bool(wide), x, x_lo, x_scale,
            x_codes, int(x_cols), int(x_dim), int(agg_bits), agg_keys, one_plus_eps, weight_codes, weight_lo,
            weight_scale, weight_sums, bias, act_bits, weight_bits, relu)
    if use_compiled("qat_gin_conv_eval", x.device):
        return torch.ops.pyg_quant.qat_gin_conv_eval.default(*args)
    return reference.qat_gin_conv_eval(*args)


if LOADED:

    @torch.library.register_fake("pyg_quant::quantize_pack")
    def _(x, lo, inv_scale, bits, col_layout, noise):
        outer, packed = (x.shape[1], x.shape[0]) if col_layout else (x.shape[0], x.shape[1])
        return x.new_empty((bits, padded_outer(outer), packed_words(packed)), dtype=torch.int32)

    def _fake_row_codes(planes, cols, col_layout):
        nodes = planes.shape[2] * 32 if col_layout else planes.shape[1]
        return planes.new_empty((nodes, row_code_bytes(cols, planes.shape[0])), dtype=torch.uint8)

    def _fake_ranges(x, bits, dim, col_layout, row_codes, code_sums):
        outer, packed = (x.shape[1], x.shape[0]) if col_layout else (x.shape[0], x.shape[1])
        ranges = x.shape[0] if dim == 1 else x.shape[1]
        planes = x.new_empty((bits, padded_outer(outer), packed_words(packed)), dtype=torch.int32)
        codes = (_fake_row_codes(planes, x.shape[1], col_layout) if row_codes
                 else x.new_empty((0, 0), dtype=torch.uint8))
        return (planes, x.new_empty((ranges,)), x.new_empty((ranges,)),
                x.new_empty((padded_outer(outer) if code_sums else 0,), dtype=torch.int64), codes)

    @torch.library.register_fake("pyg_quant::quantize_pack_ranges")
    def _(x, bits, dim, col_layout, noise, row_codes=False, col_keys=None, code_sums=True):
        return _fake_ranges(x, bits, dim, col_layout, row_codes, code_sums)

    @torch.library.register_fake("pyg_quant::fake_quantize")
    def _(x, lo, hi, bits, dim, noise, with_mask, random_noise=False, generator=None):
        return x.new_empty(x.shape), x.new_empty(x.shape if with_mask else (0,), dtype=torch.bool)

    @torch.library.register_fake("pyg_quant::csr_product")
    def _(y, adj, adj_t=None):
        return y.new_empty((adj.shape[0], y.shape[1]))

    @torch.library.register_fake("pyg_quant::csr_pair")
    def _(rows, cols, values, keep, row_scale, diag, num_rows, num_cols, dtype, transpose=True):
        nnz = rows.shape[0] + (num_rows if diag is not None else 0)
        t_rows, t_nnz = (num_cols + 1, nnz) if transpose else (0, 0)
        return (rows.new_empty((num_rows + 1,), dtype=torch.int32), rows.new_empty((nnz,), dtype=torch.int32),
                rows.new_empty((nnz,), dtype=dtype), rows.new_empty((t_rows,), dtype=torch.int32),
                rows.new_empty((t_nnz,), dtype=torch.int32), rows.new_empty((t_nnz,), dtype=dtype))

    @torch.library.register_fake("pyg_quant::degree_inv_sqrt")
    def _(dst, keep, count, diag, num_nodes):
        return dst.new_empty((num_nodes,), dtype=torch.float32), dst.new_empty((num_nodes,), dtype=torch.float32)

    @torch.library.register_fake("pyg_quant::qat_linear")
    def _(x, weight, bias, x_bits, x_random, x_generator, weight_bits, weight_random, weight_generator):
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("pyg_quant::mse_range")
    def _(x, dim, bits, grid):
        groups = 1 if dim < 0 else x.shape[1 - dim]
        return x.new_empty((groups,)), x.new_empty((groups,))

    @torch.library.register_fake("pyg_quant::ema_range")
    def _(x, stored_lo, stored_hi, momentum, dim, grid, grid_bits):
        return stored_lo.new_empty(stored_lo.shape), stored_lo.new_empty(stored_lo.shape), \
            stored_lo.new_empty(stored_lo.shape)

    @torch.library.register_fake("pyg_quant::pack_codes")
    def _(codes, bits, col_layout):
        outer, packed = (codes.shape[1], codes.shape[0]) if col_layout else (codes.shape[0], codes.shape[1])
        return codes.new_empty((bits, padded_outer(outer), packed_words(packed)), dtype=torch.int32)

    @torch.library.register_fake("pyg_quant::unpack_codes")
    def _(planes, rows, cols, col_layout):
        return planes.new_empty((rows, cols), dtype=torch.uint8)

    @torch.library.register_fake("pyg_quant::dequantize")
    def _(planes, rows, cols, col_layout, lo, scale, dim):
        return planes.new_empty((rows, cols), dtype=torch.float32)

    @torch.library.register_fake("pyg_quant::packed_code_sums")
    def _(planes):
        return planes.new_empty((planes.shape[1],), dtype=torch.int64)

    torch.library.register_fake("pyg_quant::pack_row_codes")(_fake_row_codes)

    @torch.library.register_fake("pyg_quant::bitmm_int")
    def _(a_planes, b_planes, rows, cols, wide):
        return a_planes.new_empty((rows, cols), dtype=torch.int64 if wide else torch.int32)

    @torch.library.register_fake("pyg_quant::bitmm_affine")
    def _(product, row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k, bias, relu):
        return product.new_empty(product.shape, dtype=torch.float32)

    @torch.library.register_fake("pyg_quant::bit_spmm_int")
    def _(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, rows, cols, wide, x_codes=None):
        return x_planes.new_empty((rows, cols), dtype=torch.int64 if wide else torch.int32)

    @torch.library.register_fake("pyg_quant::bit_spmm_affine")
    def _(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, lo, scale, row_sums, self_weight,
          row_scale, bias, relu, rows, cols, wide, x_codes=None):
        return x_planes.new_empty((rows, cols), dtype=torch.float32)

    @torch.library.register_fake("pyg_quant::tile_plan")
    def _(keys, sums, num_rows, num_cols, min_tile_nnz, planes):
        ctx = torch.library.get_ctx()
        tiles, in_tiles, residual = ctx.new_dynamic_size(), ctx.new_dynamic_size(), ctx.new_dynamic_size()
        return (keys.new_empty((tiles,), dtype=torch.int32), keys.new_empty((tiles, 16), dtype=torch.int16),
                keys.new_empty((in_tiles,), dtype=torch.uint8), keys.new_empty((in_tiles,), dtype=torch.uint8),
                keys.new_empty((residual,), dtype=torch.int32), keys.new_empty((residual,), dtype=torch.int32),
                keys.new_empty((residual,), dtype=torch.int64), keys.new_empty((num_rows,), dtype=torch.int64))

    @torch.library.register_fake("pyg_quant::expand_tiles")
    def _(tile_key, row_count, entry_col, entry_val, res_row, res_val, num_rows, num_cols, planes):
        windows, tiles = -(-num_rows // 16), tile_key.shape[0]
        return (tile_key.new_empty((windows + 1,), dtype=torch.int64), tile_key.new_empty((tiles,)),
                tile_key.new_empty((planes, tiles, 16, 8)), tile_key.new_empty((num_rows + 1,), dtype=torch.int64),
                tile_key.new_empty((num_rows,), dtype=torch.int64))

    def _fake_mlp_out(like, rows, weight_codes):
        return like.new_empty((rows, weight_codes[-1].shape[0]), dtype=torch.float32)

    def _fake_mlp_keys(like, weight_codes):
        return like.new_empty((2 * weight_codes[-1].shape[0],), dtype=torch.int64)

    @torch.library.register_fake("pyg_quant::quant_mlp")
    def _(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale=None):
        return _fake_mlp_out(x, x.shape[0], weight_codes)

    @torch.library.register_fake("pyg_quant::quant_mlp_keys")
    def _(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale=None):
        return _fake_mlp_out(x, x.shape[0], weight_codes), _fake_mlp_keys(x, weight_codes)

    @torch.library.register_fake("pyg_quant::quant_mlp_planes")
    @torch.library.register_fake("pyg_quant::quant_mlp_quantized")
    def _(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale, weight_sums, bias,
          act_bits, weight_bits, relu, row_scale=None):
        return _fake_mlp_out(planes, rows, weight_codes)

    @torch.library.register_fake("pyg_quant::quant_mlp_planes_keys")
    def _(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale, weight_sums, bias,
          act_bits, weight_bits, relu, row_scale=None):
        return _fake_mlp_out(planes, rows, weight_codes), _fake_mlp_keys(planes, weight_codes)

    def _fake_out_row_codes(like, rows, weight_codes, out_bits):
        return like.new_empty((packed_words(rows) * 32, row_code_bytes(weight_codes[-1].shape[0], out_bits)),
                              dtype=torch.uint8)

    @torch.library.register_fake("pyg_quant::quant_mlp_row_codes")
    def _(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale, out_lo,
          out_inv_scale, out_bits):
        return _fake_out_row_codes(x, x.shape[0], weight_codes, out_bits)

    @torch.library.register_fake("pyg_quant::quant_mlp_planes_row_codes")
    def _(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale, weight_sums, bias,
          act_bits, weight_bits, relu, row_scale, out_lo, out_inv_scale, out_bits):
        return _fake_out_row_codes(planes, rows, weight_codes, out_bits)

    @torch.library.register_fake("pyg_quant::planes_from_row_codes")
    def _(row_codes, rows, cols, bits):
        return row_codes.new_empty((bits, padded_outer(cols), packed_words(rows)), dtype=torch.int32)

    def _fake_conv_output(out, out_bits, out_dim):
        if out_bits == 0:
            return [out]
        row_codes = out.device.type == "cuda" and out_dim == 0
        return [out, *_fake_ranges(out, out_bits, out_dim, out_dim == 0, row_codes, not row_codes)]

    @torch.library.register_fake("pyg_quant::gin_conv_eval")
    def _(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, wide, x_planes, x_codes, lo, scale,
          self_weight, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu, out_bits,
          out_dim):
        return _fake_conv_output(_fake_mlp_out(x_planes, res_ptr.shape[0] - 1, weight_codes), out_bits, out_dim)

    @torch.library.register_fake("pyg_quant::gcn_conv_eval")
    def _(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, deg_inv_sqrt, bias, act_bits,
          wide, x, x_lo, x_scale, x_rows, weight_codes, weight_lo, weight_scale, weight_sums, weight_bias,
          mlp_act_bits, weight_bits, relu, out_bits, out_dim):
        return _fake_conv_output(_fake_mlp_out(x, res_ptr.shape[0] - 1, weight_codes), out_bits, out_dim)

    @torch.library.register_fake("pyg_quant::qat_gcn_conv_eval")
    @torch.library.register_fake("pyg_quant::qat_gcn_conv_eval_quantized")
    def _(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, deg_inv_sqrt, bias, agg_bits,
          wide, agg_keys, x, x_lo, x_scale, x_rows, x_cols, x_col_layout, x_dim, weight_codes, weight_lo,
          weight_scale, weight_sums, weight_bias, act_bits, weight_bits, relu):
        return _fake_mlp_out(x, res_ptr.shape[0] - 1, weight_codes)

    @torch.library.register_fake("pyg_quant::qat_gin_conv_eval")
    def _(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, row_sums, diag, wide, x, x_lo, x_scale,
          x_codes, x_cols, x_dim, agg_bits, agg_keys, one_plus_eps, weight_codes, weight_lo, weight_scale,
          weight_sums, bias, act_bits, weight_bits, relu):
        return _fake_mlp_out(x, res_ptr.shape[0] - 1, weight_codes)

    @torch.library.register_fake("pyg_quant::mlp_weight_codes")
    def _(weights, bits):
        out = []
        for w in weights:
            rows = w.shape[0]
            out += [w.new_empty(w.shape, dtype=torch.uint8), w.new_empty((rows,), dtype=torch.float32),
                    w.new_empty((rows,), dtype=torch.float32), w.new_empty((rows,), dtype=torch.int64)]
        return out

    @torch.library.register_fake("pyg_quant::expand_wire")
    def _(buffer, parts, num_rows, num_cols, planes, tiles):
        def size(name):
            return reference.wire_field(parts, name)[2]

        def shipped(name):
            return reference.wire_field(parts, name)[0] >= 0

        def new(*shape, dtype=torch.int32):
            return buffer.new_empty(shape, dtype=dtype)
        diag = new(num_rows if shipped("diag") else 0, dtype=torch.float32)
        ends = (new(-(-num_rows // TILE_ROWS) + 1, dtype=torch.int64), new(num_rows + 1, dtype=torch.int64))
        row_sums = new(num_rows, dtype=torch.int64)
        if not tiles:
            nnz = size("entry_col") + size("res_row")
            weighted = shipped("entry_val") or shipped("res_val")
            return [ends[0], new(0), new(planes, 0, TILE_ROWS, TILE_COLS // 32), ends[1], new(nnz),
                    new(nnz if weighted else 0), diag, row_sums]
        num_tiles, num_res = size("tile_key"), size("res_row")
        return [ends[0], new(num_tiles), new(planes, num_tiles, TILE_ROWS, TILE_COLS // 32), ends[1], new(num_res),
                new(num_res if shipped("res_val") else 0), diag, row_sums]

    @torch.library.register_fake("pyg_quant::expand_csr")
    def _(tile_key, row_count, entry_col, entry_val, res_row, res_col, res_val, num_rows, num_cols):
        nnz = entry_col.shape[0] + res_row.shape[0]
        weighted = entry_val is not None or res_val is not None
        return (tile_key.new_empty((num_rows + 1,), dtype=torch.int64), tile_key.new_empty((nnz,)),
                tile_key.new_empty((nnz if weighted else 0,)), tile_key.new_empty((num_rows,), dtype=torch.int64))
