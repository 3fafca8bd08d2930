r"""PyG's own tools on the pyg_quant layers: the explainers' edge masks, ``to_hetero``, readable signatures.

Oracles:

* **PyG's layers.**  With ``bits=None`` a QGCNConv / QGINConv holding the state dict of a PyG GCNConv / GINConv
  must give PyG's numbers under the same explainer mask (set by PyG's own ``set_masks``): the output and the
  gradient that reaches the mask (``atol`` 1e-5: float32 sums in another order), and GNNExplainer's whole
  optimisation from the same seed (the same edge and node masks, ``atol`` 1e-4 after its Adam steps).  PyG's graph
  here has a self-loop and a repeated edge, so the rule that GCN's own loops keep a factor of 1
  (``_loop_mask``) is exercised.
* **The mask's extremes.**  A mask of ``+1e4`` everywhere (``sigmoid`` = 1 in float32) must leave a quantized
  layer's output as it is without a mask; ``-1e4`` (factor 0) must give GIN's output on a graph without edges.
* **Where gradients reach.**  For node ``t`` of a 2-layer model, exactly the edges into ``t`` or into one of its
  in-neighbours can change ``out[t]``: the mask's gradient must be zero on every other edge and non-zero on some
  of those (quantizer ranges carry no gradient, so quantization does not widen that set).
* **to_hetero.**  ``bits=None``: the same outputs as the model built from PyG's layers with the same weights.
  ``bits=4``: the hetero model's output per node type must equal the sum, over the edge types into it, of the
  per-edge-type layers called by hand (what ``to_hetero(aggr="sum")`` promises), bit for bit.
"""
import copy
import inspect
import pickle
import pydoc

import pytest
import torch
from torch.nn import Linear, ReLU, Sequential
from torch_geometric.data import HeteroData
from torch_geometric.explain import Explainer, GNNExplainer
from torch_geometric.explain.algorithm.utils import clear_masks, set_masks
from torch_geometric.nn import GCNConv, GINConv, to_hetero
from torch_geometric.utils import to_torch_coo_tensor

import pyg_quant as pq
from pyg_quant import qat
from pyg_quant.nn import QGCNConv, QGINConv, QuantLinear

from conftest import gen, random_edges

FLOAT_ATOL = 1e-5


# --- models -----------------------------------------------------------------------------------------
class GCN(torch.nn.Module):
    def __init__(self, conv, channels=(16, 24, 5), **kwargs):
        super().__init__()
        self.conv1 = conv(channels[0], channels[1], **kwargs)
        self.conv2 = conv(channels[1], channels[2], **kwargs)

    def forward(self, x, edge_index, edge_weight=None):
        x = self.conv1(x, edge_index, edge_weight).relu()
        return torch.log_softmax(self.conv2(x, edge_index, edge_weight), dim=-1)


class GIN(torch.nn.Module):
    def __init__(self, conv, channels=(16, 24, 5), **kwargs):
        super().__init__()
        self.conv1 = conv(Sequential(Linear(channels[0], channels[1]), ReLU(), Linear(channels[1], channels[1])),
                          **kwargs)
        self.conv2 = conv(Linear(channels[1], channels[2]), **kwargs)

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        return torch.log_softmax(self.conv2(x, edge_index), dim=-1)


def model_pair(kind, bits, seed=0):
    """The model from PyG's layers and the same model from pyg_quant's (``bits``), with the same weights."""
    torch.manual_seed(seed)
    if kind == "gcn":
        ref, quant = GCN(GCNConv), GCN(QGCNConv, bits=bits)
        for conv in (ref.conv1, ref.conv2):
            torch.nn.init.uniform_(conv.bias, -0.3, 0.3)
    else:
        ref, quant = GIN(GINConv, train_eps=True), GIN(QGINConv, train_eps=True, bits=bits)
        with torch.no_grad():
            ref.conv1.eps.fill_(0.25)
    quant.load_state_dict(ref.state_dict())
    return ref, quant


