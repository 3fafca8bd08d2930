"""pyg_quant.loader: QuantClusterData (pymetis, cache key) and QuantClusterLoader (bit-packed batches).

Oracles:

* PyG's own ``ClusterLoader`` run on our ``QuantClusterData`` (PyG's ClusterData cannot
  partition here, but its loader only reads the partition): same parts in, same nodes,
  node order, edges (order included) and attributes out.
* An independent one, from the *original* graph: the batch's nodes are the original ids
  of its parts in order, and its edges are ``torch_geometric.utils.subgraph`` over them;
  the expected adjacency is built with ``index_put_(accumulate=True)``.
* ``to_bit(x, bits, dim=0)`` on the whole feature matrix: a batch's codes, ``lo`` and
  ``scale`` must be its rows exactly (features are quantized once per graph).
"""
import json
import os
import os.path as osp
import pickle
import shutil
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch_geometric.data import Data
from torch_geometric.datasets import KarateClub
from torch_geometric.loader import ClusterData, ClusterLoader
from torch_geometric.utils import subgraph

import pyg_quant as pq
from pyg_quant import ops
from pyg_quant.loader import QuantBatch, QuantClusterData, QuantClusterLoader, prefetch
from pyg_quant.loader.prefetching import one_ahead
from pyg_quant.loader import cluster_data as cluster_data_module

from conftest import CUDA_OK, assert_fp32_close, deq64, dense_from_edges, gen, mag64, requires_cuda

CORA_RAW = osp.join(osp.dirname(__file__), "..", "..", "shared", "datasets", "planetoid", "Cora", "raw")


