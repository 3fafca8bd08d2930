"""Stacks of QGCNConv / QGINConv under ``torch.compile`` with the default backend (inductor), ``fullgraph=True``.

Oracle: the eager model on the same inputs.  In eval every float step between two quantizations runs inside the
package's ops or is exact, so the compiled model must give the eager bits; in training (fake quantization in float)
inductor may fuse float steps, so the outputs and gradients must agree to a few float32 ulps except where a fused
step moves a value across a rounding boundary, which changes that value by at most one quantization step.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import pyg_quant as pq
from pyg_quant import QGCNConv, QGINConv
from pyg_quant.loader import QuantClusterData, QuantClusterLoader
from pyg_quant.synthetic import planted_class_graph

from conftest import CUDA_OK, requires_compiled

pytestmark = requires_compiled
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if CUDA_OK else [])


def mlp(cin, cout):
    return torch.nn.Sequential(torch.nn.Linear(cin, cout), torch.nn.ReLU(), torch.nn.Linear(cout, cout))


class Stack(torch.nn.Module):
    """The natural user model: three layers, ReLU between them."""

    def __init__(self, convs):
        super().__init__()
        self.convs = torch.nn.ModuleList(convs)

    def forward(self, x, adj):
        for i, conv in enumerate(self.convs):
            x = conv(x, adj)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x


def GIN(cin, hidden, cout, bits):
    return Stack([QGINConv(mlp(cin, hidden), bits=bits), QGINConv(mlp(hidden, hidden), bits=bits),
                  QGINConv(mlp(hidden, cout), bits=bits)])


def GCN(cin, hidden, cout, bits):
    return Stack([QGCNConv(cin, hidden, bits=bits), QGCNConv(hidden, hidden, bits=bits),
                  QGCNConv(hidden, cout, bits=bits)])


MODELS = {"gin": GIN, "gcn": GCN}


def make_graph(n=600, e=5000, features=24, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, n, (2, e), generator=g)
    x = torch.randn(n, features, generator=g)
    return x.to(device), edge_index.to(device)


def make_model(kind, bits, device, seed=0):
    torch.manual_seed(seed)
    return MODELS[kind](24, 32, 7, bits).to(device)


def adjacency(kind, form, edge_index, n):
    if form == "edge_index":
        return edge_index
    # GCN reads A + I from a BitAdjacency that carries its self-loops, GIN adds (1 + eps)·x itself
    return pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1 if kind == "gcn" else 0)


def compiled(model, **kwargs):
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, **kwargs)


def assert_grads_close(got_grads, want_grads):
    """Every parameter's gradient as eager's, to the float32 fusions' rounding."""
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        g = got_grads[name]
        assert g is not None and grad is not None, name
        assert torch.allclose(g, grad, rtol=1e-3, atol=1e-3 * float(grad.abs().max()) + 1e-8), name


def pyg_stack(kind, dims):
    """PyG's GCNConv / GINConv (GIN: an MLP a layer) through ``dims``, ReLU between the layers."""
    from torch_geometric.nn import GCNConv, GINConv

    pairs = zip(dims[:-1], dims[1:])
    return Stack([GCNConv(a, b) if kind == "gcn" else GINConv(mlp(a, b)) for a, b in pairs])


def assert_within_one_step(got, want, step):
    """Equal to a few float32 ulps, except entries moved by a rounding boundary: by at most ``step``, and few."""
    diff = (got - want).abs()
    ulps = 8 * torch.finfo(torch.float32).eps * want.abs().clamp_min(1.0)
    off = diff > ulps
    assert float(diff.max()) <= step, float(diff.max())
    assert float(off.float().mean()) <= 0.02, float(off.float().mean())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["edge_index", "bit_adjacency"])