def small_graph(n=30, num_edges=90, seed=3):
    """A random graph with self-loops and repeated edges kept (PyG's masks index the edges as given)."""
    edge_index = random_edges(n, n, num_edges, seed, loops=True)
    edge_index = torch.cat([edge_index, edge_index[:, :3], torch.tensor([[4, 4], [4, 4]])], dim=1)
    x = torch.randn(n, 16, generator=gen(seed + 1))
    return x, edge_index


def masked(model, mask, edge_index, fn):
    set_masks(model, mask, edge_index, apply_sigmoid=True)
    try:
        return fn()
    finally:
        clear_masks(model)


# --- edge masks: the semantics of MessagePassing.propagate --------------------------------------------
@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_float_mask_output_and_gradient_match_pyg(kind):
    x, edge_index = small_graph()
    ref, quant = model_pair(kind, None)
    weight = torch.rand(edge_index.size(1), generator=gen(7)) + 0.5
    args = (x, edge_index, weight) if kind == "gcn" else (x, edge_index)
    mask_values = torch.randn(edge_index.size(1), generator=gen(8))
    results = []
    for model in (ref, quant):
        mask = torch.nn.Parameter(mask_values.clone())
        out = masked(model, mask, edge_index, lambda: model(*args))
        out[:, 0].square().sum().backward()
        results.append((out.detach(), mask.grad))
    (out_ref, grad_ref), (out_q, grad_q) = results
    assert torch.allclose(out_q, out_ref, atol=FLOAT_ATOL)
    assert grad_ref.abs().max() > 0
    assert torch.allclose(grad_q, grad_ref, atol=FLOAT_ATOL)
    # clear_masks undoes it: the unmasked output again, and the mask changed it
    assert torch.allclose(quant(*args), ref(*args), atol=FLOAT_ATOL)
    assert not torch.allclose(out_q, quant(*args), atol=1e-3)


@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_quantized_mask_extremes_and_no_grad(kind):
    x, edge_index = small_graph()
    _, model = model_pair(kind, 4)
    model.eval()
    with torch.no_grad():
        plain = model(x, edge_index)
        no_edges = model(x, edge_index[:, :0])
    ones, zeros = torch.full((edge_index.size(1),), 1e4), torch.full((edge_index.size(1),), -1e4)
    assert torch.allclose(masked(model, ones, edge_index, lambda: model(x, edge_index)), plain, atol=FLOAT_ATOL)
    if kind == "gin":  # (GCN's degrees are those of the unmasked graph, as in PyG: no graph without edges has them)
        assert torch.allclose(masked(model, zeros, edge_index, lambda: model(x, edge_index)), no_edges,
                              atol=FLOAT_ATOL)
    # Under no_grad (the explainers' final prediction) the mask still applies: the aggregation takes the float path
    # (the Linears' bit kernels still run: the same values to float32 rounding).
    mask = torch.randn(edge_index.size(1), generator=gen(9))
    with_grad = masked(model, mask, edge_index, lambda: model(x, edge_index))
    with torch.no_grad():
        without = masked(model, mask, edge_index, lambda: model(x, edge_index))
    assert torch.allclose(without, with_grad.detach(), atol=FLOAT_ATOL)
    assert not torch.allclose(without, plain, atol=1e-3)


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_mask_gradient_reaches_exactly_the_receptive_field(kind, bits):
    x, edge_index = small_graph()
    _, model = model_pair(kind, bits)
    model.eval()  # with bits: the float path with nearest rounding (the explainers run in eval with autograd)
    target = 4
    src, dst = edge_index
    hop1 = torch.zeros(x.size(0), dtype=torch.bool)
    hop1[src[dst == target]] = True
    hop1[target] = True  # out1[target] reaches out2[target] through the self term (GCN's loop, GIN's 1 + eps)
    field = hop1[dst]
    mask = torch.nn.Parameter(torch.zeros(edge_index.size(1)))
    out = masked(model, mask, edge_index, lambda: model(x, edge_index))
    out[target].max().backward()
    assert (mask.grad[~field] == 0).all()
    assert (mask.grad[field] != 0).any()


