"""to_bit / to_val: rounding error bounds, ranges, stochastic rounding (determinism and
unbiasedness), and the BitTensor container (to, nbytes, pin_memory, as_layout)."""

import itertools
import os
import subprocess
import sys

import pytest
import torch

import pyg_quant as pq
from pyg_quant.ops import reference as ref

from conftest import deq64, gen, randn, ref_codes, requires_compiled, requires_cuda, round_up, scale_view

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = [(1, 1), (1, 7), (9, 1), (31, 33), (100, 257)]


def expected_ranges(x, bits, dim):
    """lo = min, scale = (max - min) / (2**bits - 1), reduced over dim; float32 like to_bit.

    The divisor is a tensor, as in to_bit: CUDA turns a division by a Python
    scalar into a multiplication by its reciprocal, which can differ in the last bit.
    """
    if dim is None:
        lo, hi = x.min().view(1), x.max().view(1)
    else:
        lo, hi = x.amin(dim), x.amax(dim)
    return lo, (hi - lo) / torch.full_like(hi, float(2**bits - 1))


def elementwise_slack(x, bt):
    """Float32 slack on top of the rounding step.

    v = (x - lo)·inv_scale is formed in float32 (relative error a few ulps of v ≤ 2**bits),
    which may move a code across a rounding boundary by ~1e-5 of a step; to_val's
    lo + scale·q adds a float32 rounding of ~2**-24 · (|lo| + |scale·q|).
    """
    view = scale_view(bt)
    lo, scale = bt.lo.double().view(view), bt.scale.double().view(view)
    return 1e-4 * scale + 4 * 2**-24 * (lo.abs() + scale * 2**bt.bits + x.double().abs())


@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_nearest(shape, dim, layout, device):
    x = randn(*shape, seed=shape[0] * 31 + shape[1], shift=0.7, spread=2.5, device=device)
    for bits in range(1, 9):
        bt = pq.to_bit(x, bits, dim=dim, layout=layout)
        assert bt.shape == shape and bt.bits == bits and bt.layout == layout and bt.dim == dim
        assert bt.device == x.device
        lo, scale = expected_ranges(x, bits, dim)
        assert torch.equal(bt.lo, lo) and torch.equal(bt.scale, scale)
        assert bt.lo.dtype == torch.float32 and bt.scale.dtype == torch.float32
        codes = bt.codes()
        assert codes.dtype == torch.uint8 and codes.shape == shape
        assert int(codes.max()) <= 2**bits - 1
        assert torch.equal(codes.long(), ref_codes(bt))
        val = pq.to_val(bt)
        assert val.dtype == torch.float32 and val.shape == shape
        err = (val.double() - x.double()).abs()
        step = bt.scale.double().view(scale_view(bt))
        assert (err <= step / 2 + elementwise_slack(x, bt)).all(), float((err - step / 2).max())


@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("shape", [(31, 33), (64, 300)])
def test_round_trip_error_stochastic(shape, dim):
    x = randn(*shape, seed=5, spread=3.0)
    for bits in range(1, 9):
        bt = pq.to_bit(x, bits, dim=dim, stochastic=True, generator=gen(bits))
        assert int(bt.codes().max()) <= 2**bits - 1
        err = (pq.to_val(bt).double() - x.double()).abs()
        step = bt.scale.double().view(scale_view(bt))
        assert (err <= step + elementwise_slack(x, bt)).all()
        # stochastic rounding does not always pick the nearest code
        near = pq.to_bit(x, bits, dim=dim)
        if bits < 8 or shape[0] * shape[1] > 1000:
            assert not torch.equal(bt.codes(), near.codes())


def test_nearest_codes_match_formula():
    """q = clamp(floor((x - lo)·inv_scale + 0.5), 0, 2**bits-1) with float32 steps."""
    x = randn(40, 50, 8, shift=-1.0)
    for bits in (1, 2, 7, 8):
        bt = pq.to_bit(x, bits, dim=0)
        lo = x.amin(0, keepdim=True)
        inv = 1.0 / ((x.amax(0, keepdim=True) - lo) / float(2**bits - 1))
        q = torch.floor((x - lo) * inv + 0.5).clamp(0, 2**bits - 1).long()
        assert torch.equal(bt.codes().long(), q)


