r"""QGINConv and QuantLinear: PyG's GINConv tests adapted, error bounds, gradients, formats, compile.

Oracles (see also tests/test_qgcn_conv.py):

* ``bits=None``: :class:`torch_geometric.nn.GINConv` with the same state dict, ``atol=1e-6``.
* **Same codes.** The aggregation ``A·X̃ + (1+ε)·X`` (``nn = Identity``) and a
  :class:`QuantLinear` are recomputed in float64 from codes made by the public ``pq.to_bit``;
  the bit kernels (eval) and the fake quantization (train) must match to float32 rounding,
  ``FP32_REL`` of the magnitude of the summed terms.
* **Against the float layer** (derived by propagating elementwise error bounds):
  ``|A X̃ − A X| ≤ |A|·s_x/2`` (``X`` per column); a QuantLinear fed ``a_q`` with
  ``|a_q − a| ≤ Δ`` gives ``|ã W̃ᵀ − a Wᵀ| = |(ã − a) W̃ᵀ + a (W̃ − W)ᵀ|
  ≤ (Δ + s_a/2)·|W̃|ᵀ + |a|·1 (s_W/2)ᵀ`` with ``s_a ≤ (range(a) + 2·max Δ)/(2^b − 1)`` per
  row; ReLU is 1-Lipschitz.  Stochastic rounding: ``s`` replaces ``s/2``.
"""
import copy

import pytest
import torch
import torch_geometric.typing
from torch.nn import Linear as Lin
from torch.nn import ReLU
from torch.nn import Sequential as Seq
from torch_geometric.nn import MLP, GINConv
from torch_geometric.typing import SparseTensor
from torch_geometric.utils import coalesce, to_torch_coo_tensor, to_torch_csc_tensor, to_torch_csr_tensor

import pyg_quant as pq
from pyg_quant.nn import QGINConv, QuantLinear

from conftest import gen, random_edges

FP32_REL = 1e-5
PYG_EDGE_INDEX = torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1]])


def mlp(seed=0):
    torch.manual_seed(seed)
    return Seq(Lin(16, 32), ReLU(), Lin(32, 32))


def pair(bits, nn=None, **kwargs):
    """A GINConv and a QGINConv with the same parameters and eps = 0.25."""
    nn = mlp() if nn is None else nn
    ref = GINConv(copy.deepcopy(nn), eps=0.25, train_eps=True)
    conv = QGINConv(copy.deepcopy(nn), eps=0.25, train_eps=True, bits=bits, **kwargs)
    conv.load_state_dict(ref.state_dict())
    return ref, conv


def graph(num_src=300, num_dst=300, num_edges=2000, seed=1):
    """A duplicate-free random (bipartite if num_src != num_dst) graph with tiles and a residual."""
    edge_index = coalesce(random_edges(num_src, num_dst, num_edges, seed), sort_by_row=False)
    x_src = torch.randn(num_src, 16, generator=gen(seed + 1))
    x_dst = torch.randn(num_dst, 16, generator=gen(seed + 2))
    return x_src, x_dst, edge_index


def dense(edge_index, num_src, num_dst, weight=None):
    a = torch.zeros(num_dst, num_src, dtype=torch.float64)
    w = torch.ones(edge_index.size(1), dtype=torch.float64) if weight is None else weight.double()
    return a.index_put_((edge_index[1], edge_index[0]), w, accumulate=True)


def formats(edge_index, num_src, num_dst, weight=None):
    size = (num_dst, num_src)
    out = [("edge_index", edge_index)]
    for name, convert in (("coo", to_torch_coo_tensor), ("csr", to_torch_csr_tensor), ("csc", to_torch_csc_tensor)):
        out.append((name, convert(edge_index.flip(0), weight, size=size)))
    if weight is None:
        out.append(("bit_adjacency", pq.BitAdjacency.from_edge_index(edge_index, (num_src, num_dst))))
        if torch_geometric.typing.WITH_TORCH_SPARSE:
            out.append(("sparse_tensor", SparseTensor.from_edge_index(edge_index, None, (num_src, num_dst)).t()))
    return out