# --- graphs ---------------------------------------------------------------------------------
def planted_graph(num_nodes=1200, cluster_size=150, avg_degree=12, p_in=0.8, features=20, seed=0,
                  loops=True, duplicates=True) -> Data:
    """A directed planted-partition graph, node order shuffled, with self-loops and repeated edges,
    float features, labels, masks and an isolated tail of nodes."""
    g = gen(seed)
    num_edges = num_nodes * avg_degree
    src = torch.randint(num_nodes - 5, (num_edges,), generator=g)  # the last 5 nodes stay isolated
    block = src // cluster_size * cluster_size
    inside = block + (torch.rand(num_edges, generator=g) * cluster_size).long()
    dst = torch.where(torch.rand(num_edges, generator=g) < p_in, inside.clamp(max=num_nodes - 6),
                      torch.randint(num_nodes - 5, (num_edges,), generator=g))
    perm = torch.randperm(num_nodes - 5, generator=g)
    edge_index = torch.stack([perm[src], perm[dst]])
    if not loops:
        edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    if duplicates:
        edge_index = torch.cat([edge_index, edge_index[:, :num_edges // 20]], 1)
    x = torch.randn(num_nodes, features, generator=g) * torch.linspace(0.1, 3.0, features) + 0.5
    return Data(x=x, edge_index=edge_index, y=torch.randint(7, (num_nodes,), generator=g),
                train_mask=torch.rand(num_nodes, generator=g) < 0.3,
                val_mask=torch.rand(num_nodes, generator=g) < 0.2)


@pytest.fixture(scope="module")
def karate():
    return KarateClub()[0]


@pytest.fixture(scope="module")
def planted():
    return planted_graph()


@pytest.fixture(scope="module")
def planted_parts(planted):
    return QuantClusterData(planted, 12, log=False)


def cora_data(tmp_path):
    if not osp.isdir(CORA_RAW):
        pytest.skip(f"Cora raw files not found at {osp.normpath(CORA_RAW)} (../shared/datasets/planetoid/Cora/raw)")
    pytest.importorskip("scipy", reason="Planetoid needs scipy to read the raw Cora files (pickled scipy matrices)")
    from torch_geometric.datasets import Planetoid

    shutil.copytree(CORA_RAW, tmp_path / "Cora" / "raw")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Planetoid(str(tmp_path), "Cora")[0]


# --- oracles -----------------------------------------------------------------------------------
def original_ids(cd, parts):
    """Original ids of the nodes of ``parts``, part by part (each part in original order)."""
    ptr = cd.partition.partptr
    return torch.cat([cd.partition.node_perm[ptr[p]:ptr[p + 1]] for p in parts])


def expected_dense(edge_index, num_nodes, self_loops):
    """(A + self_loops·I) as BitAdjacency documents it: A[i, j] = #edges j→i; with self_loops = k > 0
    present loops become weight 1 and absent ones weight k."""
    if self_loops == 0:
        return dense_from_edges(edge_index, num_nodes, num_nodes)
    loop = edge_index[0] == edge_index[1]
    dense = dense_from_edges(edge_index[:, ~loop], num_nodes, num_nodes)
    diag = torch.full((num_nodes,), float(self_loops), dtype=torch.float64)
    diag[edge_index[0, loop]] = 1.0
    return dense + torch.diag(diag)


def sorted_edges(edge_index, num_nodes):
    return torch.sort(edge_index[0] * num_nodes + edge_index[1]).values


def check_against_original(batch, data, cd, bits, self_loops):
    """The batch against the original graph: nodes, every attribute, edges and features."""
    parts = batch.part.tolist()
    n_id = original_ids(cd, parts)
    n = n_id.numel()
    assert batch.num_nodes == n and torch.equal(batch.n_id, n_id)
    for key in ("y", "train_mask", "val_mask"):
        if key in data:
            assert torch.equal(batch[key], data[key][n_id]), key
    ref_edges, _ = subgraph(n_id, data.edge_index, relabel_nodes=True, num_nodes=data.num_nodes)
    if "edge_index" in batch:
        assert torch.equal(sorted_edges(batch.edge_index, n), sorted_edges(ref_edges, n))
    assert torch.equal(batch.adj.to_dense().double(), expected_dense(ref_edges, n, self_loops))
    assert torch.equal(batch.deg, expected_dense(ref_edges, n, self_loops).sum(1).float())
    # features: the rows of the global per-column quantization, exactly
    whole = pq.to_bit(data.x, bits, dim=0, layout="col")
    assert batch.x.layout == "col" and batch.x.dim == 0 and batch.x.bits == bits
    assert torch.equal(batch.x.lo, whole.lo) and torch.equal(batch.x.scale, whole.scale)
    assert torch.equal(batch.x.codes(), whole.codes()[n_id])


def check_against_pyg(ours, theirs, bits):
    """Our batch against PyG's ClusterLoader batch for the same parts."""
    assert ours.num_nodes == theirs.num_nodes
    assert torch.equal(ours.edge_index, theirs.edge_index)  # same edges, same order
    for key in theirs.keys():
        if key in ("x", "edge_index", "num_nodes"):
            continue
        assert torch.equal(ours[key], theirs[key]), key
    # |to_val(x) - x| <= scale / 2 (one float32 rounding of lo + scale·q on top)
    err = (pq.to_val(ours.x) - theirs.x).abs()
    bound = ours.x.scale / 2 + 4e-7 * (ours.x.lo.abs() + ours.x.scale * (2**bits - 1))
    assert bool((err <= bound).all()), float((err - bound).max())


def loader_pairs(cd, batch_size, **kwargs):
    ours = list(QuantClusterLoader(cd, batch_size=batch_size, return_edge_index=True, **kwargs))
    theirs = [next(iter(ClusterLoader(cd, batch_size=len(b.part), sampler=b.part.tolist()))) for b in ours]
    return ours, theirs


# --- batches equal PyG's and the original graph's ------------------------------------------------
@pytest.mark.parametrize("num_parts,batch_size,sparse_format,bits,self_loops", [
    (4, 2, "csr", 4, 1), (3, 1, "csc", 8, 0), (6, 4, "csr", 2, 2)])
def test_karate_matches_pyg_cluster_loader(karate, num_parts, batch_size, sparse_format, bits, self_loops):
    cd = QuantClusterData(karate, num_parts, log=False, sparse_format=sparse_format)
    ours, theirs = loader_pairs(cd, batch_size, bits=bits, self_loops=self_loops)
    assert sum(b.num_nodes for b in ours) == karate.num_nodes
    for o, t in zip(ours, theirs):
        check_against_pyg(o, t, bits)
        check_against_original(o, karate, cd, bits, self_loops)


def test_planted_graph_shuffled_batches(planted, planted_parts):
    """Directed graph with self-loops, repeated edges and isolated nodes; shuffled batches of 5 parts
    with links between the parts of a batch."""
    torch.manual_seed(3)
    ours, theirs = loader_pairs(planted_parts, 5, shuffle=True, bits=3, self_loops=1)
    assert sorted(p for b in ours for p in b.part.tolist()) == planted_parts.nonempty_parts()
    inter = 0
    for o, t in zip(ours, theirs):
        check_against_pyg(o, t, 3)
        check_against_original(o, planted, planted_parts, 3, 1)
        part_of = torch.repeat_interleave(o.part, planted_parts.part_sizes[o.part])
        inter += int((part_of[o.edge_index[0]] != part_of[o.edge_index[1]]).sum())
    assert inter > 0  # the links between the clusters of a batch are there
    assert max(b.adj.bits for b in ours) >= 2  # repeated edges made more bit planes


def test_cora_matches_pyg_and_original(tmp_path):
    data = cora_data(tmp_path)
    cd = QuantClusterData(data, 16, log=False)
    ours, theirs = loader_pairs(cd, 4, shuffle=False, bits=4, self_loops=1)
    assert sum(b.num_nodes for b in ours) == data.num_nodes
    for o, t in zip(ours, theirs):
        check_against_pyg(o, t, 4)
        check_against_original(o, data, cd, 4, 1)
        for key in ("train_mask", "val_mask", "test_mask"):
            assert torch.equal(o[key], t[key])


def test_bit_spmm_on_batches(planted_parts):
    """Batches plug straight into the kernels: bit_spmm(batch.adj, batch.x) = (A + I)·to_val(x)."""
    for batch in QuantClusterLoader(planted_parts, batch_size=4, bits=4):
        out = pq.bit_spmm(batch.adj, batch.x)
        dense = batch.adj.to_dense().double()
        assert_fp32_close(out, dense @ deq64(batch.x), dense.abs() @ mag64(batch.x) * 1e-6 + 1e-30)


@pytest.mark.parametrize("min_tile_nnz", [1, 16])
def test_bit_spmm_on_batches_in_every_adjacency_form(planted_parts, min_tile_nnz):
    """The same batches decoded with tiles, without, and by the fill rule: the same wire bytes, the same integer
    sums A·Q and the same bit_spmm, bit for bit."""
    from pyg_quant.graph.spmm import bit_spmm_codes
    loaders = {form: list(QuantClusterLoader(planted_parts, batch_size=3, bits=4, min_tile_nnz=min_tile_nnz,
                                             adjacency=form)) for form in ("tiles", "csr", "auto")}
    assert QuantClusterLoader(planted_parts).collater.adjacency == pq.graph.adjacency_form.DEFAULT_ADJACENCY
    forms = set()
    for tiles, csr, auto in zip(loaders["tiles"], loaders["csr"], loaders["auto"]):
        assert torch.equal(tiles.buffer, csr.buffer) and torch.equal(tiles.buffer, auto.buffer)
        assert csr.adj.num_tiles == 0 and tiles.adj.num_tiles > 0
        forms.add(auto.adj.num_tiles > 0)
        expected = bit_spmm_codes(tiles.adj, tiles.x.planes, 4, tiles.x.cols)
        for batch in (csr, auto):
            assert torch.equal(bit_spmm_codes(batch.adj, batch.x.planes, 4, batch.x.cols), expected)
            assert torch.equal(pq.bit_spmm(batch.adj, batch.x), pq.bit_spmm(tiles.adj, tiles.x))
            assert torch.equal(batch.deg, tiles.deg)
    assert forms == {False}  # planted batches are far sparser than MIN_TILE_FILL


def test_cluster_data_getitem_is_the_induced_subgraph(planted, planted_parts):
    """PyG's own ClusterData.__getitem__ works on our partition and gives each part's subgraph."""
    for p in range(planted_parts.num_parts):
        sub = planted_parts[p]
        n_id = original_ids(planted_parts, [p])
        ref_edges, _ = subgraph(n_id, planted.edge_index, relabel_nodes=True, num_nodes=planted.num_nodes)
        assert sub.num_nodes == n_id.numel()
        assert torch.equal(sorted_edges(sub.edge_index, n_id.numel()), sorted_edges(ref_edges, n_id.numel()))
        assert torch.equal(sub.x, planted.x[n_id]) and torch.equal(sub.y, planted.y[n_id])


def test_partition_is_pymetis_on_the_undirected_simple_graph(planted):
    """Every node in exactly one part; METIS finds the 8 planted clusters of 150 nodes (80% of the
    edges inside): the cut is near the planted 20% where a random assignment cuts 7/8."""
    cd = QuantClusterData(planted, 8, log=False)
    assert torch.equal(torch.sort(cd.partition.node_perm).values, torch.arange(planted.num_nodes))
    assert int(cd.part_sizes.sum()) == planted.num_nodes
    src, dst = planted.edge_index
    cut = float((cd.cluster[src] != cd.cluster[dst]).float().mean())
    assert cut < 0.3, cut


def test_pymetis_gets_the_simple_undirected_graph_and_explicit_recursive(karate, monkeypatch):
    """pymetis' own default is recursive=True for <= 8 parts: ours passes the flag explicitly, and hands
    it a symmetric CSR without self-loops or repeats."""
    import pymetis

    seen = []
    original = pymetis.part_graph

    def spy(nparts, adjacency=None, xadj=None, adjncy=None, **kwargs):  # new and old pymetis APIs
        csr = (adjacency.adj_starts, adjacency.adjacent) if adjacency is not None else (xadj, adjncy)
        seen.append((nparts, csr, kwargs))
        return original(nparts, adjacency, xadj=xadj, adjncy=adjncy, **kwargs)

    monkeypatch.setattr(pymetis, "part_graph", spy)
    graph = karate.clone()  # add a self-loop, a repeated edge and a one-way edge
    graph.edge_index = torch.cat([karate.edge_index, torch.tensor([[5, 0, 3], [5, 1, 20]])], 1)
    for recursive in (False, True):
        QuantClusterData(graph, 4, recursive=recursive, log=False)
        nparts, (ptr, adj), kwargs = seen[-1]
        assert nparts == 4 and kwargs["recursive"] is recursive
        ptr, adj = torch.as_tensor(ptr), torch.as_tensor(adj)
        rows = torch.repeat_interleave(torch.arange(34), ptr[1:] - ptr[:-1])
        pairs = set(zip(rows.tolist(), adj.tolist()))
        expected = {(int(a), int(b)) for a, b in graph.edge_index.t() if a != b}
        expected |= {(b, a) for a, b in expected}
        assert pairs == expected and len(pairs) == adj.numel()


def test_undirected_csr_is_simple_and_symmetric():
    from pyg_quant.loader.metis import undirected_csr

    edge_index = torch.tensor([[0, 0, 1, 2, 2, 3, 3], [1, 1, 0, 2, 3, 0, 0]])  # repeats, a loop, one-way edges
    indptr, index = undirected_csr(edge_index, 5)
    rows = torch.repeat_interleave(torch.arange(5), indptr[1:] - indptr[:-1])
    assert sorted(zip(rows.tolist(), index.tolist())) == [(0, 1), (0, 3), (1, 0), (2, 3), (3, 0), (3, 2)]
    assert indptr.tolist() == [0, 2, 3, 4, 6, 6]


# --- features: quantized once per graph --------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_features_round_trip_within_half_a_step(planted, planted_parts, bits):
    loader = QuantClusterLoader(planted_parts, batch_size=planted_parts.num_parts, bits=bits)
    (batch,) = list(loader)
    x = planted.x[batch.n_id]
    err = (pq.to_val(batch.x) - x).abs()
    bound = batch.x.scale / 2 + 4e-7 * (batch.x.lo.abs() + batch.x.scale * (2**bits - 1))
    assert bool((err <= bound).all())
    # the ranges are the whole graph's: lo = min, lo + scale·(2^bits - 1) = max (to float32 rounding)
    assert torch.equal(batch.x.lo, planted.x.amin(0))
    assert torch.allclose(batch.x.lo + batch.x.scale * (2**bits - 1), planted.x.amax(0), rtol=1e-6, atol=1e-6)
    # and every batch of a smaller batch size shares them
    for small in QuantClusterLoader(planted_parts, batch_size=3, bits=bits):
        assert torch.equal(small.x.lo, batch.x.lo) and torch.equal(small.x.scale, batch.x.scale)


def test_features_quantized_once(planted, monkeypatch):
    cd = QuantClusterData(planted, 8, log=False)
    calls = []
    original = pq.loader.features.QuantizedFeatures.from_tensor.__func__

    def counting(cls, *args, **kwargs):
        calls.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(pq.loader.features.QuantizedFeatures, "from_tensor", classmethod(counting))
    train = QuantClusterLoader(cd, batch_size=2, shuffle=True, bits=4)
    evaluation = QuantClusterLoader(cd, batch_size=4, bits=4)
    for _ in range(2):  # two epochs
        first = [b.x.codes() for b in train]
    list(evaluation)
    assert len(calls) == 1 and len(first) == len(train)
    assert train.collater.features is evaluation.collater.features
    QuantClusterLoader(cd, batch_size=2, bits=2)
    assert len(calls) == 2  # another bit width is another quantization


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_features_per_node_are_the_rows_of_to_bit_per_row(planted, planted_parts, bits):
    """feature_dim=1: each batch's codes and ranges are exactly the batch's rows of to_bit(x, bits, dim=1), in the
    row layout, and they survive the wire; a linear layer's per-node quantizer would make these very codes."""
    whole = pq.to_bit(planted.x, bits, dim=1)
    batches = list(QuantClusterLoader(planted_parts, batch_size=3, bits=bits, feature_dim=1))
    assert sum(b.num_nodes for b in batches) == planted.num_nodes
    for batch in batches:
        x, n_id = batch.x, batch.n_id
        assert x.layout == "row" and x.dim == 1 and x.bits == bits and x.shape == (batch.num_nodes, whole.cols)
        # held as the bytes themselves (no planes packed on the way); the planes, made when asked, are to_bit's
        assert x.byte_codes is not None and not x.has_planes and x.nbytes == x.codes().numel() + 8 * x.rows
        assert torch.equal(x.planes, pq.to_bit(pq.to_val(x), bits, dim=1, layout="row").planes) and x.has_planes
        assert torch.equal(x.lo, whole.lo[n_id]) and torch.equal(x.scale, whole.scale[n_id])
        assert torch.equal(x.codes(), whole.codes()[n_id])
        assert torch.equal(pq.to_bit(pq.to_val(x), bits, dim=1).codes(), x.codes())


@requires_cuda
@pytest.mark.cuda
def test_features_per_node_on_the_gpu(planted, planted_parts):
    """feature_dim=1 batches moved to the GPU (the batch's buffer, or the BitTensor alone) give the CPU's codes,
    planes and values there."""
    for batch in QuantClusterLoader(planted_parts, batch_size=3, bits=4, feature_dim=1):
        cpu = batch.x
        moved = cpu.to("cuda")  # packed on the CPU first: the planes travel
        assert cpu.has_planes and moved.has_planes
        for x in (moved, batch.to("cuda").x):
            assert x.device.type == "cuda"
            assert torch.equal(x.planes.cpu(), cpu.planes) and torch.equal(x.codes().cpu(), cpu.codes())
            assert torch.equal(pq.to_val(x).cpu(), pq.to_val(cpu))


def test_bit_tensor_held_as_codes():
    """BitTensor.from_codes: its planes are the packed codes, made once; it moves as codes on the CPU; a bad tensor is
    a ValueError."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (37, 70), generator=g, dtype=torch.uint8)
    lo, scale = torch.randn(37, generator=g), torch.rand(37, generator=g) + 0.1
    for layout in ("row", "col"):
        x = pq.BitTensor.from_codes(codes, 4, lo, scale, 1, layout)
        assert x.byte_codes is codes and x.codes() is codes and not x.has_planes and x.device == codes.device
        moved = x.to("cpu")
        assert moved.byte_codes is not None and not moved.has_planes  # the same device: still bytes
        planes = x.planes
        assert planes is x.planes and torch.equal(planes, ops.pack_codes(codes, 4, layout == "col"))
        packed = pq.BitTensor(planes, (37, 70), 4, layout, lo, scale, 1)
        assert torch.equal(pq.to_val(x), pq.to_val(packed))
    with pytest.raises(ValueError, match="codes must be a contiguous uint8"):
        pq.BitTensor.from_codes(codes.to(torch.int32), 4, lo, scale, 1, "row")
    with pytest.raises(ValueError, match="codes must be a contiguous uint8"):
        pq.BitTensor.from_codes(codes.t(), 4, lo, scale, 1, "row")
    with pytest.raises(ValueError, match="lo and scale"):
        pq.BitTensor.from_codes(codes, 4, lo[:-1], scale, 1, "row")


def test_features_per_node_and_per_column_are_kept_apart(planted):
    cd = QuantClusterData(planted, 8, log=False)
    per_column = QuantClusterLoader(cd, batch_size=2, bits=4)
    per_node = QuantClusterLoader(cd, batch_size=2, bits=4, feature_dim=1)
    assert per_column.collater.features.dim == 0 and per_node.collater.features.dim == 1
    assert per_node.collater.features is QuantClusterLoader(cd, batch_size=4, bits=4, feature_dim=1).collater.features
    with pytest.raises(ValueError, match="dim must be 0"):
        cd.quantized_features(4, dim=2)


def test_quantized_features_bad_arguments():
    codes = torch.zeros(5, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dim must be 0"):
        pq.loader.QuantizedFeatures(codes, torch.zeros(3), torch.ones(3), 4, dim=-1)
    with pytest.raises(ValueError, match=r"lo and scale must have shape \(5,\) for dim=1"):
        pq.loader.QuantizedFeatures(codes, torch.zeros(3), torch.ones(3), 4, dim=1)
    with pytest.raises(ValueError, match="dim must be 0"):
        pq.loader.QuantizedFeatures.from_tensor(torch.randn(5, 3), 4, dim=True)
    features = pq.loader.QuantizedFeatures.from_tensor(torch.randn(5, 3), 4, dim=1)
    with pytest.raises(ValueError, match="lo and scale are the gathered rows"):
        features.pack(codes)


# --- the single pinned buffer and its transfer --------------------------------------------------
def all_tensors(batch):
    for name in batch.keys():
        value = batch[name]
        if isinstance(value, pq.BitAdjacency):
            yield from (getattr(value, a) for a in value._TENSORS if getattr(value, a) is not None)
        elif isinstance(value, pq.BitTensor):
            yield from (value.planes, value.lo, value.scale)
        elif isinstance(value, torch.Tensor):
            yield value


def test_every_wire_tensor_is_a_view_of_one_buffer(planted_parts):
    batch = next(iter(QuantClusterLoader(planted_parts, batch_size=3, bits=4, return_edge_index=True)))
    assert isinstance(batch, QuantBatch)
    base = batch.buffer.untyped_storage().data_ptr()
    wire = batch.wire_tensors()
    assert len(wire) >= 12
    assert all(t.untyped_storage().data_ptr() == base for t in wire.values())
    assert batch.nbytes == batch.buffer.numel() >= sum(t.numel() * t.element_size() for t in wire.values())


@pytest.mark.parametrize("start,length", [(0, 4096), (0, 4093), (8, 4093), (2, 4096)])
def test_field_views_are_the_wire_views(start, length):
    """A batch's fields are windows of one typed view of its buffer a dtype, the same views as the wire's (a buffer
    whose length or offset does not divide an element size takes the slice path)."""
    from pyg_quant.loader.batch import _view, _Views
    buffer = torch.arange(start + length, dtype=torch.int64).to(torch.uint8)[start:]
    views = _Views(buffer)
    specs = [(torch.float32, (5, 3), 64), (torch.int64, (7,), 128), (torch.uint8, (2, 2, 9), 256),
             (torch.bool, (0,), 512), (torch.int32, (), 1024), (torch.int16, (10,), 4072)]
    for spec in specs:
        if (start + spec[2]) % spec[0].itemsize:
            continue  # (no view of that dtype there, either way)
        got, want = views(*spec), _view(buffer, *spec)
        assert (got.dtype, got.shape, got.stride(), got.data_ptr()) == (want.dtype, want.shape, want.stride(),
                                                                          want.data_ptr()), spec
        assert torch.equal(got, want), spec
    with pytest.raises(RuntimeError):
        views(torch.int16, (20,), 4072)  # past the buffer's end: the slice path's error


def assert_same_adjacency(a, b):
    for name in pq.BitAdjacency._TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    for name in ("num_rows", "num_cols", "nnz", "max_row_sum"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("self_loops,adjacency", [(0, "tiles"), (1, "tiles"), (2, "tiles"), (1, "csr"),
                                                   (2, "auto")])
def test_wire_format_decodes_to_the_direct_build(planted_parts, self_loops, adjacency):
    """The adjacency travels as its tile plan (about a byte an edge), features without padding, integers
    narrowed; reading the fields gives exactly what a direct build gives, in the original dtypes, in the form the
    loader's adjacency option asks for (the same wire bytes for all three)."""
    loader = QuantClusterLoader(planted_parts, batch_size=4, bits=4, self_loops=self_loops, min_tile_nnz=64,
                                return_edge_index=True, adjacency=adjacency)
    tiles = residual = 0
    for batch in loader:
        wire = batch.wire_tensors()
        assert wire["adj.entry_col"].dtype == torch.uint8 and wire["y"].dtype == torch.int8
        assert wire["edge_index"].dtype == torch.int16 and wire["n_id"].dtype == torch.int16
        adj = decoded = batch.adj
        assert batch.adjacency == adjacency
        assert_same_adjacency(adj, pq.BitAdjacency.from_edge_index(batch.edge_index, batch.num_nodes,
                                                                     self_loops=self_loops, min_tile_nnz=64,
                                                                     adjacency=adjacency))
        if adjacency == "csr":
            adj = pq.BitAdjacency.from_edge_index(batch.edge_index, batch.num_nodes, self_loops=self_loops,
                                                  min_tile_nnz=64)  # the plan's split, for the byte counts below
        tiles, residual = tiles + adj.num_tiles, residual + adj.res_nnz
        adj_wire = sum(t.numel() * t.element_size() for k, t in wire.items() if k.startswith("adj."))
        per_entry = 2 if adj.bits > 1 else 1  # column byte (+ multiplicity byte)
        assert adj_wire <= per_entry * adj.tile_nnz + 20 * adj.num_tiles + 12 * adj.res_nnz + batch.num_nodes
        assert adj_wire < adj.nbytes
        assert batch.y.dtype == batch.n_id.dtype == batch.edge_index.dtype == torch.int64
        assert torch.equal(batch.n_id, planted_parts.partition.node_perm[batch.n_id.new_tensor(
            [i for p in batch.part.tolist() for i in range(int(planted_parts.partition.partptr[p]),
                                                             int(planted_parts.partition.partptr[p + 1]))])])
        x = batch.x
        assert wire["x.planes"].shape[1] == x.cols < x.planes.size(1)  # col layout, 20 features padded to 64
        assert torch.equal(x.planes[:, x.cols:], torch.zeros_like(x.planes[:, x.cols:]))
        assert torch.equal(x.planes[:, :x.cols], wire["x.planes"])
        assert batch.adj is decoded and batch["x"] is x  # decoded once
    assert residual > 0 and (tiles > 0 or adjacency == "auto")  # both halves of the format are exercised


def test_wire_integers_outside_narrow_ranges_are_kept():
    big = torch.tensor([0, 2**40])
    fields = {"big": big, "i32": torch.tensor([-70000, 5]), "f": torch.ones(3), "b": torch.tensor([True]),
              "empty": torch.empty(0, dtype=torch.int64), "i8": torch.tensor([-128, 127], dtype=torch.int16)}
    batch = QuantBatch.from_fields(fields)
    wire = batch.wire_tensors()
    assert wire["big"].dtype == torch.int64 and wire["i32"].dtype == torch.int32 and wire["i8"].dtype == torch.int8
    assert wire["empty"].dtype == torch.int64 and wire["f"].dtype == torch.float32
    for name, value in fields.items():
        assert batch[name].dtype == value.dtype and torch.equal(batch[name], value), name


def test_plain_bit_adjacency_travels_as_is(planted):
    adj = pq.BitAdjacency.from_edge_index(planted.edge_index, planted.num_nodes, self_loops=1)
    batch = QuantBatch.from_fields({"adj": adj})
    assert_same_adjacency(batch.adj, adj)
    assert batch.nbytes >= adj.nbytes


class CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_, torch.ops.aten._copy_from):
            self.copies.append(func)
        return func(*args, **(kwargs or {}))


def test_to_device_is_one_copy(planted_parts):
    batch = next(iter(QuantClusterLoader(planted_parts, batch_size=3, bits=4)))
    with CountCopies() as counter:
        moved = batch.to("meta")
    assert len(counter.copies) == 1, counter.copies
    assert moved.device.type == "meta" and moved.adj.device.type == "meta" and moved.x.device.type == "meta"
    for before, after in zip(all_tensors(batch), all_tensors(moved)):
        assert after.device.type == "meta" and after.shape == before.shape and after.dtype == before.dtype
    assert batch.to("cpu") is batch


def test_pickle_and_workers(planted_parts):
    """Batches built in DataLoader workers (shared memory) equal those built in the main process."""
    kwargs = dict(batch_size=3, bits=4, return_edge_index=True)
    main = list(QuantClusterLoader(planted_parts, **kwargs))
    workers = list(QuantClusterLoader(planted_parts, num_workers=2, **kwargs))
    assert len(main) == len(workers)
    for a, b in zip(main, workers):
        assert torch.equal(a.buffer, b.buffer) and a.keys() == b.keys()
        c = pickle.loads(pickle.dumps(a))
        assert torch.equal(c.buffer, a.buffer) and torch.equal(c.adj.to_dense(), a.adj.to_dense())


def test_fields_added_later_travel_too(planted_parts):
    batch = next(iter(QuantClusterLoader(planted_parts, batch_size=2, bits=4)))
    batch.extra = torch.ones(3)
    assert "extra" in batch.keys()
    assert batch.to("meta").extra.device.type == "meta"
    with pytest.raises(AttributeError, match="no field"):
        batch.missing


@requires_cuda
@pytest.mark.cuda
def test_cuda_transfer_from_pinned_buffer(planted_parts):
    loader = QuantClusterLoader(planted_parts, batch_size=3, bits=4, pin_memory=True)
    for batch in loader:
        assert batch.is_pinned()
        moved = batch.to("cuda", non_blocking=True)
        assert moved.adj.device.type == "cuda" and moved.x.device.type == "cuda"
        torch.testing.assert_close(pq.bit_spmm(moved.adj, moved.x).cpu(), pq.bit_spmm(batch.adj, batch.x),
                                   rtol=1e-6, atol=1e-6)
        assert torch.equal(moved.deg.cpu(), batch.deg)


@requires_cuda
@pytest.mark.cuda
def test_cuda_decode_is_sync_free_and_capturable(planted_parts):
    """The wire form is decoded on the GPU without a host round trip, equal to the CPU decode field for field,
    and the decode can be captured in a CUDA graph (replayed after refilling the buffer)."""
    batches = list(QuantClusterLoader(planted_parts, batch_size=3, bits=4, pin_memory=True))
    moved = batches[0].to("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adj, x, y = moved.adj, moved.x, moved.y
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same_adjacency(adj.to("cpu"), batches[0].adj)
    assert torch.equal(x.planes.cpu(), batches[0].x.planes) and torch.equal(y.cpu(), batches[0].y)

    # Two batches with equal wire shapes and different contents: columns mirrored inside the one
    # 256-column block (same tiles, same row counts), other features.
    g = gen(7)
    src, dst = torch.randint(256, (2, 3000), generator=g)
    hosts = [QuantBatch.from_fields({"adj": pq.BitAdjacency.compact_from_edge_index(
        torch.stack([s_, dst]), 256, self_loops=1, min_tile_nnz=1),
        "x": pq.to_bit(torch.randn(256, 5, generator=g), 4, dim=0, layout="col")}, pin_memory=True)
        for s_ in (src, 255 - src)]
    assert [t.shape for t in hosts[0].wire_tensors().values()] == [t.shape for t in hosts[1].wire_tensors().values()]
    first = hosts[0].to("cuda")
    buffer = first.buffer.clone()

    def decode_and_aggregate():
        batch = QuantBatch(buffer, first._specs, first._meta)
        return pq.bit_spmm(batch.adj, batch.x)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_and_aggregate()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_and_aggregate()
    for host in hosts[::-1] + hosts:
        buffer.copy_(host.buffer, non_blocking=True)
        graph.replay()
        torch.testing.assert_close(out.cpu(), pq.bit_spmm(host.adj, host.x), rtol=1e-6, atol=1e-6)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("adjacency", ["csr", "auto", "tiles"])
def test_cuda_decode_in_every_form_is_sync_free(planted, adjacency):
    """Each adjacency form decodes on the GPU without a host round trip, equal to the CPU decode field for field,
    and aggregates to the same integers as the tiles (batches built directly: no METIS needed)."""
    from pyg_quant.graph.spmm import bit_spmm_codes
    x = pq.to_bit(planted.x, 4, dim=0, layout="col")
    for min_tile_nnz in (1, 16):
        compact = pq.BitAdjacency.compact_from_edge_index(planted.edge_index, planted.num_nodes, self_loops=1,
                                                          min_tile_nnz=min_tile_nnz)
        host = QuantBatch.from_fields({"adj": compact, "x": x}, pin_memory=True, adjacency=adjacency)
        moved = host.to("cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            adj, x_gpu = moved.adj, moved.x
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert adj.device.type == "cuda" and (adj.num_tiles == 0) == (adjacency != "tiles")
        assert_same_adjacency(adj.to("cpu"), host.adj)
        expected = bit_spmm_codes(compact.expand(tiles=True), x.planes, 4, x.cols)
        assert torch.equal(bit_spmm_codes(adj, x_gpu.planes, 4, x_gpu.cols).cpu(), expected)
        assert torch.equal(bit_spmm_codes(host.adj, x.planes, 4, x.cols), expected)


# --- device=: batches handed over on the device, copied one batch ahead on a side stream ------------------
def assert_same_batch(a, b):
    """Bit for bit: the same wire buffer and layout, and every field decoded to the same tensors."""
    assert a.device == b.device and a.keys() == b.keys()
    assert torch.equal(a.buffer, b.buffer) and a._specs == b._specs and a._meta == b._meta
    for name in a.keys():
        x, y = a[name], b[name]
        if isinstance(x, pq.BitAdjacency):
            assert_same_adjacency(x, y)
        elif isinstance(x, pq.BitTensor):
            assert (x.shape, x.bits, x.layout, x.dim) == (y.shape, y.bits, y.layout, y.dim), name
            for t, u in ((x.planes, y.planes), (x.lo, y.lo), (x.scale, y.scale)):
                assert t.dtype == u.dtype and torch.equal(t, u), name
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), name
        else:
            assert x == y, name
    assert torch.equal(a.deg, b.deg)


def test_device_cpu_hands_over_the_same_batches_without_cuda_calls(planted_parts, monkeypatch):
    plain = list(QuantClusterLoader(planted_parts, batch_size=3, bits=4, return_edge_index=True))

    def forbidden(*args, **kwargs):
        raise AssertionError("the CPU path made a CUDA call")

    for name in ("Stream", "Event", "stream", "current_stream", "current_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    for device in ("cpu", torch.device("cpu")):
        loader = QuantClusterLoader(planted_parts, batch_size=3, bits=4, return_edge_index=True, device=device)
        assert loader.device == torch.device("cpu") and not loader.pin_memory
        batches = list(loader)
        assert len(batches) == len(plain) == len(loader)
        for batch, expected in zip(batches, plain):
            assert_same_batch(batch, expected)
            assert batch.to("cpu") is batch
        assert all(a is b for a, b in zip(prefetch(plain, device), plain))
    assert plain[0].record_stream(object()) is plain[0]  # nothing on a device to record


def test_device_meta_moves_each_batch_as_it_is_handed_over(planted_parts):
    plain = list(QuantClusterLoader(planted_parts, batch_size=3, bits=4))
    batches = list(QuantClusterLoader(planted_parts, batch_size=3, bits=4, device="meta"))
    assert len(batches) == len(plain)
    for batch, expected in zip(batches, plain):
        assert batch.device.type == "meta" and batch.to("meta") is batch
        assert batch._specs == expected._specs and batch.keys() == expected.keys()
        for before, after in zip(all_tensors(expected), all_tensors(batch)):
            assert after.device.type == "meta" and after.shape == before.shape and after.dtype == before.dtype


def test_one_ahead_issues_the_next_batch_before_handing_one_over():
    log = []

    def issue(item):
        log.append(("issue", item))
        return ("issued", item)

    def handover(issued):
        log.append(("handover", issued[1]))
        return 10 * issued[1]

    assert list(one_ahead(range(4), issue, handover)) == [0, 10, 20, 30]
    assert log == [("issue", 0), ("issue", 1), ("handover", 0), ("issue", 2), ("handover", 1), ("issue", 3),
                   ("handover", 2), ("handover", 3)]
    log.clear()
    assert list(one_ahead([], issue, handover)) == [] and log == []
    assert list(one_ahead([5], issue, handover)) == [50] and log == [("issue", 5), ("handover", 5)]
    log.clear()
    items = one_ahead(range(10), issue, handover)
    assert next(items) == 0
    items.close()  # a loop left early has issued one batch beyond the last it got, no more
    assert log == [("issue", 0), ("issue", 1), ("handover", 0)]


@pytest.mark.skipif(CUDA_OK, reason="checks the error where CUDA is missing")
def test_device_cuda_without_cuda_names_the_argument(planted_parts):
    with pytest.raises(ValueError, match="device='cuda'.*not available"):
        QuantClusterLoader(planted_parts, device="cuda")
    with pytest.raises(ValueError, match="device='cuda:0'.*not available"):
        QuantClusterLoader(planted_parts, device=0)
    with pytest.raises(TypeError, match="device must be"):
        prefetch([], None)
    with pytest.raises(TypeError, match="side_stream must be a bool"):
        prefetch([], "cpu", side_stream=1)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("adjacency,num_workers,pin_memory", [("csr", 0, None), ("tiles", 0, None),
                                                              ("auto", 2, None), ("auto", 0, False)])
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_prefetched_batches_equal_plain_copies(planted_parts, adjacency, num_workers, pin_memory, side_stream):
    """device="cuda" (and prefetch with side_stream=True) hands over exactly what the README's loop makes with
    batch.to("cuda"), with workers (pinned by the DataLoader's pin thread) and without pinned memory too;
    batch.to("cuda") then returns the batch."""
    kwargs = dict(batch_size=3, bits=4, adjacency=adjacency, return_edge_index=True)
    extra = {} if pin_memory is None else dict(pin_memory=pin_memory)
    if side_stream:
        host = QuantClusterLoader(planted_parts, num_workers=num_workers, **kwargs,
                                  **(extra or dict(pin_memory=True)))
        loader = prefetch(host, "cuda", side_stream=True)
        count = len(host)
    else:
        loader = QuantClusterLoader(planted_parts, device="cuda", num_workers=num_workers, **kwargs, **extra)
        assert loader.pin_memory == (pin_memory is None)
        count = len(loader)
    expected = [batch.to("cuda") for batch in QuantClusterLoader(planted_parts, **kwargs)]
    batches = list(loader)
    assert len(batches) == len(expected) == count
    here = torch.device("cuda", torch.cuda.current_device())
    for batch, plain in zip(batches, expected):
        assert batch.device == here and batch.to("cuda") is batch and batch.to(here) is batch
        assert_same_batch(batch, plain)


@requires_cuda
@pytest.mark.cuda
def test_cuda_prefetch_copies_on_a_side_stream_one_batch_ahead(planted_parts, monkeypatch):
    """Every copy is non-blocking from pinned memory on one stream that is not the caller's; batch i + 1's copy
    is queued before batch i is handed over; each handed-over buffer is recorded on the caller's stream."""
    copies, recorded = [], []
    to, record = QuantBatch.to, torch.Tensor.record_stream

    def spy_to(self, device=None, non_blocking=None):
        copies.append((torch.cuda.current_stream(), non_blocking, self.is_pinned()))
        return to(self, device, non_blocking)

    def spy_record(self, stream):
        recorded.append((self.data_ptr(), stream))
        return record(self, stream)

    monkeypatch.setattr(QuantBatch, "to", spy_to)
    monkeypatch.setattr(torch.Tensor, "record_stream", spy_record)
    count = len(QuantClusterLoader(planted_parts, batch_size=1, bits=4))
    user = torch.cuda.Stream()
    with torch.cuda.stream(user):
        host = QuantClusterLoader(planted_parts, batch_size=1, bits=4, pin_memory=True)
        for i, batch in enumerate(prefetch(host, "cuda", side_stream=True)):
            assert len(copies) == min(i + 2, count)
            assert (batch.buffer.data_ptr(), user) in recorded
            adj = batch.adj  # decoded on the caller's stream
            other = torch.cuda.Stream()
            batch.record_stream(other)  # the decoded fields are recorded too
            assert (adj.row_sums.data_ptr(), other) in recorded
    assert len(copies) == count > 2
    streams = {stream for stream, _, _ in copies}
    assert len(streams) == 1 and user not in streams and torch.cuda.default_stream() not in streams
    assert all(non_blocking is True and pinned for _, non_blocking, pinned in copies)


@requires_cuda
@pytest.mark.cuda
def test_cuda_prefetch_copies_one_batch_ahead_on_the_callers_stream(planted_parts, monkeypatch):
    """device="cuda": every copy is non-blocking from pinned memory on the caller's stream, batch i + 1's queued
    before batch i is handed over, and nothing is recorded on another stream."""
    copies, recorded = [], []
    to, record = QuantBatch.to, torch.Tensor.record_stream

    def spy_to(self, device=None, non_blocking=None):
        copies.append((torch.cuda.current_stream(), non_blocking, self.is_pinned()))
        return to(self, device, non_blocking)

    monkeypatch.setattr(QuantBatch, "to", spy_to)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append(stream))
    count = len(QuantClusterLoader(planted_parts, batch_size=1, bits=4))
    user = torch.cuda.Stream()
    with torch.cuda.stream(user):
        for i, batch in enumerate(QuantClusterLoader(planted_parts, batch_size=1, bits=4, device="cuda")):
            assert len(copies) == min(i + 2, count)
            batch.adj, batch.x
    assert len(copies) == count > 2 and not recorded
    assert all(stream == user and non_blocking is True and pinned for stream, non_blocking, pinned in copies)


def assert_same_buffers(seen, expected):
    """Every batch buffer read on the device (once its streams are done) equals the host's, for more than 3 batches."""
    torch.cuda.synchronize()
    assert len(seen) == len(expected) > 3
    for got, want in zip(seen, expected):
        assert torch.equal(got.cpu(), want)


@requires_cuda
@pytest.mark.cuda
def test_cuda_prefetch_hands_over_on_the_stream_current_then(planted_parts):
    """A caller that changes streams between batches: batch i + 1's copy is queued on the stream current at batch i,
    held back there by a ~10 ms sleep, and batch i + 1 is read at once on the other stream, which must wait for it."""
    kwargs = dict(batch_size=1, bits=4)
    expected = [batch.buffer for batch in QuantClusterLoader(planted_parts, **kwargs)]
    streams, seen = (torch.cuda.Stream(), torch.cuda.Stream()), []
    batches = iter(QuantClusterLoader(planted_parts, device="cuda", **kwargs))
    for i in range(len(expected)):
        with torch.cuda.stream(streams[i % 2]):
            if i % 2 == 0:
                torch.cuda._sleep(20_000_000)  # the next copy, queued now on this stream, lands ~10 ms from now
            seen.append(next(batches).buffer.clone())
    assert_same_buffers(seen, expected)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_prefetched_memory_is_not_reused_while_a_stream_reads_it(planted_parts, side_stream):
    """The copies run far ahead of a caller's stream held back by sleeps; a buffer the loop has let go before that
    stream read it must not be overwritten by a later copy.  Parts come largest first, so that a freed buffer fits
    every later batch and the allocator would hand it out again without record_stream."""
    sizes = {int(batch.part[0]): batch.nbytes for batch in QuantClusterLoader(planted_parts, batch_size=1, bits=4)}
    kwargs = dict(batch_size=1, bits=4, sampler=sorted(sizes, key=lambda part: -sizes[part]))
    expected = [batch.buffer for batch in QuantClusterLoader(planted_parts, **kwargs)]
    user, seen = torch.cuda.Stream(), []
    with torch.cuda.stream(user):
        batches = (prefetch(QuantClusterLoader(planted_parts, pin_memory=True, **kwargs), "cuda", side_stream=True)
                   if side_stream else QuantClusterLoader(planted_parts, device="cuda", **kwargs))
        for batch in batches:
            torch.cuda._sleep(20_000_000)  # ~10 ms on this stream: later copies are queued long before it reads
            seen.append(batch.buffer.clone())
            del batch
    assert_same_buffers(seen, expected)


@requires_cuda
@pytest.mark.cuda
def test_cuda_prefetch_copies_run_on_another_stream_than_the_kernels(planted_parts, tmp_path):
    """What the device ran (the profiler's trace) with side_stream=True: each batch's one host-to-device copy on a
    stream that runs none of the decode's kernels."""
    loader = QuantClusterLoader(planted_parts, batch_size=3, bits=4, pin_memory=True)
    list(prefetch(loader, "cuda", side_stream=True))  # CUDA context, pinned blocks and kernels warmed up
    nbytes = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for batch in prefetch(loader, "cuda", side_stream=True):
            nbytes.append(batch.nbytes)
            batch.adj, batch.x, batch.deg
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        pytest.skip("the profiler records no CUDA kernels here (CUPTI unavailable)")
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")
              and e["args"].get("bytes") in nbytes]
    assert sorted(e["args"]["bytes"] for e in copies) == sorted(nbytes)
    copy_streams = {e["args"]["stream"] for e in copies}
    assert not copy_streams & {e["args"]["stream"] for e in kernels}


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_prefetch_and_decode_do_not_sync_with_the_host(planted_parts, side_stream):
    host = QuantClusterLoader(planted_parts, batch_size=3, bits=4, pin_memory=True)
    batches = lambda: prefetch(host, "cuda", side_stream=side_stream)  # noqa: E731
    list(batches())  # CUDA context, pinned blocks and kernels warmed up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches():
            batch.adj, batch.x, batch.y, batch.n_id, batch.deg
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- the cache --------------------------------------------------------------------------------------
def forbid_metis(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("METIS ran although the cache should have answered")

    monkeypatch.setattr(cluster_data_module, "partition_nodes", fail)


def test_cache_hit_for_the_same_graph(tmp_path, planted, monkeypatch):
    first = QuantClusterData(planted, 8, save_dir=tmp_path, log=False)
    assert not first.from_cache and osp.exists(first.cache_path)
    forbid_metis(monkeypatch)
    int32_graph = planted.clone()
    int32_graph.edge_index = planted.edge_index.int()
    again = QuantClusterData(int32_graph, 8, save_dir=str(tmp_path), log=False)
    assert again.from_cache and again.cache_path == first.cache_path
    for field in ("indptr", "index", "partptr", "node_perm", "edge_perm"):
        assert torch.equal(getattr(again.partition, field), getattr(first.partition, field))


def test_cache_key_separates_graphs_and_settings(tmp_path, planted):
    base = QuantClusterData(planted, 8, save_dir=tmp_path, log=False)
    other = planted.clone()  # same node and edge counts, one edge moved
    other.edge_index = planted.edge_index.clone()
    other.edge_index[1, 0] = (other.edge_index[1, 0] + 1) % planted.num_nodes
    changed = QuantClusterData(other, 8, save_dir=tmp_path, log=False)
    assert not changed.from_cache and changed.cache_path != base.cache_path
    # the recomputed partition is the other graph's: its parts are its induced subgraphs
    parts = changed.nonempty_parts()[:2]
    batch = next(iter(QuantClusterLoader(changed, batch_size=2, sampler=parts, bits=4, return_edge_index=True)))
    check_against_original(batch, other, changed, 4, 1)
    paths = {base.cache_path, changed.cache_path}
    for kwargs in (dict(num_parts=9), dict(num_parts=8, recursive=True)):
        cd = QuantClusterData(planted, save_dir=tmp_path, log=False, **kwargs)
        assert not cd.from_cache and cd.cache_path not in paths
        paths.add(cd.cache_path)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".pt")]) == 4
    assert QuantClusterData(planted, 8, recursive=True, save_dir=tmp_path, log=False).from_cache