@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("layout", ["row", "col"])
def test_constant_input_round_trips_exactly(dim, stochastic, layout):
    x = torch.full((13, 70), -2.375)
    for bits in (1, 4, 8):
        bt = pq.to_bit(x, bits, dim=dim, stochastic=stochastic, layout=layout)
        assert (bt.scale == 0).all()
        assert (bt.codes() == 0).all()
        assert torch.equal(pq.to_val(bt), x)


def test_constant_slices_round_trip_exactly():
    """Per-row ranges where some rows are constant (scale 0 there, codes 0) and others not."""
    x = randn(6, 40, 2)
    x[1] = 3.5
    x[4] = -0.25
    bt = pq.to_bit(x, 5, dim=1)
    assert bt.scale[1] == 0 and bt.scale[4] == 0 and (bt.scale[[0, 2, 3, 5]] > 0).all()
    val = pq.to_val(bt)
    assert torch.equal(val[1], x[1]) and torch.equal(val[4], x[4])


@pytest.mark.parametrize("dim,expected", [(None, 1), (0, 33), (1, 21), (-1, 21), (-2, 33)])
def test_scale_shapes(dim, expected):
    x = randn(21, 33, 4)
    bt = pq.to_bit(x, 3, dim=dim)
    assert bt.lo.shape == (expected,) and bt.scale.shape == (expected,)
    assert bt.dim == (None if dim is None else dim % 2)
    # ranges: every slice's min is reached by code 0 and its max by 2**bits-1
    val = pq.to_val(bt)
    if dim is None:
        assert val.min() == x.min()
    else:
        assert torch.equal(val.amin(dim % 2), x.amin(dim % 2))


def test_non_float32_inputs_are_quantized_as_float32():
    x64 = randn(17, 40, 9).double() + 1e-9
    for x in (x64, x64.half(), x64.bfloat16()):
        bt = pq.to_bit(x, 6)
        want = pq.to_bit(x.float(), 6)
        assert torch.equal(bt.planes, want.planes) and torch.equal(bt.lo, want.lo)


# --- stochastic rounding ----------------------------------------------------------------
@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("layout", ["row", "col"])
def test_stochastic_is_deterministic_per_seed(dim, layout):
    x = randn(50, 77, 3)
    for bits in (1, 3, 8):
        a = pq.to_bit(x, bits, dim=dim, stochastic=True, generator=gen(1234), layout=layout)
        b = pq.to_bit(x, bits, dim=dim, stochastic=True, generator=gen(1234), layout=layout)
        c = pq.to_bit(x, bits, dim=dim, stochastic=True, generator=gen(4321), layout=layout)
        assert torch.equal(a.planes, b.planes)
        assert not torch.equal(a.planes, c.planes)
        # the noise is torch.rand(x.shape, generator) applied as floor(v + u)
        lo = x.min().view(1, 1) if dim is None else x.amin(dim, keepdim=True)
        hi = x.max().view(1, 1) if dim is None else x.amax(dim, keepdim=True)
        inv = 1.0 / ((hi - lo) / float(2**bits - 1))
        noise = torch.rand(x.shape, generator=gen(1234))
        want = ref.quantize_pack(x, lo, inv, bits, layout == "col", noise)
        assert torch.equal(a.planes, want)


