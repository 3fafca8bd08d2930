"""GPU == CPU, bit for bit, for every op; float results within fp32 rounding of float64.

Everything here needs a CUDA GPU and pyg_quant's compiled CUDA backend, and skips
cleanly otherwise.  The checks are written as ``_check_*(dev)`` helpers so that they
can also be exercised on the CPU (``dev="cpu"``) as a dry run of the test code.
"""
import itertools
import re

import pytest
import torch

import pyg_quant as pq
from pyg_quant.ops import reference as ref

from conftest import (CUDA_OK, EPILOGUE_BOUND, assert_fp32_close, cuda_kernel_names, deq64, dense_from_edges, gen, mag64, randn,
                      random_edges, ref_codes, requires_sm90a, round_up)
from test_quantize import check_pack_row_codes, dequantize_cases, grid_data

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU and pyg_quant's compiled CUDA backend "
                                           "(torch.cuda.is_available() and pyg_quant.backends()['cuda'])"),
]

OPS = torch.ops.pyg_quant if hasattr(torch.ops, "pyg_quant") else None
AWKWARD = [(1, 1), (31, 33), (257, 255), (100, 513), (1000, 3), (64, 256)]
ALL_PAIRS = list(itertools.product(range(1, 9), range(1, 9)))


def _equal_on_cpu(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


# --- quantize / unpack / sums -------------------------------------------------------------
def _check_quantize_pack(dev, shape):
    rows, cols = shape
    x = randn(rows, cols, rows + cols, shift=0.2)
    noise = torch.rand(rows, cols, generator=gen(rows * cols))
    for bits, dim, col, nz in itertools.product(range(1, 9), (None, 0, 1), (False, True), (None, noise)):
        if dim is None:
            lo, hi = x.min().view(1, 1), x.max().view(1, 1)
        else:
            lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        scale = (hi - lo) / float(2**bits - 1)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        want = OPS.quantize_pack(x, lo, inv, bits, col, nz)
        got = OPS.quantize_pack(x.to(dev), lo.to(dev), inv.to(dev), bits, col, None if nz is None else nz.to(dev))
        assert got.device.type == dev and _equal_on_cpu(got, want), (bits, dim, col, nz is None)
        assert torch.equal(want, ref.quantize_pack(x, lo, inv, bits, col, nz))
        if nz is None:  # the public path on the device
            bt = pq.to_bit(x.to(dev), bits, dim=dim, layout="col" if col else "row")
            assert _equal_on_cpu(bt.planes, want)
            assert _equal_on_cpu(bt.lo, lo.view(-1)) and _equal_on_cpu(bt.scale, scale.view(-1))


def _check_quantize_pack_clamping(dev):
    rows, cols = 45, 77
    x = randn(rows, cols, 11, spread=3.0)
    g = gen(12)
    for shape in ((1, 1), (rows, 1), (1, cols)):
        lo = torch.randn(shape, generator=g)
        inv = 30 + torch.rand(shape, generator=g) * 70
        noise = torch.rand(rows, cols, generator=g)
        for bits, col, nz in itertools.product((1, 3, 8), (False, True), (None, noise)):
            want = OPS.quantize_pack(x, lo, inv, bits, col, nz)
            got = OPS.quantize_pack(x.to(dev), lo.to(dev), inv.to(dev), bits, col, None if nz is None else nz.to(dev))
            assert _equal_on_cpu(got, want)


def _random_planes(bits, outer_pad, words, seed):
    return torch.randint(-2**31, 2**31, (bits, outer_pad, words), generator=gen(seed), dtype=torch.int64).to(torch.int32)


def _check_unpack_and_sums(dev, shape):
    rows, cols = shape
    for bits, col in itertools.product(range(1, 9), (False, True)):
        outer, packed = (cols, rows) if col else (rows, cols)
        planes = _random_planes(bits, round_up(outer, 64), round_up(packed, 256) // 32, bits + rows * 3 + cols)
        want = OPS.unpack_codes(planes, rows, cols, col)
        got = OPS.unpack_codes(planes.to(dev), rows, cols, col)
        assert got.device.type == dev and _equal_on_cpu(got, want)
        want_sums = OPS.packed_code_sums(planes)
        got_sums = OPS.packed_code_sums(planes.to(dev))
        assert _equal_on_cpu(got_sums, want_sums)
        assert torch.equal(want_sums, ref.packed_code_sums(planes))
    for planes, rows_, cols_, col, lo, scale, dim in dequantize_cases(shape, rows + 7 * cols):
        want = OPS.dequantize(planes, rows_, cols_, col, lo, scale, dim)
        got = OPS.dequantize(planes.to(dev), rows_, cols_, col, lo.to(dev), scale.to(dev), dim)
        assert got.device.type == dev and _equal_on_cpu(got, want), (col, dim, planes.size(0))


# --- bitmm ---------------------------------------------------------------------------------
def _bitmm_operands(dev, M, K, N, s, t, a_dim=None, b_dim=None, seed=0):
    a = pq.to_bit(randn(M, K, seed + s, shift=0.3).to(dev), s, dim=a_dim)
    b = pq.to_bit(randn(K, N, seed + 10 * t, shift=-0.1).to(dev), t, dim=b_dim, layout="col")
    return a, b


def _check_bitmm_int(dev, shape):
    M, K, N = shape
    for s, t in ALL_PAIRS:
        a, b = _bitmm_operands(dev, M, K, N, s, t, seed=K)
        for wide in (False, True):
            got = OPS.bitmm_int(a.planes, b.planes, M, N, wide)
            want = OPS.bitmm_int(a.planes.cpu(), b.planes.cpu(), M, N, wide)
            assert got.device.type == dev and _equal_on_cpu(got, want), (s, t, wide)
        assert torch.equal(want, ref_codes(a).cpu() @ ref_codes(b).cpu())
        assert _equal_on_cpu(pq.bitmm_int(a, b), want.to(torch.int32))


def _check_bitmm_int_planes(dev, s, t, rows, cols, outer_a, outer_b, words, seed):
    """Random planes, padding rows and words included (every bit random: no zero tiles for a wrong offset,
    phase or swizzle to hide behind), against the CPU kernel."""
    a = _random_planes(s, outer_a, words, seed)
    b = _random_planes(t, outer_b, words, seed + 1)
    want = OPS.bitmm_int(a, b, rows, cols, False)
    assert want.abs().sum() > 0
    got = OPS.bitmm_int(a.to(dev), b.to(dev), rows, cols, False)
    assert got.device.type == dev and _equal_on_cpu(got, want), (s, t, rows, cols, outer_a, outer_b, words)


# Shapes for the sm_90 kernel's edges (bitmm_wgmma_cuda.cu: 128 x 256 tiles for one plane pair, 128 x 128 for
# several, 128 x 64 for N <= 64; 2 to 8 B planes stacked in k = 2, 4, 8 slots: 128 x 256 / k (one A plane) or
# 128 x 128 / k (several); K chunks of 4, 2 or 1 k256 steps = 32, 16 or 8 words; 2-CTA clusters over M sharing
# B).  (s, t, rows, cols, outer_a, outer_b, words); elsewhere they run the mma.sync kernel.
TMA_EDGES = [
    # 37 steps: 10 chunks of 4 (the last one step), 4 stages wrapping 2.5 times; 3 M tiles (a cluster's second
    # CTA past the operand); 2 N tiles, the second's far half of B wholly past the operand
    (1, 1, 300, 300, 320, 320, 37 * 8),
    (1, 1, 200, 64, 384, 192, 9 * 8),  # N <= 64 (n64); planes padded well past rows/cols
    (1, 1, 129, 100, 192, 128, 3 * 8),  # 2 chunks of 2 steps (64-byte swizzle), 2 stages
    (1, 1, 70, 33, 128, 64, 8),  # one step (32-byte swizzle), one chunk, one M tile
    (1, 1, 256, 512, 256, 512, 4096),  # K = 131072 bits: 128 chunks, stage phases flip 32 times
    (1, 3, 257, 130, 320, 192, 21 * 8),  # several pairs, 2 N tiles of 128 (2 valid columns in the second)
    (2, 7, 190, 300, 192, 320, 40 * 8),  # 14 pairs (even); 2-step chunks (the planes' smem)
    (3, 5, 130, 65, 192, 128, 13 * 8),  # 15 pairs: a lone last pair per chunk
    (8, 8, 100, 200, 128, 256, 20 * 8),  # 64 pairs: 1-step chunks, 3 stages, 20 chunks
    (8, 8, 64, 40, 64, 64, 8 * 8),  # 64 pairs, n64
    (5, 1, 64, 64, 64, 64, 8),
    (4, 4, 1000, 1000, 1024, 1024, 8 * 8),
    # one A plane and 2 to 8 B planes, stacked along N (tiles of 128 or 64, 64, 32 columns): partial last
    # tiles, a cluster's second CTA past the operand, partial last chunks, every chunk length
    (1, 2, 300, 300, 320, 320, 37 * 8),
    (1, 2, 129, 50, 192, 64, 3 * 8),
    (1, 4, 257, 100, 320, 128, 21 * 8),
    (1, 4, 70, 33, 128, 64, 8),
    (1, 8, 190, 70, 192, 128, 9 * 8),
    (1, 8, 64, 250, 64, 256, 40 * 8),
    # 3, 5, 6, 7 B planes: 4 or 8 slots, the last ones zero (never copied into)
    (1, 5, 130, 90, 192, 128, 11 * 8),
    (1, 6, 300, 40, 320, 64, 2 * 8),
    (1, 7, 65, 129, 128, 192, 5 * 8),
    # several A planes against stacked B planes (n128 of 2, 4, 8 slots: output tiles of 64, 32, 16 columns)
    (2, 2, 200, 50, 256, 64, 6 * 8),
    (3, 3, 129, 70, 192, 128, 13 * 8),
    (7, 2, 64, 130, 64, 192, 3 * 8),
    (2, 5, 257, 17, 320, 64, 9 * 8),
]
# Grids below and above one wave of an H100 / H200 (132 SMs, 66 resident 2-CTA clusters; the kernel is persistent,
# a cluster walks work units = one N tile of a pair of M tiles): 34 units; 213 units (odd M tiles); 108 units of
# several plane pairs; 72 units of 10 chunks each (4 stages: the stage phases run on across a cluster's units);
# 79 units of n64.
TMA_WAVES = [
    (2, 3, 4100, 200, 4160, 256, 16),
    (1, 1, 17925, 520, 17984, 576, 16),
    (2, 2, 9000, 300, 9024, 384, 16),
    (1, 1, 9000, 300, 9024, 320, 37 * 8),
    (1, 1, 20000, 60, 20032, 64, 8),
    (1, 4, 9000, 200, 9024, 256, 16),  # 144 units of stacked planes
]


def _check_bitmm_int_misaligned(dev):
    """Planes that start 4 bytes off a 16-byte boundary (a view with a storage offset): copied, not faulted."""
    s, t, rows, cols, words = 2, 3, 150, 70, 24
    a_buf = _random_planes(1, 1, s * 192 * words + 1, 5).view(-1)
    b_buf = _random_planes(1, 1, t * 128 * words + 1, 6).view(-1)
    a, b = a_buf[1:].view(s, 192, words), b_buf[1:].view(t, 128, words)
    want = OPS.bitmm_int(a, b, rows, cols, False)
    a_dev, b_dev = a_buf.to(dev)[1:].view(s, 192, words), b_buf.to(dev)[1:].view(t, 128, words)
    assert dev == "cpu" or a_dev.data_ptr() % 16 != 0
    for wide in (False, True):
        assert _equal_on_cpu(OPS.bitmm_int(a_dev, b_dev, rows, cols, wide), want.long() if wide else want)


def _check_bitmm_float(dev, shape):
    M, K, N = shape
    for (s, t), (a_dim, b_dim) in itertools.product([(1, 1), (3, 5), (8, 8), (2, 7)], [(None, None), (1, 0)]):
        a, b = _bitmm_operands(dev, M, K, N, s, t, a_dim, b_dim, seed=7)
        out = pq.bitmm(a, b)
        assert out.device.type == dev
        A, B = deq64(a).cpu(), deq64(b).cpu()
        terms = mag64(a).cpu() @ mag64(b).cpu()  # the magnitudes of the terms the epilogue adds
        assert_fp32_close(out, A @ B, EPILOGUE_BOUND * terms + 1e-30, scale=terms)
        # and identical to the CPU result: exact integers, the same float32 epilogue
        assert _equal_on_cpu(out, pq.bitmm(a.to("cpu"), b.to("cpu")))
        # operands in the other layouts (repacked on the device)
        out2 = pq.bitmm(a.as_layout("col"), b.as_layout("row"))
        assert _equal_on_cpu(out2, out)
        # the fused epilogue itself: bit for bit the CPU kernel's, bias and ReLU included
        bias = randn(1, N, M + N).view(-1).to(dev)
        from pyg_quant.bitmm import bitmm_float
        assert _equal_on_cpu(bitmm_float(a, b, bias, True), bitmm_float(a.to("cpu"), b.to("cpu"), bias.cpu(), True))
        assert _equal_on_cpu(bitmm_float(a, b), bitmm_float(a.to("cpu"), b.to("cpu")))


def _check_bitmm_overflow_widening(dev):
    K = 33100
    xa = torch.ones(2, K)
    xa[:, 0] = 0.0
    xb = torch.ones(K, 3)
    xb[0, :] = 0.0
    a, b = pq.to_bit(xa.to(dev), 8), pq.to_bit(xb.to(dev), 8, layout="col")
    with pytest.raises(ValueError, match="overflow"):
        pq.bitmm_int(a, b)
    wide = OPS.bitmm_int(a.planes, b.planes, 2, 3, True)
    assert _equal_on_cpu(wide, ref_codes(a).cpu() @ ref_codes(b).cpu())
    out = pq.bitmm(a, b)
    A, B = deq64(a).cpu(), deq64(b).cpu()
    assert_fp32_close(out, A @ B, 1e-6 * (A.abs() @ B.abs()) + 1e-30)


# --- adjacency / spmm ------------------------------------------------------------------------
def _graph_with_bits(n, num_edges, adj_bits, seed):
    """Random graph whose largest edge multiplicity is exactly 2**(adj_bits-1) (so bits == adj_bits)."""
    ei = random_edges(n, n, num_edges, seed, loops=False)
    ei = torch.unique(ei, dim=1)
    reps = 2 ** (adj_bits - 1)
    if reps > 1:
        ei = torch.cat([ei, ei[:, :5].repeat(1, reps - 1)], 1)
    return ei


ADJ_TENSORS = ("window_ptr", "tile_col", "tile_bits", "res_ptr", "res_col", "res_val", "diag", "row_sums")


def _check_adjacency_equal(dev, ei, num_nodes, self_loops, min_tile_nnz):
    cpu = pq.BitAdjacency.from_edge_index(ei, num_nodes, self_loops=self_loops, min_tile_nnz=min_tile_nnz)
    gpu = pq.BitAdjacency.from_edge_index(ei.to(dev), num_nodes, self_loops=self_loops, min_tile_nnz=min_tile_nnz)
    assert gpu.device.type == dev
    for name in ADJ_TENSORS:
        c, g = getattr(cpu, name), getattr(gpu, name)
        assert (c is None) == (g is None), name
        if c is not None:
            assert _equal_on_cpu(g, c), name
    for name in ("num_rows", "num_cols", "nnz", "max_row_sum", "bits", "num_tiles"):
        assert getattr(gpu, name) == getattr(cpu, name), name
    assert _equal_on_cpu(gpu.to_dense(), cpu.to_dense())
    assert _equal_on_cpu(gpu.degree(), cpu.degree())
    return cpu, gpu


def _check_bit_spmm_int(dev, adj_bits):
    n = 300
    ei = _graph_with_bits(n, 3000, adj_bits, seed=adj_bits)
    for min_tile_nnz in (1, 16):
        cpu, gpu = _check_adjacency_equal(dev, ei, n, 0, min_tile_nnz)
        assert cpu.bits == adj_bits
        A = dense_from_edges(ei, n, n).long()
        for x_bits in range(1, 9):
            x = pq.to_bit(randn(n, 21, x_bits).to(dev), x_bits, dim=0, layout="col")
            for wide in (False, True):
                args = [getattr(gpu, k) for k in ADJ_TENSORS[:6]] + [x.planes, n, 21, wide]
                got = OPS.bit_spmm_int(*args)
                cpu_args = [getattr(cpu, k) for k in ADJ_TENSORS[:6]] + [x.planes.cpu(), n, 21, wide]
                want = OPS.bit_spmm_int(*cpu_args)
                assert got.device.type == dev and _equal_on_cpu(got, want), (adj_bits, x_bits, min_tile_nnz, wide)
            assert torch.equal(want, A @ ref_codes(x).cpu())


def _check_gather_equal(dev, cpu, gpu, x, A=None, tag=()):
    """bit_spmm_int of the square adjacencies `cpu` / `gpu` on x (n x cols, column layout): GPU == CPU bit for bit in
    int32 and int64, codes cached or packed inside.  With A (the dense adjacency), also CPU == A @ codes and the
    fused float epilogue (self loops, a row scale, bias, ReLU or not) GPU == CPU; returns (the CPU's ReLU output,
    row scale, bias), else None."""
    n, cols = x.rows, x.cols
    for wide, cached in itertools.product((False, True), (False, True)):
        codes = x.row_codes() if cached else None
        got = OPS.bit_spmm_int(*[getattr(gpu, k) for k in ADJ_TENSORS[:6]], x.planes, n, cols, wide, codes)
        want = OPS.bit_spmm_int(*[getattr(cpu, k) for k in ADJ_TENSORS[:6]], x.planes.cpu(), n, cols, wide)
        assert got.device.type == dev and _equal_on_cpu(got, want), tag + (wide, cached)
    if A is None:
        return None
    assert torch.equal(want, A @ ref_codes(x).cpu())
    row_scale = torch.rand(n, generator=gen(cols)) + 0.5
    bias = torch.randn(cols, generator=gen(cols + 1))
    for relu in (False, True):
        def affine(adj, on, codes=None):
            return OPS.bit_spmm_affine(*[getattr(adj, k) for k in ADJ_TENSORS[:6]], x.planes.to(on),
                                       x.lo.to(on), x.scale.to(on), adj.row_sums, adj.diag,
                                       row_scale.to(on), bias.to(on), relu, n, cols, False, codes)
        want = affine(cpu, "cpu")
        assert _equal_on_cpu(affine(gpu, dev), want), tag + (relu,)
        assert _equal_on_cpu(affine(gpu, dev, x.row_codes()), want), tag + (relu,)
    return want, row_scale, bias


def _check_bit_spmm_csr_only(dev):
    """An adjacency without tiles (min_tile_nnz above a tile's 4096 entries) runs the CUDA gather kernel:
    GPU == CPU bit for bit for 1- to 8-bit features (row-code containers of 1, 2, 4 and 8 bits, packed inside the
    op or passed in as the BitTensor's cached row codes), binary and multi-bit adjacency, int32 and int64, feature
    counts needing 1 to 32 lanes per row and two launches' worth of columns, and a 5000-entry hub row that makes
    the 16-bit partial sums flush (every 257 entries for 8-bit codes, every 17 with weights up to 255 at 4 bits);
    then the fused float epilogue (self loops, a row scale, bias, ReLU) equals the CPU's bit for bit, and weights
    past 255 (possible at the op level only) are still exact."""
    n = 5000
    hub = torch.stack([torch.arange(1, n), torch.zeros(n - 1, dtype=torch.long)])  # every node -> node 0
    binary = torch.unique(torch.cat([hub, random_edges(n, n, 30000, 21, loops=False)], 1), dim=1)
    weighted = torch.cat([binary, hub[:, :40].repeat(1, 254)], 1)  # 40 hub entries of weight 255
    for ei in (binary, weighted):
        cpu = pq.BitAdjacency.from_edge_index(ei, n, self_loops=1, min_tile_nnz=4097)
        gpu = pq.BitAdjacency.from_edge_index(ei.to(dev), n, self_loops=1, min_tile_nnz=4097)
        assert cpu.num_tiles == 0 and gpu.num_tiles == 0 and (cpu.res_val is None) == (ei is binary)
        A = dense_from_edges(ei, n, n).long()
        for x_bits, cols in itertools.product(range(1, 9), (1, 21, 64, 100, 300, 600)):
            x = pq.to_bit(randn(n, cols, x_bits + cols, shift=0.3).to(dev), x_bits, dim=0, layout="col")
            full = cols in (21, 64, 300) and x_bits in (1, 3, 4, 8)
            _check_gather_equal(dev, cpu, gpu, x, A if full else None, (ei is binary, x_bits, cols))
            if ei is weighted and cols == 64:  # op-level weights past the 8-bit adjacency: the exact slow path
                args = [getattr(cpu, k) for k in ADJ_TENSORS[:5]] + [cpu.res_val * 1000 + 7, x.planes.cpu(), n, 64, True]
                want = OPS.bit_spmm_int(*args)
                assert _equal_on_cpu(OPS.bit_spmm_int(*[a.to(dev) if torch.is_tensor(a) else a for a in args]), want)


def _check_bit_spmm_dense_rows(dev):
    """Rows of ~25 entries (METIS batches give ~40) through the CUDA gather: several whole batches of columns a
    row, then a partial one, for 1- to 5-bit codes (containers of 1, 2, 4 and 8 bits): GPU == CPU bit for bit for
    feature counts needing 1 to 16 lanes a row, a 1,999-entry hub row (the 8-bit fields' flushes), 500 empty rows,
    int32 and int64 (their 16-byte stores and the feature-at-a-time ones), with cached row codes or not, then the
    fused float epilogue (self loops, row scale, bias, ReLU; its per-column parameters loaded four at a time, and
    one at a time from a view that is not 16-byte aligned)."""
    n = 2000
    hub = torch.stack([torch.arange(1, n), torch.zeros(n - 1, dtype=torch.long)])  # every node -> node 0
    rest = random_edges(n, 1500, 48000, 77, loops=False)  # rows 1500.. stay empty
    ei = torch.unique(torch.cat([hub, rest], 1), dim=1)
    cpu = pq.BitAdjacency.from_edge_index(ei, n, self_loops=1, min_tile_nnz=4097)
    gpu = pq.BitAdjacency.from_edge_index(ei.to(dev), n, self_loops=1, min_tile_nnz=4097)
    assert gpu.num_tiles == 0 and gpu.res_val is None and gpu.res_nnz >= 16 * n
    A = dense_from_edges(ei, n, n).long()
    for x_bits, cols in itertools.product((1, 2, 3, 4, 5), (1, 5, 16, 17, 64, 100, 128, 129)):
        x = pq.to_bit(randn(n, cols, 7 * x_bits + cols, shift=0.2).to(dev), x_bits, dim=0, layout="col")
        want, row_scale, bias = _check_gather_equal(dev, cpu, gpu, x, A, (x_bits, cols))
        if cols == 64:  # lo, scale and bias as views one float past a 16-byte boundary
            def shifted(t):
                return torch.cat([t.new_zeros(1), t])[1:]
            got = OPS.bit_spmm_affine(*[getattr(gpu, k) for k in ADJ_TENSORS[:6]], x.planes, shifted(x.lo),
                                      shifted(x.scale), gpu.row_sums, gpu.diag, row_scale.to(dev),
                                      shifted(bias.to(dev)), True, n, cols, False, None)
            assert _equal_on_cpu(got, want), x_bits


def _check_gather_saturated_codes(dev):
    """8-bit containers at their largest codes through long rows: the gather's 16-bit-field sums (bytes 0 and 2
    masked, w >> 8 whole) flush every 255 entries, where 255 codes of 255 bring both registers to within 1% of 2^32:
    GPU == CPU == the exact integer product for 6- to 8-bit codes (containers of 8), rows of 254 to 4,999 entries,
    every code of a source row its maximum (and a few rows of other codes, so that every field carries its own sum)."""
    n = 5000
    hub = torch.stack([torch.arange(1, n), torch.zeros(n - 1, dtype=torch.long)])  # node 0: 4,999 entries
    row1 = torch.stack([torch.arange(2, 257), torch.ones(255, dtype=torch.long)])  # node 1: 255 entries
    row2 = torch.stack([torch.arange(3, 257), torch.full((254,), 2)])  # node 2: 254
    ei = torch.cat([hub, row1, row2], 1)
    cpu = pq.BitAdjacency.from_edge_index(ei, n, min_tile_nnz=4097)
    gpu = pq.BitAdjacency.from_edge_index(ei.to(dev), n, min_tile_nnz=4097)
    assert gpu.num_tiles == 0 and gpu.res_val is None
    A = dense_from_edges(ei, n, n).long()
    for x_bits, cols in itertools.product((6, 7, 8), (16, 64, 100)):
        values = torch.ones(n, cols)
        values[0] = 0.0  # node 0's codes are 0, every other node's the maximum: lo = 0, scale = 1 / max code
        values[5:25] = torch.rand(20, cols, generator=gen(x_bits + cols))  # a few mixed rows
        x = pq.to_bit(values.to(dev), x_bits, dim=0, layout="col")
        codes = OPS.unpack_codes(x.planes.cpu(), n, cols, True).long()
        assert int(codes[1:5].min()) == 2**x_bits - 1
        for wide in (False, True):
            args = [getattr(gpu, k) for k in ADJ_TENSORS[:6]] + [x.planes, n, cols, wide]
            got = OPS.bit_spmm_int(*args)
            want = OPS.bit_spmm_int(*[getattr(cpu, k) for k in ADJ_TENSORS[:6]] + [x.planes.cpu(), n, cols, wide])
            assert _equal_on_cpu(got, want), (x_bits, cols, wide)
            assert torch.equal(want.long(), A @ codes), (x_bits, cols, wide)


def _check_gather_block_order(dev):
    """The gather kernels run their blocks SM by SM (a permutation of the launch's blocks, sm_contiguous_block in
    csrc/cuda/spmm_gather.cuh): every row is written, for block counts below, at and above the SM count and at several
    of it plus a remainder, for 1, 4 and 8 lanes a row.  The output's memory first holds another input's
    result (the same shapes, so the caching allocator hands the same block back), so a skipped row would show."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for cols, rows_per_block in ((16, 128), (64, 32), (100, 16)):  # 4-bit codes: 1, 4 and 8 lanes a row
        for blocks in (1, sms - 1, sms, sms + 1, 3 * sms + 7):
            n = blocks * rows_per_block - rows_per_block // 2  # a partial last block
            ei = torch.unique(random_edges(n, n, 12 * n, n + cols, loops=False), dim=1)  # binary
            cpu = pq.BitAdjacency.from_edge_index(ei, n, self_loops=1, min_tile_nnz=4097)
            gpu = pq.BitAdjacency.from_edge_index(ei.to(dev), n, self_loops=1, min_tile_nnz=4097)
            assert gpu.num_tiles == 0 and gpu.res_val is None
            other, x = (pq.to_bit(randn(n, cols, seed * 1000 + n, shift=0.2).to(dev), 4, dim=0, layout="col")
                        for seed in (1, 2))

            def gather(on, adj, bt):
                return OPS.bit_spmm_int(*[getattr(adj, k) for k in ADJ_TENSORS[:6]], bt.planes.to(on), n, cols, False)

            stale = gather(dev, gpu, other)
            del stale  # its memory goes back to the cache for the next result
            got = gather(dev, gpu, x)
            want = gather("cpu", cpu, x)
            assert want.abs().sum() > 0 and _equal_on_cpu(got, want), (cols, blocks)


def _check_adjacency_variants(dev):
    ei = random_edges(300, 300, 2500, 2)
    for self_loops, min_tile_nnz in itertools.product((0, 1, 2), (1, 16, 10**6)):
        _check_adjacency_equal(dev, ei, 300, self_loops, min_tile_nnz)
    _check_adjacency_equal(dev, random_edges(300, 17, 800, 7), (300, 17), 0, 16)
    _check_adjacency_equal(dev, random_edges(17, 600, 700, 8), (17, 600), 0, 16)
    _check_adjacency_equal(dev, torch.empty(2, 0, dtype=torch.long), 37, 1, 16)
    _check_adjacency_equal(dev, random_edges(1000, 1000, 6000, 3).to(torch.int32), 1000, 1, 16)


def _check_bit_spmm_float(dev):
    for n, edges, self_loops in ((17, 60, 1), (300, 2500, 0), (1000, 6000, 2), (260, 30000, 1)):
        ei = random_edges(n, n, edges, n)
        adj = pq.BitAdjacency.from_edge_index(ei.to(dev), n, self_loops=self_loops, min_tile_nnz=16)
        A = adj.to_dense().double().cpu()
        for x_bits, x_dim in itertools.product(range(1, 9), (0, None)):
            x = pq.to_bit(randn(n, 23, x_bits + n, shift=0.5).to(dev), x_bits, dim=x_dim, layout="col")
            out = pq.bit_spmm(adj, x)
            assert out.device.type == dev
            terms = A.abs() @ mag64(x).cpu()  # A holds the diagonal: its term too
            assert_fp32_close(out, A @ deq64(x).cpu(), EPILOGUE_BOUND * terms + 1e-30, scale=terms)
            if x_bits in (1, 6):  # "row" input: repacked on the device
                xr = pq.to_bit(randn(n, 23, x_bits + n, shift=0.5).to(dev), x_bits, dim=x_dim, layout="row")
                assert _equal_on_cpu(pq.bit_spmm(adj, xr), out)


# --- stochastic rounding on the device ----------------------------------------------------
def _check_stochastic_deterministic(dev):
    x = randn(50, 77, 3).to(dev)
    for bits, dim in itertools.product((1, 3, 8), (None, 0, 1)):
        a = pq.to_bit(x, bits, dim=dim, stochastic=True, generator=gen(1234, dev))
        b = pq.to_bit(x, bits, dim=dim, stochastic=True, generator=gen(1234, dev))
        c = pq.to_bit(x, bits, dim=dim, stochastic=True, generator=gen(4321, dev))
        assert torch.equal(a.planes, b.planes) and not torch.equal(a.planes, c.planes)
        err = (pq.to_val(a).double() - x.double()).abs()
        step = a.scale.double().view({None: (1, 1), 0: (1, -1), 1: (-1, 1)}[dim])
        assert (err <= step * (1 + 1e-4) + 1e-5).all()


def _check_stochastic_unbiased(dev, bits, dim):
    # Same derivation as tests/test_quantize.py::test_stochastic_rounding_is_unbiased:
    # one draw of lo + scale·floor(v + u) has mean x and variance scale²·f(1-f), f = frac(v);
    # accept |mean of n draws - x| ≤ 5·sqrt(scale²·f(1-f)/n) + 1e-6.
    n = 2000
    x, f, scale = grid_data(bits, seed=bits * 10 + (dim or 0))
    bt = pq.to_bit(x.repeat(n, 1).to(dev), bits, dim=dim, stochastic=True, generator=gen(99 + bits, dev))
    mean = pq.to_val(bt).double().cpu().view(n, *x.shape).mean(0)
    tol = 5 * torch.sqrt(scale**2 * f * (1 - f) / n) + 1e-6
    dev_ = (mean - x.double()).abs()
    assert (dev_ <= tol).all(), f"max deviation / tolerance = {float((dev_ / tol).max()):.2f}"
    near = pq.to_val(pq.to_bit(x.to(dev), bits, dim=dim)).double().cpu()
    interior = f > 0
    assert ((near - x.double()).abs()[interior] > tol[interior]).all()


def _check_device_mismatch(dev):
    a = pq.to_bit(randn(4, 6, 1), 3)
    b = pq.to_bit(randn(6, 5, 2), 3, layout="col")
    with pytest.raises(ValueError):
        pq.bitmm(a, b.to(dev))
    adj = pq.BitAdjacency.from_edge_index(random_edges(6, 6, 20, 1), 6)
    with pytest.raises(ValueError):
        pq.bit_spmm(adj, pq.to_bit(randn(6, 4, 1), 3, dim=0).to(dev))
    with pytest.raises(ValueError):
        pq.to_bit(randn(6, 4, 1).to(dev), 3, stochastic=True, generator=gen(0, "cpu"))


def _check_to_and_as_layout(dev):
    bt = pq.to_bit(randn(70, 300, 1), 5, dim=1)
    moved = bt.to(dev)
    assert moved.device.type == dev and _equal_on_cpu(moved.planes, bt.planes)
    assert _equal_on_cpu(moved.codes(), bt.codes())
    assert _equal_on_cpu(moved.code_sums(), bt.code_sums())
    assert _equal_on_cpu(moved.as_layout("col").planes, bt.as_layout("col").planes)
    assert _equal_on_cpu(pq.to_val(moved), pq.to_val(bt))
    assert moved.to("cpu").device.type == "cpu"


# --- the tests (CUDA only) -------------------------------------------------------------------
DEV = "cuda"


@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_pack_gpu_equals_cpu(shape):
    _check_quantize_pack(DEV, shape)


def test_quantize_pack_clamping_gpu_equals_cpu():
    _check_quantize_pack_clamping(DEV)


@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: f"{s[0]}x{s[1]}")
def test_unpack_codes_and_sums_gpu_equals_cpu(shape):
    _check_unpack_and_sums(DEV, shape)


@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 300, 19), (65, 513, 70), (130, 1000, 129)],
                         ids=lambda s: "x".join(map(str, s)))
def test_bitmm_int_gpu_equals_cpu_all_bit_pairs(shape):
    _check_bitmm_int(DEV, shape)


@pytest.mark.parametrize("shape", [(190, 5000, 300), (70, 2100, 520), (257, 256, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_bitmm_int_gpu_equals_cpu_long_k(shape):
    """Several K chunks in flight, a partial last chunk, output tiles past the padded operands
    (on sm_90 the wgmma kernel's pipeline; elsewhere the mma.sync kernel's)."""
    M, K, N = shape
    for s, t in [(1, 1), (1, 4), (2, 7), (3, 5), (4, 4), (8, 8)]:
        a, b = _bitmm_operands(DEV, M, K, N, s, t, seed=K + s)
        want = OPS.bitmm_int(a.planes.cpu(), b.planes.cpu(), M, N, False)
        assert want.abs().sum() > 0
        assert _equal_on_cpu(OPS.bitmm_int(a.planes, b.planes, M, N, False), want), (s, t)
        assert _equal_on_cpu(OPS.bitmm_int(a.planes, b.planes, M, N, True), want.long()), (s, t)


@pytest.mark.parametrize("case", TMA_EDGES, ids=lambda c: "s{}t{}_{}x{}_w{}".format(c[0], c[1], c[2], c[3], c[6]))
def test_bitmm_int_gpu_equals_cpu_pipeline_edges(case):
    """The sm_90 TMA pipeline's edges: partial last chunks, stage phases wrapping, partial and empty tiles, every
    chunk length, 1 to 64 plane pairs, padded planes."""
    s, t, rows, cols, outer_a, outer_b, words = case
    _check_bitmm_int_planes(DEV, s, t, rows, cols, outer_a, outer_b, words, seed=rows + 7 * words)


@pytest.mark.parametrize("case", TMA_WAVES, ids=lambda c: f"s{c[0]}t{c[1]}_{c[2]}x{c[3]}_w{c[6]}")
def test_bitmm_int_gpu_equals_cpu_waves(case):
    s, t, rows, cols, outer_a, outer_b, words = case
    _check_bitmm_int_planes(DEV, s, t, rows, cols, outer_a, outer_b, words, seed=cols)


def test_bitmm_int_gpu_misaligned_planes():
    _check_bitmm_int_misaligned(DEV)


@requires_sm90a
def test_bitmm_int_takes_wgmma_on_sm90():
    for s, t, n in [(1, 1, 300), (1, 1, 64), (4, 4, 100), (8, 8, 200), (1, 2, 300), (1, 3, 70), (1, 4, 100),
                    (1, 7, 90), (1, 8, 40)]:
        a, b = _bitmm_operands(DEV, 300, 1000, n, s, t)
        names = cuda_kernel_names(lambda: OPS.bitmm_int(a.planes, b.planes, 300, n, False))
        assert any("bitmm_wgmma_tma_kernel" in name for name in names), (s, t, names)
        # 2 to 8 B planes: the stacked instantiation (kStack: 2, 4 or 8 slots)
        stack = 1 if t == 1 else 2 if t == 2 else 4 if t <= 4 else 8
        assert any(re.search(rf"bitmm_wgmma_tma_kernel<\d+, \w+, {stack}, \d>", name) for name in names), names
    # int64 results stay on the mma.sync kernel
    names = cuda_kernel_names(lambda: OPS.bitmm_int(a.planes, b.planes, 300, n, True))
    assert not any("bitmm_wgmma" in name for name in names) and any("bitmm_kernel" in n for n in names), names


@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 300, 19), (300, 600, 300)], ids=lambda s: "x".join(map(str, s)))
def test_bitmm_float_gpu(shape):
    _check_bitmm_float(DEV, shape)


def test_bitmm_overflow_widening_gpu():
    _check_bitmm_overflow_widening(DEV)


@pytest.mark.parametrize("adj_bits", range(1, 9))
def test_bit_spmm_int_gpu_equals_cpu(adj_bits):
    _check_bit_spmm_int(DEV, adj_bits)


def test_bit_spmm_csr_only_gpu_equals_cpu():
    _check_bit_spmm_csr_only(DEV)


def test_bit_spmm_dense_rows_gpu_equals_cpu():
    _check_bit_spmm_dense_rows(DEV)


def test_gather_saturated_codes_gpu_equals_cpu():
    _check_gather_saturated_codes(DEV)


def test_gather_block_order_gpu_equals_cpu():
    _check_gather_block_order(DEV)


def test_pack_row_codes_gpu_equals_cpu():
    check_pack_row_codes(DEV)


def test_from_edge_index_gpu_equals_cpu():
    _check_adjacency_variants(DEV)


def test_bit_spmm_float_gpu():
    _check_bit_spmm_float(DEV)


def test_stochastic_to_bit_gpu_deterministic():
    _check_stochastic_deterministic(DEV)


@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_stochastic_to_bit_gpu_unbiased(bits, dim):
    _check_stochastic_unbiased(DEV, bits, dim)


def test_device_mismatch_errors():
    _check_device_mismatch(DEV)


def test_to_and_as_layout_gpu():
    _check_to_and_as_layout(DEV)


@pytest.mark.parametrize("pair", [(1, 1), (2, 3), (4, 1), (8, 8)], ids=lambda p: f"{p[0]}x{p[1]}")
def test_bitmm_int_gpu_multi_chunk_pipeline(pair):
    """K = 2600 bits = 11 k256 steps: several cp.async stages and a partial last chunk."""
    s, t = pair
    a, b = _bitmm_operands(DEV, 70, 2600, 65, s, t, seed=s * 10 + t)
    for wide in (False, True):
        got = OPS.bitmm_int(a.planes, b.planes, 70, 65, wide)
        assert _equal_on_cpu(got, OPS.bitmm_int(a.planes.cpu(), b.planes.cpu(), 70, 65, wide)), wide
    assert torch.equal(got.cpu(), ref_codes(a).cpu() @ ref_codes(b).cpu())


def test_ops_capture_in_a_cuda_graph():
    """No host synchronisation or pageable copies inside: quantize, bitmm and bit_spmm replay in a CUDA graph."""
    n, f = 700, 40
    x = randn(n, f, 3).to(DEV)
    y = randn(n, 24, 4).to(DEV)
    adj = pq.BitAdjacency.from_edge_index(random_edges(n, n, 9000, 5), n, self_loops=1, min_tile_nnz=16).to(DEV)
    lo, hi = x.amin(0, keepdim=True), x.amax(0, keepdim=True)
    inv = torch.full_like(hi, 15.0) / (hi - lo)
    scale = (hi - lo) / torch.full_like(hi, 15.0)
    yq = pq.to_bit(y, 4, dim=0, layout="col")  # K = nodes, like x's column planes: Qxᵀ·Qy
    row_scale = torch.rand(n, device=DEV) + 0.5

    def step():
        planes = OPS.quantize_pack(x, lo, inv, 4, True, None)
        agg = OPS.bit_spmm_affine(adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col,
                                  adj.res_val, planes, lo.view(-1), scale.view(-1), adj.row_sums, adj.diag,
                                  row_scale, None, True, n, f, False)
        return planes, agg, OPS.bitmm_int(planes, yq.planes, f, 24, False)

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up on the capture stream (kernel attributes, allocator)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.add_(0.25)  # new inputs, same buffers: the replay must see them
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    for got, expected in zip(captured, want):
        assert torch.equal(got, expected)
    assert not torch.equal(captured[1], eager[1])