def test_same_filename_other_graph_recomputes_with_warning(tmp_path, planted, karate):
    QuantClusterData(planted, 4, save_dir=tmp_path, filename="metis.pt", log=False)
    with pytest.warns(RuntimeWarning, match="another graph.*edge_sha256.*num_edges.*num_nodes"):
        cd = QuantClusterData(karate, 4, save_dir=tmp_path, filename="metis.pt", log=False)
    assert not cd.from_cache and int(cd.part_sizes.sum()) == karate.num_nodes
    # PyG's ClusterLoader on it works too (PyG's own cache would give an IndexError here)
    assert sum(b.num_nodes for b in ClusterLoader(cd, batch_size=2)) == karate.num_nodes
    assert QuantClusterData(karate, 4, save_dir=tmp_path, filename="metis.pt", log=False).from_cache


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong_content", "bad_ids"])
def test_corrupt_cache_recomputes_with_warning(tmp_path, karate, damage):
    cd = QuantClusterData(karate, 4, save_dir=tmp_path, log=False)
    path = cd.cache_path
    if damage == "garbage":
        with open(path, "wb") as f:
            f.write(b"not a torch file at all")
    elif damage == "truncated":
        with open(path, "rb") as f:
            payload = f.read()
        with open(path, "wb") as f:
            f.write(payload[: len(payload) // 2])
    elif damage == "wrong_content":
        torch.save({"something": torch.zeros(3)}, path)
    else:
        stored = torch.load(path, weights_only=True)
        stored["cluster"] = stored["cluster"] + 10
        torch.save(stored, path)
    with pytest.warns(RuntimeWarning, match="recomputing"):
        again = QuantClusterData(karate, 4, save_dir=tmp_path, log=False)
    assert not again.from_cache and torch.equal(again.cluster, cd.cluster)
    assert QuantClusterData(karate, 4, save_dir=tmp_path, log=False).from_cache  # rewritten, valid


# --- empty parts ---------------------------------------------------------------------------------------
def test_metis_empty_parts_are_skipped():
    # two triangles in 5 parts: METIS leaves parts empty
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 0, 4, 5, 3]])
    data = Data(x=torch.randn(6, 3), edge_index=edge_index, y=torch.arange(6))
    cd = QuantClusterData(data, 5, log=False)
    assert cd.num_empty_parts > 0 and len(cd) == 5
    loader = QuantClusterLoader(cd, batch_size=1, bits=4, self_loops=0, return_edge_index=True)
    assert len(loader) == 5 - cd.num_empty_parts
    batches = list(loader)
    assert all(b.num_nodes > 0 for b in batches)
    assert sorted(torch.cat([b.n_id for b in batches]).tolist()) == list(range(6))
    for b in batches:
        check_against_original(b, data, cd, 4, 0)
    empty = int(torch.nonzero(cd.part_sizes == 0)[0])
    assert cd[empty].num_nodes == 0  # PyG's indexing of an empty part still works