@pytest.mark.parametrize("kind", ["gin", "gcn"])
def test_compiled_eval_equals_eager(kind, form, device):
    """no_grad with a float x, then inference_mode with a BitTensor x (a second graph): the eager bits."""
    x, edge_index = make_graph(device=device)
    adj = adjacency(kind, form, edge_index, x.size(0))
    model = make_model(kind, 4, device).eval()
    fast = compiled(model)
    with torch.no_grad():
        assert torch.equal(fast(x, adj), model(x, adj))
    xq = pq.to_bit(x, 4, dim=0, layout="col")
    with torch.inference_mode():
        assert torch.equal(fast(xq, adj), model(xq, adj))


@pytest.mark.parametrize("kind", ["gin", "gcn"])
def test_traced_whole_in_eval_and_training(kind):
    """fullgraph=True raises at any graph break: eval without grad and training, on both adjacency forms."""
    x, edge_index = make_graph()
    for model, grad in ((make_model(kind, 4, "cpu").eval(), False), (make_model(kind, 4, "cpu").train(), True)):
        for adj in (edge_index, adjacency(kind, "bit_adjacency", edge_index, x.size(0))):
            with torch.set_grad_enabled(grad):
                out = compiled(model, backend="eager")(x, adj)
            assert out.shape == (x.size(0), 7) and out.requires_grad == grad


@pytest.mark.parametrize("kind", ["gin", "gcn"])
def test_compiled_qat_step_equals_eager(kind):
    """Training (fake quantization, straight-through): loss, output and every gradient as in eager."""
    x, edge_index = make_graph()
    target = torch.randint(0, 7, (x.size(0),), generator=torch.Generator().manual_seed(3))
    eager, fast_model = make_model(kind, 4, "cpu").train(), make_model(kind, 4, "cpu").train()
    fast = compiled(fast_model)
    results = []
    for model, run in ((eager, eager), (fast_model, fast)):
        out = run(x, edge_index)
        F.cross_entropy(out, target).backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (got, got_grads), (want, want_grads) = results[1], results[0]
    step = float(want.abs().max()) / 15  # one 4-bit code step of the largest range
    assert_within_one_step(got, want, step)
    assert_grads_close(got_grads, want_grads)


def converted(kind, device):
    """The QAT route: PyG's layers, ``qat.prepare`` (4 bits), three training steps, ``qat.convert`` (the last layer
    stays fp32)."""
    torch.manual_seed(0)
    model = pq.qat.prepare(pyg_stack(kind, (24, 32, 32, 7)).to(device), bits=4).train()
    x, edge_index = make_graph(device=device)
    target = torch.randint(0, 7, (x.size(0),), generator=torch.Generator().manual_seed(3)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x, edge_index), target).backward()
        optimizer.step()
    return pq.qat.convert(model), x, edge_index


@pytest.mark.parametrize("form", ["edge_index", "bit_adjacency"])
@pytest.mark.parametrize("kind", ["gin", "gcn"])
def test_compiled_qat_prepared_training_step_equals_eager(kind, form):
    """``qat.prepare``'s model of PyG layers (static aggregation observers that record each batch) trained under
    ``torch.compile``: output and gradients as in eager, the observers' ranges moved alike."""
    x, edge_index = make_graph()
    adj = adjacency(kind, form, edge_index, x.size(0))
    target = torch.randint(0, 7, (x.size(0),), generator=torch.Generator().manual_seed(3))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(pq.qat.prepare(pyg_stack(kind, (24, 32, 7)), bits=4, stochastic=False).train())
    results = []
    for model, run in ((models[0], models[0]), (models[1], compiled(models[1]))):
        out = run(x, adj)
        F.cross_entropy(out, target).backward()
        ranges = {n: b.clone() for n, b in model.named_buffers() if n.endswith(("min_val", "max_val"))}
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}, ranges))
    (got, got_grads, got_ranges), (want, want_grads, want_ranges) = results[1], results[0]
    assert_within_one_step(got, want, float(want.abs().max()) / 15)
    assert want_ranges and got_ranges.keys() == want_ranges.keys()
    for name, value in want_ranges.items():
        assert torch.allclose(got_ranges[name], value, rtol=1e-5, atol=1e-6), name
    assert_grads_close(got_grads, want_grads)