def grid_data(bits: int, seed: int):
    """16×16 data on an exactly representable grid: x = lo + scale·(k + f).

    lo = -1.25 and scale = 2**-3 are exact in float32, as are hi - lo = scale·(2**bits-1),
    scale = (hi - lo)/(2**bits - 1) and inv_scale = 8, so v = (x - lo)·inv_scale = k + f
    exactly and f = frac(v) is known exactly.  Every row and every column holds lo
    (x[i, i]) and hi (x[i, i+1 mod 16]), so the ranges are the same for dim None/0/1.
    The other entries take f ∈ {5/64, ..., 59/64}: never on the grid, never near it.
    """
    g = gen(seed)
    lo, scale, top = -1.25, 2.0**-3, 2**bits - 1
    n = 16
    k = torch.randint(0, max(top, 1), (n, n), generator=g).double()
    f = torch.randint(5, 60, (n, n), generator=g).double() / 64
    if top == 1:
        k.zero_()
    idx = torch.arange(n)
    k[idx, idx], f[idx, idx] = 0, 0
    k[idx, (idx + 1) % n], f[idx, (idx + 1) % n] = top, 0
    x = (lo + scale * (k + f)).float()
    assert torch.equal(x.double(), lo + scale * (k + f))  # exact in float32
    return x, f, scale


@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_stochastic_rounding_is_unbiased(bits, dim):
    # One draw: q = floor(v + u), u ~ U[0,1), v = k + f  ->  q = k + 1 with probability f,
    # else k.  So E[q] = k + f = v (unbiased) and Var[q] = f(1 - f); the dequantized value
    # lo + scale·q has mean x and variance scale²·f(1 - f).  The mean of n independent draws
    # has standard deviation sqrt(scale²·f(1-f)/n); we accept |mean - x| ≤ 5 of those
    # (+1e-6 for float32 arithmetic), a 5-sigma bound per element (f ∈ [5/64, 59/64] keeps
    # the Bernoulli far from its degenerate tails, so the normal approximation holds).
    n = 2000
    x, f, scale = grid_data(bits, seed=bits * 10 + (dim or 0))
    tiled = x.repeat(n, 1)  # tiling along rows keeps every range (tensor, per column, per row)
    bt = pq.to_bit(tiled, bits, dim=dim, stochastic=True, generator=gen(99 + bits))
    assert torch.allclose(bt.scale.double(), torch.tensor(scale, dtype=torch.float64))
    assert torch.allclose(bt.lo.double(), torch.tensor(-1.25, dtype=torch.float64))
    draws = pq.to_val(bt).double().view(n, *x.shape)
    mean = draws.mean(0)
    tol = 5 * torch.sqrt(scale**2 * f * (1 - f) / n) + 1e-6
    dev = (mean - x.double()).abs()
    assert (dev <= tol).all(), f"max deviation / tolerance = {float((dev / tol).max()):.2f}"
    # the draws really are random: each interior element takes both neighbours
    interior = f > 0
    assert ((draws.amax(0) - draws.amin(0))[interior] > 0).all()

    # Sanity: round-to-nearest is biased on the same data by scale·min(f, 1-f) ≥ scale·5/64,
    # which exceeds the tolerance (≤ 5·scale·0.5/sqrt(2000) ≈ 0.056·scale): the check can fail.
    near = pq.to_val(pq.to_bit(x, bits, dim=dim)).double()
    near_dev = (near - x.double()).abs()
    assert (near_dev[interior] > tol[interior]).all()


def test_stochastic_generator_none_uses_global_rng():
    x = randn(20, 30, 1)
    torch.manual_seed(7)
    a = pq.to_bit(x, 4, stochastic=True)
    torch.manual_seed(7)
    b = pq.to_bit(x, 4, stochastic=True)
    assert torch.equal(a.planes, b.planes)