def test_injected_empty_parts_and_isolated_nodes(planted, monkeypatch):
    """Parts 0, 3 and the last one empty, wherever METIS would put nodes."""
    def fake(indptr, index, num_parts, recursive, backend):
        n = indptr.numel() - 1
        return torch.tensor([1, 2, 4, 5])[torch.arange(n) % 4]

    monkeypatch.setattr(cluster_data_module, "partition_nodes", fake)
    cd = QuantClusterData(planted, 7, log=False)
    assert cd.part_sizes.tolist()[0] == 0 and cd.part_sizes.tolist()[3] == 0 and cd.part_sizes.tolist()[6] == 0
    assert cd.nonempty_parts() == [1, 2, 4, 5]
    ours, theirs = loader_pairs(cd, 3, bits=4, self_loops=1)
    assert [b.part.tolist() for b in ours] == [[1, 2, 4], [5]]
    for o, t in zip(ours, theirs):
        check_against_pyg(o, t, 4)
        check_against_original(o, planted, cd, 4, 1)


def test_edgeless_graph_and_single_part():
    data = Data(x=torch.randn(10, 4), edge_index=torch.zeros(2, 0, dtype=torch.long), y=torch.arange(10))
    cd = QuantClusterData(data, 3, log=False)
    batches = list(QuantClusterLoader(cd, batch_size=2, bits=4))
    assert sum(b.num_nodes for b in batches) == 10
    assert all(b.adj.nnz == 0 and torch.equal(b.deg, torch.ones(b.num_nodes)) for b in batches)
    one = QuantClusterData(data, 1, log=False)
    (batch,) = list(QuantClusterLoader(one, batch_size=1, bits=4))
    assert torch.equal(batch.n_id, torch.arange(10))


