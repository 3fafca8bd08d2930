"""Graph reuse: the one-sync range check of edge_index, the graph cache shared by the layers, the QAT CSR product."""
import collections
import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.nn import Linear, ReLU, Sequential
from torch.utils._python_dispatch import TorchDispatchMode
from torch_geometric.nn import GCNConv, GINConv

import pyg_quant as pq
from pyg_quant import ops
from pyg_quant.graph import cache as graph_cache
from pyg_quant.graph import float_csr, quant_graph
from pyg_quant.graph.cache import cached_graph, cached_graph_count, graph_cache_disabled
from pyg_quant.graph.input_formats import to_edge_set
from pyg_quant.graph.quant_graph import QuantGraph
from pyg_quant.qat import conv as qat_conv

from conftest import gen


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


# --- the range check -----------------------------------------------------------------------
def test_range_check_reads_the_extrema_in_one_reduction():
    edge_index = torch.randint(10, (2, 40), generator=torch.Generator().manual_seed(0))
    with OpCounter() as ops:
        to_edge_set(edge_index, None, 10, 10, "source_to_target")
    # one reduction for the four extrema and one host read of them (.tolist() dispatches
    # nothing on the CPU; on a GPU it is one copy): no per-extremum .item()
    assert ops.counts["aminmax"] == 1
    assert ops.counts["_local_scalar_dense"] == 0
    assert ops.counts["min"] + ops.counts["max"] == 0


@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
def test_range_check_names_the_side_out_of_range(flow):
    # a bipartite graph: 6 sources, 4 targets, in the direction `flow` reads them
    src, dst = torch.tensor([0, 5, 2]), torch.tensor([3, 0, 1])
    edge_index = torch.stack((src, dst) if flow == "source_to_target" else (dst, src))
    edges = to_edge_set(edge_index, None, 6, 4, flow)
    assert edges.src.tolist() == src.tolist() and edges.dst.tolist() == dst.tolist()
    with pytest.raises(ValueError, match="out of range for a graph of 5 sources and 4 targets"):
        to_edge_set(edge_index, None, 5, 4, flow)  # source 5 has no row
    with pytest.raises(ValueError, match="out of range for a graph of 6 sources and 3 targets"):
        to_edge_set(edge_index, None, 6, 3, flow)  # target 3 has no row
    for row in (0, 1):
        negative = edge_index.clone()
        negative[row, 1] = -1
        with pytest.raises(ValueError, match="negative"):
            to_edge_set(negative, None, 6, 4, flow)


# --- the graph cache -----------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self, convs):
        super().__init__()
        self.convs = torch.nn.ModuleList(convs)

    def forward(self, x, edge_index, edge_weight=None):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index) if edge_weight is None else conv(x, edge_index, edge_weight)
            x = F.relu(x) if i < len(self.convs) - 1 else x
        return x


def make_model(kind: str, channels=(12, 16, 16, 5), seed=0):
    torch.manual_seed(seed)
    pairs = list(zip(channels[:-1], channels[1:]))
    if kind == "GCN":
        convs = [GCNConv(a, b) for a, b in pairs]
    else:
        convs = [GINConv(Sequential(Linear(a, 16), ReLU(), Linear(16, b)), train_eps=True) for a, b in pairs]
    return Net(convs)


def random_graph(num_nodes=40, num_edges=160, seed=0):
    g = gen(seed)
    return torch.randn(num_nodes, 12, generator=g), torch.randint(num_nodes, (2, num_edges), generator=g)


@pytest.fixture
def graph_builds(monkeypatch):
    """Counts the QuantGraphs built (cache misses of the layers, and every uncached build)."""
    builds = [0]
    init = quant_graph.QuantGraph.__init__

    def counting_init(self, *args, **kwargs):
        builds[0] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(quant_graph.QuantGraph, "__init__", counting_init)
    graph_cache.clear_graph_cache()
    yield builds
    graph_cache.clear_graph_cache()