def test_mask_errors():
    x, edge_index = small_graph()
    conv = QGCNConv(16, 8, bits=4)
    mask = torch.zeros(edge_index.size(1))
    n = x.size(0)
    adj = to_torch_coo_tensor(edge_index.flip(0), size=(n, n))
    bit_adj = pq.BitAdjacency.from_edge_index(edge_index, n)
    for graph_input in (adj, bit_adj):
        with pytest.raises(TypeError, match="edge mask needs edge_index"):
            masked(conv, mask, edge_index, lambda: conv(x, graph_input))
    with pytest.raises(ValueError, match="edge mask has shape"):
        masked(conv, mask[:-1], edge_index, lambda: conv(x, edge_index))
    gin = QGINConv(Linear(16, 8), bits=4)
    gin.explain = True  # PyG's flag without a mask
    with pytest.raises(ValueError, match="Could not find a pre-defined 'edge_mask'"):
        gin(x, edge_index)
    gin.explain = None
    assert gin(x, edge_index).shape == (n, 8)


# --- GNNExplainer end to end ----------------------------------------------------------------------
def explain(model, x, edge_index, seed=0, epochs=5):
    explainer = Explainer(model, algorithm=GNNExplainer(epochs=epochs), explanation_type="model",
                          node_mask_type="attributes", edge_mask_type="object",
                          model_config=dict(mode="multiclass_classification", task_level="node",
                                            return_type="log_probs"))
    torch.manual_seed(seed)
    return explainer(x, edge_index, index=4)


@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_gnn_explainer_matches_pyg_in_float(kind):
    x, edge_index = small_graph()
    ref, quant = model_pair(kind, None)
    expected, got = explain(ref, x, edge_index), explain(quant, x, edge_index)
    assert got.edge_mask.shape == (edge_index.size(1),)
    assert (expected.edge_mask > 0).any()
    assert torch.allclose(got.edge_mask, expected.edge_mask, atol=1e-4)
    assert torch.allclose(got.node_mask, expected.node_mask, atol=1e-4)


@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_gnn_explainer_on_quantized_and_prepared_models(kind):
    x, edge_index = small_graph()
    ref, quant = model_pair(kind, 4)
    prepared = qat.prepare(ref, bits=4, seed=0)
    for model in (quant, prepared):
        explanation = explain(model, x, edge_index)
        assert explanation.edge_mask.shape == (edge_index.size(1),)
        assert (explanation.edge_mask > 0).any()
        assert torch.isfinite(explanation.edge_mask).all()


# --- to_hetero --------------------------------------------------------------------------------------
def hetero_data(seed=5, bipartite=True):
    g = gen(seed)
    data = HeteroData()
    data["paper"].x = torch.randn(12, 16, generator=g)
    data["author"].x = torch.randn(9, 16, generator=g)
    data["paper", "cites", "paper"].edge_index = torch.randint(12, (2, 30), generator=g)
    if bipartite:
        writes = torch.stack([torch.randint(9, (25,), generator=g), torch.randint(12, (25,), generator=g)])
        data["author", "writes", "paper"].edge_index = writes
        data["paper", "rev_writes", "author"].edge_index = writes.flip(0)
    else:  # GCN takes no bipartite pair (as in PyG)
        data["author", "knows", "author"].edge_index = torch.randint(9, (2, 20), generator=g)
    return data


@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_to_hetero_float_matches_pyg(kind):
    data = hetero_data(bipartite=kind == "gin")
    ref, quant = model_pair(kind, None)
    ref_h, quant_h = to_hetero(ref, data.metadata(), aggr="sum"), to_hetero(quant, data.metadata(), aggr="sum")
    quant_h.load_state_dict(ref_h.state_dict())  # to_hetero re-initializes each edge type's copy
    for mode in ("train", "eval"):
        ref_h.train(mode == "train"), quant_h.train(mode == "train")
        expected, got = ref_h(data.x_dict, data.edge_index_dict), quant_h(data.x_dict, data.edge_index_dict)
        assert expected.keys() == got.keys()
        for key in expected:
            assert got[key].shape == expected[key].shape
            assert torch.allclose(got[key], expected[key], atol=FLOAT_ATOL)