# --- other ClusterData, logging, backends ----------------------------------------------------------------
def test_loader_accepts_a_pyg_cluster_data(planted_parts):
    """A PyG ClusterData (here assembled from our partition, since PyG cannot partition here)."""
    pyg = ClusterData.__new__(ClusterData)
    pyg.num_parts, pyg.recursive = planted_parts.num_parts, False
    pyg.keep_inter_cluster_edges, pyg.sparse_format = False, "csr"
    pyg.partition = planted_parts.partition
    pyg.data = planted_parts.data.clone()
    del pyg.data.num_nodes  # as PyG leaves it
    ours = list(QuantClusterLoader(planted_parts, batch_size=4, bits=4, return_edge_index=True))
    theirs = list(QuantClusterLoader(pyg, batch_size=4, bits=4, return_edge_index=True))
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys() and torch.equal(a.buffer, b.buffer)


def test_log_shows_progress(karate, capsys):
    QuantClusterData(karate, 2, log=True)
    assert "QuantClusterData" in capsys.readouterr().err
    QuantClusterData(karate, 2, log=False)
    assert capsys.readouterr().err == ""


def test_missing_backends_raise_import_error(karate):
    import importlib.util

    if importlib.util.find_spec("pyg_lib") is None:
        with pytest.raises(ImportError, match="pyg_lib"):
            QuantClusterData(karate, 2, backend="pyg_lib", log=False)
    if importlib.util.find_spec("torch_sparse") is None:
        with pytest.raises(ImportError, match="torch_sparse"):
            QuantClusterData(karate, 2, backend="torch_sparse", log=False)