# --- the container --------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("shape", [(1, 1), (65, 257), (200, 31)])
def test_nbytes_formula(shape, dim, layout):
    rows, cols = shape
    for bits in (1, 5, 8):
        bt = pq.to_bit(randn(rows, cols, 3), bits, dim=dim, layout=layout)
        outer, packed = (rows, cols) if layout == "row" else (cols, rows)
        planes = bits * round_up(outer, 64) * (round_up(packed, 256) // 32) * 4
        ranges = {None: 1, 0: cols, 1: rows}[dim]
        assert bt.nbytes == planes + 2 * 4 * ranges


def test_to_cpu_and_repr():
    bt = pq.to_bit(randn(10, 20, 1), 3, dim=0, layout="col")
    moved = bt.to("cpu")
    assert isinstance(moved, pq.BitTensor) and moved.device.type == "cpu"
    for name in ("shape", "bits", "layout", "dim"):
        assert getattr(moved, name) == getattr(bt, name)
    for name in ("planes", "lo", "scale"):
        assert torch.equal(getattr(moved, name), getattr(bt, name))
    assert torch.equal(pq.to_val(moved), pq.to_val(bt))
    assert "BitTensor(" in repr(bt) and "bits=3" in repr(bt)


def test_pin_memory():
    bt = pq.to_bit(randn(10, 20, 1), 3)
    try:
        pinned = bt.pin_memory()
    except RuntimeError as error:  # no accelerator to pin for
        pytest.skip(f"pin_memory unsupported here: {error}")
    assert pinned.planes.is_pinned() and pinned.lo.is_pinned() and pinned.scale.is_pinned()
    assert torch.equal(pinned.planes, bt.planes)


@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (300, 37)])
def test_as_layout_round_trip(shape, dim, layout):
    other = "col" if layout == "row" else "row"
    for bits in (1, 2, 6, 8):
        bt = pq.to_bit(randn(*shape, seed=bits), bits, dim=dim, layout=layout)
        assert bt.as_layout(layout) is bt
        moved = bt.as_layout(other)
        assert moved.as_layout(other) is moved
        assert bt.as_layout(other) is moved  # cached: repacked once
        assert moved.layout == other and moved.bits == bits and moved.dim == bt.dim and moved.shape == bt.shape
        assert moved.lo is bt.lo and moved.scale is bt.scale
        assert torch.equal(ref_codes(moved), ref_codes(bt))
        # the repacked planes are what quantizing in the other layout gives directly
        direct = pq.to_bit(randn(*shape, seed=bits), bits, dim=dim, layout=other)
        assert torch.equal(moved.planes, direct.planes)
        back = moved.as_layout(layout)
        assert torch.equal(back.planes, bt.planes)
        assert torch.equal(deq64(back), deq64(bt))


def test_bittensor_validates_fields():
    bt = pq.to_bit(randn(4, 5, 1), 2, dim=0)
    with pytest.raises(ValueError):
        pq.BitTensor(bt.planes, bt.shape, 2, "row", bt.lo[:1], bt.scale[:1], 0)
    with pytest.raises(ValueError):
        pq.BitTensor(bt.planes.long(), bt.shape, 2, "row", bt.lo, bt.scale, 0)
    with pytest.raises(ValueError):
        pq.BitTensor(bt.planes, bt.shape, 3, "row", bt.lo, bt.scale, 0)
    with pytest.raises(ValueError):
        pq.BitTensor(bt.planes, bt.shape, 2, "diag", bt.lo, bt.scale, 0)
    with pytest.raises(TypeError):
        pq.to_val(bt.planes)


def test_finite_input_with_float32_overflowing_range_is_rejected():
    x = torch.tensor([[-3.0e38, 3.0e38], [0.0, 1.0]])
    with pytest.raises(ValueError, match="overflows float32"):
        pq.to_bit(x, 8)  # max - min = 6e38 is not a float32: the scale would be inf, to_val NaN
    with pytest.raises(ValueError, match="overflows float32"):
        pq.to_bit(x, 8, dim=1)  # row 0's own range overflows too
    assert torch.equal(pq.to_val(pq.to_bit(x, 8, dim=0)), x)  # per column: every range is finite


