r"""QGCNConv: PyG's GCNConv tests adapted, plus quantization error bounds, gradients, formats and compile.

Oracles:

* ``bits=None`` is compared with :class:`torch_geometric.nn.GCNConv` holding the same
  state dict, at PyG's own tolerance (``atol=1e-6``).
* **Same codes.** :func:`replay` recomputes a layer's quantized operands with the public
  ``pq.to_bit`` / ``pq.bitmm`` (the same float32 steps give the same codes) and evaluates
  ``D^-1/2 Â (D^-1/2 H)`` densely in float64.  Both the bit-kernel path (eval) and the
  fake-quantization path (train) must match it to float32 rounding: ``FP32_REL`` (1e-5, about
  170 float32 ulps) of the magnitude ``D^-1/2|Â|D^-1/2 |H|`` of the terms summed.
* **Against the float layer** (:func:`gcn_error_bound`, derived, not picked): with
  ``X̃ = X + E_x`` (``|E_x| ≤ s_x/2`` per row), ``Θ̃ = Θ + E_Θ`` (``≤ s_Θ/2`` per output
  channel), ``H̃' = D_q^-1/2 X̃Θ̃ + E_h`` (``≤ s_h/2`` per channel) and ``N = D^-1/2 Â D^-1/2``::

      out_q − out_f = N_q (X̃Θ̃ − XΘ) + (N_q − N_f) XΘ + D_q^-1/2 Â_q E_h
      |X̃Θ̃ − XΘ| = |E_x Θ̃ + X E_Θ| ≤ (s_x/2)·1ᵀ|Θ̃| + |X|·1 (s_Θ/2)ᵀ

  so ``|out_q − out_f| ≤ |N_q|·B_H + |N_q − N_f|·|XΘ| + D_q^-1/2|Â_q|·s_h/2`` (+ the float32
  allowance).  Stochastic rounding moves a value by less than one step: ``s`` replaces ``s/2``.
"""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
import torch_geometric.typing
from torch_geometric.nn import GCNConv
from torch_geometric.typing import SparseTensor
from torch_geometric.utils import coalesce, to_torch_coo_tensor, to_torch_csc_tensor, to_torch_csr_tensor

import pyg_quant as pq
from pyg_quant.nn import QGCNConv
from pyg_quant.graph.packing import decode_bit_adjacency, pack_entries
from pyg_quant.graph.quant_graph import QuantGraph

from conftest import DEVICES, gen, random_edges

FP32_REL = 1e-5
PYG_EDGE_INDEX = torch.tensor([[0, 0, 0, 1, 2, 3], [1, 2, 3, 0, 0, 0]])


def pair(bits, seed=0, **kwargs):
    """A GCNConv and a QGCNConv with the same parameters (bias made non-zero so it is exercised)."""
    torch.manual_seed(seed)
    ref = GCNConv(16, 32, **kwargs)
    if ref.bias is not None:
        torch.nn.init.uniform_(ref.bias, -0.5, 0.5)
    conv = QGCNConv(16, 32, bits=bits, **kwargs)
    conv.load_state_dict(ref.state_dict())
    return ref, conv


def graph(num_nodes=300, num_edges=2000, seed=1):
    """A loop- and duplicate-free random graph big enough for both bit tiles and the CSR residual.

    (PyG's sparse converters merge repeated edges, so a graph with repeats would not be
    the same graph in every format.)
    """
    edge_index = coalesce(random_edges(num_nodes, num_nodes, num_edges, seed, loops=False))
    x = torch.randn(num_nodes, 16, generator=gen(seed + 1))
    weight = torch.rand(edge_index.size(1), generator=gen(seed + 2)) + 0.5
    return x, edge_index, weight


def formats(edge_index, weight, n):
    """Every adjacency format of the same graph, as ``(name, adj, edge_weight)``; sparse ones are ``adj_t``."""
    out = [("edge_index", edge_index, weight)]
    for name, convert in (("coo", to_torch_coo_tensor), ("csr", to_torch_csr_tensor), ("csc", to_torch_csc_tensor)):
        out.append((name, convert(edge_index.flip(0), weight, size=(n, n)), None))
    # PyG's own spelling: the transpose of a COO (uncoalesced view) and of a CSC (a CSR)
    out.append(("coo.t()", to_torch_coo_tensor(edge_index, weight, size=(n, n)).t(), None))
    out.append(("csc.t()", to_torch_csc_tensor(edge_index, weight, size=(n, n)).t(), None))
    if weight is None:
        out.append(("bit_adjacency", pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1), None))
        out.append(("bit_adjacency_no_diag", pq.BitAdjacency.from_edge_index(edge_index, n), None))
    if torch_geometric.typing.WITH_TORCH_SPARSE:
        out.append(("sparse_tensor", SparseTensor.from_edge_index(edge_index, weight, (n, n)).t(), None))
    return out


def dense_norm(edge_index, weight, n, fill=1.0):
    """``(Â, D^-1/2)`` in float64 for a loop-free graph: ``Â = A + fill·I``."""
    a_hat = torch.zeros(n, n, dtype=torch.float64)
    w = torch.ones(edge_index.size(1), dtype=torch.float64) if weight is None else weight.double()
    a_hat.index_put_((edge_index[1], edge_index[0]), w, accumulate=True)
    a_hat += fill * torch.eye(n, dtype=torch.float64)
    deg = a_hat.sum(1)
    return a_hat, deg.pow(-0.5)


