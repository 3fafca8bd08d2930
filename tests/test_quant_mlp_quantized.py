"""ops.quant_mlp_quantized (the fused chain of bit layers whose first input is a packed tensor's codes taken as they
are) against what a QAT linear layer runs on an input quantized already.

Oracle: the first layer is ``bitmm(x, Wᵀ)`` (pyg_quant.bitmm: the plane-pair integer product and bitmm_affine, no
kernel of the op), then its bias and ReLU in float32, then the later layers by ``quant_mlp`` and the row scale; the
op (CPU) and the pure-torch reference must equal it exactly (``torch.equal``), for codes of 1..8 bits up to the first
layer's width, ranges per row and per tensor, row counts across the op's blocks, and garbage in the planes'
padding; the codes given as bytes (``uint8 [rows, cols]``) instead of planes give the same bits.  The op is compiled
for the CPU only; elsewhere ``ops.quant_mlp_quantized`` runs the reference.
"""
import pytest
import torch
import torch.nn.functional as F

import pyg_quant as pq
from pyg_quant import ops
from pyg_quant.bit_tensor import BitTensor
from pyg_quant.ops import reference as ref

from conftest import requires_compiled
from test_quant_mlp import make_case, row_scale_for


def quantized_case(i, n=None, narrower=False, per_tensor=False, device="cpu"):
    """make_case's chain, its input quantized per row (or per tensor) in the row layout to the first layer's width
    (or one bit less): (BitTensor, the op's layer arguments, Wᵀ BitTensors)."""
    args, weights = make_case(i, n=n)
    bits = max(1, args[6][0] - 1) if narrower else args[6][0]
    x = pq.to_bit(args[0], bits, dim=None if per_tensor else 1, layout="row")
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    layers = tuple([to(t) for t in a] if isinstance(a, list) else a for a in args[1:])
    return x.to(device), layers, weights


def planes_args(x: BitTensor):
    return (x.planes, x.rows, x.cols, x.layout == "col", x.lo, x.scale, -1 if x.dim is None else x.dim)


def byte_args(x: BitTensor):
    """planes_args with the codes themselves in place of the planes."""
    return (x.codes(),) + planes_args(x)[1:]


def oracle(x: BitTensor, layers, weights, row_scale=None):
    codes, w_lo, w_scale, w_sums, bias, act_bits, weight_bits, relu = layers
    h = pq.bitmm(x, weights[0])
    if bias[0] is not None:
        h = h + bias[0]
    if relu[0]:
        h = F.relu(h)
    if len(codes) > 1:
        return torch.ops.pyg_quant.quant_mlp(h, codes[1:], w_lo[1:], w_scale[1:], w_sums[1:], bias[1:], act_bits[1:],
                                            weight_bits[1:], relu[1:], row_scale)
    return h if row_scale is None else h * row_scale.view(-1, 1)


@requires_compiled
@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-row", "per-tensor"])
@pytest.mark.parametrize("narrower", [False, True], ids=["same-width", "narrower"])
@pytest.mark.parametrize("i", range(16))
def test_op_equals_bitmm_then_the_chain(i, narrower, per_tensor):
    x, layers, weights = quantized_case(i, narrower=narrower, per_tensor=per_tensor)
    scale = row_scale_for(x.rows, i) if i % 2 else None
    want = oracle(x, layers, weights, scale)
    got = torch.ops.pyg_quant.quant_mlp_quantized(*planes_args(x), *layers, scale)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(ops.quant_mlp_quantized(*planes_args(x), *layers, scale), want)
    assert torch.equal(ref.quant_mlp_quantized(*planes_args(x), *layers, scale), want)  # the pure-torch fallback
    for op in (torch.ops.pyg_quant.quant_mlp_quantized, ref.quant_mlp_quantized):  # the codes as bytes
        assert torch.equal(op(*byte_args(x), *layers, scale), want)