def linear_bound(layer, a_f, delta, step_factor=0.5):
    """``(float output, elementwise bound on |QuantLinear(a_q) − Linear(a_f)|)`` given ``|a_q − a_f| ≤ delta``."""
    wq = pq.to_bit(layer.weight.detach(), layer.weight_bits, dim=1)
    w_deq, w = pq.to_val(wq).double(), layer.weight.detach().double()
    bias = layer.bias.detach().double()
    a_range = a_f.amax(1) - a_f.amin(1) + 2 * delta.amax(1)
    s_a = a_range / (2**layer.act_bits - 1) * (1 + FP32_REL)
    bound = ((delta + step_factor * s_a.view(-1, 1)) @ w_deq.abs().t()
             + a_f.abs().sum(1, keepdim=True) * (step_factor * wq.scale.double().view(1, -1)))
    slack = FP32_REL * ((a_f.abs() + delta) @ w_deq.abs().t() + bias.abs())
    return a_f @ w.t() + bias, bound + slack


def gin_error_bound(conv, x_src, x_dst, edge_index, step_factor=0.5):
    """Float GINConv output and the elementwise bound on |QGINConv − GINConv| for nn = Lin, ReLU, Lin."""
    a = dense(edge_index, x_src.size(0), x_dst.size(0))
    xq = pq.to_bit(x_src, conv.act_bits, dim=0)
    x64 = x_src.double()
    agg = a @ x64 + (1 + conv.eps.detach().double()) * x_dst.double()
    delta = a.abs().sum(1, keepdim=True) * (step_factor * xq.scale.double().view(1, -1))
    delta = delta + FP32_REL * (a.abs() @ x64.abs() + x_dst.double().abs())
    first, relu, second = conv.nn
    y, delta = linear_bound(first, agg, delta, step_factor)
    return linear_bound(second, y.clamp_min(0), delta, step_factor)


def assert_within(out, expected, bound):
    diff = (out.double() - expected.double()).abs()
    worst = float((diff / bound.clamp_min(1e-30)).max())
    assert (diff <= bound).all(), f"{int((diff > bound).sum())} entries over the bound (worst ratio {worst:.3g})"


# --- PyG's test_gin_conv.py, adapted --------------------------------------------------
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_gin_conv(bits):
    x1 = torch.randn(4, 16)
    x2 = torch.randn(2, 16)
    edge_index = PYG_EDGE_INDEX
    adj1 = to_torch_csc_tensor(edge_index, size=(4, 4))

    ref, conv = pair(bits)
    inner = ("  (0): Linear(in_features=16, out_features=32, bias=True)\n  (1): ReLU()\n"
             "  (2): Linear(in_features=32, out_features=32, bias=True)\n") if bits is None else (
        f"  (0): QuantLinear(16, 32, bias=True, bits={bits})\n  (1): ReLU()\n"
        f"  (2): QuantLinear(32, 32, bias=True, bits={bits})\n")
    assert str(conv) == f"QGINConv(nn=Sequential(\n{inner}){'' if bits is None else f', bits={bits}'})"

    for mode in ("train", "eval"):
        getattr(conv, mode)()
        with torch.no_grad():
            # eval with bits: one bit layout and exact integers, so the formats agree bit for bit
            same = torch.equal if (bits is not None and mode == "eval") else \
                (lambda a, b: torch.allclose(a, b, atol=1e-6))
            out = conv(x1, edge_index)
            assert out.size() == (4, 32)
            assert same(conv(x1, edge_index, size=(4, 4)), out)
            assert same(conv(x1, adj1.t()), out)
            if bits is None:
                assert torch.allclose(out, ref(x1, edge_index), atol=1e-6)
            if torch_geometric.typing.WITH_TORCH_SPARSE:
                adj2 = SparseTensor.from_edge_index(edge_index, sparse_sizes=(4, 4))
                assert same(conv(x1, adj2.t()), out)

            # bipartite message passing
            adj1_bip = to_torch_csc_tensor(edge_index, size=(4, 2))
            out1 = conv((x1, x2), edge_index)
            assert out1.size() == (2, 32)
            assert same(conv((x1, x2), edge_index, (4, 2)), out1)
            assert same(conv((x1, x2), adj1_bip.t()), out1)
            out2 = conv((x1, None), edge_index, (4, 2))
            assert out2.size() == (2, 32)
            assert same(conv((x1, None), adj1_bip.t()), out2)
            assert same(conv((x1, None), edge_index), out2)  # num_dst from the edges, as in PyG
            if bits is None:
                assert torch.allclose(out1, ref((x1, x2), edge_index), atol=1e-6)
                assert torch.allclose(out2, ref((x1, None), edge_index, (4, 2)), atol=1e-6)
            if torch_geometric.typing.WITH_TORCH_SPARSE:
                adj2 = SparseTensor.from_edge_index(edge_index, sparse_sizes=(4, 2))
                assert same(conv((x1, x2), adj2.t()), out1)
                assert same(conv((x1, None), adj2.t()), out2)