def quantized_weights(weight, adj_bits):
    """Edge weights as the layer codes them: one range for the tensor, nearest rounding."""
    if weight is None:
        return None
    return pq.to_val(pq.to_bit(weight.view(1, -1), adj_bits)).view(-1)


def degree_like_layer(edge_index, weight, n, adj_bits=8, fill=1.0):
    """float32 degree exactly as the layer evaluates it (integer row sums, float64, one rounding)."""
    dst = edge_index[1]
    count = torch.zeros(n, dtype=torch.int64).index_add_(0, dst, torch.ones_like(dst))
    if weight is None:
        return (count.double() + fill).float()
    wq = pq.to_bit(weight.view(1, -1), adj_bits)
    codes = torch.zeros(n, dtype=torch.int64).index_add_(0, dst, wq.codes().view(-1).long())
    return (wq.lo.double() * count.double() + wq.scale.double() * codes.double() + fill).float()


def replay(conv, x, edge_index, weight, bits_path):
    """float64 output of ``conv`` (normalize=True, loop-free graph) from its own codes, and the term magnitudes."""
    n, bits = x.size(0), conv.act_bits
    xq = pq.to_bit(x, bits, dim=1)
    wq_t = pq.to_bit(conv.lin.weight.detach().t(), conv.weight_bits, dim=0, layout="col")
    if bits_path:
        h = pq.bitmm(xq, wq_t)
    else:
        h = F.linear(pq.to_val(xq), pq.to_val(wq_t).t())
    dinv = degree_like_layer(edge_index, weight, n, conv.adj_bits).pow(-0.5)
    hq = pq.to_bit(h * dinv.view(-1, 1), bits, dim=0, layout="col")
    a_hat, _ = dense_norm(edge_index, quantized_weights(weight, conv.adj_bits), n)
    h64 = pq.to_val(hq).double()
    d = dinv.double().view(-1, 1)
    out = d * (a_hat @ h64) + conv.bias.detach().double()
    magnitude = d * (a_hat.abs() @ h64.abs()) + conv.bias.detach().double().abs()
    return out, magnitude


def gcn_error_bound(conv, x, edge_index, weight, step_factor=0.5):
    """Elementwise bound on |QGCNConv − GCNConv| (see the module docstring), float64."""
    n = x.size(0)
    xq = pq.to_bit(x, conv.act_bits, dim=1)
    wq = pq.to_bit(conv.lin.weight.detach(), conv.weight_bits, dim=1)
    w_t, w_deq_t = conv.lin.weight.detach().double().t(), pq.to_val(wq).double().t()
    x64 = x.double()
    h_f = x64 @ w_t
    h_q = pq.to_val(xq).double() @ w_deq_t
    b_h = (step_factor * xq.scale.double().view(-1, 1) * w_deq_t.abs().sum(0).view(1, -1)
           + x64.abs().sum(1, keepdim=True) * (step_factor * wq.scale.double().view(1, -1)))
    a_f, dinv_f = dense_norm(edge_index, weight, n)
    a_q, dinv_q = dense_norm(edge_index, quantized_weights(weight, conv.adj_bits), n)
    n_f = dinv_f.view(-1, 1) * a_f * dinv_f.view(1, -1)
    n_q = dinv_q.view(-1, 1) * a_q * dinv_q.view(1, -1)
    h_prime = dinv_q.view(-1, 1) * h_q
    s_h = (h_prime.amax(0) - h_prime.amin(0)) / (2**conv.act_bits - 1) * (1 + FP32_REL)
    bound = (n_q.abs() @ b_h + (n_q - n_f).abs() @ h_f.abs()
             + (dinv_q.view(-1, 1) * a_q.abs()).sum(1, keepdim=True) * (step_factor * s_h.view(1, -1)))
    out_f = n_f @ h_f + conv.bias.detach().double()
    return bound + FP32_REL * (n_q.abs() @ h_q.abs() + out_f.abs()), out_f


def assert_within(out, expected, bound):
    diff = (out.double() - expected.double()).abs()
    worst = float((diff / bound.clamp_min(1e-30)).max())
    assert (diff <= bound).all(), f"{int((diff > bound).sum())} entries over the bound (worst ratio {worst:.3g})"