@pytest.mark.parametrize("kind", ["GCN", "GIN"])
def test_layers_share_one_graph_until_the_edges_change(kind, graph_builds):
    model = pq.qat.prepare(make_model(kind), bits=4).eval()  # nearest rounding: calls repeat bit for bit
    x, edge_index = random_graph()
    first = model(x, edge_index)
    assert graph_builds[0] == 1  # three layers, one graph (the fp32 last layer too: no adj_bits without weights)
    assert torch.equal(model(x, edge_index), first) and graph_builds[0] == 1  # the next step reuses it

    edge_index[0, 0] = (edge_index[0, 0] + 1) % x.size(0)  # an in-place edit bumps the version
    edited = model(x, edge_index)
    assert graph_builds[0] == 2
    with graph_cache_disabled():
        assert torch.equal(model(x, edge_index), edited)  # the rebuilt graph holds the edit
    assert not torch.equal(edited, first)
    builds = graph_builds[0]

    grown = torch.cat([x, torch.randn(1, 12)])  # the same edges in a graph with an isolated node
    model(grown, edge_index)
    assert graph_builds[0] == builds + 1
    model(x, edge_index.clone())  # equal values in another tensor: built again (keyed on the object)
    assert graph_builds[0] == builds + 2


def test_cache_keys_on_the_layer_options(graph_builds):
    x, edge_index = random_graph()
    convs = [pq.QGCNConv(12, 8, bits=4), pq.QGCNConv(12, 8, bits=4, improved=True),
             pq.QGCNConv(12, 8, bits=4, normalize=False), pq.QGCNConv(12, 8, bits=4, flow="target_to_source"),
             pq.QGINConv(Linear(12, 8), bits=4), pq.QGINConv(Linear(12, 8), bits=4, flow="target_to_source")]
    for conv in convs:
        conv.eval()
        expected = conv(x, edge_index)
        with graph_cache_disabled():
            assert torch.equal(conv(x, edge_index), expected)
    assert graph_builds[0] == 2 * len(convs)  # each options set built once (and once more with the cache off)
    assert cached_graph_count() == len(convs)


def test_a_dead_edge_index_is_not_kept(graph_builds):
    conv = pq.QGINConv(Linear(12, 8), bits=4)
    x, edge_index = random_graph()
    conv(x, edge_index)
    assert cached_graph_count() == 1
    ref = weakref.ref(edge_index)
    del edge_index
    gc.collect()
    assert ref() is None  # the cache held no strong reference
    assert cached_graph_count() == 0  # and its entry went with the tensor


def test_the_cache_is_bounded(graph_builds):
    conv = pq.QGINConv(Linear(12, 8), bits=4)
    x, _ = random_graph()
    alive = [random_graph(seed=seed)[1] for seed in range(graph_cache.MAX_ENTRIES + 3)]
    for edge_index in alive:
        conv(x, edge_index)
    assert cached_graph_count() == graph_cache.MAX_ENTRIES
    builds = graph_builds[0]
    conv(x, alive[-1])  # the most recent ones stay
    conv(x, alive[0])  # the oldest went first
    assert graph_builds[0] == builds + 1


def test_an_evicted_graph_is_rebuilt_without_checking_its_indices_again(graph_builds, monkeypatch):
    """The range check (a host sync on a GPU) runs once per unchanged tensor, also after its graph was evicted."""
    monkeypatch.setattr(graph_cache, "MAX_ENTRIES", 1)
    conv = pq.QGINConv(Linear(12, 8), bits=4)
    x, first = random_graph(seed=1)
    second = random_graph(seed=2)[1].to(torch.int32)  # an int32 index is remembered too (checked before .long())
    for edge_index in (first, second):
        conv(x, edge_index)
    with OpCounter() as ops:
        for edge_index in (first, second, first):  # each call evicts the other's graph: three rebuilds
            conv(x, edge_index)
    assert graph_builds[0] == 5
    assert ops.counts["aminmax"] == 0  # but no new range check
    first[1, 3] = x.size(0)  # an in-place edit is seen: checked again, and out of range now
    with pytest.raises(ValueError, match="out of range"):
        conv(x, first)
    with pytest.raises(ValueError, match="out of range"):  # remembered bounds still meet the node count of each call
        conv(x[:5], second)
    ref = weakref.ref(second)
    del second
    gc.collect()
    assert ref() is None and all(entry[0]() is not None for entry in graph_cache._bounds.values())


def _tensors_in(value, depth=0):
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, dict):
        for child in value.values():
            yield from _tensors_in(child, depth + 1)
    elif depth < 4 and isinstance(value, (tuple, list)):
        for child in value:
            yield from _tensors_in(child, depth + 1)
    elif depth < 4 and hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
        yield from _tensors_in(vars(value), depth + 1)