# --- ranges + quantize + pack in one op (the layers' quantizer) ------------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (300, 37), (64, 64), (129, 1433), (2000, 16), (50, 120), (70, 250)])
@pytest.mark.parametrize("dim,layout", [(1, "row"), (0, "col"), (1, "col"), (0, "row")])
@pytest.mark.parametrize("noise", [False, True])
def test_quantize_pack_ranges_equals_reference(device, shape, dim, layout, noise):
    """ops.quantize_pack_ranges (one fused kernel for per-row ranges in row layout on the GPU) returns the same
    planes, ranges and code sums as the torch reference, bit for bit, for every bit width; constant rows and
    columns (scale 0) and a NaN-free extreme range included."""
    g = gen(shape[0] * 7 + shape[1])
    x = randn(*shape, seed=shape[0] * 7 + shape[1], spread=3)
    x[0] = 1.5  # a constant row (scale 0 along dim=1)
    if shape[0] > 3:
        x[:, 0] = -2.0  # a constant column
        x[2, 1] = 3e38
    u = torch.rand(shape, generator=g) if noise else None
    for bits in range(1, 9):
        row_codes = bits % 2 == 1 or layout == "col"  # the row codes too (written by the column quantizer on a GPU)
        expected = ref.quantize_pack_ranges(x, bits, dim, layout == "col", u, row_codes)
        got = pq.ops.quantize_pack_ranges(x.to(device), bits, dim, layout == "col", None if u is None else u.to(device),
                                          row_codes)
        assert len(got) == 5 and (row_codes or got[4].numel() == 0)
        for name, a, b in zip(("planes", "lo", "scale", "code_sums", "row_codes"), got, expected):
            assert a.device.type == device
            a = a.cpu()
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, bits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("dim,layout", [(1, "row"), (0, "col"), (1, "col"), (0, "row")])
def test_quantize_pack_ranges_without_code_sums(device, dim, layout):
    """code_sums=False: the fourth result is an empty int64 tensor on the input's device and the others are the
    reference's, with and without column keys (the layers' call on a GPU)."""
    x = randn(70, 90, seed=9, spread=2)
    x[3, 4] = 3e38
    keys_cases = [None, ref.col_keys_of(x)] if (dim, layout) == (0, "col") else [None]
    for bits, keys in itertools.product((1, 3, 4, 8), keys_cases):
        want = ref.quantize_pack_ranges(x, bits, dim, layout == "col", None, True)
        for fn in (pq.ops.quantize_pack_ranges, ref.quantize_pack_ranges):
            got = fn(x.to(device), bits, dim, layout == "col", None, True, None if keys is None else keys.to(device),
                     False)
            assert got[3].dtype == torch.int64 and got[3].numel() == 0 and got[3].device.type == device
            for i in (0, 1, 2, 4):
                assert torch.equal(got[i].cpu(), want[i]), (bits, i)


@requires_compiled
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def test_quantize_pack_ranges_without_code_sums_opcheck(device):
    x = randn(33, 5, seed=2).to(device)
    for args in ((x, 3, 0, True, None, True, ref.col_keys_of(x), False), (x, 4, 1, False, None, False, None, False)):
        torch.library.opcheck(torch.ops.pyg_quant.quantize_pack_ranges.default, args)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("shape", [(300, 64), (65, 100), (33, 16)])