# --- PyG's test_gcn_conv.py, adapted --------------------------------------------------
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_gcn_conv(bits):
    x = torch.randn(4, 16)
    edge_index = PYG_EDGE_INDEX
    value = torch.rand(edge_index.size(1))
    adj1 = to_torch_csc_tensor(edge_index, size=(4, 4))
    adj2 = to_torch_csc_tensor(edge_index, value, size=(4, 4))

    ref, conv = pair(bits)
    assert str(conv) == ("QGCNConv(16, 32)" if bits is None else f"QGCNConv(16, 32, bits={bits})")

    for mode in ("train", "eval"):
        getattr(conv, mode)()
        with torch.no_grad():
            out1 = conv(x, edge_index)
            out2 = conv(x, edge_index, value)
        assert out1.size() == (4, 32) and out2.size() == (4, 32)
        with torch.no_grad():
            if bits is not None and mode == "eval":
                # one bit layout, exact integer products: the formats agree to the last bit
                assert torch.equal(conv(x, adj1.t()), out1)
                assert torch.equal(conv(x, adj2.t()), out2)
            else:  # float sums, in each format's edge order
                assert torch.allclose(conv(x, adj1.t()), out1, atol=1e-6)
                assert torch.allclose(conv(x, adj2.t()), out2, atol=1e-6)
        if bits is None:
            assert torch.allclose(out1, ref(x, edge_index), atol=1e-6)
            assert torch.allclose(out2, ref(x, edge_index, value), atol=1e-6)

        if torch_geometric.typing.WITH_TORCH_SPARSE:
            adj3 = SparseTensor.from_edge_index(edge_index, sparse_sizes=(4, 4))
            adj4 = SparseTensor.from_edge_index(edge_index, value, (4, 4))
            assert torch.allclose(conv(x, adj3.t()), out1, atol=1e-6)
            assert torch.allclose(conv(x, adj4.t()), out2, atol=1e-6)

    # PyG's `cached`: the first call's normalized graph is reused, whatever is passed later.
    conv.cached = True
    conv(x, edge_index)
    assert conv._cached_edge_index is not None and conv._cached_adj_t is None  # PyG's own check
    assert conv._cached_graph is not None
    assert torch.allclose(conv(x, edge_index), out1, atol=1e-6)
    assert torch.allclose(conv(x, adj1.t()), out1, atol=1e-6)
    assert torch.allclose(conv(x, adj2.t()), out1, atol=1e-6)
    if bits is not None:  # in eval the packed bit tiles are part of the cache
        with torch.no_grad():
            conv(x, edge_index)
        assert conv._cached_graph._packed is not None
    conv.reset_parameters()
    assert conv._cached_graph is None
    assert conv._cached_edge_index is None and conv._cached_adj_t is None


@pytest.mark.parametrize("bits", [None, 4])
def test_pyg_cache_attributes(bits):
    """PyG's ``_cached_edge_index`` / ``_cached_adj_t``: one per input kind, and None means "recompute" (PyG's
    tests and users drop a cached graph by setting it to None).  bits=None is compared with GCNConv doing the same."""
    x, edge_index, _ = graph(60, 300, seed=11)
    _, other, _ = graph(60, 300, seed=12)
    n = x.size(0)
    ref, conv = pair(bits, cached=True)
    fresh = copy.deepcopy(conv)
    fresh.cached = False
    for layer in (ref, conv):
        layer.eval()
    fresh.eval()
    with torch.no_grad():
        out1 = conv(x, edge_index)
        assert conv._cached_edge_index is not None and conv._cached_adj_t is None
        assert torch.equal(conv(x, other), out1)  # stale, as PyG's
        conv._cached_edge_index = None
        assert torch.equal(conv(x, other), fresh(x, other))
        assert not torch.allclose(fresh(x, other), out1, atol=1e-3)
        if bits is None:
            assert torch.allclose(ref(x, edge_index), out1, atol=1e-6)
            assert torch.allclose(ref(x, other), out1, atol=1e-6)  # PyG keeps its stale graph too
            ref._cached_edge_index = None
            assert torch.allclose(ref(x, other), conv(x, other), atol=1e-6)
        # A BitAdjacency (an adj_t PyG does not know) is cached beside the edge_index graph, like a SparseTensor.
        adj = pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1)
        from_adj = conv(x, adj)
        # (bits=None: an uncached layer runs the float short path on a BitAdjacency, its own float32 roundings)
        same = torch.equal if bits is not None else (lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6))
        assert same(from_adj, fresh(x, adj)) and conv._cached_adj_t is not None
        assert torch.equal(conv(x, pq.BitAdjacency.from_edge_index(other, n, self_loops=1)), from_adj)
        assert torch.equal(conv(x, edge_index), fresh(x, other))  # the edge_index graph is still the other's
        conv._cached_adj_t = None
        assert conv._cached_adj_t is None and conv._cached_edge_index is not None
        assert same(conv(x, pq.BitAdjacency.from_edge_index(other, n, self_loops=1)), fresh(x, other))
        conv.reset_parameters()
        assert conv._cached_edge_index is None and conv._cached_adj_t is None


@pytest.mark.parametrize("bits", [None, 4])
def test_cached_without_normalization_caches_nothing(bits):
    """As in PyG, ``cached`` only caches the normalization: with ``normalize=False`` every call uses its own graph."""
    x, edge_index, weight = graph(60, 300, seed=13)
    ref, conv = pair(bits, cached=True, normalize=False)
    conv.eval()
    with torch.no_grad():
        first = conv(x, edge_index, weight)
        second = conv(x, edge_index, weight * 2)
        assert conv._cached_edge_index is None and conv._cached_adj_t is None
        assert not torch.allclose(first, second, atol=1e-3)
        if bits is None:
            assert torch.allclose(second, ref(x, edge_index, weight * 2), atol=1e-5)


@pytest.mark.parametrize("bits", [None, 4])
def test_gcn_conv_with_decomposed_layers(bits):
    x = torch.randn(4, 16)
    _, conv = pair(bits)
    decomposed_conv = copy.deepcopy(conv)
    decomposed_conv.decomposed_layers = 2
    for module in (conv, decomposed_conv):
        module.eval()
    with torch.no_grad():
        assert torch.equal(conv(x, PYG_EDGE_INDEX), decomposed_conv(x, PYG_EDGE_INDEX))


@pytest.mark.parametrize("bits", [None, 8])
def test_gcn_conv_with_sparse_input_feature(bits):
    x = torch.sparse_coo_tensor(indices=torch.tensor([[0, 0], [0, 1]]), values=torch.tensor([1., 1.]),
                                size=torch.Size([4, 16]))
    ref, conv = pair(bits)
    out = conv(x, PYG_EDGE_INDEX)
    assert out.size() == (4, 32)
    assert torch.allclose(out, conv(x.to_dense(), PYG_EDGE_INDEX), atol=1e-6)
    if bits is None:
        assert torch.allclose(out, ref(x, PYG_EDGE_INDEX), atol=1e-6)