def test_the_cache_holds_no_autograd_history(graph_builds):
    x, edge_index = random_graph()
    weight = torch.rand(edge_index.size(1), generator=gen(1)).requires_grad_()
    model = pq.qat.prepare(make_model("GCN"), bits=4)
    F.cross_entropy(model(x, edge_index, weight), torch.zeros(40, dtype=torch.long)).backward()
    assert weight.grad is not None and cached_graph_count() == 0  # weighted graphs are built per call
    F.cross_entropy(model(x, edge_index), torch.zeros(40, dtype=torch.long)).backward()
    assert cached_graph_count() == 1
    tensors = [t for entry in graph_cache._entries.values() for t in _tensors_in(entry[2])]
    assert len(tensors) > 5  # the walk reaches the graph's tensors (edges, degrees, the CSR matrices)
    assert all(not t.requires_grad and t.grad_fn is None for t in tensors)

    # a graph that holds a tensor asking for a gradient is handed out but never stored
    class Holder:
        pass

    holder = Holder()
    holder.coefficients = torch.ones(3, requires_grad=True) * 2
    assert cached_graph(edge_index, ("test",), lambda adj: holder) is holder
    assert cached_graph_count() == 1


def test_nothing_is_cached_in_inference_mode_or_while_compiling(graph_builds, monkeypatch):
    conv = pq.QGINConv(Linear(12, 8), bits=4).eval()
    x, edge_index = random_graph()
    with torch.inference_mode():
        expected = conv(x, edge_index)
        inference_edge_index = edge_index.clone()  # an inference tensor: no version counter
    assert cached_graph_count() == 0
    with torch.no_grad():
        assert torch.equal(conv(x, inference_edge_index), expected)
    assert cached_graph_count() == 0
    monkeypatch.setattr(graph_cache, "is_compiling", lambda: True)
    _ = conv(x, edge_index)
    assert cached_graph_count() == 0
    monkeypatch.undo()
    _ = conv(x, edge_index)
    assert cached_graph_count() == 1


@pytest.mark.filterwarnings("ignore:quantizers .* have observed no data")
@pytest.mark.parametrize("kind", ["GCN", "GIN"])
def test_eval_bit_kernels_reuse_the_packed_tiles(kind, graph_builds, monkeypatch):
    packs = [0]
    pack = quant_graph.pack_entries

    def counting_pack(*args, **kwargs):
        packs[0] += 1
        return pack(*args, **kwargs)

    monkeypatch.setattr(quant_graph, "pack_entries", counting_pack)
    model = pq.qat.convert(pq.qat.prepare(make_model(kind), bits=4).eval())
    x, edge_index = random_graph()
    with torch.no_grad():
        out = model(x, edge_index)
        assert torch.equal(model(x, edge_index), out)
        assert packs[0] == 1  # one adjacency packed for every layer and call
        with graph_cache_disabled():
            assert torch.equal(model(x, edge_index), out)  # fresh graphs, same bits


# --- the QAT aggregation's CSR product -------------------------------------------------------
def dense_adjacency(graph) -> torch.Tensor:
    """``Â`` of a QuantGraph in float64, from its edges and the self-loop term (the oracle of the products); quantized
    edge weights ``lo_w + s_w·c`` unrounded, as the bit kernels and the float64 evaluation multiply them."""
    edges = graph.edges
    coef = graph.edge_coefficients(torch.float64)
    values = torch.ones(edges.src.numel(), dtype=torch.float64) if coef is None else coef.detach().double()
    dense = torch.zeros(graph.num_dst, graph.num_src, dtype=torch.float64)
    dense.index_put_((edges.dst, edges.src), values, accumulate=True)
    if graph.diag is not None:
        dense[:, :graph.num_dst] += torch.diag(graph.diag.detach().double())
    return dense


GRAPH_CASES = [(kind, flow, options, weighted) for flow in ("source_to_target", "target_to_source")
               for kind, options, weighted in
               [("gcn", dict(), False), ("gcn", dict(), True), ("gcn", dict(improved=True), False),
                ("gcn", dict(improved=True), True), ("gcn", dict(normalize=False), False),
                ("gcn", dict(normalize=False), True), ("gin", dict(), False), ("gin bipartite", dict(), False)]]


