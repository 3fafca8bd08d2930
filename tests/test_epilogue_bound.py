"""The float32 epilogues' error bound (csrc/epilogue.h), on inputs chosen to make it work.

The bit kernels' integer products and code sums are exact; their epilogues convert them to float32 and add the
affine terms in float32.  The stated bound: each output is within ``8·2**-24`` of the sum of the magnitudes of the
terms it adds of the exact value.  Here the terms cancel (large ``lo`` against the products), the products pass
2**24 (their conversion rounds) and pass 2**31 (int64 products), so every rounding of the epilogue is exercised; the
exact value is formed in float64 from the same integers.  The compiled kernels (CPU and GPU) also equal the
reference's float32 torch ops bit for bit: they make the same operations in the same order.
"""
import pytest
import torch

from pyg_quant.ops import reference as ref

from conftest import EPILOGUE_BOUND, gen, requires_compiled


def _bitmm_affine_case(seed, wide):
    g = gen(seed)
    m, n, k = 61, 45, 3000
    top = 2**40 if wide else 2**31 - 1
    product = torch.randint(0, top, (m, n), generator=g, dtype=torch.int64)
    product[0] = torch.randint(0, 2**20, (n,), generator=g)  # small products: their conversion is exact
    row_sums = torch.randint(0, 2**28, (m,), generator=g, dtype=torch.int64)
    col_sums = torch.randint(0, 2**28, (n,), generator=g, dtype=torch.int64)
    a_lo = torch.randn(m, generator=g) * 1e3
    a_scale = torch.rand(m, generator=g) * 1e-3 + 1e-6
    b_lo = -torch.rand(n, generator=g) * 50
    b_scale = torch.rand(n, generator=g) + 0.01
    bias = torch.randn(n, generator=g) * 10
    return (product if wide else product.int(), row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k, bias)


def _bitmm_exact(product, row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k, bias):
    la, ra = a_lo.double().view(-1, 1), a_scale.double().view(-1, 1)
    lb, rb = b_lo.double().view(1, -1), b_scale.double().view(1, -1)
    rs, cs, p = row_sums.double().view(-1, 1), col_sums.double().view(1, -1), product.double()
    terms = [k * la * lb, la * rb * cs, ra * lb * rs, ra * rb * p, bias.double().view(1, -1).expand(p.shape)]
    return sum(terms), sum(t.abs() for t in terms)


def _assert_within(out, exact, magnitude):
    diff = (out.double().cpu() - exact).abs()
    ratio = float((diff / magnitude).max())
    assert ratio <= EPILOGUE_BOUND, f"error {ratio / 2**-24:.2f} float32 ulps of the terms (bound 8)"
    return ratio


@pytest.mark.parametrize("wide", [False, True])
def test_reference_bitmm_affine_within_the_bound(wide):
    args = _bitmm_affine_case(1 + wide, wide)
    out = ref.bitmm_affine(*args, False)
    exact, magnitude = _bitmm_exact(*args)
    ratio = _assert_within(out, exact, magnitude)
    assert ratio > 2**-26  # the inputs do reach float32 roundings of the terms' size


@requires_compiled
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_compiled_bitmm_affine_within_the_bound(wide, relu, device):
    args = _bitmm_affine_case(3 + wide, wide)
    on_device = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    out = torch.ops.pyg_quant.bitmm_affine(*on_device, relu)
    want = ref.bitmm_affine(*args, relu)
    assert torch.equal(out.cpu(), want)  # the same float32 operations in the same order
    exact, magnitude = _bitmm_exact(*args)
    _assert_within(out, exact.clamp_min(0) if relu else exact, magnitude)


def _spmm_case(seed, weight):
    """A residual-only adjacency with multi-bit weights (some rows' sums pass 2**31 at weight 2**30) and 8-bit
    features whose ranges put a large ``lo`` against the product."""
    g = gen(seed)
    n, cols = 70, 23
    counts = torch.randint(0, 9, (n,), generator=g)
    counts[3] = 0  # an empty row: its output is the self term and the bias
    res_ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    res_col = torch.randint(n, (int(counts.sum()),), generator=g).int()
    res_val = torch.randint(1, weight + 1, res_col.shape, generator=g).int()
    codes = torch.randint(0, 256, (n, cols), generator=g)
    lo = torch.randn(cols, generator=g) * 500
    scale = torch.rand(cols, generator=g) * 0.01 + 1e-4
    row_sums = torch.zeros(n, dtype=torch.int64).index_add_(
        0, torch.repeat_interleave(torch.arange(n), counts), res_val.long())
    self_weight = torch.rand(n, generator=g) * 3 - 1
    row_scale = torch.rand(n, generator=g) + 0.05
    bias = torch.randn(cols, generator=g) * 20
    return res_ptr, res_col, res_val, codes, lo, scale, row_sums, self_weight, row_scale, bias


@requires_compiled
@pytest.mark.parametrize("weight", [1, 255, 2**30])
def test_compiled_bit_spmm_affine_within_the_bound(weight, device):
    res_ptr, res_col, res_val, codes, lo, scale, row_sums, self_weight, row_scale, bias = _spmm_case(weight, weight)
    n, cols = codes.shape
    one = torch.ones(1, 1)
    planes = torch.ops.pyg_quant.quantize_pack(codes.float(), one - 1, one, 8, True, None)  # the codes themselves
    windows = (n + 15) // 16
    args = (torch.zeros(windows + 1, dtype=torch.long), torch.zeros(0, dtype=torch.int32),
            torch.zeros(1, 0, 16, 8, dtype=torch.int32), res_ptr, res_col, res_val, planes, lo, scale, row_sums,
            self_weight, row_scale, bias, False, n, cols, True)
    on_device = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    out = torch.ops.pyg_quant.bit_spmm_affine(*on_device)
    assert torch.equal(out.cpu(), ref.bit_spmm_affine(*args))
    # the exact value: the integer product, lo·Σw + scale·(A·Q), the self term on to_val's float32 value
    rows = torch.repeat_interleave(torch.arange(n), res_ptr[1:] - res_ptr[:-1])
    product = torch.zeros(n, cols, dtype=torch.float64).index_add_(
        0, rows, res_val.double().view(-1, 1) * codes[res_col.long()].double())
    assert weight < 2**30 or product.max() >= 2**31
    self_value = (lo.view(1, -1) + scale.view(1, -1) * codes.float()).double()
    lo64, scale64 = lo.double().view(1, -1), scale.double().view(1, -1)
    terms = [lo64 * row_sums.double().view(-1, 1), scale64 * product, self_weight.double().view(-1, 1) * self_value]
    rs = row_scale.double().view(-1, 1)
    exact = rs * sum(terms) + bias.double().view(1, -1)
    magnitude = rs * sum(t.abs() for t in terms) + bias.double().abs().view(1, -1)
    _assert_within(out, exact, magnitude)