@pytest.mark.parametrize("bits", [None, 4])
def test_static_gin_conv(bits):
    x = torch.randn(3, 4, 16)
    edge_index = torch.tensor([[0, 0, 0, 1, 2, 3], [1, 2, 3, 0, 0, 0]])
    ref, conv = pair(bits)
    conv.eval()
    with torch.no_grad():
        out = conv(x, edge_index)
        assert out.size() == (3, 4, 32)
        for b in range(3):  # every graph of the batch is quantized with its own ranges
            assert torch.allclose(out[b], conv(x[b], edge_index), atol=1e-6, rtol=0)
        if bits is None:
            assert torch.allclose(out, ref(x, edge_index), atol=1e-6)


# --- same codes -------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4, 1])
@pytest.mark.parametrize("bipartite", [False, True])
def test_aggregation_same_codes_in_both_paths(bits, bipartite):
    x_src, x_dst, edge_index = graph(300, 200 if bipartite else 300)
    x_dst = x_dst if bipartite else x_src
    _, conv = pair(bits, nn=torch.nn.Identity())
    xq = pq.to_bit(x_src, bits, dim=0, layout="col")
    a = dense(edge_index, x_src.size(0), x_dst.size(0))
    expected = a @ pq.to_val(xq).double() + 1.25 * x_dst.double()
    magnitude = a.abs() @ pq.to_val(xq).double().abs() + 1.25 * x_dst.double().abs()
    inputs = (x_src, x_dst) if bipartite else x_src
    for mode in ("eval", "train"):
        getattr(conv, mode)()
        with torch.no_grad():
            assert_within(conv(inputs, edge_index), expected, FP32_REL * magnitude + 1e-30)


@pytest.mark.parametrize("bits", [8, 4, 1])
def test_quant_linear_same_codes_in_both_paths(bits):
    layer = QuantLinear(64, 24, bits=bits)
    x = torch.randn(70, 64, generator=gen(3))
    xq, wq = pq.to_bit(x, bits, dim=1), pq.to_bit(layer.weight.detach(), bits, dim=1)
    x_deq, w_deq = pq.to_val(xq).double(), pq.to_val(wq).double()
    expected = x_deq @ w_deq.t() + layer.bias.detach().double()
    magnitude = x_deq.abs() @ w_deq.abs().t() + layer.bias.detach().double().abs()
    for mode in ("eval", "train"):
        getattr(layer, mode)()
        with torch.no_grad():
            assert_within(layer(x), expected, FP32_REL * magnitude + 1e-30)
            assert_within(layer(x.view(7, 10, 64)).view(70, 24), expected, FP32_REL * magnitude + 1e-30)
    layer.eval()
    with torch.no_grad():  # a BitTensor of the layer's own width and ranges is used as it is
        assert torch.equal(layer(xq), layer(x))


# --- against the float layer ------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_error_bound_against_ginconv(bits):
    x_src, _, edge_index = graph()
    ref, conv = pair(bits)
    out_f, bound = gin_error_bound(conv, x_src, x_src, edge_index)
    with torch.no_grad():
        assert torch.allclose(ref(x_src, edge_index).double(), out_f, atol=1e-4)
        conv.eval()
        assert_within(conv(x_src, edge_index), out_f, bound)
        conv.train()
        assert_within(conv(x_src, edge_index), out_f, bound)


def test_stochastic_rounding():
    x, _, edge_index = graph()
    _, conv = pair(4, stochastic=True)
    out_f, bound = gin_error_bound(conv, x, x, edge_index, step_factor=1.0)
    torch.manual_seed(3)
    first = conv(x, edge_index).detach()
    torch.manual_seed(3)
    assert torch.equal(conv(x, edge_index).detach(), first)
    assert not torch.equal(conv(x, edge_index).detach(), first)
    assert_within(first, out_f, bound)
    conv.eval()
    with torch.no_grad():
        assert torch.equal(conv(x, edge_index), conv(x, edge_index))


