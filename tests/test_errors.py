"""Argument validation of to_bit (and of the compiled quantize/unpack ops)."""
import pytest
import torch

import pyg_quant as pq

from conftest import gen, randn, requires_compiled

X = randn(4, 5, 0)


@pytest.mark.parametrize("bits,exc", [(0, ValueError), (9, ValueError), (-1, ValueError), (2.5, TypeError),
                                      (True, TypeError), (False, TypeError), ("4", TypeError), (None, TypeError),
                                      (4.0, TypeError)])
def test_bad_bits(bits, exc):
    with pytest.raises(exc):
        pq.to_bit(X, bits)


@pytest.mark.parametrize("x", [torch.arange(20).view(4, 5), torch.ones(4, 5, dtype=torch.bool),
                               torch.ones(4, 5, dtype=torch.complex64), [[1.0, 2.0]], None])
def test_non_float_x(x):
    with pytest.raises(TypeError):
        pq.to_bit(x, 4)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4), ()])
def test_bad_rank(shape):
    with pytest.raises(ValueError):
        pq.to_bit(torch.randn(shape, generator=gen(0)), 4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_non_finite(bad, dtype):
    """Judged from the ranges: every granularity's range that holds the value is non-finite."""
    x = X.clone().to(dtype)
    x[2, 3] = bad
    for dim in (None, 0, 1):
        for layout in ("row", "col"):
            with pytest.raises(ValueError, match="must be finite"):
                pq.to_bit(x, 4, dim=dim, layout=layout)
            with pytest.raises(ValueError, match="must be finite"):
                pq.to_bit(x, 4, dim=dim, layout=layout, stochastic=True)


def test_float64_overflowing_float32_is_rejected():
    """1e300 is finite in float64 but not in float32, which is what gets quantized."""
    x = X.double()
    x[0, 0] = 1e300
    with pytest.raises(ValueError):
        pq.to_bit(x, 4)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)])
def test_empty(shape):
    with pytest.raises(ValueError):
        pq.to_bit(torch.empty(shape), 4)


@pytest.mark.parametrize("layout", ["ROW", "column", "", None, 0])
def test_bad_layout(layout):
    with pytest.raises(ValueError):
        pq.to_bit(X, 4, layout=layout)


@pytest.mark.parametrize("dim", [2, -3, "0", True, 0.0, (0,)])
def test_bad_dim(dim):
    with pytest.raises(ValueError):
        pq.to_bit(X, 4, dim=dim)


def test_generator_without_stochastic():
    with pytest.raises(ValueError):
        pq.to_bit(X, 4, generator=gen(1))
    pq.to_bit(X, 4, stochastic=True, generator=gen(1))  # fine with stochastic


def test_bitmm_output_arguments_are_validated():
    a = pq.to_bit(randn(4, 6, 1), 3)
    b = pq.to_bit(randn(6, 5, 2), 3, layout="col")
    with pytest.raises(ValueError):
        pq.bitmm(a, b, out_bits=9)
    with pytest.raises(ValueError):
        pq.bitmm(a, b, out_bits=4, out_layout="diag")
    with pytest.raises(ValueError):
        pq.bitmm(a, b, out_bits=4, generator=gen(0))  # generator without stochastic


@requires_compiled
def test_compiled_quantize_ops_validate():
    x = randn(4, 5, 0)
    lo = torch.zeros(1, 1)
    inv = torch.ones(1, 1)
    op = torch.ops.pyg_quant
    with pytest.raises(ValueError):
        op.quantize_pack(x, lo, inv, 9, False, None)
    with pytest.raises(ValueError):
        op.quantize_pack(x, lo, inv, 0, False, None)
    with pytest.raises(ValueError):
        op.quantize_pack(x.double(), lo, inv, 4, False, None)
    with pytest.raises(ValueError):
        op.quantize_pack(x, torch.zeros(3, 1), inv, 4, False, None)  # does not broadcast
    with pytest.raises(ValueError):
        op.quantize_pack(x, lo, inv, 4, False, torch.rand(4, 6))  # noise shape
    with pytest.raises(ValueError):
        op.quantize_pack(x.view(-1), lo, inv, 4, False, None)
    planes = op.quantize_pack(x, lo, inv, 4, False, None)
    with pytest.raises(ValueError):
        op.unpack_codes(planes, 65, 5, False)  # rows past the padded outer dim
    with pytest.raises(ValueError):
        op.unpack_codes(planes, 4, 257, False)  # cols past the padded packed dim
    with pytest.raises(ValueError):
        op.unpack_codes(planes.long(), 4, 5, False)
    with pytest.raises(ValueError):
        op.packed_code_sums(planes[..., :7])  # odd number of words


# --- check_finite: a sum first, every element only when the sum is not finite -------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_check_finite_raises_for_nan_and_inf(bad, dtype):
    from pyg_quant._utils import check_finite
    from pyg_quant.quantization.observers import check_finite as qat_check_finite
    x = torch.randn(37, 19).to(dtype)
    x[20, 3] = bad
    for fn in (check_finite, qat_check_finite):
        with pytest.raises(ValueError, match="features holds NaN or inf"):
            fn(x, "features")
    x.requires_grad_(True)  # a leaf asking for a gradient is checked the same way
    with pytest.raises(ValueError, match="NaN or inf"):
        check_finite(x, "features")


def test_check_finite_accepts_finite_values_whose_sum_overflows():
    from pyg_quant._utils import check_finite
    x = torch.full((64, 64), 3.0e38)  # every element finite, the float32 sum is inf
    assert not torch.isfinite(x.sum())
    check_finite(x, "x")
    check_finite(torch.full((4, 4), 6.0e4, dtype=torch.float16), "x")  # fp16 sum overflows too
    check_finite(torch.arange(10), "x")  # integers are always finite
    check_finite(torch.empty(0, 3), "x")
