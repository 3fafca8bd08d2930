"""The bit layout documented in pyg_quant/layout.py holds literally, and the compiled
pack/unpack/sum kernels agree bit for bit with the pure-torch reference.

The expected planes are built here with numpy's ``packbits(bitorder="little")`` on a
little-endian machine (bit k of 32-bit word w = element 32w+k), independent of both
the compiled kernels and pyg_quant.ops.reference.
"""
import sys

import numpy as np
import pytest
import torch

import pyg_quant as pq
from pyg_quant import layout as bit_layout
from pyg_quant import ops
from pyg_quant.ops import reference as ref

from conftest import gen, randn, requires_compiled, round_up

pytestmark = pytest.mark.skipif(sys.byteorder != "little", reason="numpy oracle assumes little-endian words")


def expected_planes(codes: torch.Tensor, bits: int, layout: str) -> torch.Tensor:
    """codes [rows, cols] (ints) -> int32[bits, outer_pad, words] per the documented layout."""
    c = codes.long().numpy()
    if layout == "col":
        c = c.T
    outer, packed = c.shape
    outer_pad, packed_pad = round_up(outer, 64), round_up(packed, 256)
    padded = np.zeros((outer_pad, packed_pad), dtype=np.int64)
    padded[:outer, :packed] = c
    planes = np.stack([
        np.packbits(((padded >> p) & 1).astype(np.uint8), axis=-1, bitorder="little").view("<i4")
        for p in range(bits)])
    return torch.from_numpy(planes.astype(np.int32))


def decode_bits(planes: torch.Tensor) -> np.ndarray:
    """int32[bits, outer, words] -> uint8[bits, outer, words*32], bit k of word w at 32w+k."""
    return np.unpackbits(planes.numpy().astype("<i4").view(np.uint8), axis=-1, bitorder="little")


