"""bitmm / bitmm_int against float64 and integer references.

Error model of the float product.  bitmm evaluates the exact affine identity
``a @ b = K·la·lb + la·(rb∘1ᵀQb) + (ra∘Qa1)·lb + (ra·rb)∘(Qa·Qb)`` from exact integer
code products in float32 (csrc/epilogue.h): each entry is within ``8·2**-24`` of the
sum of its four terms' magnitudes, which is ``(|la| + |ra|·Qa) @ (|lb| + |rb|·Qb)``
= ``mag64(a) @ mag64(b)``.  We assert that bound elementwise against the float64 product
of the represented values ``deq64(a) @ deq64(b)`` (deq64 = lo + scale·q in float64), and
``||out - ref|| ≤ 1e-6·||mag64(a) @ mag64(b)||`` norm-wise.

(``to_val`` rounds ``lo + scale·q`` to float32, off by ~6e-8·(|lo| + |scale·q|), so
``to_val(a).double() @ to_val(b).double()`` is held to twice that bound.)
"""
import itertools

import pytest
import torch

import pyg_quant as pq
from pyg_quant.ops import reference as ref

from conftest import EPILOGUE_BOUND, assert_fp32_close, deq64, gen, mag64, randn, ref_codes, requires_compiled

# all of 1..8 on each side: every s with t ∈ {1, 3, 8}, every t with s ∈ {2, 5}
BIT_PAIRS = sorted({(s, t) for s in range(1, 9) for t in (1, 3, 8)} |
                   {(s, t) for t in range(1, 9) for s in (2, 5)})
SHAPES = [(37, 300, 19), (1, 1, 1), (65, 513, 70)]
A_DIMS, B_DIMS = [None, 1], [None, 0]
LAYOUTS = list(itertools.product(["row", "col"], ["row", "col"]))


def operands(M, K, N, s, t, a_dim, b_dim, a_layout, b_layout, seed, device="cpu"):
    a = pq.to_bit(randn(M, K, seed, shift=0.4, device=device), s, dim=a_dim, layout=a_layout)
    b = pq.to_bit(randn(K, N, seed + 1, shift=-0.2, spread=2.0, device=device), t, dim=b_dim, layout=b_layout)
    return a, b


def check_float_product(out, a, b):
    expected = deq64(a) @ deq64(b)
    terms = mag64(a) @ mag64(b)
    assert out.dtype == torch.float32 and out.shape == (a.rows, b.cols)
    assert_fp32_close(out, expected, EPILOGUE_BOUND * terms + 1e-30, scale=terms)
    # the literal to_val reference (see the module docstring for its bound)
    via_to_val = pq.to_val(a).double() @ pq.to_val(b).double()
    assert_fp32_close(out, via_to_val, 2 * EPILOGUE_BOUND * terms + 1e-30, scale=terms)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bits", BIT_PAIRS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_bitmm_matches_float64(bits, shape, device):
    s, t = bits
    M, K, N = shape
    for a_dim, b_dim in itertools.product(A_DIMS, B_DIMS):
        for a_layout, b_layout in LAYOUTS:
            a, b = operands(M, K, N, s, t, a_dim, b_dim, a_layout, b_layout, seed=s * 10 + t + K, device=device)
            out = pq.bitmm(a, b)
            assert out.device == a.device
            check_float_product(out, a, b)