@pytest.mark.parametrize("bits", [None, 4])
def test_static_gcn_conv(bits):
    x = torch.randn(3, 4, 16)
    ref, conv = pair(bits)
    conv.eval()
    with torch.no_grad():
        out = conv(x, PYG_EDGE_INDEX)
        assert out.size() == (3, 4, 32)
        # each graph of the batch is quantized with its own ranges, as if alone
        for b in range(3):
            assert torch.allclose(out[b], conv(x[b], PYG_EDGE_INDEX), atol=1e-6, rtol=0)
        if bits is None:
            assert torch.allclose(out, ref(x, PYG_EDGE_INDEX), atol=1e-6)


@pytest.mark.parametrize("bits", [None, 4])
def test_gcn_conv_norm(bits):
    x = torch.randn(4, 16)
    edge_index = torch.tensor([[0, 0, 0], [1, 2, 3]])
    _, conv = pair(bits, flow="source_to_target")
    conv.eval()
    with torch.no_grad():
        out1 = conv(x, edge_index)
        conv.flow = "target_to_source"
        out2 = conv(x, edge_index.flip(0))
    assert torch.allclose(out1, out2, atol=1e-6)


@pytest.mark.parametrize("layout", ["edge_index", torch.sparse_coo])
def test_gcn_norm_gradient(layout):
    """PyG checks that gcn_norm keeps the weights' autograd graph; here the layer must pass it on."""
    x = torch.randn(4, 16)
    edge_weight = torch.rand(PYG_EDGE_INDEX.size(1)).requires_grad_()
    _, conv = pair(4)
    if layout == "edge_index":
        out = conv(x, PYG_EDGE_INDEX, edge_weight)
    else:
        out = conv(x, to_torch_coo_tensor(PYG_EDGE_INDEX, edge_weight, size=(4, 4)).t())
    out.sum().backward()
    assert edge_weight.grad is not None and torch.isfinite(edge_weight.grad).all()
    assert edge_weight.grad.abs().sum() > 0