@pytest.mark.parametrize("kind", ["gin", "gcn"])
def test_traced_qat_training_reads_a_csr_bit_adjacency_as_stored(kind):
    """A QAT model trained under torch.compile on a tile-free BitAdjacency (the loader's cluster batches): the traced
    step reads the stored CSR entries, with no decoding sort or ``unique`` (the layers' graph is made at every
    call of a compiled step, where eager keeps it on the adjacency)."""
    x, edge_index = make_graph()
    adj = adjacency(kind, "bit_adjacency", edge_index, x.size(0))
    assert adj.num_tiles == 0 and adj.res_col.numel() > 0
    torch.manual_seed(0)
    model = pq.qat.prepare(pyg_stack(kind, (24, 32, 7)), bits=4).train()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True, backend=record)(x, adj)
    assert out.requires_grad and len(graphs) == 1
    calls = [str(node.target) for node in graphs[0].graph.nodes if node.op in ("call_function", "call_method")]
    assert any("repeat_interleave" in c for c in calls)  # the residual's rows: the entries are read
    # (torch.unique traces as a function named after its return_inverse / return_counts variant)
    decoding = ("nonzero", "unique", "_return_inverse", "_return_counts", "sort")
    assert not [c for c in calls if any(name in c for name in decoding)], calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["gin", "gcn"])
def test_compiled_converted_qat_models_equal_eager(kind, device):
    """``qat.convert``'s inference model (the main job's and the examples') compiled whole: float x under no_grad
    on both adjacency forms, and under inference_mode the codes a loader ships (per feature; for GCN also per node,
    which its first layer multiplies as they are).  Compiled, each layer runs its general path, whose float steps
    inductor may fuse where eager runs one op: a few float32 ulps, or one 4-bit step of the range where a fused step
    moves a value across a rounding boundary before the next layer's quantizer."""
    model, x, edge_index = converted(kind, device)
    inputs = [(torch.no_grad, x, edge_index), (torch.no_grad, x, adjacency(kind, "bit_adjacency", edge_index, 600))]
    adj = inputs[-1][2]
    inputs.append((torch.inference_mode, pq.to_bit(x, 4, dim=0, layout="col"), adj))
    if kind == "gcn":
        inputs.append((torch.inference_mode, pq.to_bit(x, 4, dim=1, layout="row"), adj))
    fast = compiled(model)
    for context, features, graph in inputs:
        with context():
            want = model(features, graph)
            got = fast(features, graph)
        assert_within_one_step(got, want, float(want.abs().max()) / 15)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["gin", "gcn"])
def test_compiled_over_loader_batches(kind, device, tmp_path):
    """The README's loop compiled, floats between the layers: every batch gives the eager bits (batches of other
    sizes compile again, with dynamic sizes)."""
    data = planted_class_graph(num_nodes=1200, num_classes=4, num_features=24, seed=1)
    cluster_data = QuantClusterData(data, num_parts=6, save_dir=str(tmp_path))
    model = make_model(kind, 4, device).eval()
    fast = compiled(model)
    seen = 0
    with torch.inference_mode():
        for batch in QuantClusterLoader(cluster_data, batch_size=2, bits=4, self_loops=int(kind == "gcn")):
            batch = batch.to(device)
            assert torch.equal(fast(batch.x, batch.adj), model(batch.x, batch.adj))
            seen += 1
    assert seen == 3


def test_wide_sums_bound_covers_max_row_sum():
    """While tracing, the int32 / int64 choice reads a power-of-two bound of the largest row sum (one graph for
    batches whose largest sums differ); the bound never chooses int32 where the exact sums need int64."""
    edge_index = torch.randint(0, 50, (2, 900), generator=torch.Generator().manual_seed(5))
    adj = pq.BitAdjacency.from_edge_index(edge_index, 50)
    assert (1 << adj.row_sum_bits) - 1 >= adj.max_row_sum > (1 << (adj.row_sum_bits - 1)) - 1
    for bits in range(1, 9):
        exact = adj.max_row_sum * (2**bits - 1) > 2**31 - 1
        assert adj.wide_sums(bits) == exact
        traced = torch.compile(lambda t, b=bits: t + int(adj.wide_sums(b)), fullgraph=True, backend="eager")
        assert int(traced(torch.zeros(()))) >= int(exact)