@requires_compiled
@pytest.mark.parametrize("shape", SHAPES + [(130, 257, 33)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bits", BIT_PAIRS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_bitmm_int_exact(bits, shape):
    s, t = bits
    M, K, N = shape
    a, b = operands(M, K, N, s, t, 1, 0, "row", "col", seed=s + 7 * t)
    got = pq.bitmm_int(a, b)
    want = ref_codes(a) @ ref_codes(b)  # int64 matmul of the codes
    assert got.dtype == torch.int32 and got.shape == (M, N)
    assert torch.equal(got.long(), want)
    reference = ref.bitmm_int(a.planes, b.planes, M, N, False)
    assert torch.equal(got, reference)
    wide = torch.ops.pyg_quant.bitmm_int(a.planes, b.planes, M, N, True)
    assert wide.dtype == torch.int64 and torch.equal(wide, want)
    # operands in the "wrong" layouts go through the cached repack
    assert torch.equal(pq.bitmm_int(a.as_layout("col"), b.as_layout("row")), got)


@requires_compiled
@pytest.mark.parametrize("bits", [(8, 8), (3, 5), (1, 1)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_bitmm_int_larger_exact(bits):
    """Larger than the CPU kernel's 4-row × 32-column blocks and many K words."""
    s, t = bits
    M, K, N = 300, 600, 300
    a, b = operands(M, K, N, s, t, None, None, "row", "col", seed=3)
    got = torch.ops.pyg_quant.bitmm_int(a.planes, b.planes, M, N, False)
    assert torch.equal(got.long(), ref_codes(a) @ ref_codes(b))
    out = pq.bitmm(a, b)
    check_float_product(out, a, b)


@requires_compiled
def test_bitmm_int_padding_garbage_free():
    """Rows/cols beyond the logical shape are never returned; the compiled op only reads planes."""
    a, b = operands(5, 40, 3, 4, 4, None, None, "row", "col", seed=1)
    full = torch.ops.pyg_quant.bitmm_int(a.planes, b.planes, 64, 64, False)
    assert full.shape == (64, 64)
    assert torch.equal(full[:5, :3], pq.bitmm_int(a, b))
    assert (full[5:] == 0).all() and (full[:, 3:] == 0).all()


def code_operand(codes, bits, layout):
    """The BitTensor of integer ``codes`` themselves (lo 0, scale 1, ranges per tensor)."""
    one = torch.ones(1, 1)
    planes = torch.ops.pyg_quant.quantize_pack(codes.float(), one - 1, one, bits, layout == "col", None)
    return pq.BitTensor(planes, tuple(codes.shape), bits, layout, torch.zeros(1), torch.ones(1), None)


@requires_compiled
@pytest.mark.parametrize("bits", [(4, 4), (7, 7), (1, 3), (8, 4), (2, 8)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_bitmm_int_many_rows_and_unused_words(bits):
    """More rows than the CPU's int8 path unpacks at once, and a B whose codes are zero past some K (the words that
    path leaves out), or everywhere."""
    s, t = bits
    g = gen(5 + s * t)
    A = torch.randint(0, 2**s, (2500, 700), generator=g)
    B = torch.randint(0, 2**t, (700, 9), generator=g)
    a = code_operand(A, s, "row")
    for zero_from in (700, 300, 0):
        Bz = B.clone()
        Bz[zero_from:] = 0
        got = pq.bitmm_int(a, code_operand(Bz, t, "col"))
        assert torch.equal(got.long(), A @ Bz), zero_from


@pytest.mark.parametrize("out_dim", [None, 0, 1])
@pytest.mark.parametrize("out_layout", ["row", "col"])
@pytest.mark.parametrize("out_bits", [1, 4, 8])
def test_bitmm_requantized_output(out_bits, out_layout, out_dim):
    a, b = operands(37, 300, 19, 4, 6, 1, 0, "row", "col", seed=21)
    product = pq.bitmm(a, b)
    res = pq.bitmm(a, b, out_bits=out_bits, out_dim=out_dim, out_layout=out_layout)
    assert isinstance(res, pq.BitTensor)
    assert res.bits == out_bits and res.layout == out_layout and res.dim == out_dim and res.shape == (37, 19)
    view = {None: (1, 1), 0: (1, -1), 1: (-1, 1)}[out_dim]
    step = res.scale.double().view(view)
    exact = deq64(a) @ deq64(b)
    slack = 1e-4 * step + 1e-6 * exact.abs().max()
    assert ((pq.to_val(res).double() - product.double()).abs() <= step / 2 + slack).all()
    assert ((pq.to_val(res).double() - exact).abs() <= step / 2 + slack).all()
    # it is exactly to_bit of the float product
    assert torch.equal(res.planes, pq.to_bit(product, out_bits, dim=out_dim, layout=out_layout).planes)
    # stochastic requantization: within one step, deterministic per generator
    r1 = pq.bitmm(a, b, out_bits=out_bits, out_dim=out_dim, stochastic=True, generator=gen(5))
    r2 = pq.bitmm(a, b, out_bits=out_bits, out_dim=out_dim, stochastic=True, generator=gen(5))
    assert torch.equal(r1.planes, r2.planes)
    assert ((pq.to_val(r1).double() - product.double()).abs() <= step + slack).all()


# --- overflow and widening --------------------------------------------------------------
def overflow_operands(a_dim=None, b_dim=None):
    """s = t = 8, K = 33100: K·255·255 = 2_152_327_500 > 2**31 - 1.

    Nearly every code is 255 (x is 1 except one 0 per row/column), so the true code
    products (~33099·255² ≈ 2.15e9) really do not fit int32.
    """
    K = 33100
    xa = torch.ones(2, K)
    xa[:, 0] = 0.0
    xa[1, 5:9] = 0.25
    xb = torch.ones(K, 3)
    xb[0, :] = 0.0
    xb[7:20, 2] = 0.5
    return pq.to_bit(xa, 8, dim=a_dim), pq.to_bit(xb, 8, dim=b_dim, layout="col")


def test_overflow_bound_example():
    assert 33100 * 255 * 255 > 2**31 - 1 >= 33000 * 255 * 255


def test_bitmm_int_raises_on_overflow():
    a, b = overflow_operands()
    with pytest.raises(ValueError, match="overflow"):
        pq.bitmm_int(a, b)


@pytest.mark.parametrize("a_dim,b_dim", [(None, None), (1, 0)])
def test_bitmm_widens_on_overflow(a_dim, b_dim):
    a, b = overflow_operands(a_dim, b_dim)
    codes_product = ref_codes(a) @ ref_codes(b)
    assert codes_product.max() > 2**31 - 1  # int32 accumulation would wrap
    if pq.backends()["cpu"]:
        wide = torch.ops.pyg_quant.bitmm_int(a.planes, b.planes, 2, 3, True)
        assert wide.dtype == torch.int64 and torch.equal(wide, codes_product)
    out = pq.bitmm(a, b)
    check_float_product(out, a, b)


def test_bitmm_int_just_below_overflow_is_int32():
    K = 33000  # K·255² = 2_145_825_000 ≤ 2**31 - 1
    xa = torch.ones(1, K)
    xa[0, 0] = 0
    xb = torch.ones(K, 1)
    xb[0, 0] = 0
    a, b = pq.to_bit(xa, 8), pq.to_bit(xb, 8, layout="col")
    got = pq.bitmm_int(a, b)
    assert got.dtype == torch.int32 and int(got) == (K - 1) * 255 * 255


# --- bad operands -----------------------------------------------------------------------
@pytest.mark.parametrize("fn", [pq.bitmm, pq.bitmm_int])
def test_bad_operands(fn):
    a = pq.to_bit(randn(4, 6, 1), 3)
    b = pq.to_bit(randn(6, 5, 2), 3, layout="col")
    with pytest.raises(ValueError, match="dim=0"):
        fn(pq.to_bit(randn(4, 6, 1), 3, dim=0), b)
    with pytest.raises(ValueError, match="dim=1"):
        fn(a, pq.to_bit(randn(6, 5, 2), 3, dim=1))
    with pytest.raises(ValueError):
        fn(a, pq.to_bit(randn(7, 5, 2), 3))
    with pytest.raises(ValueError):
        fn(b, a)  # [6,5] @ [4,6]
    with pytest.raises(TypeError):
        fn(randn(4, 6, 1), b)
    with pytest.raises(TypeError):
        fn(a, randn(6, 5, 2))


@requires_compiled
def test_compiled_bitmm_int_rejects_bad_planes():
    a = torch.zeros(2, 64, 8, dtype=torch.int32)
    with pytest.raises(ValueError):  # different K words
        torch.ops.pyg_quant.bitmm_int(a, torch.zeros(2, 64, 16, dtype=torch.int32), 4, 4, False)
    with pytest.raises(ValueError):  # more than 8 planes
        torch.ops.pyg_quant.bitmm_int(torch.zeros(9, 64, 8, dtype=torch.int32), a, 4, 4, False)
    with pytest.raises(ValueError):  # rows past the padded operand
        torch.ops.pyg_quant.bitmm_int(a, a, 65, 4, False)
    with pytest.raises(ValueError):  # not int32
        torch.ops.pyg_quant.bitmm_int(a.long(), a, 4, 4, False)


def _affine_operands(rows, cols, k, seed, wide):
    g = gen(seed)
    product = torch.randint(-(2**40) if wide else -(2**30), 2**40 if wide else 2**30, (rows, cols), generator=g,
                            dtype=torch.int64)
    product = product if wide else product.to(torch.int32)
    row_sums = torch.randint(0, 2**20, (rows,), generator=g)
    col_sums = torch.randint(0, 2**20, (cols,), generator=g)
    a_lo, a_scale = torch.randn(rows, generator=g), torch.rand(rows, generator=g)
    b_lo, b_scale = torch.randn(cols, generator=g), torch.rand(cols, generator=g)
    return product, row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k


@requires_compiled
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("use_bias,relu", [(False, False), (True, False), (False, True), (True, True)])
def test_bitmm_affine_kernel_equals_reference(wide, use_bias, relu):
    """The compiled epilogue evaluates the reference's float64 expression in its order: bit for bit."""
    args = _affine_operands(67, 45, 1000, 3, wide)
    bias = randn(1, 45, 9).view(-1) if use_bias else None
    out = torch.ops.pyg_quant.bitmm_affine(*args, bias, relu)
    expected = ref.bitmm_affine(*args, bias, relu)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    if relu:
        assert (out >= 0).all() and (out == 0).any() and (out > 0).any()


@requires_compiled
def test_compiled_bitmm_affine_rejects_bad_operands():
    product, row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k = _affine_operands(5, 4, 10, 1, False)
    op = torch.ops.pyg_quant.bitmm_affine
    with pytest.raises(ValueError, match="row_sums"):
        op(product, row_sums[:4], col_sums, a_lo, a_scale, b_lo, b_scale, k, None, False)
    with pytest.raises(ValueError, match="b_lo"):
        op(product, row_sums, col_sums, a_lo, a_scale, b_lo.double(), b_scale, k, None, False)
    with pytest.raises(ValueError, match="bias"):
        op(product, row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k, torch.zeros(5), False)
    with pytest.raises(ValueError, match="product"):
        op(product.float(), row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k, None, False)


@pytest.mark.parametrize("bits", [(1, 1), (4, 4), (8, 3)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_bitmm_float_bias_relu(bits, device):
    """bitmm_float(a, b, bias, relu) is relu(bitmm(a, b) + bias), computed in the kernel's epilogue."""
    from pyg_quant.bitmm import bitmm_float
    a = pq.to_bit(randn(40, 300, 5, device=device), bits[0], dim=1)
    b = pq.to_bit(randn(300, 21, 6, device=device), bits[1], dim=0, layout="col")
    bias = randn(1, 21, 7, device=device).view(-1)
    plain = pq.bitmm(a, b)
    assert torch.equal(bitmm_float(a, b), plain)
    assert torch.equal(bitmm_float(a, b, bias), plain + bias)
    assert torch.equal(bitmm_float(a, b, bias, True), (plain + bias).clamp_min(0))