# --- bad inputs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_parts=34), ValueError, "num_parts"),
    (dict(num_parts=100), ValueError, "num_parts"),
    (dict(num_parts=0), ValueError, "num_parts"),
    (dict(num_parts=2.0), TypeError, "num_parts"),
    (dict(num_parts=True), TypeError, "num_parts"),
    (dict(num_parts=2, recursive="yes"), TypeError, "recursive"),
    (dict(num_parts=2, log=1), TypeError, "log"),
    (dict(num_parts=2, backend="kahip"), ValueError, "backend"),
    (dict(num_parts=2, sparse_format="coo"), ValueError, "sparse_format"),
    (dict(num_parts=2, filename="x.pt"), ValueError, "filename"),
    (dict(num_parts=2, save_dir=3), TypeError, "save_dir"),
    (dict(num_parts=2, keep_inter_cluster_edges=None), TypeError, "keep_inter_cluster_edges"),
])
def test_cluster_data_bad_arguments(karate, kwargs, error, match):
    with pytest.raises(error, match=match):
        QuantClusterData(karate, **{"log": False, **kwargs})


def test_cluster_data_bad_graphs(karate):
    from torch_geometric.data import HeteroData

    with pytest.raises(TypeError, match="data"):
        QuantClusterData(HeteroData(), 2, log=False)
    with pytest.raises(TypeError, match="data"):
        QuantClusterData({"edge_index": karate.edge_index}, 2, log=False)
    with pytest.raises(ValueError, match="edge_index"):
        QuantClusterData(Data(x=karate.x), 2, log=False)
    with pytest.raises(TypeError, match="edge_index"):
        QuantClusterData(Data(x=karate.x, edge_index=karate.edge_index.float()), 2, log=False)
    with pytest.raises(ValueError, match="edge_index"):
        QuantClusterData(Data(x=karate.x, edge_index=karate.edge_index[:1]), 2, log=False)
    with pytest.raises(ValueError, match="edge_index.*outside"):
        QuantClusterData(Data(x=karate.x, edge_index=karate.edge_index + 30), 2, log=False)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(bits=0), ValueError, "bits"),
    (dict(bits=9), ValueError, "bits"),
    (dict(bits="4"), TypeError, "bits"),
    (dict(self_loops=3), ValueError, "self_loops"),
    (dict(feature_dim=2), ValueError, "feature_dim"),
    (dict(feature_dim=True), ValueError, "feature_dim"),
    (dict(batch_size=0), ValueError, "batch_size"),
    (dict(min_tile_nnz=0), ValueError, "min_tile_nnz"),
    (dict(adjacency="dense"), ValueError, "adjacency"),
    (dict(adjacency=3), ValueError, "adjacency"),
    (dict(return_edge_index=1), TypeError, "return_edge_index"),
    (dict(collate_fn=list), TypeError, "collate_fn"),
    (dict(device=3.5), TypeError, "device must be a str"),
    (dict(device=True), TypeError, "device must be a str"),
    (dict(device="gpu"), ValueError, "device must name a device"),
    (dict(device=-1), ValueError, "device must be a non-negative"),
    (dict(device="cuda:99"), ValueError, "device='cuda:99'"),
])
def test_loader_bad_arguments(planted_parts, kwargs, error, match):
    with pytest.raises(error, match=match):
        QuantClusterLoader(planted_parts, **kwargs)