class GINCodes(torch.nn.Module):
    """GIN whose hidden layers hand the next one their output's codes (``out_bits``, the ReLU inside ``nn``)."""

    def __init__(self, cin, hidden, cout, bits):
        super().__init__()
        hidden_nn = lambda i: torch.nn.Sequential(mlp(i, hidden), torch.nn.ReLU())  # noqa: E731
        self.convs = torch.nn.ModuleList([QGINConv(hidden_nn(cin), bits=bits, out_bits=bits),
                                          QGINConv(hidden_nn(hidden), bits=bits, out_bits=bits),
                                          QGINConv(mlp(hidden, cout), bits=bits)])

    def forward(self, x, adj):
        for conv in self.convs:
            x = conv(x, adj)
        return x


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["gin", "gin_codes", "gcn"])
def test_reduce_overhead_equals_eager(kind):
    """CUDA graphs replayed on two inputs in turn (BitTensor features, as a loader hands them over): the eager bits
    each time; nothing made inside a replay is kept on an input (the next replay overwrites it)."""
    if not CUDA_OK:
        pytest.skip("needs a CUDA GPU and pyg_quant's compiled CUDA backend")
    torch.manual_seed(0)
    model = (GINCodes(24, 32, 7, 4) if kind == "gin_codes" else MODELS[kind](24, 32, 7, 4)).cuda().eval()
    inputs = []
    for seed in (0, 1):
        x, edge_index = make_graph(seed=seed, device="cuda")
        inputs.append((pq.to_bit(x, 4, dim=0, layout="col"), adjacency(kind[:3], "bit_adjacency", edge_index, 600)))
    fast = compiled(model, mode="reduce-overhead")
    with torch.inference_mode():
        want = [model(*args).clone() for args in inputs]
        for _ in range(3):  # recorded, then replayed
            for args, expected in zip(inputs, want):
                assert torch.equal(fast(*args), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_compile_quantizes_weights_once(device):
    """Inductor's freezing (``torch._inductor.config.freezing = True``) in inference folds the weights' quantization
    (codes, ranges, code sums) into constants, so the compiled graph runs only the layer's aggregation and fused MLP
    kernels, and gives the eager bits."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    x, edge_index = make_graph(n=200, e=1500, device=device)
    adj = adjacency("gin", "bit_adjacency", edge_index, x.size(0))
    torch.manual_seed(0)
    model = QGINConv(mlp(24, 32), bits=4).to(device).eval()
    xq = pq.to_bit(x, 4, dim=0, layout="col")
    torch._dynamo.reset()
    frozen = torch.compile(model, fullgraph=True)
    with torch.no_grad(), config.patch(freezing=True):
        want = model(xq, adj)
        got, codes = run_and_get_code(frozen, xq, adj)
    assert torch.equal(got, want)
    called = set(re.findall(r"torch\.ops\.pyg_quant\.(\w+)", "\n".join(codes)))
    assert called == {"gin_conv_eval"}, called


def pyg_quant_ops(fn, *args):
    """``(fn(*args), the pyg_quant ops it called, sorted)``: host events only (on a GPU the kernels' names start with
    the namespace too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    return out, sorted(e.name[len("pyg_quant::"):] for e in prof.events()
                       if e.name.startswith("pyg_quant::") and e.device_type == torch.autograd.DeviceType.CPU)


def flat_gin_codes(cin, hidden, cout, bits):
    """GIN as the benchmarks' workload writes it: each ``nn`` one Sequential of QuantLinear-able layers, the hidden
    layers handing the next one their output's codes (``out_bits``, the ReLU inside ``nn``)."""
    def nn(a, b, last):
        layers = [torch.nn.Linear(a, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, b)]
        return torch.nn.Sequential(*layers) if last else torch.nn.Sequential(*layers, torch.nn.ReLU())

    convs = [QGINConv(nn(cin, hidden, False), bits=bits, out_bits=bits),
             QGINConv(nn(hidden, hidden, False), bits=bits, out_bits=bits), QGINConv(nn(hidden, cout, True), bits=bits)]
    model = GINCodes(cin, hidden, cout, bits)
    model.convs = torch.nn.ModuleList(convs)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["gin", "gcn"])
def test_compiled_eval_runs_one_op_a_layer(kind, device):
    """On a BitAdjacency in eval, a compiled stack calls the ops an eager one does, each layer's one op
    (``gin_conv_eval`` / ``gcn_conv_eval``), plus the weights' codes made in the graph, one op a layer
    (``mlp_weight_codes``, kept between calls in eager), and gives the eager bits."""
    x, edge_index = make_graph(device=device)
    adj = adjacency(kind, "bit_adjacency", edge_index, x.size(0))
    torch.manual_seed(0)
    model = (flat_gin_codes(24, 32, 7, 4) if kind == "gin" else GCN(24, 32, 7, 4)).to(device).eval()
    xq = pq.to_bit(x, 4, dim=0, layout="col")
    fast = compiled(model)
    with torch.no_grad():
        model(xq, adj)  # (the first eager call makes the weights' codes, kept for the next)
        want, eager = pyg_quant_ops(model, xq, adj)
        fast(xq, adj)
        got, traced = pyg_quant_ops(fast, xq, adj)
    assert torch.equal(got, want)
    layer_op = "gin_conv_eval" if kind == "gin" else "gcn_conv_eval"
    assert eager == [layer_op] * 3, eager
    assert traced == sorted(eager + ["mlp_weight_codes"] * 3), traced


@pytest.mark.parametrize("case", ["gin_self_loops", "gin_tensor_range", "gin_row_ranges_out", "gin_tiles",
                                  "gin_float", "gin_float_tiles", "gcn_codes", "gcn_tiles"])
def test_compiled_one_op_layers_equal_eager(case):
    """The traced one-op layer path in the cases its checks tell apart: a GIN adjacency with a diagonal term, features
    over one range, per-row ranges out (``out_dim=1``), bit tiles besides the CSR, float features (their own op);
    GCN on column codes it reads as floats, and on tiles: eager's layer op in the graph, and the eager bits."""
    x, edge_index = make_graph()
    torch.manual_seed(0)
    kind = case[:3]
    loops = 1 if kind == "gcn" or case == "gin_self_loops" else 0
    tiles = {"min_tile_nnz": 4} if case.endswith("tiles") else {}
    adj = pq.BitAdjacency.from_edge_index(edge_index, x.size(0), self_loops=loops, **tiles)
    assert (adj.num_tiles > 0) == case.endswith("tiles")
    if kind == "gin":
        nn = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.ReLU())
        layer = QGINConv(nn, bits=4, out_bits=4, out_dim=1 if case == "gin_row_ranges_out" else 0).eval()
        xq = pq.to_bit(x, 4, dim=None if case == "gin_tensor_range" else 0, layout="col")
        if case.startswith("gin_float"):
            xq = torch.relu(x)  # a previous layer's output after F.relu
    else:
        layer = QGCNConv(24, 16, bits=4).eval()
        xq = pq.to_bit(x, 3, dim=0, layout="col") if case == "gcn_codes" else x
    fast = compiled(layer)
    layer_op = "qat_gin_conv_eval" if case.startswith("gin_float") else f"{kind}_conv_eval"
    with torch.no_grad():
        want = layer(xq, adj)
        fast(xq, adj)  # (compiles)
        got, traced = pyg_quant_ops(fast, xq, adj)
    assert traced.count(layer_op) == 1, (case, traced)
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), case
    else:  # a BitTensor: the same shape, ranges and values
        assert type(got) is type(want) and got.shape == want.shape and got.dim == want.dim, case
        assert torch.equal(got.lo, want.lo) and torch.equal(pq.to_val(got), pq.to_val(want)), case