@requires_compiled
@pytest.mark.parametrize("n", [1, 31, 2049, 4100])  # within a word, a block of 2048 rows, past two blocks
def test_row_counts_and_padding_garbage(n):
    x, layers, weights = quantized_case(3, n=n)
    want = oracle(x, layers, weights)
    g = torch.Generator().manual_seed(n)
    noisy = torch.randint(-2**31, 2**31 - 1, x.planes.shape, generator=g, dtype=torch.int64).to(torch.int32)
    cols = x.cols
    keep = torch.zeros(x.planes.size(2) * 32, dtype=torch.bool)
    keep[:cols] = True
    mask = (keep.view(-1, 32).long() << torch.arange(32)).sum(1).to(torch.int64)  # the words' bits of real columns
    mask = torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)
    planes = x.planes.clone()
    planes[:, n:] = noisy[:, n:]  # padding rows
    planes[:, :n] = (x.planes[:, :n] & mask) | (noisy[:, :n] & ~mask)  # padding columns of every row
    assert torch.equal(torch.ops.pyg_quant.quant_mlp_quantized(planes, *planes_args(x)[1:], *layers), want)
    out = torch.ops.pyg_quant.quant_mlp_quantized(x.planes, 0, x.cols, False, x.lo[:0], x.scale[:0], 1,
                                                  *layers)  # no rows
    assert out.shape == (0, layers[0][-1].size(0))


@requires_compiled
def test_errors_name_the_argument():
    x, layers, _ = quantized_case(2, n=37)
    planes, rows, cols, col_layout, lo, scale, dim = planes_args(x)
    col = pq.to_bit(pq.to_val(x), x.bits, dim=1, layout="col")
    act = layers[5][0]
    wider = pq.to_bit(pq.to_val(x), act + 1, dim=1, layout="row") if act < 8 else None
    for op in (torch.ops.pyg_quant.quant_mlp_quantized, ref.quant_mlp_quantized):
        with pytest.raises(ValueError, match=r"row layout \(col_layout=False\)"):
            op(*planes_args(col), *layers)
        per_column = pq.to_bit(pq.to_val(x), x.bits, dim=0, layout="row")
        with pytest.raises(ValueError, match="ranges per row .dim=1. or one range .dim=-1., got dim=0"):
            op(*planes_args(per_column), *layers)
        if wider is not None:
            with pytest.raises(ValueError, match=f"planes hold {act + 1}-bit codes, more than the first layer's "
                                                 f"act_bits \\({act}\\)"):
                op(*planes_args(wider), *layers)
    with pytest.raises(ValueError, match="lo and scale"):
        torch.ops.pyg_quant.quant_mlp_quantized(planes, rows, cols, col_layout, lo[:-1], scale, dim, *layers)
    codes = x.codes().clone()
    for op in (torch.ops.pyg_quant.quant_mlp_quantized, ref.quant_mlp_quantized):  # codes given as bytes
        too_big = codes.clone()
        too_big[5, 3] = 1 << act
        with pytest.raises(ValueError, match=f"planes holds the code {1 << act}, more than the first layer's "
                                             f"act_bits \\({act}\\) allow"):
            op(too_big, rows, cols, col_layout, lo, scale, dim, *layers)
        with pytest.raises(ValueError, match=r"uint8 \[rows=37, cols="):
            op(codes[:-1], rows, cols, col_layout, lo, scale, dim, *layers)
    with pytest.raises(ValueError, match="lo and scale must be float32 with 37 entries"):
        torch.ops.pyg_quant.quant_mlp_quantized(codes, rows, cols, col_layout, lo[:-1], scale, dim, *layers)


@requires_compiled
def test_opcheck():
    x, layers, _ = quantized_case(6, n=37)
    torch.library.opcheck(torch.ops.pyg_quant.quant_mlp_quantized.default, planes_args(x) + layers)
    torch.library.opcheck(torch.ops.pyg_quant.quant_mlp_quantized.default, byte_args(x) + layers)
