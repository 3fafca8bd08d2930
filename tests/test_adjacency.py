"""BitAdjacency.from_edge_index (tiles, residual, self loops, degrees) and bit_spmm.

Dense references are built here from edge_index with index_put_(accumulate=True); the
tiles are decoded with a plain Python walk of the format documented in
pyg_quant/layout.py.  Error model of bit_spmm: out = lo·Σ_j A_ij + scale·(A·Q) +
diag·to_val(x) in float32 (csrc/epilogue.h) with the integer A·Q exact, so against
(A + diag·I) @ deq64(x) each entry is within 8·2**-24 of the magnitudes of its terms,
|A| @ (|lo| + |scale·q|) (the diagonal's included); we assert that bound elementwise and
||out - ref|| ≤ 1e-6·|| |A| @ (|lo| + |scale·q|) || norm-wise.
"""
import pytest
import torch
from torch_geometric.utils import add_remaining_self_loops

import pyg_quant as pq
from pyg_quant.graph.packing import decode_bit_adjacency
from pyg_quant.ops import reference as ref

from conftest import (DEVICES, EPILOGUE_BOUND, assert_fp32_close, deq64, dense_from_edges, gen, mag64, randn, random_edges,
                      ref_codes, requires_compiled, requires_cuda)

TILE_R, TILE_C = 16, 256


