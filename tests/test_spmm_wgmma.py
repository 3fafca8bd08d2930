"""bit_spmm's wgmma kernel (csrc/cuda/spmm_wgmma_cuda.cu): 128-row blocks of bit tiles on the b1 tensor cores, the
CSR residual and the epilogue finished in the same kernel.  GPU == CPU bit for bit on random cluster graphs whose
shapes reach every branch of the kernel: several tiles a window merged by column, windows and whole row blocks
without tiles, a partial last block, feature tiles (kTileN = 64 or 32 features) in several slices and a partial
last one, 1- to 8-bit features (stacked plane slots partly empty at 3, 5, 6 and 7 bits), more tiles in one block than
the kernel's shared list holds, self loops, row scale, bias and ReLU.  sm_90 only for the kernel-choice test; the
bit-exact checks run on any GPU (elsewhere they exercise the mma.sync tile kernel)."""
import re

import pytest
import torch

import pyg_quant as pq
from pyg_quant.synthetic import planted_partition_graph

from conftest import CUDA_OK, cuda_kernel_names, dense_from_edges, gen, randn, ref_codes, requires_sm90a

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU and pyg_quant's compiled CUDA backend "
                                           "(torch.cuda.is_available() and pyg_quant.backends()['cuda'])"),
]

OPS = torch.ops.pyg_quant if hasattr(torch.ops, "pyg_quant") else None
DEV = "cuda"
ADJ = ("window_ptr", "tile_col", "tile_bits", "res_ptr", "res_col", "res_val")