def layer_graph(kind: str, flow: str, options: dict, weighted: bool):
    """A QuantGraph as the layer builds it: repeated edges and self-loops, isolated nodes."""
    g = gen(5)
    n = 30
    edge_index = torch.randint(n - 4, (2, 90), generator=g)  # nodes 26..29 isolated
    # repeated edges, a self-loop and a repeated one (GCN keeps one loop's weight)
    edge_index = torch.cat([edge_index, edge_index[:, :12], torch.tensor([[3, 7, 7], [3, 7, 7]])], 1)
    weight = torch.rand(edge_index.size(1), generator=g) + 0.5 if weighted else None
    if kind == "gcn":
        return pq.QGCNConv(4, 4, bits=4, flow=flow, **options)._graph(torch.zeros(n, 4), edge_index, weight)
    gin = pq.QGINConv(Linear(4, 4), bits=4, flow=flow)
    if kind == "gin":
        return gin._graph(edge_index, n, n)
    bipartite = torch.stack([torch.randint(n, (70,), generator=g), torch.randint(12, (70,), generator=g)])
    return gin._graph(bipartite if flow == "source_to_target" else bipartite.flip(0), n, 12)


@pytest.mark.parametrize("kind, flow, options, weighted", GRAPH_CASES)
def test_csr_product_equals_the_dense_reference(kind, flow, options, weighted):
    graph = layer_graph(kind, flow, options, weighted)
    dense = dense_adjacency(graph)
    y = torch.randn(graph.num_src, 5, generator=gen(6)).requires_grad_()
    upstream = torch.randn(graph.num_dst, 5, generator=gen(7))
    # the product (and its gradient) as the QAT layers run it: A by CSR, the self-loop term apart
    out = qat_conv._aggregate_float(graph, y, True)
    (grad,) = torch.autograd.grad((out * upstream).sum(), y)
    assert graph.csr_pair(torch.float32) is not None  # the CSR path ran, not the edge-wise one
    expected = dense @ y.detach().double()
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=1e-5)
    assert torch.allclose(grad.double(), dense.t() @ upstream.double(), rtol=1e-6, atol=1e-5)
    # evaluation: float64 products rounded once
    with torch.no_grad():
        assert torch.equal(qat_conv._aggregate_float(graph, y, False), expected.float())
    # and the edge-wise aggregation of QuantGraph agrees
    assert torch.allclose(out, graph.aggregate_float(y), rtol=1e-6, atol=1e-5)


def test_csr_product_gradcheck():
    edge_index = torch.tensor([[0, 1, 1, 2, 2, 4], [1, 0, 2, 1, 1, 4]])  # a repeated edge, a loop, node 3 isolated
    graph = pq.QGCNConv(2, 2, bits=4)._graph(torch.zeros(5, 2), edge_index, None)
    adj, adj_t = graph.csr_pair(torch.float64)
    assert adj.layout == torch.sparse_csr and adj.crow_indices().dtype == torch.int32
    assert torch.equal(adj_t.to_dense(), adj.to_dense().t())
    y = torch.randn(5, 3, dtype=torch.float64, generator=gen(8), requires_grad=True)
    compiled = lambda y: ops.csr_product(y, adj, adj_t)  # noqa: E731
    reference = lambda y: ops._ReferenceCsrProduct.apply(y, adj, adj_t)  # noqa: E731
    for product in (compiled, reference):
        assert torch.autograd.gradcheck(product, (y,))
        assert torch.autograd.gradgradcheck(product, (y,))
    assert torch.equal(compiled(y), reference(y))


def test_csr_pair_is_built_once_per_graph_and_dtype(monkeypatch):
    builds = [0]
    build = float_csr.csr_pair

    def counting_build(*args, **kwargs):
        builds[0] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(quant_graph, "csr_pair", counting_build)
    graph_cache.clear_graph_cache()
    model = pq.qat.prepare(make_model("GIN"), bits=4, skip_last=False)
    x, edge_index = random_graph()
    for _ in range(2):
        model(x, edge_index).sum().backward()
    assert builds[0] == 1  # A and Aᵀ in float32, shared by the layers and the steps
    model.eval()
    model(x, edge_index)
    assert builds[0] == 2  # and in float64 for evaluation with autograd