def test_quant_batch_bad_adjacency_form():
    with pytest.raises(ValueError, match="adjacency"):
        QuantBatch.from_fields({"y": torch.ones(3)}, adjacency="sparse")


def test_loader_bad_cluster_data_and_features(karate):
    with pytest.raises(TypeError, match="cluster_data"):
        QuantClusterLoader(karate, batch_size=2)
    cd = QuantClusterData(Data(x=torch.arange(34).view(34, 1), edge_index=karate.edge_index), 2, log=False)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        QuantClusterLoader(cd, bits=4)
    (batch,) = list(QuantClusterLoader(cd, batch_size=2, bits=None))  # bits=None ships x as is
    assert torch.equal(batch.x, torch.arange(34)[batch.n_id].view(34, 1))


def test_custom_sampler_yields_part_ids(planted_parts):
    """As in PyG, a sampler yields part ids; bad ids and repeated parts raise."""
    parts = planted_parts.nonempty_parts()
    loader = QuantClusterLoader(planted_parts, batch_size=2, sampler=[parts[3], parts[1]], bits=4)
    (batch,) = list(loader)
    assert batch.part.tolist() == [parts[3], parts[1]]
    for bad, match in (([0, 0], "twice"), ([planted_parts.num_parts], "part ids")):
        with pytest.raises(ValueError, match=match):
            list(QuantClusterLoader(planted_parts, batch_size=2, sampler=bad, bits=4))