def test_column_quantizer_reads_rows_off_16_byte_boundaries(shape, noise):
    """The GPU column quantizer loads a row's values four at a time when the rows start on 16-byte boundaries and
    one at a time otherwise: a contiguous input (and noise) one float off such a boundary gives the reference's
    planes, ranges, code sums and row codes, bit for bit."""
    rows, cols = shape
    x = randn(rows, cols, seed=rows + cols, spread=2)
    u = torch.rand(shape, generator=gen(rows)) if noise else None

    def shifted(t):
        buffer = torch.empty(t.numel() + 1, device="cuda")
        view = buffer[1:].view(t.shape)
        view.copy_(t)
        assert view.is_contiguous() and view.data_ptr() % 16 != 0
        return view

    for bits in (1, 3, 4, 8):
        expected = ref.quantize_pack_ranges(x, bits, 0, True, u, True)
        got = pq.ops.quantize_pack_ranges(shifted(x), bits, 0, True, None if u is None else shifted(u), True)
        for name, a, b in zip(("planes", "lo", "scale", "code_sums", "row_codes"), got, expected):
            assert torch.equal(a.cpu(), b), (name, bits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("dim,layout", [(1, "row"), (0, "col")])
def test_quantize_pack_ranges_propagates_nan_like_reference(device, dim, layout):
    """A NaN (of either sign) makes its row's or column's range NaN, as amin/amax do, and every backend then
    gives that row or column the same codes as the reference; the other ranges are untouched."""
    x = randn(70, 90, seed=3, spread=2)
    x[5, 7] = float("nan")
    x[40, 60] = -float("nan")
    for bits in (1, 4, 8):
        expected = ref.quantize_pack_ranges(x, bits, dim, layout == "col", None, True)
        got = pq.ops.quantize_pack_ranges(x.to(device), bits, dim, layout == "col", None, True)
        for name, a, b in zip(("planes", "lo", "scale", "code_sums", "row_codes"), got, expected):
            a = a.cpu()
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()), (name, bits)
            assert torch.equal(torch.nan_to_num(a, 0.0), torch.nan_to_num(b, 0.0)), (name, bits)
        assert int(got[1].isnan().sum()) == 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("dim,layout", [(1, "row"), (0, "col"), (0, "row")])
def test_quantize_pack_ranges_on_relu_outputs(device, dim, layout):
    """ReLU outputs, whose groups' minimum is mostly a zero (of either sign: amin's choice between -0 and +0 changes
    no code or value), and a transposed (non-contiguous) input: the reference's results."""
    x = randn(90, 40, seed=4, spread=2).relu()
    x[:, 3] = x[:, 3].abs()
    x[7, 3], x[20, 3] = -0.0, 0.0  # column 3: its minimum a zero of either sign
    x[11, 5:9] = -0.0  # row 11: zeros of both signs
    x[:, 9] = -x[:, 9].abs()
    x[30, 9] = -0.0  # column 9: its maximum a zero
    for t in (x, x.t().contiguous().t()):
        for bits in (1, 4, 8):
            expected = ref.quantize_pack_ranges(x, bits, dim, layout == "col", None, True)
            got = pq.ops.quantize_pack_ranges(t.to(device), bits, dim, layout == "col", None, True)
            for name, a, b in zip(("planes", "lo", "scale", "code_sums", "row_codes"), got, expected):
                assert torch.equal(a.cpu(), b), (name, bits)


def test_layer_quantizer_attaches_code_sums():
    from pyg_quant.quantization.quantize import quantize
    x = randn(100, 70, seed=5)
    for dim, layout in ((1, "row"), (0, "col"), (None, "row")):
        bt = quantize(x, 4, dim, layout)
        expected = pq.to_bit(x, 4, dim=dim, layout=layout)
        assert torch.equal(bt.planes, expected.planes) and torch.equal(bt.lo, expected.lo)
        assert torch.equal(bt.scale, expected.scale)
        assert torch.equal(bt.code_sums(), expected.code_sums())
        assert (bt._code_sums is not None) == (dim is not None)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("shape", [(32_000, 64), (1000, 100), (33, 1), (257, 47)])
def test_layer_quantizer_on_gpu_attaches_row_codes(shape):
    """Per-column codes on a GPU come with their row codes (what bit_spmm gathers), written by the quantizer
    itself: equal to pack_row_codes of the planes, at every width; their code sums are left to be made on request."""
    from pyg_quant.quantization.quantize import quantize
    x = randn(*shape, seed=11, spread=2).cuda()
    for bits in range(1, 9):
        bt = quantize(x, bits, 0, "col")
        assert bt._row_codes is not None
        assert torch.equal(bt._row_codes, pq.ops.pack_row_codes(bt.planes, bt.cols, True)), bits
        cpu = quantize(x.cpu(), bits, 0, "col")
        assert torch.equal(bt._row_codes.cpu(), cpu.row_codes()), bits
        # no code sums from the quantizer (bit_spmm never reads them); made on request, equal to the CPU's
        assert bt._code_sums is None
        assert torch.equal(bt.code_sums().cpu(), cpu.code_sums()), bits


