"""bit_spmm's fused epilogue: self_weight, row_scale, bias and relu.

out = relu(diag(s)·(A + diag(d + w))·to_val(x) + b), checked against a float64
dense reference within csrc/epilogue.h's bound (8 float32 ulps of the terms' magnitudes);
compiled == reference bit for bit (both make csrc/epilogue.h's float32 steps with no
contraction); GPU == CPU bit for bit.
"""
import itertools

import pytest
import torch

import pyg_quant as pq
from pyg_quant import ops
from pyg_quant.ops import reference as ref

from conftest import DEVICES, EPILOGUE_BOUND, dense_from_edges, deq64, gen, mag64, randn, random_edges, requires_compiled


def _graph(n, e, seed, dup=False):
    ei = random_edges(n, n, e, seed)
    if dup:
        ei = torch.cat([ei, ei[:, : e // 3]], 1)  # repeated edges: a multi-bit adjacency
    # a dense block so that some 16 x 256 blocks become tiles
    block = torch.cartesian_prod(torch.arange(40), torch.arange(40)).t()
    return torch.cat([ei, block], 1)


def _expected(adj, ei, x, self_weight, row_scale, bias, relu):
    n = adj.num_rows
    A = dense_from_edges(ei, adj.num_cols, n)
    if adj.diag is not None:
        A = A.clone()
        A.fill_diagonal_(0)
        A += torch.diag(adj.diag.double().cpu())
    if self_weight is not None:
        w = torch.as_tensor(self_weight, dtype=torch.float64).cpu().expand(n)
        A = A + torch.diag(w)
    X = deq64(x.to("cpu"))
    out = A @ X
    mag = A.abs() @ mag64(x.to("cpu"))
    if row_scale is not None:
        out = out * row_scale.double().cpu().view(-1, 1)
        mag = mag * row_scale.double().cpu().abs().view(-1, 1)
    if bias is not None:
        out = out + bias.double().cpu().view(1, -1)
        mag = mag + bias.double().cpu().abs().view(1, -1)
    if relu:
        out = out.clamp_min(0)
    return out, mag


OPTIONS = list(itertools.product([None, 0.25, "vector"], [False, True], [False, True], [False, True]))


@pytest.mark.parametrize("self_weight,use_row_scale,use_bias,relu", OPTIONS)
@pytest.mark.parametrize("self_loops", [0, 1])
def test_epilogue_matches_float64(self_weight, use_row_scale, use_bias, relu, self_loops, device):
    n, f = 301, 37
    ei = _graph(n, 2500, 11)
    adj = pq.BitAdjacency.from_edge_index(ei, n, self_loops=self_loops, min_tile_nnz=16).to(device)
    assert adj.num_tiles > 0 and adj.res_nnz > 0  # both paths of the kernel run (an explicit threshold keeps tiles)
    x = pq.to_bit(randn(n, f, 3, shift=0.4).to(device), 5, dim=0, layout="col")
    if self_weight == "vector":
        self_weight = (torch.rand(n, generator=gen(4)) * 2 - 0.5).to(device)
    row_scale = (torch.rand(n, generator=gen(5)) + 0.1).to(device) if use_row_scale else None
    bias = torch.randn(f, generator=gen(6)).to(device) if use_bias else None
    out = pq.bit_spmm(adj, x, self_weight=self_weight, row_scale=row_scale, bias=bias, relu=relu)
    assert out.dtype == torch.float32 and out.shape == (n, f) and out.device == x.device
    want, mag = _expected(adj.to("cpu"), ei, x, self_weight, row_scale, bias, relu)
    bound = EPILOGUE_BOUND * mag + 1e-30  # mag: the magnitudes of the terms the epilogue adds
    diff = (out.double().cpu() - want).abs()
    assert (diff <= bound).all(), float((diff / bound).max())
    if relu:
        assert (out >= 0).all() and (out == 0).any()


@requires_compiled
@pytest.mark.parametrize("x_bits,dup", [(1, False), (3, True), (8, False)])
def test_compiled_epilogue_equals_reference_bit_for_bit(x_bits, dup, device):
    n, f = 290, 45
    ei = _graph(n, 3000, x_bits, dup)
    adj = pq.BitAdjacency.from_edge_index(ei, n, self_loops=2).to(device)
    x = pq.to_bit(randn(n, f, 8, shift=-0.3).to(device), x_bits, dim=0, layout="col")
    self_weight = (torch.rand(n, generator=gen(1)) + 0.5).to(device)
    row_scale = (torch.rand(n, generator=gen(2)) + 0.1).to(device)
    bias = torch.randn(f, generator=gen(3)).to(device)
    args = (adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val, x.planes,
            x.lo, x.scale, adj.row_sums, self_weight, row_scale, bias, True, n, f, False)
    got = torch.ops.pyg_quant.bit_spmm_affine(*args)
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    want = ref.bit_spmm_affine(*cpu_args)
    assert torch.equal(got.cpu(), want)
    if device == "cuda":
        assert torch.equal(got.cpu(), torch.ops.pyg_quant.bit_spmm_affine(*cpu_args))
    # the wide accumulator gives the same floats
    wide_args = args[:-1] + (True,)
    assert torch.equal(torch.ops.pyg_quant.bit_spmm_affine(*wide_args).cpu(), want)


def test_per_tensor_x_and_empty_graph(device):
    n = 50
    x = pq.to_bit(randn(n, 6, 1).to(device), 4)  # one range for the whole tensor
    adj = pq.BitAdjacency.from_edge_index(torch.empty(2, 0, dtype=torch.long), n, self_loops=1).to(device)
    assert torch.equal(pq.bit_spmm(adj, x), pq.to_val(x))  # (0 + I)·X is X exactly
    bias = torch.arange(6, dtype=torch.float32, device=device)
    assert torch.equal(pq.bit_spmm(adj, x, bias=bias), pq.to_val(x) + bias)
    assert torch.equal(pq.bit_spmm(adj, x, self_weight=1.0), 2 * pq.to_val(x))


def test_epilogue_bad_arguments():
    n = 40
    adj = pq.BitAdjacency.from_edge_index(random_edges(n, n, 100, 1), n)
    x = pq.to_bit(randn(n, 5, 2), 4, dim=0, layout="col")
    with pytest.raises(ValueError, match="row_scale"):
        pq.bit_spmm(adj, x, row_scale=torch.ones(n + 1))
    with pytest.raises(ValueError, match="bias"):
        pq.bit_spmm(adj, x, bias=torch.ones(6))
    with pytest.raises(TypeError, match="bias"):
        pq.bit_spmm(adj, x, bias=1.0)
    with pytest.raises(TypeError, match="self_weight"):
        pq.bit_spmm(adj, x, self_weight="1")
    with pytest.raises(TypeError, match="relu"):
        pq.bit_spmm(adj, x, relu=1)
    rect = pq.BitAdjacency.from_edge_index(random_edges(n, 30, 100, 1), (n, 30))
    with pytest.raises(ValueError, match="square"):
        pq.bit_spmm(rect, x, self_weight=1.0)


@requires_compiled
def test_compiled_epilogue_validates_vectors():
    n, f = 40, 5
    adj = pq.BitAdjacency.from_edge_index(random_edges(n, n, 100, 1), n)
    x = pq.to_bit(randn(n, f, 2), 4, dim=0, layout="col")
    base = [adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val, x.planes,
            x.lo, x.scale, adj.row_sums, None, None, None, False, n, f, False]
    for index, bad in ((7, torch.zeros(f + 1)), (8, torch.zeros(f, dtype=torch.float64)),
                       (9, adj.row_sums.int()), (10, torch.ones(2)), (10, torch.ones(1, 1)), (11, torch.ones(n - 1)),
                       (12, torch.ones(f + 2))):
        args = list(base)
        args[index] = bad
        with pytest.raises(ValueError):
            torch.ops.pyg_quant.bit_spmm_affine(*args)


@requires_compiled
@pytest.mark.parametrize("min_tile_nnz", [16, 10**9])  # tiles + CSR residual, CSR only
def test_one_self_weight_for_every_row_equals_its_expansion(min_tile_nnz, device):
    """A single self_weight (GIN's scalar 1 + eps) is read for every row, not expanded to a vector first."""
    n, f = 301, 37
    adj = pq.BitAdjacency.from_edge_index(_graph(n, 2500, 11), n, self_loops=1, min_tile_nnz=min_tile_nnz).to(device)
    x = pq.to_bit(randn(n, f, 3, shift=0.4).to(device), 4, dim=0, layout="col")
    weight = torch.tensor([1.375], device=device)
    row_scale = (torch.rand(n, generator=gen(5)) + 0.1).to(device)
    codes = pq.graph.spmm.gathered_codes(adj, x, True)
    args = [adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val, x.planes, x.lo,
            x.scale, adj.row_sums, weight, row_scale, None, True, n, f, False, codes]
    one = torch.ops.pyg_quant.bit_spmm_affine(*args)
    args[10] = weight.expand(n).contiguous()
    assert torch.equal(one, torch.ops.pyg_quant.bit_spmm_affine(*args))
    assert torch.equal(pq.bit_spmm(adj, x, self_weight=weight[0]), pq.bit_spmm(adj, x, self_weight=1.375))
    assert torch.equal(pq.bit_spmm(adj, x, self_weight=weight[0]),
                       pq.bit_spmm(adj, x, self_weight=torch.full((n,), 1.375, device=device)))