def test_edge_attributes_need_edge_index(karate):
    data = karate.clone()
    data.edge_weight = torch.rand(data.num_edges, generator=gen(1))
    cd = QuantClusterData(data, 3, log=False)
    with pytest.warns(UserWarning, match="edge_weight"):
        batch = next(iter(QuantClusterLoader(cd, batch_size=3, bits=4)))
    assert "edge_weight" not in batch
    ours, theirs = loader_pairs(cd, 2, bits=4)
    for o, t in zip(ours, theirs):
        assert torch.equal(o.edge_weight, t.edge_weight)


@requires_cuda
@pytest.mark.cuda
def test_gcn_on_an_adjacency_decoded_in_a_cuda_graph_normalizes_once(monkeypatch):
    """An adjacency decoded inside a captured forward keeps its D^-1/2 for the other layers of that forward (its
    tensors are the capture's already): one degree computation in the graph, outputs equal to eager replays."""
    import pyg_quant.nn.qgcn_conv as qgcn_module

    g = gen(11)
    src, dst = torch.randint(300, (2, 4000), generator=g)
    hosts = [QuantBatch.from_fields({"adj": pq.BitAdjacency.compact_from_edge_index(
        torch.stack([s_, dst]), 300, self_loops=1),
        "x": pq.to_bit(torch.randn(300, 8, generator=g), 4, dim=0, layout="col")}, pin_memory=True)
        for s_ in (src, 299 - src)]
    first = hosts[0].to("cuda")
    buffer = first.buffer.clone()
    torch.manual_seed(0)
    # Every layer on the bit kernels: a bits=None layer decodes the adjacency into edges, which syncs.
    convs = torch.nn.ModuleList([pq.QGCNConv(8, 8, bits=4), pq.QGCNConv(8, 8, bits=4),
                                 pq.QGCNConv(8, 3, bits=4)]).cuda().eval()

    def forward(batch):
        h = batch.x
        for conv in convs:
            h = conv(h, batch.adj)
        return h

    calls = []
    inv_sqrt = qgcn_module.row_sums_inv_sqrt
    monkeypatch.setattr(qgcn_module, "row_sums_inv_sqrt", lambda adj: calls.append(None) or inv_sqrt(adj))
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(QuantBatch(buffer, first._specs, first._meta))
        torch.cuda.current_stream().wait_stream(side)
        calls.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward(QuantBatch(buffer, first._specs, first._meta))
        assert len(calls) == 1
        for host in hosts[::-1] + hosts:
            buffer.copy_(host.buffer, non_blocking=True)
            graph.replay()
            assert torch.equal(out, forward(host.to("cuda")))


def test_a_decoded_edge_index_skips_the_range_check(monkeypatch):
    """A QuantBatch reads each ``[2, E]`` integer field's bounds where it is packed: a layer building its graph from
    the decoded ``edge_index`` skips the range check's read of the device (a host synchronization on a GPU), still
    raises on indices out of range, and checks again once the tensor is edited."""
    import pyg_quant.graph.input_formats as formats
    torch.manual_seed(0)
    n = 60
    edge_index = torch.randint(n, (2, 400))
    x = torch.randn(n, 8)
    computed = []
    real = formats.index_bounds
    monkeypatch.setattr(formats, "index_bounds", lambda t, compute: real(t, lambda: computed.append(1) or compute()))
    conv = pq.QGCNConv(8, 4, bits=4)  # training: the graph is built at every new tensor
    batch = QuantBatch.from_fields({"x": x, "edge_index": edge_index})
    decoded = batch.edge_index
    assert decoded.dtype == torch.int64 and torch.equal(decoded, edge_index)
    conv(batch.x, decoded)
    assert computed == []
    with torch.inference_mode():  # a graph built outside the cache (inference mode keeps none) too
        conv.eval()(batch.x, decoded)
    conv.train()
    assert computed == []
    bad = edge_index.clone()
    bad[1, 5] = n + 3
    with pytest.raises(ValueError, match="out of range"):
        conv(x, QuantBatch.from_fields({"edge_index": bad}).edge_index)
    assert computed == []
    decoded[0, 7] = n + 1  # an edit: the remembered bounds no longer hold
    with pytest.raises(ValueError, match="out of range"):
        conv(batch.x, decoded)
    assert computed == [1]


def test_bit_features_with_a_small_padding_decode_in_place():
    """Planes whose outer padding is at most 1/16 of them travel padded and decode as views of the batch's buffer
    (no copy); a larger padding is left out of the wire and re-added, with zeros, on decode."""
    torch.manual_seed(0)
    for cols, in_place in ((1433, True), (1000, True), (97, False), (20, False)):
        x = pq.to_bit(torch.randn(37, cols), 4, dim=0, layout="col")
        batch = QuantBatch.from_fields({"x": x})
        wire, decoded = batch.wire_tensors()["x.planes"], batch.x
        assert torch.equal(decoded.planes, x.planes) and torch.equal(decoded.lo, x.lo)
        assert (wire.size(1) == x.planes.size(1)) == in_place
        shares = decoded.planes.untyped_storage().data_ptr() == batch.buffer.untyped_storage().data_ptr()
        assert shares == in_place, cols


def test_wire_decode_benchmark_runs_and_agrees(tmp_path):
    """benchmarks/wire_decode.py on a tiny graph: its two decodes give the same BitAdjacency (the script checks) and
    it reports both, the one-op decode as a single top-level op."""
    import subprocess
    import sys
    root = osp.dirname(osp.dirname(osp.abspath(__file__)))
    done = subprocess.run([sys.executable, osp.join(root, "benchmarks", "wire_decode.py"), "--small", "--device", "cpu",
                           "--num-parts", "4", "--parts-per-batch", "2", "--part-size", "60", "--avg-degree", "10",
                           "--rounds", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("GIN", "GCN"))]
    assert len(lines) == 4 and all("one op" in line or "composed" in line for line in lines)
    if ops.use_compiled("expand_wire", torch.device("cpu")):
        assert all(line.endswith("top-level ops 1") for line in lines if "one op" in line)