# --- quantized: same codes, error bounds, formats -------------------------------------
@pytest.mark.parametrize("form", ["tiles", "csr"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("bits", [8, 4, 1])
def test_same_codes_in_both_paths(bits, weighted, form, monkeypatch):
    """The bit kernels (eval) and the fake quantization (train) compute GCN on the same codes, whichever form the
    layer packs its adjacency in (the default form set to "auto": tiles when MIN_TILE_FILL is 0, none above 1)."""
    monkeypatch.setattr(pq.graph.adjacency_form, "DEFAULT_ADJACENCY", "auto")
    monkeypatch.setattr(pq.graph.adjacency_form, "MIN_TILE_FILL", 0.0 if form == "tiles" else 2.0)
    x, edge_index, weight = graph()
    weight = weight if weighted else None
    _, conv = pair(bits)
    packed = pq.BitAdjacency.from_edge_index(edge_index, 300)
    if form == "tiles":
        assert packed.num_tiles > 0 and packed.res_nnz > 0  # both parts of the format are exercised
    else:
        assert packed.num_tiles == 0 and packed.res_nnz == packed.nnz
    for bits_path in (True, False):
        conv.train(not bits_path)
        with torch.no_grad():
            out = conv(x, edge_index, weight)
        expected, magnitude = replay(conv, x, edge_index, weight, bits_path)
        assert_within(out, expected, FP32_REL * magnitude + 1e-30)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_error_bound_against_gcnconv(bits, weighted):
    x, edge_index, weight = graph()
    weight = weight if weighted else None
    ref, conv = pair(bits)
    bound, out_f = gcn_error_bound(conv, x, edge_index, weight)
    with torch.no_grad():
        assert torch.allclose(ref(x, edge_index, weight).double(), out_f, atol=1e-5)  # the bound's float GCN is PyG's
        conv.eval()
        assert_within(conv(x, edge_index, weight), out_f, bound)
        conv.train()
        assert_within(conv(x, edge_index, weight), out_f, bound)


def test_stochastic_rounding():
    x, edge_index, _ = graph()
    ref, conv = pair(4)
    conv.stochastic = conv.lin.stochastic = True
    bound, out_f = gcn_error_bound(conv, x, edge_index, None, step_factor=1.0)
    torch.manual_seed(5)
    first = conv(x, edge_index)
    torch.manual_seed(5)
    assert torch.equal(conv(x, edge_index), first)
    torch.manual_seed(6)
    second = conv(x, edge_index)
    assert not torch.equal(first, second)
    assert_within(first.detach(), out_f, bound)
    # unbiased: the mean of many draws approaches the nearest-free expectation, i.e. the float layer
    mean = torch.stack([conv(x, edge_index).detach() for _ in range(64)]).mean(0)
    assert (mean.double() - out_f).abs().mean() < 0.25 * (first.detach().double() - out_f).abs().mean()
    conv.eval()
    with torch.no_grad():  # eval rounds to nearest whatever `stochastic` says
        assert torch.equal(conv(x, edge_index), conv(x, edge_index))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_formats_agree(bits, weighted):
    x, edge_index, weight = graph()
    weight = weight if weighted else None
    _, conv = pair(bits)
    conv.eval()
    with torch.no_grad():
        want = conv(x, edge_index, weight)
        for name, adj, edge_weight in formats(edge_index, weight, 300):
            # one bit layout, one kernel: exact integers and the same float64 epilogue
            assert torch.equal(conv(x, adj, edge_weight), want), name
        conv.train()
        want = conv(x, edge_index, weight)
        for name, adj, edge_weight in formats(edge_index, weight, 300):
            assert torch.allclose(conv(x, adj, edge_weight), want, atol=1e-5, rtol=1e-5), name


@pytest.mark.parametrize("bits", [None, 8])
def test_self_loops_and_duplicates_follow_pyg(bits):
    """Graphs with loops and repeated edges: each format gets PyG's own self-loop rule."""
    edge_index = torch.cat([random_edges(40, 40, 300, 7), torch.tensor([[3, 3, 5, 9], [3, 3, 5, 1]])], 1)
    weight = torch.rand(edge_index.size(1), generator=gen(8)) + 0.5
    x = torch.randn(40, 16, generator=gen(9))
    for improved in (False, True):
        ref, conv = pair(bits, improved=improved)
        conv.eval()
        with torch.no_grad():
            for adj, ew in ((edge_index, None), (edge_index, weight),
                            (to_torch_csr_tensor(edge_index.flip(0), size=(40, 40)), None),
                            (to_torch_coo_tensor(edge_index.flip(0), weight, size=(40, 40)), None)):
                got, want = conv(x, adj, ew), ref(x, adj, ew)
                if bits is None:
                    assert torch.allclose(got, want, atol=1e-5)
                else:
                    assert (got - want).abs().max() < 0.05 * want.abs().max()
            if bits is not None:  # a BitAdjacency follows add_remaining_self_loops with fill 1 or 2
                ones = torch.ones(edge_index.size(1))
                adj = pq.BitAdjacency.from_edge_index(edge_index, 40, self_loops=2 if improved else 1)
                assert torch.equal(conv(x, adj), conv(x, edge_index, ones))
                assert torch.equal(conv(x, pq.BitAdjacency.from_edge_index(edge_index, 40)), conv(x, edge_index, ones))


def test_improved_follows_pyg_per_format():
    """PyG's gcn_norm gives an unweighted edge_index loops of weight 1 even when improved; weights get 2."""
    x, edge_index, _ = graph(40, 200)
    ref, conv = pair(None, improved=True)
    plain, _ = pair(None)
    ones = torch.ones(edge_index.size(1))
    assert torch.allclose(conv(x, edge_index), plain(x, edge_index), atol=1e-6)
    assert torch.allclose(conv(x, edge_index, ones), ref(x, edge_index, ones), atol=1e-6)
    assert not torch.allclose(conv(x, edge_index, ones), conv(x, edge_index), atol=1e-3)


@pytest.mark.parametrize("normalize", [True, False])
def test_options_match_pyg(normalize):
    x, edge_index, weight = graph(60, 300)
    for kwargs in (dict(improved=True), dict(add_self_loops=False), dict(bias=False)):
        if not normalize and kwargs.get("add_self_loops", True) is not False:
            kwargs = dict(kwargs, add_self_loops=False)
        ref, conv = pair(None, normalize=normalize, **kwargs)
        assert torch.allclose(conv(x, edge_index, weight), ref(x, edge_index, weight), atol=1e-5)
        _, qconv = pair(8, normalize=normalize, **kwargs)
        qconv.eval()
        with torch.no_grad():
            out = qconv(x, edge_index, weight)
        assert (out - ref(x, edge_index, weight)).abs().max() < 0.05 * ref(x, edge_index, weight).abs().max()


def test_lazy_in_channels():
    x, edge_index, _ = graph(60, 300)
    conv = QGCNConv(-1, 32, bits=4)
    assert str(conv) == "QGCNConv(-1, 32, bits=4)"
    out = conv(x, edge_index)
    assert out.size() == (60, 32) and conv.lin.weight.shape == (32, 16)
    eager = QGCNConv(16, 32, bits=4)
    eager.load_state_dict(conv.state_dict())
    assert torch.equal(eager(x, edge_index), out)


def test_mixed_widths_and_float_edge_weights():
    x, edge_index, weight = graph(60, 300)
    ref, _ = pair(None)
    for kwargs in (dict(weight_bits=4, act_bits=8), dict(weight_bits=4, act_bits=None),
                   dict(weight_bits=None, act_bits=4), dict(bits=4, adj_bits=None)):
        conv = QGCNConv(16, 32, **kwargs)
        conv.load_state_dict(ref.state_dict())
        conv.eval()
        with torch.no_grad():
            got, want = conv(x, edge_index, weight), ref(x, edge_index, weight)
            assert (got - want).abs().max() < 0.2 * want.abs().max()
            conv.train()
            assert torch.allclose(conv(x, edge_index, weight), got, atol=1e-5)
    assert str(QGCNConv(16, 32, weight_bits=4, act_bits=8)) == "QGCNConv(16, 32, weight_bits=4, act_bits=8)"


def test_bit_tensor_input_and_out_bits():
    """A stack hands BitTensors on: the same numbers as quantizing the float output in the next layer."""
    x, edge_index, _ = graph(60, 300)
    _, first = pair(4, seed=1)
    second = QGCNConv(32, 32, bits=4)
    chained = copy.deepcopy(first)
    chained.out_bits = 4
    for module in (first, second, chained):
        module.eval()
    with torch.no_grad():
        hidden = chained(x, edge_index)
        assert isinstance(hidden, pq.BitTensor) and hidden.bits == 4 and hidden.dim == 1
        assert torch.equal(pq.to_val(hidden), pq.to_val(pq.to_bit(first(x, edge_index), 4, dim=1)))
        assert torch.equal(second(hidden, edge_index), second(first(x, edge_index), edge_index))
        # codes that do not fit (another width) are read as the floats they hold
        wide = pq.to_bit(first(x, edge_index), 8, dim=0)
        assert torch.equal(second.lin(wide), second.lin(pq.to_val(wide)))
    chained.train()
    assert isinstance(chained(x, edge_index), torch.Tensor)  # training hands floats on


# --- gradients --------------------------------------------------------------------------
def test_gradients_match_gcnconv_on_dequantized_operands():
    """Straight-through: the gradients are GCNConv's at X̃, Θ̃ (exact: the layer is linear in H̃')."""
    x, edge_index, _ = graph(60, 300)
    ref, conv = pair(4)
    readout = torch.randn(60, 32, generator=gen(3))
    x_leaf = x.clone().requires_grad_()
    (conv(x_leaf, edge_index) * readout).sum().backward()

    x_deq = pq.to_val(pq.to_bit(x, 4, dim=1)).requires_grad_()
    with torch.no_grad():
        ref.lin.weight.copy_(pq.to_val(pq.to_bit(ref.lin.weight, 4, dim=1)))
    (ref(x_deq, edge_index) * readout).sum().backward()
    for got, want in ((x_leaf.grad, x_deq.grad), (conv.lin.weight.grad, ref.lin.weight.grad),
                      (conv.bias.grad, ref.bias.grad)):
        assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


def test_edge_weight_gradient_matches_float64_reference():
    """d out / d w through the codes (straight-through) and the degrees, against float64 autograd."""
    x, edge_index, weight = graph(60, 300)
    _, conv = pair(4)
    readout = torch.randn(60, 32, generator=gen(4))
    w_leaf = weight.clone().requires_grad_()
    (conv(x, edge_index, w_leaf) * readout).sum().backward()

    w64 = weight.double().requires_grad_()
    w_q = quantized_weights(weight, conv.adj_bits).double() + (w64 - w64.detach())
    h = F.linear(pq.to_val(pq.to_bit(x, 4, dim=1)), pq.to_val(pq.to_bit(conv.lin.weight.detach(), 4, dim=1)))
    deg = torch.ones(60, dtype=torch.float64).index_add(0, edge_index[1], w_q)
    dinv = deg.pow(-0.5)
    h_prime = h.double() * dinv.view(-1, 1)
    dinv32 = degree_like_layer(edge_index, weight, 60).pow(-0.5)
    h_codes = pq.to_val(pq.to_bit(h * dinv32.view(-1, 1), 4, dim=0, layout="col")).double()
    h_q = h_codes + (h_prime - h_prime.detach())
    a_hat = torch.zeros(60, 60, dtype=torch.float64).index_put((edge_index[1], edge_index[0]), w_q, accumulate=True)
    out = dinv.view(-1, 1) * (a_hat @ h_q + h_q)
    (out * readout.double()).sum().backward()
    assert torch.allclose(w_leaf.grad.double(), w64.grad, atol=1e-4 * float(w64.grad.abs().max()), rtol=1e-4)


# --- adjacency formats internals --------------------------------------------------------
def test_pack_entries_is_from_edge_index_layout():
    for n, e, min_tile_nnz in ((300, 6000, 16), (40, 900, 1)):
        edge_index = torch.randint(0, n, (2, e), generator=gen(n))
        want = pq.BitAdjacency.from_edge_index(edge_index, n, min_tile_nnz=min_tile_nnz)
        got = pack_entries(edge_index[1], edge_index[0], None, n, n, min_tile_nnz, "tiles")
        for field in ("window_ptr", "tile_col", "tile_bits", "res_ptr", "res_col", "res_val", "row_sums"):
            a, b = getattr(want, field), getattr(got, field)
            assert (a is None and b is None) or torch.equal(a, b), field
        for form in ("auto", "csr"):  # the layers' default, "auto", is from_edge_index's rule
            want = pq.BitAdjacency.from_edge_index(edge_index, n, min_tile_nnz=min_tile_nnz, adjacency=form)
            got = pack_entries(edge_index[1], edge_index[0], None, n, n, min_tile_nnz, form)
            for field in ("window_ptr", "tile_col", "tile_bits", "res_ptr", "res_col", "res_val", "row_sums"):
                a, b = getattr(want, field), getattr(got, field)
                assert (a is None and b is None) or torch.equal(a, b), (form, field)
        src, dst, count = decode_bit_adjacency(want)
        dense = torch.zeros(n, n).index_put_((dst, src), count.float(), accumulate=True)
        assert torch.equal(dense, want.to_dense())
        # integer entries beyond 8 planes go to the residual and still multiply exactly
        values = torch.randint(0, 400, (e,), generator=gen(n + 1))
        coded = pack_entries(edge_index[1], edge_index[0], values, n, n, min_tile_nnz)
        dense = torch.zeros(n, n).index_put_((edge_index[1], edge_index[0]), values.float(), accumulate=True)
        assert torch.equal(coded.to_dense(), dense)


# --- compile ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_dynamo_explain_no_graph_breaks(bits, mode):
    x, edge_index, weight = graph(60, 300)
    _, conv = pair(bits)
    getattr(conv, mode)()
    with torch.set_grad_enabled(mode == "train"):  # eval under no_grad: the bit-kernel path
        for args in ((x, edge_index), (x, edge_index, weight)):
            torch._dynamo.reset()
            explanation = torch._dynamo.explain(conv)(*args)
            assert explanation.graph_break_count == 0, explanation.break_reasons
            assert explanation.graph_count == 1


def test_compiled_equals_eager():
    x, edge_index, weight = graph(60, 300)
    _, conv = pair(4)
    conv.eval()
    torch._dynamo.reset()
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for args in ((x, edge_index), (x, edge_index, weight), (x, pq.BitAdjacency.from_edge_index(edge_index, 60, self_loops=1))):
            assert torch.equal(compiled(*args), conv(*args))


# --- bad inputs -------------------------------------------------------------------------
def test_bad_arguments():
    for kwargs, error, name in ((dict(bits=0), ValueError, "bits"), (dict(bits=9), ValueError, "bits"),
                                (dict(bits=2.5), TypeError, "bits"), (dict(bits=True), TypeError, "bits"),
                                (dict(weight_bits=9), ValueError, "weight_bits"),
                                (dict(act_bits=0), ValueError, "act_bits"), (dict(adj_bits=12), ValueError, "adj_bits"),
                                (dict(out_bits=0), ValueError, "out_bits"), (dict(out_dim=2), ValueError, "out_dim"),
                                (dict(bits=4, weight_bits=4), ValueError, "bits"), (dict(aggr="mean"), ValueError, "aggr"),
                                (dict(normalize=False, add_self_loops=True), ValueError, "self-loops")):
        with pytest.raises(error, match=name):
            QGCNConv(16, 32, **kwargs)


def test_bad_inputs():
    x, edge_index, weight = graph(60, 300)
    conv = QGCNConv(16, 32, bits=4)
    with pytest.raises(ValueError, match="edge_index holds node indices out of range"):
        conv(x[:50], edge_index)
    with pytest.raises(ValueError, match="negative"):
        conv(x, edge_index - 1)
    with pytest.raises(ValueError, match=r"edge_weight must have shape \[num_edges\]"):
        conv(x, edge_index, weight[:-1])
    with pytest.raises(ValueError, match="BitAdjacency of shape"):
        conv(x, pq.BitAdjacency.from_edge_index(edge_index, 70, self_loops=1))
    with pytest.raises(ValueError, match="sparse tensor of shape"):
        conv(x, to_torch_csr_tensor(edge_index, size=(70, 70)))
    with pytest.raises(ValueError, match="edge_weight cannot be combined"):
        conv(x, to_torch_csr_tensor(edge_index, size=(60, 60)), weight)
    with pytest.raises(ValueError, match="x has 15 features"):
        conv(x[:, :15], edge_index)
    with pytest.raises(ValueError, match="bipartite"):
        conv((x, x), edge_index)
    with pytest.raises(ValueError, match="NaN or inf"):
        conv(torch.full_like(x, float("nan")), edge_index)
    with pytest.raises(TypeError, match="edge_index must"):
        conv(x, edge_index.tolist())
    with pytest.raises(TypeError, match="integer"):
        conv(x, edge_index.float())
    conv.flow = "target_to_source"
    with pytest.raises(ValueError, match="target_to_source"):
        conv(x, to_torch_csr_tensor(edge_index, size=(60, 60)))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_layers_on_one_bit_adjacency_share_its_normalization(monkeypatch, mode):
    """D^-1/2 of a BitAdjacency that carries its self-loops is made once for all layers (and every later call),
    with the same outputs as when every layer makes its own."""
    import pyg_quant.nn.qgcn_conv as qgcn_module

    edge_index = random_edges(120, 120, 900, 5)
    x = torch.randn(120, 12, generator=gen(6))
    torch.manual_seed(0)
    convs = [QGCNConv(12, 12, bits=4), QGCNConv(12, 12, bits=4), QGCNConv(12, 5, bits=None)]

    def run(adj):
        h = x
        for conv in convs:
            h = conv(h, adj)
        return h

    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}[mode]
    with context():
        expected = run(pq.BitAdjacency.from_edge_index(edge_index, 120, self_loops=1).to("cpu"))  # a fresh memo
        calls = []
        inv_sqrt = qgcn_module.row_sums_inv_sqrt
        monkeypatch.setattr(qgcn_module, "row_sums_inv_sqrt", lambda adj: calls.append(None) or inv_sqrt(adj))
        graph_inv_sqrt = QuantGraph.degree_inv_sqrt  # (an edge list's, in one op)
        monkeypatch.setattr(QuantGraph, "degree_inv_sqrt", lambda graph: calls.append(None) or graph_inv_sqrt(graph))
        adj = pq.BitAdjacency.from_edge_index(edge_index, 120, self_loops=1)
        first, second = run(adj), run(adj)
    assert len(calls) == 1
    assert torch.equal(first, expected) and torch.equal(second, expected)
    # the adjacency without self-loops is decoded and gets them added by the layer: nothing is kept then
    calls.clear()
    with context():
        bare = pq.BitAdjacency.from_edge_index(edge_index, 120)
        run(bare)
    assert len(calls) == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("self_loops", [1, 2])
@pytest.mark.parametrize("form", ["tiles", "csr"])
def test_bit_adjacency_inv_sqrt_degree_is_the_torch_composition(self_loops, form, device):
    """D^-1/2 of a BitAdjacency in one op (each row's sum its one "edge") is inv_sqrt_degree(adj.degree()) bit for
    bit, repeated edges (counts) and isolated rows (degree 0 without loops: 0) included."""
    import pyg_quant.nn.qgcn_conv as qgcn_module

    edge_index = random_edges(300, 300, 2500, 11)
    edge_index = torch.cat([edge_index, edge_index[:, :400]], 1)  # repeated edges: counts above 1
    edge_index = edge_index[:, edge_index[1] >= 20]  # rows (targets) 0..19 only get their self-loops
    adj = pq.BitAdjacency.from_edge_index(edge_index, 300, self_loops=self_loops, min_tile_nnz=4,
                                          adjacency=form).to(device)
    assert (adj.num_tiles > 0) == (form == "tiles")
    got = qgcn_module.row_sums_inv_sqrt(adj)
    assert got.device == adj.device
    assert got.dtype == torch.float32 and torch.equal(got, qgcn_module.inv_sqrt_degree(adj.degree()))
    bare = pq.BitAdjacency.from_edge_index(edge_index, 300, adjacency=form).to(device)  # degree-0 rows exist
    got = qgcn_module.row_sums_inv_sqrt(bare)
    assert bool((got == 0).any()) and torch.equal(got, qgcn_module.inv_sqrt_degree(bare.degree()))


@pytest.mark.parametrize("form", ["tiles", "csr"])
def test_float_layer_on_bit_adjacency_builds_its_matrix_once(monkeypatch, form):
    """A float QGCNConv (bits=None: a QAT model's last layer) on a BitAdjacency builds its CSR matrix once, kept on
    the adjacency for every layer and call (and not in inference mode for the others): with tiles by decoding the
    adjacency, without them from its residual's CSR as it is (no decoding)."""
    import pyg_quant.graph.input_formats as input_formats
    import pyg_quant.nn._eval_path as eval_path

    x, edge_index, _ = graph()
    ref, conv = pair(None)
    conv.eval()
    adj = pq.BitAdjacency.from_edge_index(edge_index, 300, self_loops=1, min_tile_nnz=4, adjacency=form)
    assert (adj.num_tiles > 0) == (form == "tiles")
    decodes, residuals = [], []
    decode, residual = input_formats.decode_bit_adjacency, eval_path.residual_csr
    monkeypatch.setattr(input_formats, "decode_bit_adjacency", lambda a: decodes.append(a) or decode(a))
    monkeypatch.setattr(eval_path, "residual_csr", lambda *a: residuals.append(a) or residual(*a))
    with torch.no_grad():
        first = conv(x, adj)
        assert torch.equal(conv(x, adj), first) and torch.equal(conv(conv(x, adj)[:, :16], adj), conv(first[:, :16], adj))
    assert (len(decodes), len(residuals)) == ((1, 0) if form == "tiles" else (0, 1))
    with torch.no_grad():
        torch.testing.assert_close(first, ref(x, edge_index), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        assert torch.equal(conv(x, adj), first)
    assert len(decodes) + len(residuals) == 2
    # what is kept (sparse CSR matrices among it) is left out of copies and pickles, which rebuild it
    for twin in (copy.deepcopy(adj), pickle.loads(pickle.dumps(adj))):
        with torch.no_grad():
            assert torch.equal(conv(x, twin), first)


@pytest.mark.parametrize("form", ["edge_index", "weighted", "bit_csr", "bit_tiles"])
@pytest.mark.parametrize("qat_layer", [False, True])
def test_training_aggregation_folds_the_normalization(form, qat_layer, monkeypatch):
    """In training, ``D^-1/2 Â h`` is one CSR product on a matrix with ``D^-1/2`` and the self-loop term folded in
    (``QuantGraph.aggregate_scaled``): outputs and gradients those of PyG's GCNConv (float layer) and of the
    step-by-step aggregation (product, self-loop term, row scaling), within float32 rounding."""
    from pyg_quant.graph.quant_graph import QuantGraph
    x, edge_index, weight = graph()
    n = x.size(0)
    ref, conv = pair(None)
    weighted = form == "weighted"
    if form.startswith("bit"):
        adj = pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1,
                                              adjacency="csr" if form == "bit_csr" else "tiles")
        args, pyg_args = (adj,), (edge_index,)
    else:
        args = pyg_args = (edge_index, weight) if weighted else (edge_index,)
    if qat_layer:
        conv = pq.qat.QATGCNConv.from_float(ref, pq.qat.QConfig(weight_bits=None, act_bits=None))
    folded = [0]
    original = QuantGraph.aggregate_scaled

    def counting(graph_, y):
        out = original(graph_, y)
        folded[0] += out is not None
        return out

    monkeypatch.setattr(QuantGraph, "aggregate_scaled", counting)
    results = []
    for model, model_args, fold in ((ref, pyg_args, None), (conv, args, True), (conv, args, False)):
        if fold is False:
            monkeypatch.setattr(QuantGraph, "aggregate_scaled", lambda graph_, y: None)
        model.train()
        leaf = x.clone().requires_grad_()
        out = model(leaf, *model_args)
        weights = torch.randn(out.shape, generator=gen(5))
        (out * weights).sum().backward()
        results.append((out.detach(), leaf.grad, model.lin.weight.grad.clone()))
        model.zero_grad()
    assert folded[0] == 1  # the folded product ran once, in the second call
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