def test_csr_pair_is_the_sorted_coo_matrix_and_its_transpose():
    """Both matrices equal the dense sums of the entries (repeated entries summed), rows and columns in their
    stable order, int32 indices; with values and with the shared ones alike."""
    rows = torch.tensor([2, 0, 2, 1, 2, 0])
    cols = torch.tensor([1, 3, 1, 0, 2, 3])
    values = torch.tensor([0.5, 1.0, 2.0, -1.0, 4.0, 3.0])
    for vals in (values, None):
        m, m_t = float_csr.csr_pair(rows, cols, vals, 3, 4, torch.float64)
        dense = torch.zeros(3, 4, dtype=torch.float64).index_put_((rows, cols), (values if vals is not None else
                                                                            torch.ones(6)).double(), accumulate=True)
        assert torch.equal(m.to_dense(), dense) and torch.equal(m_t.to_dense(), dense.t())
        assert m.crow_indices().dtype == m.col_indices().dtype == m_t.col_indices().dtype == torch.int32
        assert m.col_indices().tolist() == [3, 3, 0, 1, 1, 2]  # each row's entries in their given order
        single = float_csr.csr_matrix(rows, cols, vals, 3, 4, torch.float64)
        assert torch.equal(single.values(), m.values()) and torch.equal(single.col_indices(), m.col_indices())


def test_csr_matrices_do_not_block_copies():
    conv = pq.qat.prepare(GCNConv(12, 8, cached=True), bits=4, skip_last=False).eval()
    x, edge_index = random_graph()
    out = conv(x, edge_index)
    assert "_csr" in vars(conv._cached_graph)
    for clone in (copy.deepcopy(conv), pickle.loads(pickle.dumps(conv))):  # CSR tensors cannot be copied
        assert torch.equal(clone(x, edge_index), out)