def word_bit(planes, p, o, e) -> int:
    """Bit ``e % 32`` of word ``e // 32`` of plane p, outer row o, read as a Python int."""
    return (int(planes[p, o, e // 32]) >> (e % 32)) & 1


# --- the documented layout, literally -------------------------------------------------
def hand_codes(rows, cols, bits):
    """Deterministic codes that hold 0 and 2**bits-1 (so to_bit maps them to themselves)."""
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    codes = (7 * c + 3 * r + (c * c) // 5) % (2**bits)
    codes[0, 0] = 0
    codes[-1, -1] = 2**bits - 1
    return codes


@pytest.mark.parametrize("layout", ["row", "col"])
def test_literal_bits_row_and_col(layout):
    bits, rows, cols = 4, 3, 70
    codes = hand_codes(rows, cols, bits)
    codes[1, 33] = 0b1010
    codes[0, 31] = 0b1111
    codes[2, 64] = 0b0001
    # integer-valued x whose range is exactly [0, 15]: lo = 0, scale = 1, codes = x
    bt = pq.to_bit(codes.float(), bits, layout=layout)
    assert bt.lo.tolist() == [0.0] and bt.scale.tolist() == [1.0]
    P = bt.planes
    if layout == "row":
        # row 1, element 33 -> word 1, bit 1
        assert [word_bit(P, p, 1, 33) for p in range(4)] == [0, 1, 0, 1]
        assert (int(P[1, 1, 1]) >> 1) & 1 == 1 and (int(P[0, 1, 1]) >> 1) & 1 == 0
        # element 31 of row 0 lives in the sign bit of word 0 of every plane
        assert all(int(P[p, 0, 0]) < 0 for p in range(4))
        # element 64 of row 2 -> word 2, bit 0: only plane 0
        assert [int(P[p, 2, 2]) & 1 for p in range(4)] == [1, 0, 0, 0]
        outer, packed = rows, cols
    else:
        # column 33, element (row) 1 -> outer 33, word 0, bit 1
        assert [word_bit(P, p, 33, 1) for p in range(4)] == [0, 1, 0, 1]
        # row 0 of column 31 -> outer 31, word 0, bit 0
        assert [int(P[p, 31, 0]) & 1 for p in range(4)] == [1, 1, 1, 1]
        # row 2 of column 64 -> outer 64, word 0, bit 2
        assert [(int(P[p, 64, 0]) >> 2) & 1 for p in range(4)] == [1, 0, 0, 0]
        outer, packed = cols, rows
    # every bit, through a plain Python walk of the documented formula
    for p in range(bits):
        for o in range(outer):
            for e in range(packed):
                q = int(codes[o, e]) if layout == "row" else int(codes[e, o])
                assert word_bit(P, p, o, e) == (q >> p) & 1
    assert torch.equal(bt.codes().long(), codes)


@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("shape", [(1, 1), (5, 32), (31, 33), (64, 256), (65, 257), (100, 513)])
@pytest.mark.parametrize("bits", [1, 3, 8])
def test_layout_matches_numpy_packbits_and_padding(layout, shape, bits):
    rows, cols = shape
    codes = hand_codes(rows, cols, bits) if rows * cols > 1 else torch.zeros(1, 1, dtype=torch.long)
    bt = pq.to_bit(codes.float(), bits, layout=layout)
    outer, packed = (rows, cols) if layout == "row" else (cols, rows)
    # padding: packed dim to 256 bits (8 words), outer dim to 64
    assert bt.planes.shape == (bits, round_up(outer, 64), round_up(packed, 256) // 32)
    assert bt.planes.dtype == torch.int32 and bt.planes.is_contiguous()
    assert torch.equal(bt.planes, expected_planes(codes, bits, layout))
    decoded = decode_bits(bt.planes)
    assert not decoded[:, outer:, :].any(), "padded outer rows must hold zero codes"
    assert not decoded[:, :, packed:].any(), "padded packed positions must hold zero codes"


@requires_compiled
@pytest.mark.parametrize("rows,cols", [(1, 1), (31, 65), (256, 64), (257, 300)])
def test_compiled_padding_and_tiles_follow_layout_py(rows, cols):
    """csrc/layout.h's constants and rules, as the compiled ops apply them, are layout.py's: the planes' padding,
    the row codes' row bytes and the adjacency's tile shape."""
    x = randn(rows, cols, rows + cols)
    lo, inv = to_bit_args(x, 3, None)
    for col in (False, True):
        outer, packed = (cols, rows) if col else (rows, cols)
        shape = (3, bit_layout.padded_outer(outer), bit_layout.packed_words(packed))
        assert torch.ops.pyg_quant.quantize_pack(x, lo, inv, 3, col, None).shape == shape
        for dim in (0, 1):
            assert torch.ops.pyg_quant.quantize_pack_ranges(x, 3, dim, col, None)[0].shape == shape
    for bits in (1, 2, 3, 5, 8):
        planes = torch.ops.pyg_quant.quantize_pack(x, lo, inv, bits, True, None)
        codes = torch.ops.pyg_quant.pack_row_codes(planes, cols, True)
        assert codes.shape == (bit_layout.packed_words(rows) * 32, bit_layout.row_code_bytes(cols, bits))
        assert torch.ops.pyg_quant.planes_from_row_codes(codes, rows, cols, bits).shape == planes.shape
    keys = torch.arange(0, rows * cols, 5)
    tile_key, row_count, entry_col, _, res_row, _, _, _ = torch.ops.pyg_quant.tile_plan(
        keys, torch.ones_like(keys), rows, cols, 1, 1)
    window_ptr, tile_col, tile_bits, _, _ = torch.ops.pyg_quant.expand_tiles(
        tile_key, row_count, entry_col, None, res_row, None, rows, cols, 1)
    windows, col_tiles = -(-rows // bit_layout.TILE_ROWS), -(-cols // bit_layout.TILE_COLS)
    assert row_count.shape[1:] == (bit_layout.TILE_ROWS,) and window_ptr.shape == (windows + 1,)
    assert tile_bits.shape == (1, tile_key.numel(), bit_layout.TILE_ROWS, bit_layout.TILE_WORDS)
    assert torch.equal(tile_col, tile_key % col_tiles) and int(tile_key.max()) < windows * col_tiles


# --- compiled == reference, bit for bit -----------------------------------------------
AWKWARD = [(1, 1), (31, 33), (257, 255), (100, 513), (3, 1000)]


def to_bit_args(x, bits, dim):
    """lo / inv_scale exactly as to_bit builds them."""
    if dim is None:
        lo, hi = x.min().view(1, 1), x.max().view(1, 1)
    else:
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / float(2**bits - 1)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return lo, inv


@requires_compiled
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("shape", AWKWARD)
def test_quantize_pack_compiled_equals_reference(shape, dim, layout, stochastic):
    rows, cols = shape
    seed = rows * 1000 + cols
    x = randn(rows, cols, seed, shift=0.3)
    noise = torch.rand(rows, cols, generator=gen(seed + 1)) if stochastic else None
    col = layout == "col"
    for bits in range(1, 9):
        lo, inv = to_bit_args(x, bits, dim)
        got = torch.ops.pyg_quant.quantize_pack(x, lo, inv, bits, col, noise)
        want = ref.quantize_pack(x, lo, inv, bits, col, noise)
        assert got.dtype == torch.int32 and want.dtype == torch.int32
        assert torch.equal(got, want), (bits, dim, layout, stochastic)
        # and the public path (which dispatches to the compiled op) gives the same planes
        if not stochastic:
            bt = pq.to_bit(x, bits, dim=dim, layout=layout)
            assert torch.equal(bt.planes, want)
            assert bt.codes().max() <= 2**bits - 1


@requires_compiled
@pytest.mark.parametrize("col", [False, True])
@pytest.mark.parametrize("lo_shape", ["tensor", "row", "col", "full", "strided"])
@pytest.mark.parametrize("shape", [(70, 530), (33, 1), (1, 17), (96, 272)])
def test_quantize_pack_tiles_and_specials_like_reference(shape, lo_shape, col):
    """The word-at-a-time CPU packer (SSE2 codes, 32x256 column tiles, 16x16 byte transposes) against the
    reference: several column tiles with ragged edges, every lo / inv_scale broadcast (a full matrix, a
    strided float64 one), NaN and ±inf inputs (a NaN code is 0, as the bit-at-a-time packer gave)."""
    rows, cols = shape
    g = gen(rows * 7 + cols)
    x = torch.randn(rows, cols, generator=g) * 2
    u = torch.rand(rows, cols, generator=g)
    x[u < 0.03] = float("nan")
    x[(u >= 0.03) & (u < 0.06)] = float("inf")
    x[(u >= 0.06) & (u < 0.09)] = -float("inf")
    if lo_shape == "strided":  # a transposed view in float64: made float32 and contiguous inside
        lo = torch.randn(cols, 1, generator=g, dtype=torch.float64).t()
        inv = torch.rand(cols, 1, generator=g, dtype=torch.float64).t() * 3
    else:
        size = {"tensor": (1, 1), "row": (rows, 1), "col": (1, cols), "full": (rows, cols)}[lo_shape]
        lo, inv = torch.randn(size, generator=g), torch.rand(size, generator=g) * 3
    noise = torch.rand(rows, cols, generator=g)
    for bits in (1, 2, 3, 6, 8):
        for nz in (None, noise):
            got = torch.ops.pyg_quant.quantize_pack(x, lo, inv, bits, col, nz)
            want = ref.quantize_pack(x, lo.float(), inv.float(), bits, col, nz)
            assert torch.equal(got, want), (bits, nz is None)
    codes = ref.unpack_codes(torch.ops.pyg_quant.quantize_pack(x, lo, inv, 3, col, None), rows, cols, col)
    assert (codes[x.isnan()] == 0).all()


@requires_compiled
@pytest.mark.parametrize("col", [False, True])
@pytest.mark.parametrize("lo_shape", ["tensor", "row", "col"])
def test_quantize_pack_clamps_like_reference(col, lo_shape):
    """Arbitrary lo / inv_scale push codes below 0 and above 2**bits-1: both clamp alike."""
    rows, cols = 45, 77
    x = randn(rows, cols, 11, spread=3.0)
    g = gen(12)
    shape = {"tensor": (1, 1), "row": (rows, 1), "col": (1, cols)}[lo_shape]
    lo = torch.randn(shape, generator=g)
    inv = 30 + torch.rand(shape, generator=g) * 70
    if inv.numel() > 1:
        inv.view(-1)[0] = 0.0  # a zero inv_scale (a constant slice) as well
    noise = torch.rand(rows, cols, generator=g)
    for bits in (1, 2, 5, 8):
        for nz in (None, noise):
            got = torch.ops.pyg_quant.quantize_pack(x, lo, inv, bits, col, nz)
            want = ref.quantize_pack(x, lo, inv, bits, col, nz)
            assert torch.equal(got, want)
            codes = ref.unpack_codes(want, rows, cols, col).long()
            assert (codes == 0).any() and (codes == 2**bits - 1).any()  # clamping was exercised


@requires_compiled
def test_quantize_pack_noncontiguous_x():
    x = randn(70, 40, 5).t()  # [40, 70], not contiguous
    lo, inv = to_bit_args(x, 6, 0)
    got = torch.ops.pyg_quant.quantize_pack(x, lo, inv, 6, True, None)
    assert torch.equal(got, ref.quantize_pack(x.contiguous(), lo, inv, 6, True, None))


def random_planes(bits, outer_pad, words, seed):
    """Random bits everywhere (padding included)."""
    return torch.randint(-2**31, 2**31, (bits, outer_pad, words), generator=gen(seed), dtype=torch.int64).to(torch.int32)


@requires_compiled
@pytest.mark.parametrize("col", [False, True])
@pytest.mark.parametrize("rows,cols", [(1, 1), (31, 33), (64, 256), (100, 513), (257, 255)])
def test_unpack_codes_compiled_equals_reference(rows, cols, col):
    outer, packed = (cols, rows) if col else (rows, cols)
    for bits in range(1, 9):
        planes = random_planes(bits, round_up(outer, 64), round_up(packed, 256) // 32, bits * 7 + rows)
        got = torch.ops.pyg_quant.unpack_codes(planes, rows, cols, col)
        want = ref.unpack_codes(planes, rows, cols, col)
        assert got.dtype == torch.uint8 and got.shape == (rows, cols)
        assert torch.equal(got, want)
        # and against the numpy decoder: q = sum_p 2**p * bit_p
        dec = decode_bits(planes).astype(np.int64)  # [bits, outer_pad, packed_pad]
        q = (dec * (1 << np.arange(bits)).reshape(-1, 1, 1)).sum(0)[:outer, :packed]
        if col:
            q = q.T
        assert np.array_equal(got.numpy().astype(np.int64), q)


@requires_compiled
@pytest.mark.parametrize("outer_pad,words", [(64, 8), (128, 16), (192, 72)])
def test_packed_code_sums_compiled_equals_reference(outer_pad, words):
    for bits in range(1, 9):
        planes = random_planes(bits, outer_pad, words, bits + outer_pad + words)
        got = torch.ops.pyg_quant.packed_code_sums(planes)
        want = ref.packed_code_sums(planes)
        assert got.dtype == torch.int64 and got.shape == (outer_pad,)
        assert torch.equal(got, want)
        dec = decode_bits(planes).astype(np.int64)
        expected = (dec.sum(-1) * (1 << np.arange(bits)).reshape(-1, 1)).sum(0)
        assert np.array_equal(got.numpy(), expected)


@pytest.mark.parametrize("layout", ["row", "col"])
def test_code_sums_are_sums_along_packed_dim(layout):
    x = randn(37, 300, 3)
    for bits in (1, 4, 8):
        bt = pq.to_bit(x, bits, dim=None, layout=layout)
        codes = ref.unpack_codes(bt.planes, 37, 300, layout == "col").long()
        want = codes.sum(1) if layout == "row" else codes.sum(0)
        assert torch.equal(bt.code_sums(), want)
        assert torch.equal(ops.packed_code_sums(bt.planes), ref.packed_code_sums(bt.planes))