@pytest.mark.parametrize("bits", [8, 4])
def test_formats_agree(bits):
    x_src, x_dst, edge_index = graph(300, 200)
    _, conv = pair(bits)
    conv.eval()
    with torch.no_grad():
        want = conv((x_src, x_dst), edge_index)
        for name, adj in formats(edge_index, 300, 200):
            assert torch.equal(conv((x_src, x_dst), adj), want), name
            assert torch.equal(conv((x_src, None), adj, (300, 200)),
                               conv((x_src, None), edge_index, (300, 200))), name


@pytest.mark.parametrize("bits", [None, 8])
def test_weighted_sparse_adjacency(bits):
    """torch.sparse values weight the sum (PyG's spmm); with bits they become adj_bits codes."""
    x_src, _, edge_index = graph(100, 100, 600)
    weight = torch.rand(edge_index.size(1), generator=gen(5)) + 0.5
    ref, conv = pair(bits)
    conv.eval()
    with torch.no_grad():
        for name, adj in formats(edge_index, 100, 100, weight):
            if name == "edge_index":
                continue
            got, want = conv(x_src, adj), ref(x_src, adj)
            if bits is None:
                assert torch.allclose(got, want, atol=1e-5), name
            else:
                assert (got - want).abs().max() < 0.05 * want.abs().max(), name
                assert torch.equal(got, conv(x_src, formats(edge_index, 100, 100, weight)[2][1])), name


# --- gradients --------------------------------------------------------------------------
def test_gradients_match_ginconv_on_dequantized_operands():
    """Straight-through gradients: x, x_dst and eps exactly as GINConv at (X̃, Θ̃); the weight's
    gradient uses the quantized Linear input, within Σ_i |∂L/∂y_ik|·s_a,i/2 of GINConv's."""
    x_src, x_dst, edge_index = graph(300, 200)
    torch.manual_seed(0)
    linear = Lin(16, 8)
    ref, conv = pair(4, nn=linear)
    readout = torch.randn(200, 8, generator=gen(7))
    xs, xd = x_src.clone().requires_grad_(), x_dst.clone().requires_grad_()
    (conv((xs, xd), edge_index) * readout).sum().backward()

    xs_ref = pq.to_val(pq.to_bit(x_src, 4, dim=0)).requires_grad_()
    xd_ref = x_dst.clone().requires_grad_()
    with torch.no_grad():
        ref.nn.weight.copy_(pq.to_val(pq.to_bit(ref.nn.weight, 4, dim=1)))
    (ref((xs_ref, xd_ref), edge_index) * readout).sum().backward()
    for got, want in ((xs.grad, xs_ref.grad), (xd.grad, xd_ref.grad), (conv.eps.grad, ref.eps.grad),
                      (conv.nn.bias.grad, ref.nn.bias.grad)):
        assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)

    agg = (dense(edge_index, 300, 200) @ xs_ref.detach().double() + 1.25 * x_dst.double())
    s_a = (agg.amax(1) - agg.amin(1)) / 15 * (1 + FP32_REL)
    bound = readout.double().abs().t() @ (0.5 * s_a.view(-1, 1)).expand(-1, 16)
    bound = bound + FP32_REL * (readout.double().abs().t() @ agg.abs())
    assert_within(conv.nn.weight.grad, ref.nn.weight.grad, bound)


# --- module plumbing --------------------------------------------------------------------
def test_linears_are_swapped_in_place_sharing_parameters():
    nn = mlp()
    weight = nn[0].weight
    ref_state = copy.deepcopy(nn.state_dict())
    conv = QGINConv(nn, bits=4)
    assert conv.nn is nn and isinstance(nn[0], QuantLinear) and isinstance(nn[2], QuantLinear)
    assert nn[0].weight is weight  # the same Parameter: optimizers and references keep working
    assert set(conv.state_dict()) == {"eps"} | {f"nn.{k}" for k in ref_state}
    # PyG's MLP (PyG Linear inside a ModuleList) and a lazy Linear are found too
    pyg_mlp = MLP([-1, 32, 32], norm=None)
    conv = QGINConv(pyg_mlp, bits=4)
    assert all(isinstance(lin, QuantLinear) for lin in pyg_mlp.lins)
    out = conv(torch.randn(4, 16), PYG_EDGE_INDEX)
    assert out.size() == (4, 32) and pyg_mlp.lins[0].weight.shape == (32, 16)
    # a float GIN's state dict loads into the quantized one
    float_conv = GINConv(mlp())
    QGINConv(mlp(), bits=4).load_state_dict(float_conv.state_dict())