def _equal_on_cpu(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def _cluster_graph(clusters, size, degree, inside, seed, empty_rows=0):
    """A planted-partition graph without repeated edges (a binary adjacency); with `empty_rows`, the last rows
    receive no edges, so that whole 128-row blocks have no tiles and no residual."""
    n = clusters * size + empty_rows
    ei = planted_partition_graph(clusters, size, degree, inside, gen(seed))
    return torch.unique(ei, dim=1), n


def _adjacencies(ei, n, self_loops, min_tile_nnz):
    cpu = pq.BitAdjacency.from_edge_index(ei, n, self_loops=self_loops, min_tile_nnz=min_tile_nnz)
    gpu = pq.BitAdjacency.from_edge_index(ei.to(DEV), n, self_loops=self_loops, min_tile_nnz=min_tile_nnz)
    assert cpu.bits == 1 and gpu.num_tiles == cpu.num_tiles > 0
    return cpu, gpu


def _check(cpu, gpu, x, A=None, tag=()):
    n, cols = x.rows, x.cols
    for cached in (False, True):
        codes = x.row_codes() if cached else None
        got = OPS.bit_spmm_int(*[getattr(gpu, k) for k in ADJ], x.planes, n, cols, False, codes)
        want = OPS.bit_spmm_int(*[getattr(cpu, k) for k in ADJ], x.planes.cpu(), n, cols, False)
        assert _equal_on_cpu(got, want), tag + (cached,)
    if A is not None:
        assert torch.equal(want.long(), A @ ref_codes(x).cpu())
    row_scale = torch.rand(n, generator=gen(cols)) + 0.5
    bias = torch.randn(cols, generator=gen(cols + 1))
    for relu in (False, True):
        def affine(adj, on):
            return OPS.bit_spmm_affine(*[getattr(adj, k) for k in ADJ], x.planes.to(on), x.lo.to(on),
                                       x.scale.to(on), adj.row_sums, adj.diag, row_scale.to(on), bias.to(on), relu,
                                       n, cols, False, None)
        assert _equal_on_cpu(affine(gpu, DEV), affine(cpu, "cpu")), tag + (relu,)


@pytest.mark.parametrize("x_bits", range(1, 9))
def test_cluster_graph_gpu_equals_cpu(x_bits):
    # 7 clusters of 300 and 150 rows without edges: 2,250 rows = 17 full blocks and a partial one, the last two
    # blocks without tiles; 25% of edges leave their cluster (mostly residual entries)
    ei, n = _cluster_graph(7, 300, 30, 0.75, seed=x_bits, empty_rows=150)
    A = dense_from_edges(ei, n, n).long()
    for self_loops, min_tile_nnz in ((0, 16), (1, 1)):
        cpu, gpu = _adjacencies(ei, n, self_loops, min_tile_nnz)
        assert gpu.res_nnz > 0 or min_tile_nnz == 1
        for cols in (1, 21, 64, 100, 129):
            x = pq.to_bit(randn(n, cols, 31 * x_bits + cols, shift=0.3).to(DEV), x_bits, dim=0, layout="col")
            _check(cpu, gpu, x, A if self_loops == 0 and cols in (21, 100) else None,
                   (x_bits, self_loops, min_tile_nnz, cols))


@pytest.mark.parametrize("x_bits", (1, 2, 4, 8))
def test_more_units_than_blocks_gpu_equals_cpu(x_bits):
    # 16 clusters of 1,200 rows: 150 row blocks, and 300 work units at 100 features, more than an H100's 132
    # resident blocks, so that blocks walk a second unit (its residual bounds and first columns loaded during the
    # first); 20% of the edges leave their cluster, most of them residual entries
    ei, n = _cluster_graph(16, 1200, 24, 0.8, seed=40 + x_bits)
    cpu, gpu = _adjacencies(ei, n, 0, 16)
    assert gpu.res_nnz > 0
    for cols in (64, 100):
        x = pq.to_bit(randn(n, cols, 7 * x_bits + cols, shift=0.2).to(DEV), x_bits, dim=0, layout="col")
        _check(cpu, gpu, x, None, (x_bits, cols))


def test_block_with_more_tiles_than_the_shared_list():
    # 128 rows, each with an entry in every one of 130 column chunks: 8 windows x 130 = 1,040 tiles in one block
    # (the kernel keeps 1,024 columns of a unit in shared memory and reads the rest from global memory), and a
    # second block of residual-only rows
    chunks, n = 130, 130 * 256
    rows = torch.arange(128).repeat_interleave(chunks)
    cols = (torch.arange(chunks).repeat(128) * 256 + (rows * 7) % 256)
    extra = torch.stack([torch.randint(n, (500,), generator=gen(5)),
                         128 + torch.randint(200, (500,), generator=gen(6))])
    ei = torch.unique(torch.cat([torch.stack([cols, rows]), extra], 1), dim=1)
    ei = ei[:, ei[0] != ei[1]]  # self loops would move to the diagonal term, out of bit_spmm_int's sums
    cpu, gpu = _adjacencies(ei, n, 1, 1)
    assert gpu.num_tiles > 1024
    for x_bits, feats in ((1, 70), (4, 64), (7, 33)):
        x = pq.to_bit(randn(n, feats, x_bits, shift=0.1).to(DEV), x_bits, dim=0, layout="col")
        _check(cpu, gpu, x, None, (x_bits, feats))
        got = OPS.bit_spmm_int(*[getattr(gpu, k) for k in ADJ], x.planes, n, feats, False, None)
        want = torch.zeros(n, feats, dtype=torch.long).index_add_(0, ei[1], ref_codes(x).cpu()[ei[0]])
        assert torch.equal(got.cpu().long(), want)


def test_layers_on_tiles_gpu_equals_cpu():
    """bit_spmm through the Python API with GIN's scalar self weight and GCN's degree scaling on a tiled cluster
    graph: the float outputs equal the CPU's bit for bit."""
    ei, n = _cluster_graph(5, 400, 24, 0.9, seed=11)
    for self_loops in (0, 1):
        cpu = pq.BitAdjacency.from_edge_index(ei, n, self_loops=self_loops, adjacency="tiles")
        gpu = pq.BitAdjacency.from_edge_index(ei.to(DEV), n, self_loops=self_loops, adjacency="tiles")
        assert gpu.num_tiles > 0
        for x_bits in (2, 4, 8):
            x = pq.to_bit(randn(n, 64, x_bits, shift=0.4), x_bits, dim=0, layout="col")
            scale = torch.rand(n, generator=gen(3)) + 0.5
            want = pq.bit_spmm(cpu, x, self_weight=1.25, row_scale=scale, relu=True)
            got = pq.bit_spmm(gpu, x.to(DEV), self_weight=1.25, row_scale=scale.to(DEV), relu=True)
            assert _equal_on_cpu(got, want), (self_loops, x_bits)


def test_captured_in_a_cuda_graph():
    """Captured with no eager call of this shape first (the tensor maps are encoded and the row codes packed inside
    the capture), replayed on new feature codes: equals an eager call."""
    ei, n = _cluster_graph(4, 300, 20, 0.9, seed=2)
    adj = pq.BitAdjacency.from_edge_index(ei.to(DEV), n, adjacency="tiles")
    x = pq.to_bit(randn(n, 48, 1).to(DEV), 4, dim=0, layout="col")
    planes = x.planes.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = OPS.bit_spmm_int(*[getattr(adj, k) for k in ADJ], planes, n, 48, False, None)
    torch.cuda.current_stream().wait_stream(stream)
    y = pq.to_bit(randn(n, 48, 2).to(DEV), 4, dim=0, layout="col")
    planes.copy_(y.planes)
    graph.replay()
    torch.cuda.synchronize()
    want = OPS.bit_spmm_int(*[getattr(adj, k) for k in ADJ], y.planes, n, 48, False, None)
    assert _equal_on_cpu(out, want)


@requires_sm90a
def test_takes_wgmma_on_sm90():
    ei, n = _cluster_graph(4, 300, 20, 0.9, seed=4)
    adj = pq.BitAdjacency.from_edge_index(ei.to(DEV), n, adjacency="tiles")
    multi = pq.BitAdjacency.from_edge_index(torch.cat([ei, ei[:, :3]], 1).to(DEV), n, adjacency="tiles")
    assert multi.bits == 2
    for x_bits, (block_n, stack) in zip(range(1, 9), [(64, 1), (128, 2), (256, 4), (256, 4)] + [(256, 8)] * 4):
        x = pq.to_bit(randn(n, 40, x_bits).to(DEV), x_bits, dim=0, layout="col")
        names = cuda_kernel_names(lambda: OPS.bit_spmm_int(*[getattr(adj, k) for k in ADJ], x.planes, n, 40, False,
                                                       None))
        assert any(re.search(rf"bit_spmm_wgmma_kernel<{block_n}, {stack}, \d>", name) for name in names), names
        # int64 sums and a multi-bit adjacency stay on the mma.sync tile kernel
        for a, wide in ((adj, True), (multi, False)):
            names = cuda_kernel_names(lambda: OPS.bit_spmm_int(*[getattr(a, k) for k in ADJ], x.planes, n, 40, wide,
                                                           None))
            assert not any("wgmma" in name for name in names) and any("bit_spmm_kernel" in m for m in names), names