def test_weighted_edges_that_need_a_gradient_take_the_edge_wise_path():
    x, edge_index = random_graph()
    weight = torch.rand(edge_index.size(1), generator=gen(2)).requires_grad_()
    graph = pq.QGCNConv(12, 8, bits=4)._graph(x, edge_index, weight)
    assert graph.csr_pair(torch.float32) is None
    y = torch.randn(40, 3, generator=gen(3))
    qat_conv._aggregate_float(graph, y, True).sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def train(model, x, edge_index, y, steps=2):
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x, edge_index), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["GCN", "GIN"])
def test_training_steps_equal_with_and_without_the_cache(kind, monkeypatch):
    x, edge_index = random_graph()
    y = torch.randint(5, (40,), generator=gen(4))
    cached = train(pq.qat.prepare(make_model(kind), bits=4, seed=11), x, edge_index, y)
    with graph_cache_disabled():
        fresh = train(pq.qat.prepare(make_model(kind), bits=4, seed=11), x, edge_index, y)
    assert all(torch.equal(a, b) for a, b in zip(cached[0] + cached[1], fresh[0] + fresh[1]))
    # the edge-wise aggregation (index_add, autograd's gradient) gives the same step to float32 rounding
    monkeypatch.setattr(QuantGraph, "csr_pair", lambda graph, dtype: None)
    edge_wise = train(pq.qat.prepare(make_model(kind), bits=4, seed=11), x, edge_index, y)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(cached[0] + cached[1],
                                                                          edge_wise[0] + edge_wise[1]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, flow, options, weighted", [case for case in GRAPH_CASES if not case[3]])
def test_csr_product_on_the_gpu_equals_the_dense_reference(kind, flow, options, weighted):
    """int32 CSR products (csr_product's CUDA kernel) forward and backward, against float64 dense products of the same
    graph."""
    graph_cpu = layer_graph(kind, flow, options, weighted)
    edges = graph_cpu.edges
    num_src, num_dst = graph_cpu.num_src, graph_cpu.num_dst
    edge_index = torch.stack([edges.src, edges.dst]).cuda()
    with graph_cache_disabled():
        graph = QuantGraph(to_edge_set(edge_index, None, num_src, num_dst, "source_to_target"), None, 4)
    dense_a = torch.zeros(num_dst, num_src, dtype=torch.float64).index_put_(
        (edges.dst, edges.src), torch.ones(edges.dst.numel(), dtype=torch.float64), accumulate=True)
    y = torch.randn(num_src, 70, generator=gen(9)).cuda().requires_grad_()
    upstream = torch.randn(num_dst, 70, generator=gen(10)).cuda()
    out = graph.aggregate_float(y)
    (grad,) = torch.autograd.grad((out * upstream).sum(), y)
    assert graph.csr_pair(torch.float32)[0].device.type == "cuda"
    assert torch.allclose(out.double().cpu(), dense_a @ y.detach().double().cpu(), rtol=1e-6, atol=1e-5)
    assert torch.allclose(grad.double().cpu(), dense_a.t() @ upstream.double().cpu(), rtol=1e-6, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("width", [1, 3, 4, 16, 47, 64, 130])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_csr_product_kernel_on_the_gpu(width, index_dtype):
    """The float32 CUDA product (a group of lanes a row, the row's entries in CSR order): within n float32 roundings
    of the exact sum for a row of n entries (|error| <= n·2^-24·Σ|a·y| elementwise), the same bits at every run, empty
    rows zero, a strided y taken as its values; its gradient is the product with Aᵀ."""
    g = gen(width)
    rows, cols, nnz = 300, 257, 4000
    dst = torch.randint(rows - 20, (nnz,), generator=g)  # rows 280.. stay empty
    src = torch.randint(cols, (nnz,), generator=g)
    values = torch.randn(nnz, generator=g)
    adj, adj_t = float_csr.csr_pair(dst, src, values, rows, cols, torch.float32)
    if index_dtype == torch.int64:
        adj, adj_t = [torch.sparse_csr_tensor(m.crow_indices().long(), m.col_indices().long(), m.values(), m.shape)
                      for m in (adj, adj_t)]
    dense = torch.zeros(rows, cols, dtype=torch.float64).index_put_((dst, src), values.double(), accumulate=True)
    y = torch.randn(cols, 2 * width, generator=g)[:, ::2]  # strided
    adj_g, adj_t_g = adj.cuda(), adj_t.cuda()
    yg = y.cuda().requires_grad_()
    out = ops.csr_product(yg, adj_g, adj_t_g)
    assert torch.equal(out, ops.csr_product(yg, adj_g, adj_t_g))
    with torch.no_grad():
        assert torch.equal(out, ops.csr_product(yg, adj_g))  # without Aᵀ: the same kernel, no gradient
    exact = dense @ y.double()
    per_row = torch.bincount(dst, minlength=rows).double().view(-1, 1)
    bound = per_row * 2.0**-24 * (dense.abs() @ y.double().abs())
    assert ((out.detach().double().cpu() - exact).abs() <= bound).all()
    assert torch.equal(out[rows - 20:].cpu(), torch.zeros(20, width))
    upstream = torch.randn(rows, width, generator=g)
    (grad,) = torch.autograd.grad((out * upstream.cuda()).sum(), yg)
    per_col = torch.bincount(src, minlength=cols).double().view(-1, 1)
    bound = per_col * 2.0**-24 * (dense.abs().t() @ upstream.double().abs())
    assert ((grad.double().cpu() - dense.t() @ upstream.double()).abs() <= bound).all()


@pytest.mark.parametrize("compiled", [True, False])
def test_csr_product_without_transpose_takes_no_gradient(compiled, monkeypatch):
    """Without ``adj_t`` (the float layers' eval forward) the product is ``torch.mm``'s, and asking it for a
    gradient to ``y`` is a ValueError, not a wrong or missing gradient."""
    if not compiled:
        monkeypatch.setattr(ops, "use_compiled", lambda *a: False)
    edge_index = torch.tensor([[0, 1, 1, 2, 2, 4], [1, 0, 2, 1, 1, 4]])
    graph = pq.QGCNConv(2, 2, bits=4)._graph(torch.zeros(5, 2), edge_index, None)
    adj, _ = graph.csr_pair(torch.float32)
    y = torch.randn(5, 3, generator=gen(3), requires_grad=True)
    with torch.no_grad():
        assert torch.equal(ops.csr_product(y, adj), torch.mm(adj, y))
    assert torch.equal(ops.csr_product(y.detach(), adj), torch.mm(adj, y.detach()))
    with pytest.raises(ValueError, match="needs adj_t"):
        ops.csr_product(y, adj)


def test_csr_product_rejects_operands_that_do_not_fit():
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    graph = pq.QGCNConv(2, 2, bits=4)._graph(torch.zeros(3, 2), edge_index, None)
    adj, adj_t = graph.csr_pair(torch.float32)
    y = torch.randn(3, 4, generator=gen(1))
    with pytest.raises(ValueError, match="adj_t its transpose"):
        ops.csr_product(torch.randn(4, 4), adj, adj_t)  # y has 4 rows for a 3-node graph
    with pytest.raises(ValueError, match="sparse CSR"):
        ops.csr_product(y, adj.to_dense(), adj_t)
    with pytest.raises(ValueError, match="dense 2-D"):
        ops.csr_product(y[0], adj, adj_t)
