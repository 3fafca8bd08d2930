r"""pyg_quant.qat's API around the layers: convert under inference mode, inputs that are quantized already,
and the fp32 layers ``prepare`` leaves (``skip_last`` / ``skip``).

Oracles:

* **Inference mode.** A converted model must give, under ``torch.inference_mode()``, the same outputs bit
  for bit as under ``torch.no_grad()`` (the same codes on the same kernels), whether ``convert`` itself ran
  under inference mode or not, and whether the QAT model's tensors were made under it.
* **Quantized inputs.** For the dynamic per-node input quantizer, ``to_bit(x, b, dim=1)`` holds exactly the
  codes the quantizer makes of ``x`` (``test_qat.py``'s code oracle), so a layer fed that BitTensor must
  give the output it gives for ``x``, bit for bit, without quantizing anything (the quantizer's
  ``quantize`` is spied on and must not be called; ``bitmm`` must receive the very BitTensor).  Inputs of
  fewer bits are checked against the float64 product of the dequantized operands
  (``to_val(x)·to_val(W̃)ᵀ``, rounded once) to 1e-6 relative.
* **fp32 layers.** A skipped ``GCNConv`` / ``GINConv`` is a ``QGCNConv`` / ``QGINConv`` with
  ``bits=None``; on a :class:`~pyg_quant.BitAdjacency` it must equal the unprepared PyG layer on
  ``edge_index`` (the same graph) to float32 rounding: ``|Δ| ≤ 1e-5·max|out|``.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn import Linear, ReLU, Sequential
from torch_geometric.nn import GCNConv, GINConv

import pyg_quant as pq
import pyg_quant.qat.linear as qat_linear
from pyg_quant import ops, qat

from conftest import requires_compiled
from test_qat import GIN, planted_graph

pytestmark = requires_compiled


class GCN(torch.nn.Module):
    """A 2-layer GCN on any adjacency its layers read (not ``cached``: the graphs differ from call to call)."""

    def __init__(self, channels, hidden, classes):
        super().__init__()
        self.conv1 = GCNConv(channels, hidden)
        self.conv2 = GCNConv(hidden, classes)

    def forward(self, x, edge_index):
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


def train(model, data, epochs, graph=None, lr=0.01):
    graph = data.edge_index if graph is None else graph
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        model.train()
        optimizer.zero_grad()
        out = model(data.x, graph)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        optimizer.step()
    return model


class GINOnly(torch.nn.Module):
    """Two GINConv layers, the last one the output layer (what skip_last keeps fp32)."""

    def __init__(self, channels, hidden, classes):
        super().__init__()
        self.conv1 = GINConv(Sequential(Linear(channels, hidden), ReLU(), Linear(hidden, hidden)), train_eps=True)
        self.conv2 = GINConv(Sequential(Linear(hidden, hidden), ReLU(), Linear(hidden, classes)), eps=0.25)

    def forward(self, x, edge_index):
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


def close(a, b, rel=1e-5):
    a, b = a.detach(), b.detach()
    scale = float(b.abs().max())
    return float((a - b).abs().max()) <= rel * max(scale, 1e-30)


def trained(kind="gcn", bits=4, epochs=3, **kwargs):
    data = planted_graph(nodes=200, seed=5)
    torch.manual_seed(0)
    model = {"gcn": lambda: GCN(16, 8, 4), "gin": lambda: GIN(16, 8, 4)}[kind]()
    kwargs.setdefault("skip_last", False)
    return train(qat.prepare(model, bits=bits, seed=1, **kwargs), data, epochs=epochs), data


# --- convert and evaluation under inference mode ------------------------------------------------------
@pytest.mark.parametrize("kind", ["gcn", "gin"])
@pytest.mark.parametrize("inplace", [False, True])
def test_convert_under_inference_mode(kind, inplace):
    # static ranges for the Linear inputs too: their range buffers are what broke under inference mode
    model, data = trained(kind, input_observer="minmax")
    reference = qat.convert(model)
    with torch.no_grad():
        expected = reference(data.x, data.edge_index)
    with torch.inference_mode():
        inference = qat.convert(model, inplace=inplace)
        first = inference(data.x, data.edge_index)
        second = inference(data.x, data.edge_index)  # the cached codes, read back
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert not any(t.is_inference() for t in list(inference.parameters()) + list(inference.buffers()))
    assert not any(p.requires_grad for p in inference.parameters()) and not inference.training
    with torch.no_grad():  # and the same model outside inference mode
        assert torch.equal(inference(data.x, data.edge_index), expected)
    lin = next(m for m in inference.modules() if isinstance(m, qat.QATLinear))
    assert lin.packed_weight() is lin.packed_weight()  # packed once


def test_convert_of_a_model_made_under_inference_mode():
    """A checkpoint loaded under inference mode: every tensor of the QAT model is an inference tensor."""
    model, data = trained("gcn", input_observer="ema")
    state = model.state_dict()
    reference = qat.convert(model)
    with torch.no_grad():
        expected = reference(data.x, data.edge_index)
    with torch.inference_mode():
        fresh = qat.prepare(GCN(16, 8, 4), bits=4, seed=1, skip_last=False, input_observer="ema")
        fresh.load_state_dict(state)
        assert all(p.is_inference() for p in fresh.parameters())
        inference = qat.convert(fresh)
        out = inference(data.x, data.edge_index)
    assert torch.equal(out, expected)
    assert not any(t.is_inference() for t in list(inference.parameters()) + list(inference.buffers()))


@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_qat_model_evaluates_under_inference_mode(kind):
    model, data = trained(kind)
    model.eval()
    with torch.no_grad():
        expected = model(data.x, data.edge_index)
    with torch.inference_mode():
        assert torch.equal(model(data.x, data.edge_index), expected)
    # the model trains on afterwards (nothing it keeps was made under inference mode)
    model.train()
    model(data.x, data.edge_index).sum().backward()


def test_unconverted_qat_model_with_inference_tensors_evaluates():
    """A QAT model (not converted) whose observers hold inference tensors, e.g. loaded under inference mode,
    evaluates under inference mode like the same model outside it (the code cache is skipped, not crashed on)."""
    model, data = trained("gcn", input_observer="ema")
    model.eval()
    with torch.no_grad():
        expected = model(data.x, data.edge_index)
    state = model.state_dict()
    with torch.inference_mode():
        fresh = qat.prepare(GCN(16, 8, 4), bits=4, seed=1, skip_last=False, input_observer="ema").eval()
        fresh.load_state_dict(state)
        assert any(b.is_inference() for b in fresh.buffers())
        out = fresh(data.x, data.edge_index)
    assert torch.equal(out, expected)


NOT_CACHED = "the weight is an inference tensor"


def test_weights_made_under_inference_mode_are_packed_every_call():
    """An inference tensor keeps no version counter: its codes are never cached (a stale cache could not be told),
    and the module says so once (every call quantizes its weight again)."""
    with torch.inference_mode():
        lin = pq.nn.QuantLinear(16, 8, bits=4).eval()
        x = torch.randn(10, 16)
        with pytest.warns(UserWarning, match=NOT_CACHED) as seen:
            first = lin(x)
            lin.weight.mul_(2)  # allowed on an inference tensor inside inference mode
            second = lin(x)
    assert len([w for w in seen if NOT_CACHED in str(w.message)]) == 1  # once per module
    assert lin.weight.is_inference() and not torch.equal(first, second)
    model, data = trained("gcn")
    with torch.inference_mode():
        qlin = qat.convert(model).conv1.lin
        qlin.weight = torch.nn.Parameter(qlin.weight.clone(), requires_grad=False)  # an inference tensor
        with pytest.warns(UserWarning, match="QATLinear: " + NOT_CACHED):
            assert qlin.packed_weight() is not qlin.packed_weight()
        assert torch.equal(qlin.packed_weight().planes, qlin.packed_weight().planes)


def test_a_model_made_outside_inference_mode_caches_its_codes_silently():
    """The supported pattern: create, load and move the model outside inference_mode, call it inside."""
    lin = pq.nn.QuantLinear(16, 8, bits=4).eval()
    x = torch.randn(10, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode():
            first = lin(x)
            assert lin.fused_weight() is lin.fused_weight()  # cached
            assert torch.equal(lin(x), first)


# --- inputs that are quantized already ------------------------------------------------------------------
def spy(monkeypatch, fq):
    calls = []
    real = fq.quantize
    monkeypatch.setattr(fq, "quantize", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def test_qat_linear_takes_fitting_codes_as_they_are(monkeypatch):
    model, data = trained("gcn", bits=4)
    inference = qat.convert(model)
    adj = pq.BitAdjacency.from_edge_index(data.edge_index, data.num_nodes, self_loops=1)
    lin = inference.conv1.lin
    calls = spy(monkeypatch, lin.input_quant)
    seen, fused = [], []
    real_bitmm, real_fused = qat_linear.bitmm, ops.qat_gcn_conv_eval
    monkeypatch.setattr(qat_linear, "bitmm", lambda a, b, **k: seen.append(a) or real_bitmm(a, b, **k))
    monkeypatch.setattr(ops, "qat_gcn_conv_eval", lambda *a, **k: fused.append((a, k)) or real_fused(*a, **k))
    with torch.no_grad():
        expected = inference(data.x, adj)  # the float input: quantized in the fused kernel (qat/eval_path.py)
        xq = pq.to_bit(data.x, 4, dim=1, layout="row")  # the codes the dynamic per-node quantizer makes
        first = len(fused)
        out = inference(xq, adj)
        assert not calls, "a BitTensor that fits the input quantizer must not be quantized again"
        args, kwargs = fused[first]  # conv1's one-op path (CPU) multiplied the input's own planes as they are
        assert kwargs["x_quantized"] and args[13] is xq.planes and not seen
        inference(xq, data.edge_index)  # the general path: conv1's bit GEMM reads the input's own codes
        assert seen[0] is xq and not calls
        inference(data.x, data.edge_index)  # the general path quantizes a float input itself
    assert len(calls) == 1
    assert torch.equal(out, expected)
    with torch.inference_mode():
        assert torch.equal(inference(xq, adj), expected)


@pytest.mark.parametrize("bits,dim", [(2, 1), (4, None), (1, None)])
def test_qat_linear_fewer_bits_and_per_tensor_codes_are_exact(monkeypatch, bits, dim):
    model, data = trained("gcn", bits=4)
    lin = qat.convert(model).conv1.lin
    calls = spy(monkeypatch, lin.input_quant)
    xq = pq.to_bit(data.x, bits, dim=dim, layout="col")  # any layout: bitmm reads it as its A
    w = lin.packed_weight()
    assert lin.bias is None  # GCNConv adds its bias after the aggregation
    expected = (pq.to_val(xq).double() @ pq.to_val(w).double()).float()
    with torch.no_grad():
        out = lin(xq)
    assert not calls
    assert close(out, expected, 1e-6)
    # eval with autograd on (the float path) uses the same values
    lin.weight.requires_grad_(True)
    assert close(lin(xq).detach(), expected, 1e-6)


def test_qat_linear_requantizes_codes_that_do_not_fit(monkeypatch):
    model, data = trained("gcn", bits=4)
    lin = qat.convert(model).conv1.lin
    calls = spy(monkeypatch, lin.input_quant)
    with torch.no_grad():
        for xq in (pq.to_bit(data.x, 8, dim=1), pq.to_bit(data.x, 4, dim=0)):  # too wide; per channel
            out = lin(xq)
            assert torch.equal(out, lin(pq.to_val(xq)))  # read as the floats it holds
    assert len(calls) == 4


def test_quantized_input_in_training_is_unrounded_and_observed():
    torch.manual_seed(0)
    # 4-bit inputs with a static (per-tensor) range and stochastic rounding; the weight stays float so
    # that any rounding of the input would show
    layer = qat.prepare(Linear(16, 8), weight_bits=None, act_bits=4, skip_last=False, input_observer="minmax",
                        stochastic=True, seed=0)
    assert isinstance(layer, qat.QATLinear) and not layer.input_quant.dynamic
    x = torch.randn(50, 16)
    xq = pq.to_bit(x, 3, dim=None)  # 7 steps: not a sub-grid of the 15 of 4 bits, so rounding would move them
    values = pq.to_val(xq)
    out = layer.train()(xq)
    # the values were used as they are (no stochastic rounding) ...
    assert torch.equal(out, F.linear(values, layer.weight, layer.bias))
    # ... and the observer saw them: its range is the one float inputs will be quantized with
    assert torch.equal(layer.input_quant.observer.min_val, values.min().view(1))
    assert torch.equal(layer.input_quant.observer.max_val, values.max().view(1))
    assert not torch.equal(layer.input_quant(values), values)  # (what rounding them would have done)
    out.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    # evaluation (converted, float weight) gives the same for the same codes
    with torch.no_grad():
        assert close(qat.convert(layer)(xq), out.detach(), 1e-6)


def test_qat_gin_aggregates_fitting_codes_as_they_are(monkeypatch):
    model, data = trained("gin", bits=4)
    inference = qat.convert(model)
    conv = inference.conv1
    calls = spy(monkeypatch, conv.agg_quant)
    xq = pq.to_bit(data.x, 4, dim=0, layout="col")  # per channel, as QuantClusterLoader ships features
    adj = pq.BitAdjacency.from_edge_index(data.edge_index, data.num_nodes)
    values = pq.to_val(xq).double()
    dense = torch.zeros(data.num_nodes, data.num_nodes, dtype=torch.float64)
    dense.index_put_((data.edge_index[1], data.edge_index[0]), torch.ones(data.edge_index.size(1),
                                                                          dtype=torch.float64), accumulate=True)
    aggregated = (dense @ values).float() + (1 + conv.eps) * values.float()
    with torch.no_grad():
        out = conv(xq, adj)
        expected = conv.nn(aggregated)
    assert not calls
    assert close(out, expected)
    with torch.no_grad():  # and codes of more bits than agg_quant's are quantized again
        conv(pq.to_bit(data.x, 8, dim=0, layout="col"), adj)
    assert len(calls) == 1


# --- the layers prepare keeps fp32 -------------------------------------------------------------------------
def test_skip_last_gcn_reads_a_bit_adjacency():
    data = planted_graph(nodes=300, seed=6)
    torch.manual_seed(0)
    model = GCN(16, 8, 4)
    prepared = qat.prepare(model, bits=4, seed=0)
    last = prepared.conv2
    assert type(last) is pq.QGCNConv and last.weight_bits is None and last.act_bits is None
    assert last.lin.weight is not model.conv2.lin.weight  # a copy (inplace=False) ...
    assert torch.equal(last.lin.weight, model.conv2.lin.weight) and torch.equal(last.bias, model.conv2.bias)
    assert (last.improved, last.cached, last.add_self_loops, last.normalize) == (False, False, True, True)
    assert set(last.state_dict()) == set(model.conv2.state_dict())
    adj = pq.BitAdjacency.from_edge_index(data.edge_index, data.num_nodes, self_loops=1)
    h = F.relu(torch.randn(data.num_nodes, 8))
    expected = GCNConv(8, 4)
    expected.load_state_dict(model.conv2.state_dict())
    assert close(last(h, adj), expected(h, data.edge_index))
    # the whole prepared model trains and evaluates on the bit adjacency
    train(prepared, data, epochs=2, graph=adj)
    prepared.eval()
    with torch.no_grad():
        on_bits = prepared(data.x, adj)
        on_edges = prepared(data.x, data.edge_index)
    assert close(on_bits, on_edges)
    with torch.no_grad():
        assert torch.equal(qat.convert(prepared)(data.x, adj), on_bits)


def test_skip_last_gin_reads_a_bit_adjacency():
    data = planted_graph(nodes=300, seed=7)
    torch.manual_seed(0)
    model = GINOnly(16, 8, 4)
    prepared = qat.prepare(model, bits=4, seed=0)
    last = prepared.conv2
    assert type(last) is pq.QGINConv and last.act_bits is None
    assert type(last.nn[0]) is Linear  # the MLP stays as it was
    assert float(last.eps) == 0.25 and not isinstance(last.eps, torch.nn.Parameter)
    assert isinstance(prepared.conv1, qat.QATGINConv) and isinstance(prepared.conv1.eps, torch.nn.Parameter)
    state = model.conv2.state_dict()
    assert all(torch.equal(last.state_dict()[k], v) for k, v in state.items())
    adj = pq.BitAdjacency.from_edge_index(data.edge_index, data.num_nodes)  # A, no self-loops (GIN)
    h = torch.randn(data.num_nodes, 8)
    assert close(last(h, adj), model.conv2(h, data.edge_index))
    prepared.train()
    prepared(data.x, adj).sum().backward()
    assert last.nn[0].weight.grad is not None


def test_skip_keeps_sharing_in_place_and_leaves_other_layers():
    model = GIN(16, 8, 4)
    prepared = qat.prepare(model, bits=4, skip=["conv1"], inplace=True)
    assert prepared is model and type(model.conv1) is pq.QGINConv and type(model.head) is Linear
    gcn = GCN(16, 8, 4)
    weight = gcn.conv2.lin.weight
    qat.prepare(gcn, bits=4, inplace=True)
    assert gcn.conv2.lin.weight is weight  # the same Parameter: an optimizer holding it still trains it
    quantized = torch.nn.ModuleList([pq.QGCNConv(16, 8, bits=4), pq.QGCNConv(8, 4, bits=2)])
    kept = qat.prepare(quantized, bits=4)
    assert kept[1].act_bits == 2  # a pyg_quant layer that is skipped is left as it is


def test_prepared_model_runs_on_loader_batches():
    pytest.importorskip("pymetis")
    from pyg_quant.loader import QuantClusterData, QuantClusterLoader

    data = planted_graph(nodes=400, seed=8)
    cluster_data = QuantClusterData(data, num_parts=4, log=False)
    torch.manual_seed(0)
    prepared = qat.prepare(GCN(16, 8, 4), bits=4, seed=0)
    optimizer = torch.optim.Adam(prepared.parameters(), lr=0.01)
    for batch in QuantClusterLoader(cluster_data, batch_size=2, bits=4, shuffle=True):
        prepared.train()
        optimizer.zero_grad()
        F.cross_entropy(prepared(batch.x, batch.adj), batch.y).backward()
        optimizer.step()
    inference = qat.convert(prepared)
    with torch.inference_mode():
        for batch in QuantClusterLoader(cluster_data, batch_size=2, bits=4):
            out = inference(batch.x, batch.adj)
            assert out.shape == (batch.y.numel(), 4) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_disabled_fake_quant_is_not_quantized_in_eval(kind):
    """disable_fake_quant() turns a quantization point off in evaluation too: no bit kernel runs for it (before,
    the eval bit path quantized anyway).  With every point off, the eval output under no_grad (bit path when a
    point quantizes) equals the float path's (autograd on, parameters requiring grad), which passes inputs through."""
    model, data = trained(kind)
    model.eval()
    with torch.no_grad():
        quantized = model(data.x, data.edge_index)
    for _, fq in qat.fake_quantizers(model):
        fq.disable_fake_quant()
    with torch.no_grad():
        out = model(data.x, data.edge_index)
    with torch.enable_grad():  # parameters require grad: the float path everywhere
        expected = model(data.x, data.edge_index).detach()
    assert close(out, expected)
    assert not close(out, quantized)  # the points really were quantized before