def test_bit_tensor_inputs_and_out_bits():
    x, _, edge_index = graph(60, 60, 300)
    _, first = pair(4)
    second = QGINConv(Seq(Lin(32, 32), ReLU(), Lin(32, 32)), bits=4)
    chained = copy.deepcopy(first)
    chained.out_bits = 4
    for module in (first, second, chained):
        module.eval()
    with torch.no_grad():
        hidden = chained(x, edge_index)
        assert isinstance(hidden, pq.BitTensor) and hidden.dim == 0 and hidden.layout == "col"
        float_hidden = first(x, edge_index)
        assert torch.equal(pq.to_val(hidden), pq.to_val(pq.to_bit(float_hidden, 4, dim=0)))
        # per-channel codes are aggregated as they are; the self term reads their values
        assert torch.allclose(second(hidden, edge_index),
                              second((pq.to_val(hidden), pq.to_val(hidden)), edge_index), atol=1e-6)
        per_node = pq.to_bit(float_hidden, 4, dim=1)  # ranges that do not factor: read as floats
        assert torch.equal(second(per_node, edge_index), second(pq.to_val(per_node), edge_index))
    chained.train()
    assert isinstance(chained(x, edge_index), torch.Tensor)


# --- compile ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_dynamo_explain_no_graph_breaks(bits, mode):
    x, _, edge_index = graph(60, 60, 300)
    _, conv = pair(bits)
    getattr(conv, mode)()
    with torch.set_grad_enabled(mode == "train"):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(conv)(x, edge_index)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1


def test_compiled_equals_eager():
    x_src, x_dst, edge_index = graph(60, 40, 300)
    _, conv = pair(4)
    conv.eval()
    torch._dynamo.reset()
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for args in ((x_src[:40], edge_index[:, edge_index[0] < 40]), ((x_src, x_dst), edge_index),
                     ((x_src, x_dst), pq.BitAdjacency.from_edge_index(edge_index, (60, 40)))):
            assert torch.equal(compiled(*args), conv(*args))


# --- bad inputs -------------------------------------------------------------------------
def test_bad_arguments():
    for kwargs, error, name in ((dict(bits=0), ValueError, "bits"), (dict(bits=9), ValueError, "bits"),
                                (dict(bits="4"), TypeError, "bits"), (dict(act_bits=-1), ValueError, "act_bits"),
                                (dict(adj_bits=9), ValueError, "adj_bits"), (dict(out_dim=3), ValueError, "out_dim"),
                                (dict(aggr="max"), ValueError, "aggr")):
        with pytest.raises(error, match=name):
            QGINConv(mlp(), **kwargs)
    with pytest.raises(ValueError, match="weight_bits"):
        QuantLinear(4, 4, weight_bits=16)


def test_bad_inputs():
    x_src, x_dst, edge_index = graph(60, 40, 300)
    conv = QGINConv(mlp(), bits=4)
    with pytest.raises(ValueError, match=r"size\[1\]=30 but x has 40 target nodes"):
        conv((x_src, x_dst), edge_index, (60, 30))
    with pytest.raises(ValueError, match=r"size\[0\]"):
        conv((x_src, x_dst), edge_index, (50, 40))
    with pytest.raises(ValueError, match="out of range"):
        conv((x_src, x_dst[:10]), edge_index)
    with pytest.raises(ValueError, match="BitAdjacency of shape"):
        conv((x_src, x_dst), pq.BitAdjacency.from_edge_index(edge_index, (60, 50)))
    with pytest.raises(ValueError, match="sparse tensor of shape"):
        conv((x_src, x_dst), to_torch_csr_tensor(edge_index.flip(0), size=(60, 40)))
    with pytest.raises(ValueError, match="x_src"):
        conv((None, x_dst), edge_index)
    with pytest.raises(ValueError, match="x has 12 features"):
        conv((x_src[:, :12], x_dst[:, :12]), edge_index)
    with pytest.raises(ValueError, match="NaN or inf"):
        conv((torch.full_like(x_src, float("inf")), x_dst), edge_index)
    with pytest.raises(TypeError, match="pair"):
        conv([x_src], edge_index)