def decode_tiles(adj) -> torch.Tensor:
    """The tiles alone, per the documented format: tile_bits[p, t, r, w] bit k = bit p of the
    entry at row 16·window + r, column 256·tile_col[t] + 32·w + k (float64 dense)."""
    rows_pad = (adj.window_ptr.numel() - 1) * TILE_R
    cols_pad = -(-adj.num_cols // TILE_C) * TILE_C
    dense = torch.zeros(rows_pad, cols_pad, dtype=torch.float64)
    wp = adj.window_ptr.tolist()
    tb = adj.tile_bits.tolist()
    for win in range(len(wp) - 1):
        for t in range(wp[win], wp[win + 1]):
            c0 = int(adj.tile_col[t]) * TILE_C
            for r in range(TILE_R):
                for w in range(8):
                    for p in range(adj.bits):
                        word = tb[p][t][r][w] & 0xFFFFFFFF
                        while word:
                            k = (word & -word).bit_length() - 1
                            word &= word - 1
                            dense[win * TILE_R + r, c0 + 32 * w + k] += 2**p
    return dense


def decode_residual(adj) -> torch.Tensor:
    dense = torch.zeros(adj.num_rows, adj.num_cols, dtype=torch.float64)
    ptr = adj.res_ptr.tolist()
    for i in range(adj.num_rows):
        for e in range(ptr[i], ptr[i + 1]):
            dense[i, int(adj.res_col[e])] += 1 if adj.res_val is None else int(adj.res_val[e])
    return dense


def block_nnz(dense: torch.Tensor) -> torch.Tensor:
    """Non-zero count of every 16 × 256 block."""
    R, C = dense.shape
    padded = torch.zeros(-(-R // TILE_R) * TILE_R, -(-C // TILE_C) * TILE_C, dtype=torch.float64)
    padded[:R, :C] = dense
    blocks = (padded != 0).view(padded.size(0) // TILE_R, TILE_R, padded.size(1) // TILE_C, TILE_C)
    return blocks.sum((1, 3))


def expected_dense(edge_index, num_src, num_dst, self_loops):
    """A (duplicates summed) + k·I for nodes without a self-loop; present loops weigh 1."""
    dense = dense_from_edges(edge_index, num_src, num_dst)
    if self_loops:
        diag = torch.diagonal(dense)
        has_loop = diag > 0
        diag.copy_(torch.where(has_loop, torch.ones_like(diag), torch.full_like(diag, float(self_loops))))
    return dense


# (num_src, num_dst, num_edges, seed, duplicate factor)
GRAPHS = {
    "n1": (1, 1, 1, 0, 1),
    "n17": (17, 17, 60, 1, 1),
    "n300": (300, 300, 2500, 2, 1),
    "n1000": (1000, 1000, 6000, 3, 1),
    "n300-dup": (300, 300, 900, 4, 3),       # duplicates -> bits > 1
    "n260-dense": (260, 260, 30000, 5, 1),   # dense tiles (the CPU popcount path)
    "n70-dense-dup": (70, 70, 12000, 6, 2),  # dense with heavy duplicates (bits 4)
    "bip-300x17": (300, 17, 800, 7, 1),
    "bip-17x600": (17, 600, 700, 8, 2),
}


def make_graph(name):
    num_src, num_dst, num_edges, seed, dup = GRAPHS[name]
    ei = random_edges(num_src, num_dst, num_edges, seed)
    if dup > 1:
        # repeat a random subset of edges up to dup more times
        g = gen(seed + 100)
        extra = [ei[:, torch.randperm(ei.size(1), generator=g)[: ei.size(1) // (i + 2)]] for i in range(dup)]
        ei = torch.cat([ei] + extra, 1)
    return ei, num_src, num_dst


def build(name, self_loops=0, min_tile_nnz=16, dtype=torch.int64):
    ei, num_src, num_dst = make_graph(name)
    num_nodes = num_src if num_src == num_dst else (num_src, num_dst)
    adj = pq.BitAdjacency.from_edge_index(ei.to(dtype), num_nodes, self_loops=self_loops, min_tile_nnz=min_tile_nnz)
    return adj, ei, num_src, num_dst


def square(name):
    return GRAPHS[name][0] == GRAPHS[name][1]


CASES = [(g, k) for g in GRAPHS for k in ((0, 1, 2) if square(g) else (0,))]


@pytest.mark.parametrize("min_tile_nnz", [1, 16, 10**6])
@pytest.mark.parametrize("graph,self_loops", CASES)
def test_from_edge_index_structure(graph, self_loops, min_tile_nnz):
    adj, ei, num_src, num_dst = build(graph, self_loops, min_tile_nnz)
    dense = expected_dense(ei, num_src, num_dst, self_loops)
    assert adj.shape == (num_dst, num_src) and adj.num_rows == num_dst and adj.num_cols == num_src
    assert torch.equal(adj.to_dense().double(), dense)
    # the stored parts, decoded independently: tiles + residual (+ diag) = A
    off = dense.clone()
    if self_loops:
        off.fill_diagonal_(0)
        assert torch.equal(adj.diag.double(), torch.diagonal(dense))
    else:
        assert adj.diag is None
    tiles, residual = decode_tiles(adj), decode_residual(adj)
    assert torch.equal(tiles[:num_dst, :num_src] + residual, off)
    assert not tiles[num_dst:].any() and not tiles[:, num_src:].any()
    # bits: enough planes for the largest multiplicity, no more
    assert adj.bits == max(1, int(off.max()).bit_length())
    assert adj.tile_bits.shape[0] == adj.bits and adj.tile_bits.dtype == torch.int32
    # counts
    nnz_blocks = block_nnz(off)
    assert adj.nnz == int((off != 0).sum())
    assert adj.num_tiles == int((nnz_blocks >= min_tile_nnz).sum())
    assert adj.tile_nnz == int(nnz_blocks[nnz_blocks >= min_tile_nnz].sum())
    assert adj.res_nnz == adj.nnz - adj.tile_nnz
    assert adj.fill_ratio == pytest.approx(adj.tile_nnz / max(1, adj.num_tiles * 4096), rel=1e-12)
    if min_tile_nnz == 1:  # every non-empty block is a tile, nothing in the residual
        assert adj.num_tiles == int((nnz_blocks > 0).sum()) and adj.res_nnz == 0
        assert adj.fill_ratio == pytest.approx(adj.nnz / max(1, adj.num_tiles * 4096), rel=1e-12)
    # every stored tile is a block with >= min_tile_nnz entries (so never all zero), sorted
    # by (window, column tile), window_ptr consistent
    occupied = (adj.tile_bits != 0).any(0)  # [tiles, 16, 8] words with any set bit
    union = adj.tile_bits[0]
    for p in range(1, adj.bits):
        union = union | adj.tile_bits[p]
    popcounts = [sum(bin(w & 0xFFFFFFFF).count("1") for w in tile.flatten().tolist()) for tile in union]
    assert all(c >= max(1, min_tile_nnz) for c in popcounts)
    assert occupied.flatten(1).any(1).all()
    wp = adj.window_ptr
    assert wp.dtype == torch.int64 and wp[0] == 0 and wp[-1] == adj.num_tiles
    assert wp.numel() == -(-num_dst // TILE_R) + 1 and (wp[1:] >= wp[:-1]).all()
    window = torch.repeat_interleave(torch.arange(wp.numel() - 1), wp[1:] - wp[:-1])
    key = window * 10**6 + adj.tile_col.long()
    assert (key[1:] > key[:-1]).all()
    assert adj.tile_col.dtype == torch.int32 and adj.res_col.dtype == torch.int32
    assert adj.res_ptr.dtype == torch.int64 and adj.res_ptr.numel() == num_dst + 1
    # degrees and row sums
    assert torch.equal(adj.row_sums, off.sum(1).long())
    assert adj.max_row_sum == int(off.sum(1).max())
    assert adj.degree().dtype == torch.float32
    assert torch.equal(adj.degree().double(), dense.sum(1))
    # nbytes: every stored tensor
    expected_nbytes = (8 * wp.numel() + 4 * adj.num_tiles + 4 * adj.bits * adj.num_tiles * 16 * 8
                       + 8 * (num_dst + 1) + 4 * adj.res_nnz + (4 * adj.res_nnz if adj.bits > 1 else 0)
                       + (4 * num_dst if self_loops else 0) + 8 * num_dst)
    assert adj.nbytes == expected_nbytes


@pytest.mark.parametrize("self_loops", [1, 2])
@pytest.mark.parametrize("graph", ["n17", "n300", "n1000"])
def test_self_loops_match_pyg(graph, self_loops):
    ei, n, _ = make_graph(graph)
    ei = torch.unique(ei, dim=1)  # PyG's semantics are compared on a duplicate-free edge_index
    ei = torch.cat([ei, torch.tensor([[3, 5], [3, 5]])], 1)  # make sure some loops exist
    ei = torch.unique(ei, dim=1)
    assert (ei[0] == ei[1]).any() and (ei[0] != ei[1]).any()
    weight = torch.ones(ei.size(1))
    pyg_ei, pyg_w = add_remaining_self_loops(ei, weight, fill_value=float(self_loops), num_nodes=n)
    pyg_dense = torch.zeros(n, n, dtype=torch.float64)
    pyg_dense.index_put_((pyg_ei[1], pyg_ei[0]), pyg_w.double(), accumulate=True)
    adj = pq.BitAdjacency.from_edge_index(ei, n, self_loops=self_loops)
    assert torch.equal(adj.to_dense().double(), pyg_dense)
    assert torch.equal(adj.degree().double(), pyg_dense.sum(1))


def test_int32_edge_index_and_default_num_nodes():
    ei = random_edges(90, 90, 400, 9)
    n = int(ei.max()) + 1
    a = pq.BitAdjacency.from_edge_index(ei)  # num_nodes defaults to max index + 1
    b = pq.BitAdjacency.from_edge_index(ei.to(torch.int32), n)
    assert a.num_rows == a.num_cols == n
    for name in ("window_ptr", "tile_col", "tile_bits", "res_ptr", "res_col", "row_sums"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert torch.equal(a.to_dense().double(), dense_from_edges(ei, n, n))


# --- bit_spmm ---------------------------------------------------------------------------
def spmm_reference(adj, x):
    """The float64 product and the magnitudes of the terms the epilogue adds."""
    A = adj.to_dense().double()
    return A @ deq64(x), A.abs() @ mag64(x)


SPMM_GRAPHS = [("n1", 0), ("n17", 1), ("n300", 0), ("n300", 2), ("n1000", 1), ("n300-dup", 0),
               ("n260-dense", 0), ("n260-dense", 1), ("n70-dense-dup", 2), ("bip-300x17", 0), ("bip-17x600", 0)]


@pytest.mark.parametrize("x_dim", [0, None])
@pytest.mark.parametrize("graph,self_loops", SPMM_GRAPHS)
def test_bit_spmm_matches_float64(graph, self_loops, x_dim, device):
    adj, ei, num_src, num_dst = build(graph, self_loops)
    assert torch.equal(adj.to_dense().double(), expected_dense(ei, num_src, num_dst, self_loops))
    adj = adj.to(device)
    for bits in range(1, 9):
        for layout in ("col", "row"):
            if layout == "row" and bits not in (1, 5):
                continue  # the repack path, a couple of widths suffice
            x = pq.to_bit(randn(num_src, 23, bits + num_src, shift=0.5, device=device), bits, dim=x_dim, layout=layout)
            out = pq.bit_spmm(adj, x)
            assert out.device == x.device and out.dtype == torch.float32 and out.shape == (num_dst, 23)
            expected, terms = spmm_reference(adj, x)
            assert_fp32_close(out, expected, EPILOGUE_BOUND * terms + 1e-30, scale=terms)
            # the literal reference of the brief, norm-wise
            lit = adj.to_dense().double() @ pq.to_val(x).double()
            assert float((out.double() - lit).norm()) <= 1e-6 * float(lit.norm()) + 1e-30


@pytest.mark.parametrize("min_tile_nnz", [1, 16, 10**6])
@pytest.mark.parametrize("graph", ["n17", "n300-dup", "n260-dense", "n70-dense-dup", "bip-17x600"])
def test_bit_spmm_int_exact(graph, min_tile_nnz):
    adj, ei, num_src, num_dst = build(graph, 0, min_tile_nnz)
    A = dense_from_edges(ei, num_src, num_dst).long()
    for bits in (1, 2, 3, 5, 8):
        x = pq.to_bit(randn(num_src, 19, bits), bits, dim=0, layout="col")
        Q = ref_codes(x)
        want = A @ Q
        args = (adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val,
                x.planes, num_dst, 19)
        reference = ref.bit_spmm_int(*args, False)
        assert reference.dtype == torch.int32 and torch.equal(reference.long(), want)
        if pq.backends()["cpu"]:
            got = torch.ops.pyg_quant.bit_spmm_int(*args, False)
            assert got.dtype == torch.int32 and torch.equal(got, reference)
            wide = torch.ops.pyg_quant.bit_spmm_int(*args, True)
            assert wide.dtype == torch.int64 and torch.equal(wide, want)


@requires_compiled
@pytest.mark.parametrize("weight", [2**22, 2**30, -(2**30)])
def test_compiled_bit_spmm_int_sums_past_int32(weight):
    """The CPU kernel sums in 32 bits only where no sum can reach 2**31: with weights this large a row's sums pass
    it, and the int64 result must still be exact; the int32 one keeps the low 32 bits, as the reference's cast."""
    n, cols = 40, 19
    x = pq.to_bit(randn(n, cols, 5), 8, dim=0, layout="col")
    counts = torch.tensor([0, 5, 0, 1] + [3] * (n - 4))
    res_ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    res_col = torch.randint(n, (int(counts.sum()),), generator=gen(3)).int()
    res_val = torch.full_like(res_col, weight)
    res_val[::2] = 3
    windows = (n + 15) // 16
    args = (torch.zeros(windows + 1, dtype=torch.long), torch.zeros(0, dtype=torch.int32),
            torch.zeros(1, 0, 16, 8, dtype=torch.int32), res_ptr, res_col, res_val, x.planes, n, cols)
    want = ref.bit_spmm_int(*args, True)
    assert int(want.abs().max()) >= 2**31 or weight == 2**22
    for wide in (True, False):
        got = torch.ops.pyg_quant.bit_spmm_int(*args, wide)
        assert got.dtype == (torch.int64 if wide else torch.int32)
        assert torch.equal(got, want if wide else want.to(torch.int32))


@pytest.mark.parametrize("graph", ["n300", "n1000", "n260-dense"])
def test_bit_spmm_equals_pyg_sum_aggregation(graph):
    adj, ei, n, _ = build(graph, 0)
    x = pq.to_bit(randn(n, 32, 17, shift=1.0), 8, dim=0, layout="col")
    xq = pq.to_val(x)
    src, dst = ei
    out_pyg = torch.zeros(n, 32).index_add_(0, dst, xq[src])  # PyG's sum aggregation (flow source_to_target)
    from torch_geometric.utils import scatter
    assert torch.allclose(out_pyg, scatter(xq[src], dst, dim=0, dim_size=n, reduce="sum"), rtol=1e-5, atol=1e-5)
    out = pq.bit_spmm(adj, x)
    # both sides are float32; the PyG side sums deg_i terms sequentially (≤ deg_i·2**-24 relative
    # to the term magnitudes), bit_spmm rounds once
    deg = adj.degree().double().view(-1, 1)
    A = adj.to_dense().double()
    bound = (deg + 4) * 2**-24 * (A @ mag64(x)) + 1e-30
    assert ((out.double() - out_pyg.double()).abs() <= bound).all()


def test_bit_spmm_on_empty_graph_is_the_diagonal_term():
    ei = torch.empty(2, 0, dtype=torch.long)
    x = pq.to_bit(randn(37, 9, 2), 6, dim=0, layout="col")
    for k in (0, 1, 2):
        adj = pq.BitAdjacency.from_edge_index(ei, 37, self_loops=k)
        assert adj.num_tiles == 0 and adj.nnz == 0 and adj.res_nnz == 0 and adj.fill_ratio == 0.0
        assert torch.equal(adj.row_sums, torch.zeros(37, dtype=torch.long))
        assert torch.equal(adj.to_dense(), k * torch.eye(37))
        out = pq.bit_spmm(adj, x)
        assert torch.equal(out, k * pq.to_val(x))
        assert torch.equal(adj.degree(), torch.full((37,), float(k)))


def test_only_self_loops_graph():
    ei = torch.arange(20).repeat(2, 1)
    adj = pq.BitAdjacency.from_edge_index(ei, 20, self_loops=2)
    assert adj.nnz == 0 and adj.num_tiles == 0
    assert torch.equal(adj.to_dense(), torch.eye(20))
    adj0 = pq.BitAdjacency.from_edge_index(ei, 20, self_loops=0)
    assert adj0.nnz == 20 and torch.equal(adj0.to_dense(), torch.eye(20))


def test_adjacency_to_cpu():
    adj, *_ = build("n300", 1)
    moved = adj.to("cpu")
    assert moved.num_rows == adj.num_rows and moved.nnz == adj.nnz and moved.max_row_sum == adj.max_row_sum
    assert torch.equal(moved.to_dense(), adj.to_dense())
    assert "BitAdjacency(" in repr(adj)


# --- bad inputs ---------------------------------------------------------------------------
def test_from_edge_index_bad_inputs():
    ei = random_edges(10, 10, 30, 1)
    build_ = pq.BitAdjacency.from_edge_index
    with pytest.raises(TypeError, match="edge_index must be int64 or int32"):
        build_(ei.float(), 10)
    with pytest.raises(ValueError):
        build_(torch.cat([ei, ei[:1]]), 10)  # [3, E]
    with pytest.raises(ValueError):
        build_(ei[0], 10)  # 1-D
    bad = ei.clone()
    bad[0, 3] = -1
    with pytest.raises(ValueError):
        build_(bad, 10)
    with pytest.raises(ValueError):
        build_(ei, 5)  # indices >= num_nodes
    with pytest.raises(ValueError):
        build_(ei, (10, 5))  # targets out of range
    with pytest.raises(ValueError):
        build_(ei, (5, 10))  # sources out of range
    for k in (3, -1, True):
        with pytest.raises(ValueError):
            build_(ei, 10, self_loops=k)
    with pytest.raises(ValueError):
        build_(ei, (10, 12), self_loops=1)  # bipartite
    with pytest.raises(ValueError):
        build_(ei, 10, min_tile_nnz=0)
    with pytest.raises(ValueError):
        build_(torch.empty(2, 0, dtype=torch.long))  # empty needs num_nodes
    with pytest.raises(ValueError):
        build_(ei, 0)
    with pytest.raises(ValueError):
        build_(ei.repeat(1, 256), 10)  # an edge repeated > 255 times
    with pytest.raises(TypeError):
        build_(ei.tolist(), 10)


def test_bit_spmm_bad_inputs():
    adj = pq.BitAdjacency.from_edge_index(random_edges(10, 10, 30, 1), 10)
    x = pq.to_bit(randn(10, 4, 1), 3, dim=0, layout="col")
    with pytest.raises(ValueError):
        pq.bit_spmm(adj, pq.to_bit(randn(11, 4, 1), 3, dim=0, layout="col"))
    with pytest.raises(ValueError, match="dim=1"):
        pq.bit_spmm(adj, pq.to_bit(randn(10, 4, 1), 3, dim=1, layout="col"))
    with pytest.raises(TypeError):
        pq.bit_spmm(adj, randn(10, 4, 1))
    with pytest.raises(TypeError):
        pq.bit_spmm(adj.to_dense(), x)


@requires_compiled
def test_compiled_bit_spmm_int_rejects_bad_arguments():
    adj, ei, n, _ = build("n300", 0, 1)
    x = pq.to_bit(randn(n, 4, 1), 3, dim=0, layout="col")
    small = pq.to_bit(randn(20, 4, 1), 3, dim=0, layout="col")  # only 256 nodes of words
    args = [adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val, x.planes, n, 4, False]
    torch.ops.pyg_quant.bit_spmm_int(*args)
    bad = list(args)
    bad[6] = small.planes  # tile_col points past the feature words
    with pytest.raises(ValueError):
        torch.ops.pyg_quant.bit_spmm_int(*bad)
    bad = list(args)
    bad[8] = 1000  # cols past the padded feature count
    with pytest.raises(ValueError):
        torch.ops.pyg_quant.bit_spmm_int(*bad)
    bad = list(args)
    bad[7] = n + 100  # rows past the windows
    with pytest.raises(ValueError):
        torch.ops.pyg_quant.bit_spmm_int(*bad)
    bad = list(args)
    bad[1] = adj.tile_col.long()
    with pytest.raises(ValueError):
        torch.ops.pyg_quant.bit_spmm_int(*bad)


def test_bit_spmm_widens_when_row_sums_could_overflow(monkeypatch):
    """wide accumulation is chosen from max_row_sum·(2**bits - 1) > 2**31 - 1.

    A real graph that needs it has > 8.4M edges into one node, so the decision is checked by
    recording the flag (and the result must not change)."""
    import pyg_quant.graph.spmm as spmm

    adj, ei, n, _ = build("n300", 1)
    x = pq.to_bit(randn(n, 7, 3), 8, dim=0, layout="col")
    seen = []
    real = spmm.ops.bit_spmm_affine

    def spy(*args):
        seen.append(args[16])  # wide
        return real(*args)

    monkeypatch.setattr(spmm.ops, "bit_spmm_affine", spy)
    small = pq.bit_spmm(adj, x)
    assert seen == [False]
    adj.max_row_sum = (2**31 - 1) // 255 + 1  # claims row sums that would overflow int32 with 8-bit x
    wide = pq.bit_spmm(adj, x)
    assert seen == [False, True]
    assert torch.equal(wide, small)
    adj.max_row_sum = (2**31 - 1) // 255  # exactly at the bound: still int32
    pq.bit_spmm(adj, x)
    assert seen[-1] is False


# --- the compact form (tile plan + a byte an edge) -----------------------------------------------
@pytest.mark.parametrize("shape,edges,min_tile_nnz,repeat", [
    ((300, 300), 5000, 16, 1), ((17, 1000), 3000, 1, 3), ((4000, 700), 20000, 40, 1), ((40, 300), 12000, 1, 1),
    ((1, 1), 0, 16, 1), ((5000, 5000), 300, 4, 300)])
@requires_compiled
def test_tile_plan_compiled_equals_reference(shape, edges, min_tile_nnz, repeat):
    """The C++ planner and the torch reference emit the same plan (tiles, row counts, entries, residual)."""
    g = gen(edges + repeat)
    rows, cols = shape
    keys = torch.randint(rows * cols, (edges,), generator=g)
    if edges and shape == (40, 300):  # dense: some tile rows hold all 256 columns
        keys = torch.cat([keys, torch.arange(3 * cols, 3 * cols + 256)])
    keys = torch.cat([keys] + [keys[: max(1, edges // 50)]] * (repeat - 1))  # repeats -> multi-bit / residual
    keys, sums = torch.unique(keys, return_counts=True)
    planes = min(8, max(1, int(sums.max()).bit_length())) if sums.numel() else 1
    expected = ref.tile_plan(keys, sums, rows, cols, min_tile_nnz, planes)
    got = pq.ops.tile_plan(keys, sums, rows, cols, min_tile_nnz, planes)
    for name, a, b in zip(("tile_key", "row_count", "entry_col", "entry_val", "res_row", "res_col", "res_sum",
                           "row_sums"), got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("graph", ["planted", "random"])
@pytest.mark.parametrize("self_loops", [0, 1, 2])
def test_compact_expands_to_from_edge_index(graph, self_loops):
    """CompactAdjacency.expand() is BitAdjacency.from_edge_index field for field, and costs about a byte an edge."""
    g = gen(3)
    n = 3000
    if graph == "planted":
        src = torch.randint(n, (60000,), generator=g)
        dst = (src // 300) * 300 + torch.randint(300, (60000,), generator=g)
    else:
        src, dst = torch.randint(n, (2, 30000), generator=g)
    edge_index = torch.stack([src, dst])
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, n, self_loops=self_loops)
    adj = compact.expand()
    expected = pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=self_loops)
    for name in pq.BitAdjacency._TENSORS:
        a, b = getattr(adj, name), getattr(expected, name)
        assert (a is None) == (b is None), name
        assert a is None or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)), name
    assert (adj.nnz, adj.max_row_sum) == (expected.nnz, expected.max_row_sum)
    per_entry = 2 if compact.planes > 1 else 1
    assert compact.nbytes <= per_entry * adj.tile_nnz + 20 * adj.num_tiles + 12 * adj.res_nnz + n
    if graph == "planted":
        assert compact.nbytes < adj.nbytes / 3


def test_compact_rejects_non_integer_diag():
    from pyg_quant.graph.bit_adjacency import CompactAdjacency
    keys, sums = torch.tensor([0, 5]), torch.tensor([1, 1])
    with pytest.raises(ValueError, match="diag"):
        CompactAdjacency.from_entries(keys, sums, 3, 3, 1, diag=torch.tensor([0.5, 1.0, 1.0]))


@requires_compiled
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("shape,edges,min_tile_nnz,repeat", [
    ((300, 300), 5000, 16, 1), ((17, 1000), 3000, 1, 3), ((4000, 700), 20000, 40, 1), ((40, 300), 12000, 1, 1),
    ((1, 1), 0, 16, 1), ((5000, 5000), 300, 4, 300), ((33, 70000), 40000, 2, 2)])
def test_expand_tiles_compiled_equals_reference(device, shape, edges, min_tile_nnz, repeat):
    """The compiled tile writer (CPU, and CUDA on a GPU) equals the torch reference, every output, on plans with
    one and several planes, int16 row counts (full tile rows), residual entries and empty windows."""
    g = gen(edges + repeat + 1)
    rows, cols = shape
    keys = torch.randint(rows * cols, (edges,), generator=g)
    if edges and shape == (40, 300):
        keys = torch.cat([keys, torch.arange(3 * cols, 3 * cols + 256)])
    keys = torch.cat([keys] + [keys[: max(1, edges // 50)]] * (repeat - 1))
    keys, sums = torch.unique(keys, return_counts=True)
    compact = pq.graph.CompactAdjacency.from_entries(keys, sums, rows, cols, min_tile_nnz)
    if shape == (40, 300):
        assert compact.row_count.dtype == torch.int16
    args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (
        compact.tile_key, compact.row_count, compact.entry_col, compact.entry_val, compact.res_row, compact.res_val,
        rows, cols, compact.planes)]
    expected = ref.expand_tiles(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    got = pq.ops.expand_tiles(*args)
    for name, a, b in zip(("window_ptr", "tile_col", "tile_bits", "res_ptr", "row_sums"), got, expected):
        assert a.device.type == device
        a = a.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


@requires_compiled
def test_expand_tiles_rejects_inconsistent_plans():
    keys, sums = torch.tensor([0, 1, 2, 700, 20 * 800 + 3]), torch.tensor([1, 1, 1, 1, 1])
    plan = pq.graph.CompactAdjacency.from_entries(keys, sums, 40, 800, 1)
    args = dict(tile_key=plan.tile_key, row_count=plan.row_count, entry_col=plan.entry_col, entry_val=None,
                res_row=plan.res_row, res_val=None, num_rows=40, num_cols=800, planes=1)
    with pytest.raises(RuntimeError, match="disagree|more entries"):
        torch.ops.pyg_quant.expand_tiles(**{**args, "entry_col": plan.entry_col[:-1]})
    with pytest.raises(RuntimeError, match="sorted"):
        torch.ops.pyg_quant.expand_tiles(**{**args, "tile_key": plan.tile_key.flip(0)})
    with pytest.raises(RuntimeError, match="entry_val"):
        torch.ops.pyg_quant.expand_tiles(**{**args, "planes": 2})


# --- the tile-free decode (expand_csr) ---------------------------------------------------------------------------
def csr_case(name):
    """``(edge_index, num_nodes, self_loops, min_tile_nnz)`` of one expand_csr case."""
    g = gen(sum(map(ord, name)))
    if name == "random-loops-dup":  # self loops (the diagonal term), repeated edges (several planes)
        ei = random_edges(300, 300, 5000, 11)
        return torch.cat([ei, ei[:, :400], ei[:, :50]], 1), 300, 1, 60
    if name == "planted-dup":  # dense blocks (tiles) and sparse links (residual), multiplicities up to 4
        src = torch.randint(1200, (30000,), generator=g)
        dst = (src // 200) * 200 + torch.randint(200, (30000,), generator=g)
        links = torch.randint(1200, (2, 2000), generator=g)
        ei = torch.cat([torch.stack([src, dst]), links], 1)
        return torch.cat([ei] + [ei[:, :3000]] * 3, 1), 1200, 2, 8
    if name == "empty-rows":  # targets only in [100, 140) and [900, 1000): most rows empty, empty windows
        dst = torch.cat([torch.randint(100, 140, (3000,), generator=g), torch.randint(900, 1000, (400,), generator=g)])
        return torch.stack([torch.randint(1000, (dst.numel(),), generator=g), dst]), 1000, 0, 16
    if name == "empty-graph":
        return torch.empty(2, 0, dtype=torch.long), 5, 1, 16
    if name == "tiles-only":  # min_tile_nnz=1: every entry in a tile, the residual empty
        return random_edges(500, 500, 4000, 12), 500, 0, 1
    if name == "residual-only":
        return random_edges(500, 500, 4000, 13), 500, 0, 4097
    if name == "rows-tiles-or-residual":  # rows 0..15: a dense block and nothing else; rows 400..: sparse only
        dense = torch.stack([torch.randint(256, (2000,), generator=g), torch.randint(16, (2000,), generator=g)])
        sparse = torch.stack([torch.randint(600, (300,), generator=g), torch.randint(400, 600, (300,), generator=g)])
        mixed = torch.stack([torch.randint(600, (800,), generator=g), torch.randint(16, 32, (800,), generator=g)])
        return torch.cat([dense, sparse, mixed], 1), 600, 0, 40
    if name == "full-tile-row":  # row 3 holds all 256 columns of a tile: row_count int16
        full = torch.stack([torch.arange(256, 512), torch.full((256,), 3)])
        return torch.cat([full, random_edges(700, 700, 3000, 14)], 1), 700, 1, 4
    if name == "bipartite":  # 40 targets x 700 sources
        return random_edges(700, 40, 6000, 15), (700, 40), 0, 8
    if name == "bipartite-wide":  # 17 targets x 70000 sources, repeats
        ei = random_edges(70000, 17, 20000, 16)
        return torch.cat([ei, ei[:, :500]], 1), (70000, 17), 0, 2
    raise KeyError(name)


CSR_CASES = ["random-loops-dup", "planted-dup", "empty-rows", "empty-graph", "tiles-only", "residual-only",
             "rows-tiles-or-residual", "full-tile-row", "bipartite", "bipartite-wide"]


def assert_same_bit_adjacency(a, b):
    for name in pq.BitAdjacency._TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            x, y = x.cpu(), y.cpu()
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    for name in ("num_rows", "num_cols", "nnz", "max_row_sum"):
        assert getattr(a, name) == getattr(b, name), name


def csr_args(compact, device="cpu"):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in (
        compact.tile_key, compact.row_count, compact.entry_col, compact.entry_val, compact.res_row, compact.res_col,
        compact.res_val, compact.num_rows, compact.num_cols)]


@pytest.mark.parametrize("case", CSR_CASES)
def test_expand_csr_is_the_tile_free_build(case):
    """CompactAdjacency.expand(tiles=False) (expand_csr) is, field for field, what from_edge_index builds with every
    entry in the CSR; the compiled op equals the torch reference; the tile form holds the same matrix."""
    edge_index, num_nodes, self_loops, min_tile_nnz = csr_case(case)
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, num_nodes, self_loops, min_tile_nnz)
    expected = pq.BitAdjacency.from_edge_index(edge_index, num_nodes, self_loops, min_tile_nnz=4097)
    assert expected.num_tiles == 0
    csr = compact.expand(tiles=False)
    assert_same_bit_adjacency(csr, expected)
    assert_same_bit_adjacency(pq.BitAdjacency.from_edge_index(edge_index, num_nodes, self_loops, adjacency="csr"),
                              expected)
    reference = ref.expand_csr(*csr_args(compact))
    compiled = pq.ops.expand_csr(*csr_args(compact))
    weighted = compact.entry_val is not None or compact.res_val is not None
    for name, a, b, c in zip(("res_ptr", "res_col", "res_val", "row_sums"), compiled, reference,
                             (csr.res_ptr, csr.res_col, csr.res_val, csr.row_sums)):
        if name == "res_val" and not weighted:
            assert a is None and b.numel() == 0 and c is None
            continue
        assert a.dtype == b.dtype == c.dtype and torch.equal(a, b) and torch.equal(a, c), name
    tiled = compact.expand(tiles=True)
    assert torch.equal(tiled.to_dense(), csr.to_dense())
    assert torch.equal(tiled.row_sums, csr.row_sums)
    # The tile-free form's entries read as they are stored: the same (src, dst, count), in the same order, as the
    # tiled form's decoded and made distinct.
    for got, want in zip(decode_bit_adjacency(csr), decode_bit_adjacency(tiled)):
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)
    if case == "tiles-only":
        assert compact.res_row.numel() == 0 and compact.num_tiles > 0
    if case in ("residual-only", "empty-graph"):
        assert compact.num_tiles == 0
        assert_same_bit_adjacency(tiled, csr)  # without tiles both decodes agree
    if case == "full-tile-row":
        assert compact.row_count.dtype == torch.int16
    if case == "rows-tiles-or-residual":  # rows 0..15 only in tiles, rows 400.. only in the residual
        res_rows = set(compact.res_row.tolist())
        assert compact.num_tiles > 0 and not res_rows & set(range(16)) and res_rows & set(range(400, 600))
    if case in ("random-loops-dup", "planted-dup"):
        assert compact.planes > 1 and compact.num_tiles > 0 and compact.res_row.numel() > 0
    if case == "empty-rows":
        assert int((csr.res_ptr[1:] == csr.res_ptr[:-1]).sum()) > 800


@requires_compiled
def test_expand_csr_values_past_eight_planes():
    """Integer entries too large for 8 planes travel in the residual (int32) and are merged in as they are."""
    g = gen(5)
    keys = torch.unique(torch.randint(300 * 900, (9000,), generator=g))
    sums = torch.randint(1, 4, keys.shape, generator=g)
    big = torch.randperm(keys.numel(), generator=g)[:100]
    sums[big] = torch.randint(256, 1000, (100,), generator=g)
    compact = pq.graph.CompactAdjacency.from_entries(keys, sums, 300, 900, 4)
    assert compact.num_tiles > 0 and compact.entry_val is not None and compact.res_val is not None
    got = pq.ops.expand_csr(*csr_args(compact))
    expected = ref.expand_csr(*csr_args(compact))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    rows = torch.repeat_interleave(torch.arange(300), got[0][1:] - got[0][:-1])
    assert torch.equal(rows * 900 + got[1].long(), keys) and torch.equal(got[2].long(), sums)


@requires_compiled
@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("case", CSR_CASES)
def test_expand_csr_cuda_equals_cpu(case):
    edge_index, num_nodes, self_loops, min_tile_nnz = csr_case(case)
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, num_nodes, self_loops, min_tile_nnz)
    on_gpu = pq.graph.CompactAdjacency.from_tensors(
        {k: v.cuda() for k, v in compact.tensors().items()}, compact.scalars())
    got = on_gpu.expand(tiles=False)
    assert got.device.type == "cuda" and got.res_col.device.type == "cuda"
    assert_same_bit_adjacency(got, compact.expand(tiles=False))
    gpu_ops = pq.ops.expand_csr(*csr_args(compact, "cuda"))
    cpu_ops = pq.ops.expand_csr(*csr_args(compact))
    for a, b in zip(gpu_ops, cpu_ops):
        assert (a is None) == (b is None) and (a is None or torch.equal(a.cpu(), b))


@requires_compiled
@pytest.mark.cuda
@requires_cuda
def test_expand_csr_cuda_malformed_plan_stays_in_bounds():
    """Counts that disagree with the entries, unsorted keys and residual rows out of range: no out-of-range access
    (the kernels clamp every index they read and write)."""
    edge_index, num_nodes, self_loops, min_tile_nnz = csr_case("planted-dup")
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, num_nodes, self_loops, min_tile_nnz)
    args = csr_args(compact, "cuda")
    for index, bad in ((1, args[1] * 3), (0, args[0].flip(0)), (4, args[4] + 700), (2, args[2][: args[2].numel() // 2]),
                       (3, None if args[3] is None else args[3][: args[2].numel() // 2])):
        if index == 2:
            trimmed = list(args)
            trimmed[2], trimmed[3] = bad, args[3][: bad.numel()] if args[3] is not None else None
            torch.ops.pyg_quant.expand_csr(*trimmed)
        elif index != 3:
            torch.ops.pyg_quant.expand_csr(*(args[:index] + [bad] + args[index + 1:]))
    torch.cuda.synchronize()


@requires_compiled
def test_expand_csr_rejects_inconsistent_plans():
    keys, sums = torch.tensor([0, 1, 2, 700, 20 * 800 + 3]), torch.tensor([1, 1, 1, 1, 1])
    plan = pq.graph.CompactAdjacency.from_entries(keys, sums, 40, 800, 1)
    args = dict(tile_key=plan.tile_key, row_count=plan.row_count, entry_col=plan.entry_col, entry_val=None,
                res_row=plan.res_row, res_col=plan.res_col, res_val=None, num_rows=40, num_cols=800)
    with pytest.raises(RuntimeError, match="disagree"):
        torch.ops.pyg_quant.expand_csr(**{**args, "entry_col": plan.entry_col[:-1]})
    with pytest.raises(RuntimeError, match="sorted"):
        torch.ops.pyg_quant.expand_csr(**{**args, "tile_key": plan.tile_key.flip(0)})
    with pytest.raises(RuntimeError, match="num_cols"):
        torch.ops.pyg_quant.expand_csr(**{**args, "num_cols": 600})
    with pytest.raises(RuntimeError, match="res_col"):
        torch.ops.pyg_quant.expand_csr(**{**args, "res_col": plan.res_col.long()})
    residual = pq.graph.CompactAdjacency.from_entries(keys, sums, 40, 800, 4)
    with pytest.raises(RuntimeError, match="res_col"):
        torch.ops.pyg_quant.expand_csr(**{**args, "tile_key": residual.tile_key, "row_count": residual.row_count,
                                          "entry_col": residual.entry_col, "res_row": residual.res_row,
                                          "res_col": residual.res_col + 800})


# --- the wire decode (expand_wire) -------------------------------------------------------------------------------
def wire_batch(compact, device="cpu"):
    """A QuantBatch holding ``compact`` as its loader ships it (integer parts narrowed), its buffer on ``device``."""
    from pyg_quant.loader import QuantBatch
    return QuantBatch.from_fields({"adj": compact}).to(device)


def wire_parts(batch):
    """``{part: (dtype, shape, byte offset)}`` of ``batch``'s adjacency as it travels."""
    return {name.split(".", 1)[1]: (dtype, shape, offset) for name, dtype, shape, offset in batch._specs
            if name.startswith("adj.")}


def wire_layout(batch):
    """expand_wire's ``(buffer, parts)`` of ``batch``'s adjacency."""
    return batch.buffer, pq.ops.wire_layout(wire_parts(batch))


@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("case", CSR_CASES)
def test_expand_wire_is_the_plans_expansion(case, tiles):
    """A batch's adjacency decoded from its narrowed wire parts in one op is compact.expand(tiles) field for field;
    the compiled op equals the torch reference."""
    edge_index, num_nodes, self_loops, min_tile_nnz = csr_case(case)
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, num_nodes, self_loops, min_tile_nnz)
    batch = wire_batch(compact)
    narrowed = {name for name, dtype, _, _ in batch._specs if dtype != getattr(compact, name.split(".", 1)[1]).dtype}
    if case == "planted-dup":
        assert {"adj.res_row", "adj.res_col", "adj.tile_key"} <= narrowed  # the decode widens them
    got = pq.graph.CompactAdjacency.expand_wire(batch.buffer, wire_parts(batch), compact.scalars(),
                                                "tiles" if tiles else "csr")
    assert_same_bit_adjacency(got, compact.expand(tiles=tiles))
    args = wire_layout(batch) + (compact.num_rows, compact.num_cols, compact.planes, tiles)
    for a, b in zip(pq.ops.expand_wire(*args), ref.expand_wire(*args)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if pq.ops.use_compiled("expand_wire", torch.device("cpu")):  # no output aliases the buffer
        for out in torch.ops.pyg_quant.expand_wire(*args):
            assert out.numel() == 0 or out.untyped_storage().data_ptr() != batch.buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize("form", ["auto", "tiles", "csr"])
def test_loader_batch_decodes_its_adjacency_in_one_op(form):
    """QuantBatch's wire adjacency is decoded by expand_wire alone: one op, the BitAdjacency of compact.expand."""
    edge_index, num_nodes, self_loops, min_tile_nnz = csr_case("planted-dup")
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, num_nodes, self_loops, min_tile_nnz)
    from pyg_quant.loader import QuantBatch
    batch = QuantBatch.from_fields({"adj": compact}, adjacency=form)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        adj = batch.adj
    assert_same_bit_adjacency(adj, compact.expand(tiles=compact.wants_tiles(form)))
    top = [e.name for e in prof.events() if e.cpu_parent is None and not e.name.startswith("aten::as_strided")]
    if pq.ops.use_compiled("expand_wire", torch.device("cpu")):
        assert top == ["pyg_quant::expand_wire"], top


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["planted-dup", "random-loops-dup", "bipartite", "empty-graph"])
def test_expand_ops_take_narrowed_indices(case, device):
    """expand_csr and expand_tiles read tile_key, res_row, res_col and res_val in int16 or int8 (as a loader batch
    ships them, where the values fit) exactly as in int32."""
    edge_index, num_nodes, self_loops, min_tile_nnz = csr_case(case)
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, num_nodes, self_loops, min_tile_nnz)

    def narrowed(t, dtype):
        if t is None or t.numel() and int(t.abs().max()) > torch.iinfo(dtype).max:
            return t
        return t.to(dtype)
    for dtype in (torch.int16, torch.int8):
        args = csr_args(compact, device)
        for i in (0, 4, 5, 6):  # tile_key, res_row, res_col, res_val
            args[i] = narrowed(args[i], dtype)
        assert any(a is not None and a.dtype == dtype for a in args[:7]) or case == "empty-graph"
        for got, want in zip(pq.ops.expand_csr(*args), pq.ops.expand_csr(*csr_args(compact, device))):
            assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
        tiles_args = args[:5] + [args[6], compact.num_rows, compact.num_cols, compact.planes]
        want = pq.ops.expand_tiles(*(csr_args(compact, device)[:5] + [tiles_args[5] if tiles_args[5] is None else
                                                                       compact.res_val.to(device)] + tiles_args[6:]))
        for a, b in zip(pq.ops.expand_tiles(*tiles_args), want):
            assert a.dtype == b.dtype and torch.equal(a, b)


@requires_compiled
def test_expand_wire_rejects_bad_layouts():
    compact = pq.BitAdjacency.compact_from_edge_index(random_edges(60, 60, 300, 24), 60, 1, 4)
    buffer, layout = wire_layout(wire_batch(compact))
    common = (compact.num_rows, compact.num_cols, compact.planes, False)
    op = torch.ops.pyg_quant.expand_wire
    with pytest.raises(ValueError, match="parts must hold"):
        op(buffer, layout[:-4], *common)
    with pytest.raises(ValueError, match="is required"):
        op(buffer, [-1] + layout[1:], *common)
    with pytest.raises(ValueError, match="wire dtype"):
        op(buffer, layout[:1] + [9] + layout[2:], *common)
    with pytest.raises(ValueError, match="aligned window"):
        op(buffer, layout[:2] + [buffer.numel() + 1] + layout[3:], *common)
    with pytest.raises(ValueError, match="buffer"):
        op(buffer.view(torch.int8), layout, *common)
    with pytest.raises(ValueError, match="part entry_val"):
        pq.graph.CompactAdjacency.expand_wire(buffer, {"entry_val": (torch.float32, (3,), 0)}, compact.scalars())


@pytest.mark.parametrize("device", DEVICES)
def test_expand_wire_opcheck(device):
    """opcheck, and no result sharing the buffer's storage or another result's (torch.compile's rule)."""
    edge_index, num_nodes, self_loops, min_tile_nnz = csr_case("random-loops-dup")
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, num_nodes, self_loops, min_tile_nnz)
    buffer, layout = wire_layout(wire_batch(compact))
    buffer = buffer.to(device)
    if not pq.ops.use_compiled("expand_wire", buffer.device):
        pytest.skip("the compiled extension is not loaded")
    for tiles in (False, True):
        args = (buffer, layout, compact.num_rows, compact.num_cols, compact.planes, tiles)
        torch.library.opcheck(torch.ops.pyg_quant.expand_wire.default, args)
        got = [t for t in torch.ops.pyg_quant.expand_wire.default(*args) if t.numel()]
        storages = [t.untyped_storage().data_ptr() for t in got]
        assert len(set(storages)) == len(storages) and buffer.untyped_storage().data_ptr() not in storages


@requires_compiled
@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("case", CSR_CASES)
def test_expand_wire_cuda_equals_cpu(case, tiles):
    edge_index, num_nodes, self_loops, min_tile_nnz = csr_case(case)
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, num_nodes, self_loops, min_tile_nnz)
    args = (compact.num_rows, compact.num_cols, compact.planes, tiles)
    on_gpu = pq.ops.expand_wire(*wire_layout(wire_batch(compact, "cuda")), *args)
    on_cpu = pq.ops.expand_wire(*wire_layout(wire_batch(compact)), *args)
    for a, b in zip(on_gpu, on_cpu):
        assert a.device.type == "cuda" and a.dtype == b.dtype and torch.equal(a.cpu(), b)
    assert_same_bit_adjacency(wire_batch(compact, "cuda").adj, compact.expand(tiles=compact.wants_tiles(None)))


def test_auto_form_follows_the_tile_fill(monkeypatch):
    """"auto" decodes without tiles below MIN_TILE_FILL, with them at or above it; expand() and from_edge_index
    follow DEFAULT_ADJACENCY unless a tile threshold is given; explicit arguments win."""
    from pyg_quant.graph import adjacency_form as ca
    edge_index = random_edges(400, 400, 6000, 21)  # tiles ~1% full
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, 400)
    assert 0 < compact.tile_fill < ca.MIN_TILE_FILL
    assert not compact.wants_tiles("auto") and compact.wants_tiles("tiles") and not compact.wants_tiles("csr")
    assert compact.expand("auto").num_tiles == 0 and compact.expand(False).num_tiles == 0
    assert compact.expand(True).num_tiles == compact.num_tiles > 0
    by_default = compact.num_tiles if ca.DEFAULT_ADJACENCY == "tiles" else 0
    assert compact.expand().num_tiles == by_default
    assert pq.BitAdjacency.from_edge_index(edge_index, 400).num_tiles == by_default
    assert pq.BitAdjacency.from_edge_index(edge_index, 400, min_tile_nnz=16).num_tiles == compact.num_tiles > 0
    assert pq.BitAdjacency.from_edge_index(edge_index, 400, adjacency="tiles").num_tiles == compact.num_tiles
    assert pq.BitAdjacency.from_edge_index(edge_index, 400, min_tile_nnz=16, adjacency="auto").num_tiles == 0
    monkeypatch.setattr(ca, "MIN_TILE_FILL", compact.tile_fill)
    assert compact.wants_tiles("auto") and compact.expand("auto").num_tiles == compact.num_tiles
    empty = pq.BitAdjacency.compact_from_edge_index(torch.empty(2, 0, dtype=torch.long), 3)
    assert empty.tile_fill == 0 and not empty.wants_tiles("auto")


def test_adjacency_form_bad_arguments():
    edge_index = random_edges(40, 40, 100, 22)
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, 40)
    with pytest.raises(ValueError, match="adjacency"):
        pq.BitAdjacency.from_edge_index(edge_index, 40, adjacency="dense")
    with pytest.raises(ValueError, match="adjacency"):
        compact.wants_tiles("CSR")
    with pytest.raises(ValueError, match="tiles"):
        compact.expand(tiles="csr")
    with pytest.raises(TypeError, match="tiles"):
        compact.expand(tiles=1)


@pytest.mark.parametrize("op", ["expand_tiles", "expand_csr"])
def test_expand_rejects_unsorted_or_negative_residual_rows(op):
    """A residual whose rows are out of order (or negative) would land entries in the wrong CSR rows, or leave
    output slots unwritten; the CPU kernels check it (the end-of-rows count alone let a reversed order pass)."""
    edge_index = random_edges(60, 60, 300, 23)
    compact = pq.BitAdjacency.compact_from_edge_index(edge_index, 60, min_tile_nnz=4097)
    assert compact.res_row.numel() > 2 and compact.res_row[0] < compact.res_row[-1]
    for res_row in (compact.res_row.flip(0), torch.cat([compact.res_row[:1] * 0 - 1, compact.res_row[1:]])):
        common = (compact.tile_key, compact.row_count, compact.entry_col, compact.entry_val, res_row)
        with pytest.raises(RuntimeError, match="res_row must be sorted and in range"):
            if op == "expand_tiles":
                torch.ops.pyg_quant.expand_tiles(*common, compact.res_val, 60, 60, compact.planes)
            else:
                torch.ops.pyg_quant.expand_csr(*common, compact.res_col, compact.res_val, 60, 60)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["csr", "tiles"])
def test_float_csr_of_a_bit_adjacency_holds_its_stored_entries(device, form):
    """``bit_adjacency_csr`` (A and Aᵀ, the float layers' and the QAT layers' matrices) holds each stored entry with
    its multiplicity, the diagonal term apart, in both forms (without tiles it is read off the residual's CSR)."""
    from pyg_quant.graph.input_formats import bit_adjacency_csr
    n = 200
    edge_index = torch.cat([random_edges(n, n, 2500, 9), random_edges(n, n, 400, 9)], 1)  # repeated edges
    adj = pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1, min_tile_nnz=4, adjacency=form).to(device)
    assert (adj.num_tiles > 0) == (form == "tiles") and adj.bits > 1
    want = dense_from_edges(edge_index, n, n).to(device)
    want.fill_diagonal_(0.0)  # self loops live in the diagonal term
    for dtype in (torch.float32, torch.float64):
        a, a_t = bit_adjacency_csr(adj, dtype), bit_adjacency_csr(adj, dtype, transpose=True)
        stored = a.to_dense() - torch.diag(torch.diagonal(a.to_dense()))
        assert a.dtype == dtype and a.layout == torch.sparse_csr and torch.equal(stored, want.to(dtype))
        assert torch.equal(a_t.to_dense(), a.to_dense().t())