def test_quantize_pack_ranges_bad_arguments():
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match="bits"):
        pq.ops.quantize_pack_ranges(x, 9, 1, False)
    with pytest.raises(ValueError, match="dim"):
        torch.ops.pyg_quant.quantize_pack_ranges(x, 4, 2, False, None)
    with pytest.raises(ValueError, match="float32"):
        torch.ops.pyg_quant.quantize_pack_ranges(x.double(), 4, 1, False, None)
    with pytest.raises(ValueError, match="noise"):
        torch.ops.pyg_quant.quantize_pack_ranges(x, 4, 1, False, torch.rand(3, 5))


def check_pack_row_codes(dev):
    """Row codes (pyg_quant/layout.py) of both layouts, every width 1..8: the op on ``dev`` == the CPU op == the
    torch reference, 16-byte rows, and read back container by container they are the codes, zero past the shape."""
    import itertools
    ops = torch.ops.pyg_quant
    for (rows, cols), bits, layout in itertools.product([(1, 1), (31, 33), (257, 255), (1000, 3), (70, 1000)],
                                                         range(1, 9), ("row", "col")):
        x = pq.to_bit(randn(rows, cols, rows + bits, shift=0.1).to(dev), bits, dim=0, layout=layout)
        got = ops.pack_row_codes(x.planes, cols, layout == "col")
        want = ops.pack_row_codes(x.planes.cpu(), cols, layout == "col")
        assert got.device.type == dev and torch.equal(got.cpu(), want), (rows, cols, bits, layout)
        assert torch.equal(want, ref.pack_row_codes(x.planes.cpu(), cols, layout == "col"))
        width = pq.layout.container_bits(bits)
        assert want.shape[1] == pq.layout.row_code_bytes(cols, bits) and want.shape[1] % 16 == 0
        fields = [(want.long() >> (width * k)) & ((1 << width) - 1) for k in range(8 // width)]
        unpacked = torch.stack(fields, -1).reshape(want.shape[0], -1)
        assert torch.equal(unpacked[:rows, :cols], x.codes().cpu().long()), (rows, cols, bits, layout)
        assert not unpacked[rows:].any() and not unpacked[:, cols:].any()
        assert torch.equal(x.row_codes().cpu(), want) and x.row_codes() is x.row_codes()


@pytest.mark.skipif(not pq.backends()["cpu"], reason="needs pyg_quant's compiled CPU backend")
def test_pack_row_codes_cpu():
    check_pack_row_codes("cpu")



def dequantize_cases(shape, seed):
    """Random planes of every width and layout, with random ranges for each granularity (never all zeros)."""
    rows, cols = shape
    g = gen(seed)
    for bits, col_layout, dim in itertools.product((1, 2, 3, 4, 7, 8), (False, True), (-1, 0, 1)):
        outer, packed = (cols, rows) if col_layout else (rows, cols)
        planes = torch.randint(-2**31, 2**31, (bits, round_up(outer, 64), round_up(packed, 256) // 32), generator=g,
                               dtype=torch.int64).to(torch.int32)
        groups = 1 if dim < 0 else (cols if dim == 0 else rows)
        lo = torch.randn(groups, generator=g) * 3
        scale = torch.rand(groups, generator=g) * 0.7 + 1e-3
        yield planes, rows, cols, col_layout, lo, scale, dim


needs_compiled_cpu = pytest.mark.skipif(not pq.backends()["cpu"], reason="needs the compiled CPU backend")


@needs_compiled_cpu
@pytest.mark.parametrize("shape", [(1, 1), (31, 33), (257, 255), (100, 513), (1000, 3)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_dequantize_op_equals_the_torch_steps(shape):
    """pyg_quant::dequantize is lo + scale * q with each step rounded to float32, as to_val's torch steps."""
    for planes, rows, cols, col_layout, lo, scale, dim in dequantize_cases(shape, sum(shape)):
        want = ref.dequantize(planes, rows, cols, col_layout, lo, scale, dim)
        got = torch.ops.pyg_quant.dequantize(planes, rows, cols, col_layout, lo, scale, dim)
        assert got.dtype == torch.float32 and torch.equal(got, want), (col_layout, dim, planes.size(0))


@needs_compiled_cpu
def test_dequantize_op_rejects_bad_arguments():
    planes = torch.zeros(4, 64, 8, dtype=torch.int32)
    lo, scale = torch.zeros(5), torch.ones(5)
    with pytest.raises(ValueError, match="dim must be"):
        torch.ops.pyg_quant.dequantize(planes, 10, 5, True, lo, scale, 2)
    with pytest.raises(ValueError, match="5 entries"):
        torch.ops.pyg_quant.dequantize(planes, 10, 5, True, lo[:3], scale[:3], 0)
    with pytest.raises(ValueError, match="float32"):
        torch.ops.pyg_quant.dequantize(planes, 10, 5, True, lo.double(), scale.double(), 0)
    with pytest.raises(ValueError, match="padded shape"):
        torch.ops.pyg_quant.dequantize(planes, 10, 65, True, torch.zeros(65), torch.ones(65), 0)


def test_to_val_keeps_the_gradient_of_ranges():
    """A BitTensor whose ranges require grad dequantizes through the differentiable torch steps."""
    bt = pq.to_bit(torch.randn(20, 6, generator=gen(3)), 4, dim=0, layout="col")
    lo = bt.lo.clone().requires_grad_(True)
    out = pq.to_val(bt._replace(lo=lo))
    out.sum().backward()
    assert torch.equal(lo.grad, torch.full_like(lo, 20.0))


@requires_compiled
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def test_pack_codes_packs_given_codes_as_quantize_pack_does(device):
    """A loader's stored uint8 codes packed directly: quantize_pack's planes of the same codes (as floats with lo = 0,
    inv_scale = 1) and the reference's, every width and both layouts; codes out of range and other dtypes refused."""
    g = torch.Generator().manual_seed(7)
    for bits in range(1, 9):
        for shape in ((1, 1), (33, 7), (300, 256), (64, 301)):
            codes = torch.randint(0, 2**bits, shape, generator=g).to(torch.uint8)
            for col in (True, False):
                got = pq.ops.pack_codes(codes.to(device), bits, col)
                assert got.device.type == device
                want = pq.ops.quantize_pack(codes.float(), torch.zeros(1, 1), torch.ones(1, 1), bits, col, None)
                assert torch.equal(got.cpu(), want) and torch.equal(want, ref.pack_codes(codes.long(), bits, col))
    codes = torch.full((4, 5), 16, dtype=torch.uint8, device=device)
    with pytest.raises(TypeError, match="uint8"):
        pq.ops.pack_codes(codes.int(), 5, True)
    if device == "cpu":
        with pytest.raises(ValueError, match="codes must lie in 0..15"):
            pq.ops.pack_codes(codes, 4, True)
        return
    # On the GPU a code out of range is a device-side assert (no host synchronization), which ends its process.
    script = ("import torch, pyg_quant as pq; pq.ops.pack_codes(torch.full((4, 5), 16, dtype=torch.uint8, "
              "device='cuda'), 4, True); torch.cuda.synchronize()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    assert done.returncode != 0 and "assert" in done.stderr.lower(), done.stderr[-2000:]


@requires_compiled
def test_pack_codes_opcheck():
    codes = torch.randint(0, 16, (37, 19), generator=torch.Generator().manual_seed(1)).to(torch.uint8)
    for col in (True, False):
        torch.library.opcheck(torch.ops.pyg_quant.pack_codes.default, (codes, 4, col))