@pytest.mark.parametrize("prepared", [False, True])
def test_to_hetero_quantized_gin_is_the_sum_over_edge_types(prepared):
    data = hetero_data()
    ref, quant = model_pair("gin", 4)
    if prepared:
        quant = qat.prepare(ref, bits=4, skip_last=False, seed=0)
    model = to_hetero(quant, data.metadata(), aggr="sum")
    out_train = model(data.x_dict, data.edge_index_dict)
    assert {k: tuple(v.shape) for k, v in out_train.items()} == {"paper": (12, 5), "author": (9, 5)}
    model.eval()
    with torch.no_grad():
        out = model(data.x_dict, data.edge_index_dict)

        def layer(name, x_dict):
            result = {}
            for src, rel, dst in data.edge_types:
                conv = getattr(model, name)[f"{src}__{rel}__{dst}"]
                x = x_dict[src] if src == dst else (x_dict[src], x_dict[dst])
                y = conv(x, data[src, rel, dst].edge_index)
                result[dst] = y if dst not in result else result[dst] + y
            return result

        hidden = {k: v.relu() for k, v in layer("conv1", data.x_dict).items()}
        expected = {k: torch.log_softmax(v, dim=-1) for k, v in layer("conv2", hidden).items()}
    for key in expected:
        assert torch.equal(out[key], expected[key])


# --- readable signatures ----------------------------------------------------------------------------
def test_unset_default_reads_well_and_is_one_object():
    from pyg_quant.quantization.bits import UNSET
    for fn in (QGCNConv, QGINConv, QuantLinear, qat.prepare):
        params = inspect.signature(fn).parameters
        for name in ("weight_bits", "act_bits"):
            assert params[name].default is UNSET
            assert repr(params[name].default) == "<same as bits>"
        assert "object at 0x" not in pydoc.render_doc(fn)
    assert copy.deepcopy(UNSET) is UNSET and pickle.loads(pickle.dumps(UNSET)) is UNSET
    # no change in meaning: bits fills what is left out, an explicit None stays float
    conv = QGCNConv(16, 8, bits=4)
    assert (conv.weight_bits, conv.act_bits) == (4, 4)
    assert (QGCNConv(16, 8, bits=None, weight_bits=2).weight_bits, QGINConv(Linear(4, 4), act_bits=3).act_bits) \
        == (2, 3)
    assert QuantLinear(4, 4, weight_bits=None, act_bits=4).weight_bits is None


def test_bipartite_gcn_is_refused_as_in_pyg():
    """to_hetero hands a GCN layer ``(x_src, x_dst)`` on bipartite edge types: PyG's GCNConv refuses it with a
    ValueError, and so do QGCNConv and its QAT version."""
    x = torch.randn(5, 16)
    edge_index = torch.tensor([[0, 1], [1, 2]])
    layers = (GCNConv(16, 8), QGCNConv(16, 8, bits=4), qat.prepare(GCNConv(16, 8), bits=4, skip_last=False))
    for layer in layers:
        with pytest.raises(ValueError, match="does not support bipartite message passing"):
            layer((x, x), edge_index)


def test_to_hetero_with_an_unrecognised_edge_argument_says_why():
    """to_hetero treats an argument whose name holds neither 'edge' nor 'adj' as node features and passes pairs of
    them (PyG's GINConv fails there too); the layer's error names the cause."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = QGINConv(Linear(16, 4), bits=4)

        def forward(self, x, graph):
            return self.conv(x, graph)

    data = hetero_data()
    model = to_hetero(Net(), data.metadata(), aggr="sum")
    with pytest.raises(TypeError, match="named with neither 'edge' nor 'adj'"):
        model(data.x_dict, data.edge_index_dict)
