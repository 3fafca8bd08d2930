"""The layers' eval forward on a BitAdjacency (``pyg_quant.nn._eval_path``): the general path's bits, no host
synchronization on the GPU, and the general path wherever a call leaves the common case.

Oracle: the same layer with the short path switched off (the general forward, which reaches the same ops through
its format conversions): every result must be equal bit for bit.
"""
import pytest
import torch
import torch.nn.functional as F

import pyg_quant as pq
import pyg_quant.nn.qgcn_conv as qgcn_module
import pyg_quant.nn.qgin_conv as qgin_module
from pyg_quant import QGCNConv, QGINConv
from pyg_quant.nn import QuantLinear
from pyg_quant.nn import _eval_path

from conftest import DEVICES, gen, random_edges, requires_compiled

pytestmark = requires_compiled


def mlp(cin, hidden, cout, last_relu=False):
    layers = [torch.nn.Linear(cin, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, cout)]
    return torch.nn.Sequential(*(layers + [torch.nn.ReLU()] if last_relu else layers))


def general(monkeypatch):
    """The layers with the short path off."""
    monkeypatch.setattr(qgin_module, "gin_eval", lambda *args: None)
    monkeypatch.setattr(qgcn_module, "gcn_eval", lambda *args: None)


def short_and_general(monkeypatch, call, context=torch.no_grad):
    """``(call(), call())``: with the short path, then with the general path."""
    with context():
        fast = call()
    with monkeypatch.context() as m:
        general(m)
        with context():
            return fast, call()


def same(a, b) -> bool:
    if isinstance(a, pq.BitTensor):
        return (isinstance(b, pq.BitTensor) and (a.bits, a.dim, a.layout, a.shape) == (b.bits, b.dim, b.layout, b.shape)
                and torch.equal(a.codes(), b.codes()) and torch.equal(a.lo, b.lo) and torch.equal(a.scale, b.scale))
    return torch.equal(a, b)


def graph(n, e, seed, device, self_loops=0, adjacency=None):
    edge_index = random_edges(n, n, e, seed)
    return pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=self_loops, adjacency=adjacency).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dim", [0, None])
@pytest.mark.parametrize("out", [(None, 0), (4, 0), (4, 1), (3, None)])
@pytest.mark.parametrize("loops,adjacency", [(0, "tiles"), (1, "csr"), (0, "auto")])
def test_gin_equals_general_path(monkeypatch, device, x_dim, out, loops, adjacency):
    out_bits, out_dim = out
    torch.manual_seed(0)
    conv = QGINConv(mlp(24, 32, 20), eps=0.37, train_eps=True, bits=4, out_bits=out_bits, out_dim=out_dim)
    conv = conv.to(device).eval()
    adj = graph(150, 1400, 1, device, loops, adjacency)
    x = pq.to_bit(torch.randn(150, 24, generator=gen(2)).to(device), 4, dim=x_dim, layout="col")
    with torch.inference_mode():
        assert _eval_path.gin_eval(conv, x, adj, None) is not None  # the short path applies
    assert same(*short_and_general(monkeypatch, lambda: conv(x, adj), torch.inference_mode))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out", [(None, 0), (4, 0), (4, 1)])
@pytest.mark.parametrize("loops,adjacency", [(0, "tiles"), (1, "csr"), (0, "auto")])
def test_gin_on_float_features_equals_general_path(monkeypatch, device, out, loops, adjacency):
    """GIN on float features (a model with F.relu between its layers): the aggregation's operand quantized per column
    over its own ranges, the self term on the floats, in one op (``qat_gin_conv_eval``), the general path's bits."""
    out_bits, out_dim = out
    torch.manual_seed(0)
    conv = QGINConv(mlp(24, 32, 20), eps=0.37, train_eps=True, bits=4, out_bits=out_bits, out_dim=out_dim)
    conv = conv.to(device).eval()
    adj = graph(150, 1400, 1, device, loops, adjacency)
    x = F.relu(torch.randn(150, 24, generator=gen(2))).to(device)
    with torch.inference_mode():
        assert _eval_path.gin_eval(conv, x, adj, None) is not None  # the short path applies
    fast, slow = short_and_general(monkeypatch, lambda: conv(x, adj), torch.inference_mode)
    assert same(fast, slow)
    assert isinstance(fast, pq.BitTensor) == (out_bits is not None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plain_last,act", [(True, "relu"), (False, "relu"), (True, None)])
def test_gin_with_a_pyg_mlp_equals_general_path(monkeypatch, device, plain_last, act):
    """A QGINConv whose ``nn`` is PyG's ``MLP`` without normalization (what PyG's ``GIN`` model builds) fuses it like
    a Sequential, on codes and on float features: one op, the general path's bits; a changed MLP (a linear layer
    swapped) is seen at the next call."""
    from torch_geometric.nn.models import MLP

    torch.manual_seed(0)
    conv = QGINConv(MLP([24, 32, 20], norm=None, plain_last=plain_last, act=act), bits=4, out_bits=4).to(device).eval()
    adj = graph(150, 1400, 1, device)
    xf = F.relu(torch.randn(150, 24, generator=gen(2))).to(device)
    for x in (xf, pq.to_bit(xf, 4, dim=0, layout="col")):
        with torch.inference_mode():
            assert _eval_path.gin_eval(conv, x, adj, None) is not None
        assert same(*short_and_general(monkeypatch, lambda: conv(x, adj), torch.inference_mode))
    with torch.no_grad():
        conv(xf, adj)
        conv.nn.lins[1] = QuantLinear(32, 20, bits=4).to(device).eval()
    assert same(*short_and_general(monkeypatch, lambda: conv(xf, adj)))


def test_pyg_mlp_chain_view():
    """What :func:`~pyg_quant.nn.mlp_chain.chain_view` reads a PyG ``MLP`` as: its linear layers with the activation
    after each (the last too without ``plain_last``); nothing with normalization or in training."""
    from torch_geometric.nn.models import MLP
    from pyg_quant.nn.mlp_chain import chain_view

    mlp = MLP([8, 16, 16, 4], norm=None).eval()
    assert chain_view(mlp).steps == (mlp.lins[0], mlp.act, mlp.lins[1], mlp.act, mlp.lins[2])
    mlp = MLP([8, 16, 4], norm=None, plain_last=False).eval()
    assert chain_view(mlp).steps == (mlp.lins[0], mlp.act, mlp.lins[1], mlp.act)
    mlp = MLP([8, 16, 4], norm=None, act=None).eval()
    assert chain_view(mlp).steps == (mlp.lins[0], mlp.lins[1])
    assert chain_view(MLP([8, 16, 4]).eval()) is None  # batch normalization
    assert chain_view(MLP([8, 16, 4], norm=None, act="gelu").eval()) is None
    assert chain_view(MLP([8, 16, 4], norm=None).train()) is None  # its dropout draws in training
    conv = QGINConv(MLP([8, 16, 4], norm=None), bits=4).eval()
    handle = conv.nn.lins[0].register_forward_hook(lambda *a: None)
    x = torch.rand(30, 8)
    adj = pq.BitAdjacency.from_edge_index(random_edges(30, 30, 100, 4), 30)
    with torch.no_grad():
        assert _eval_path.gin_eval(conv, x, adj, None) is None  # a hook inside the MLP: the general path
        handle.remove()
        assert _eval_path.gin_eval(conv, x, adj, None) is not None
        # one fused call through the MLP gives what its own forward (a call a linear layer) gives
        from pyg_quant.nn.quant_linear import run_fused_mlp
        assert torch.equal(run_fused_mlp(conv.nn, x), conv.nn(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_kind", ["float", "codes8"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out", [(None, 1), (4, 1), (4, 0), (3, None)])
def test_gcn_equals_general_path(monkeypatch, device, x_kind, bias, out):
    out_bits, out_dim = out
    torch.manual_seed(0)
    conv = QGCNConv(24, 20, bias=bias, bits=4, out_bits=out_bits, out_dim=out_dim).to(device).eval()
    if bias:
        with torch.no_grad():
            conv.bias.normal_()
    adj = graph(150, 1400, 3, device, self_loops=1)
    x = torch.randn(150, 24, generator=gen(4)).to(device)
    if x_kind == "codes8":
        x = pq.to_bit(x, 8, dim=0, layout="col")
    with torch.no_grad():
        assert _eval_path.gcn_eval(conv, x, adj, None, qgcn_module.bit_adjacency_deg_inv_sqrt) is not None
    assert same(*short_and_general(monkeypatch, lambda: conv(x, adj)))


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_updates_reach_the_short_path(monkeypatch, device):
    """The kept MLP arguments follow in-place updates (an optimizer step) and loaded states."""
    torch.manual_seed(0)
    conv = QGINConv(mlp(16, 16, 8), bits=4).to(device).eval()
    gcn = QGCNConv(16, 8, bits=4).to(device).eval()
    adj, adj1 = graph(90, 700, 5, device), graph(90, 700, 5, device, self_loops=1)
    x = pq.to_bit(torch.randn(90, 16, generator=gen(6)).to(device), 4, dim=0, layout="col")
    xf = torch.randn(90, 16, generator=gen(7)).to(device)
    with torch.no_grad():
        before, before_gcn = conv(x, adj), gcn(xf, adj1)
        conv.nn[0].weight.mul_(-1.5)
        conv.nn[2].bias.add_(0.25)
        conv.eps.fill_(0.5)
        gcn.lin.weight.mul_(-1.5)
        after, after_gcn = conv(x, adj), gcn(xf, adj1)
    assert not torch.equal(before, after) and not torch.equal(before_gcn, after_gcn)
    state = {k: v.clone() for k, v in conv.state_dict().items()}
    with monkeypatch.context() as m:
        general(m)
        with torch.no_grad():
            assert torch.equal(after, conv(x, adj)) and torch.equal(after_gcn, gcn(xf, adj1))
    torch.manual_seed(1)
    other = QGINConv(mlp(16, 16, 8), bits=4).to(device).eval()
    with torch.no_grad():
        first = other(x, adj)
        other.load_state_dict(state)
        assert not torch.equal(first, after) and torch.equal(other(x, adj), after)
    # storage swapped without a version bump (what Module.to() does to .data), a layer replaced, its bits changed:
    # each time the short path's result is the general path's, and differs from the one before
    def change_swap():
        other.nn[2].weight.data = other.nn[2].weight.data * 2

    def change_replace():
        other.nn[0] = QuantLinear(16, 16, bits=4).to(device).eval()

    def change_bits():
        other.nn[0].weight_bits = 2

    def change_eps():
        other.eps.data = other.eps.data + 0.75

    previous = after
    for change in (change_swap, change_replace, change_bits, change_eps):
        with torch.no_grad():
            change()
        fast, slow = short_and_general(monkeypatch, lambda: other(x, adj))
        assert torch.equal(fast, slow), change.__name__
        assert not torch.equal(fast, previous), change.__name__
        previous = fast
    previous = after_gcn
    for change in (lambda: gcn.bias.add_(0.5), lambda: setattr(gcn.bias, "data", gcn.bias.data * 3 + 1)):
        with torch.no_grad():
            change()
        fast, slow = short_and_general(monkeypatch, lambda: gcn(xf, adj1))
        assert torch.equal(fast, slow) and not torch.equal(fast, previous)
        previous = fast


def test_other_calls_take_the_general_path():
    torch.manual_seed(0)
    conv = QGINConv(mlp(16, 16, 8), bits=4).eval()
    gcn = QGCNConv(16, 8, bits=4).eval()
    edge_index = random_edges(60, 60, 400, 8)
    adj = pq.BitAdjacency.from_edge_index(edge_index, 60)
    adj1 = pq.BitAdjacency.from_edge_index(edge_index, 60, self_loops=1)
    x = pq.to_bit(torch.randn(60, 16, generator=gen(9)), 4, dim=0, layout="col")
    xf = torch.randn(60, 16, generator=gen(10))
    deg = qgcn_module.bit_adjacency_deg_inv_sqrt

    def gin_applies(module=conv, x_in=x, adjacency=adj, size=None) -> bool:
        return _eval_path.gin_eval(module, x_in, adjacency, size) is not None

    def gcn_applies(module=gcn, x_in=xf, adjacency=adj1, weight=None) -> bool:
        return _eval_path.gcn_eval(module, x_in, adjacency, weight, deg) is not None

    with torch.no_grad():
        assert gin_applies() and gcn_applies()
        assert not gin_applies(adjacency=edge_index) and not gcn_applies(adjacency=edge_index)
        assert not gin_applies(size=(60, 60)) and not gcn_applies(weight=torch.ones(edge_index.size(1)))
        assert gin_applies(x_in=pq.to_val(x))  # float features: their own one op
        assert not gin_applies(x_in=pq.to_val(x).double()) and not gin_applies(x_in=pq.to_val(x)[:50])
        assert not gin_applies(x_in=pq.to_bit(pq.to_val(x), 8, dim=0))
        assert not gin_applies(x_in=pq.to_bit(pq.to_val(x), 4, dim=1))
        assert not gcn_applies(adjacency=adj)  # its self loops are added by the layer
        assert not gcn_applies(x_in=pq.to_bit(xf, 4, dim=1, layout="row"))  # codes the linear multiplies as they are
        for hooked in (conv.nn[0], conv.nn):  # hooks on a layer of the MLP, on the MLP, on every module
            handle = hooked.register_forward_hook(lambda *args: None)
            assert not gin_applies()
            handle.remove()
            assert gin_applies()
        handle = gcn.lin.register_forward_pre_hook(lambda *args: None)
        assert not gcn_applies()
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
        assert not gin_applies() and not gcn_applies()
        handle.remove()
        assert gin_applies() and gcn_applies()
        conv.train()
        assert not gin_applies()
        conv.eval()
        observed = QGINConv(mlp(16, 16, 8), bits=4, out_bits=4).eval()
        assert gin_applies(observed)
        with pq.nn.calibrate(observed):  # the general path records the ranges
            assert not gin_applies(observed)
            observed(x, adj)
        assert not gin_applies(observed)  # calibrated: the fixed ranges' path
        gcn.cached = True
        assert not gcn_applies()
        gcn.cached = False
        assert gin_applies() and gcn_applies()
    assert not gin_applies() and not gcn_applies()  # autograd on: the float path keeps the gradients


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_inputs(device):
    """On the CPU the layers raise; on a GPU, where a check would synchronize the host, a NaN or inf propagates as
    in the float layers: every output it reaches is non-finite, never a finite wrong value."""
    torch.manual_seed(0)
    conv = QGINConv(mlp(16, 16, 8), bits=4).to(device).eval()
    gcn = QGCNConv(16, 8, bits=4).to(device).eval()
    adj, adj1 = graph(70, 500, 11, device), graph(70, 500, 11, device, self_loops=1)
    x = pq.to_bit(torch.randn(70, 16, generator=gen(12)).to(device), 4, dim=0, layout="col")
    bad_codes = x._replace(scale=torch.full_like(x.scale, float("inf")))
    bad_float = torch.randn(70, 16, generator=gen(13)).to(device)
    bad_float[5, 3] = float("nan")
    with torch.no_grad():
        for run in (lambda: conv(bad_codes, adj), lambda: conv(bad_float, adj), lambda: gcn(bad_float, adj1),
                    lambda: gcn(bad_codes, adj1)):
            if device == "cpu":
                with pytest.raises(ValueError, match="NaN or inf"):
                    run()
            else:
                out = run()
                assert not torch.isfinite(out).any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eager_forward_does_not_synchronize():
    """The natural models (three layers, a BitTensor input, a BitAdjacency; GIN handing codes on with ``out_bits``, and
    GIN and GCN with F.relu between layers) make no host synchronization in eval (torch.cuda.set_sync_debug_mode turns
    one into an error)."""
    torch.manual_seed(0)
    gin = torch.nn.ModuleList([QGINConv(mlp(16, 32, 32, True), bits=4, out_bits=4),
                               QGINConv(mlp(32, 32, 32, True), bits=4, out_bits=4),
                               QGINConv(mlp(32, 32, 8), bits=4)]).cuda().eval()
    gcn = torch.nn.ModuleList([QGCNConv(16, 16, bits=4), QGCNConv(16, 16, bits=4), QGCNConv(16, 8, bits=4)])
    gcn = gcn.cuda().eval()
    gin_relu = torch.nn.ModuleList([QGINConv(mlp(16, 32, 32), bits=4), QGINConv(mlp(32, 32, 32), bits=4),
                                    QGINConv(mlp(32, 32, 8), bits=4)]).cuda().eval()
    adj, adj1 = graph(300, 3000, 14, "cuda"), graph(300, 3000, 14, "cuda", self_loops=1)
    x = pq.to_bit(torch.randn(300, 16, generator=gen(15)).cuda(), 4, dim=0, layout="col")

    def run_gin():
        h = x
        for conv in gin:
            h = conv(h, adj)
        return h

    def relu_between(convs, a):
        h = x
        for i, conv in enumerate(convs):
            h = conv(h, a)
            h = F.relu(h) if i < 2 else h
        return h

    def run_gcn():
        return relu_between(gcn, adj1)

    def run_gin_relu():
        return relu_between(gin_relu, adj)

    with torch.inference_mode():
        expected = run_gin(), run_gcn(), run_gin_relu()  # first calls make the kept arguments and D^-1/2
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = run_gin(), run_gcn(), run_gin_relu()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def conv_eval_samples(device):
    """Arguments of gin_conv_eval / gcn_conv_eval as the layers pass them: codes per column and per tensor, float
    features and codes for GCN, outputs as floats, per-column and per-row codes."""
    torch.manual_seed(0)
    gin = QGINConv(mlp(24, 32, 20), eps=0.3, bits=4).to(device).eval()
    gcn = QGCNConv(24, 20, bits=4).to(device).eval()
    edge_index = random_edges(300, 300, 4000, 3)
    adj = pq.BitAdjacency.from_edge_index(edge_index, 300, min_tile_nnz=16).to(device)
    adj1 = pq.BitAdjacency.from_edge_index(edge_index, 300, self_loops=1).to(device)
    assert adj.num_tiles > 0 and adj.res_nnz > 0  # both parts of the aggregation
    x = torch.randn(300, 24, generator=gen(22)).to(device)
    codes = pq.to_bit(x, 4, dim=0, layout="col")
    with torch.no_grad():  # as the layers make them: eval, no autograd
        chain = _eval_path._mlp_chain(gin, gin.nn, 24)
        gcn_chain = _eval_path._mlp_chain(gcn, gcn.lin, 24)
        self_term = gin._one_plus_eps().reshape(1)
        dinv = qgcn_module.bit_adjacency_deg_inv_sqrt(adj1)
    planes, x_codes = pq.graph.spmm.gather_operands(adj, codes, True)
    a, a1 = pq.graph.spmm.adjacency_args(adj), pq.graph.spmm.adjacency_args(adj1)
    gin_args = [a + (False, planes, x_codes, codes.lo, codes.scale, self_term) + chain + (bits, dim)
                for bits, dim in ((0, 0), (4, 0), (3, 1))]
    gcn_args = [a1 + (adj1.diag, dinv, gcn.bias.detach(), 4, False) + x_args + gcn_chain + (bits, dim)
                for x_args in ((x, None, None, 300), (codes.planes, codes.lo, codes.scale, 300))
                for bits, dim in ((0, 0), (4, 0), (4, 1))]
    return gin_args, gcn_args


@pytest.mark.parametrize("device", DEVICES)
def test_conv_eval_ops_equal_their_reference(device):
    """The composite ops against pyg_quant/ops/reference.py's composition of the reference ops, and opcheck (schema,
    fake kernel, no result aliasing an input or another result)."""
    from pyg_quant.ops import reference

    gin_args, gcn_args = conv_eval_samples(device)
    for name, samples in (("gin_conv_eval", gin_args), ("gcn_conv_eval", gcn_args)):
        op = getattr(torch.ops.pyg_quant, name).default
        for args in samples:
            got, want = op(*args), getattr(reference, name)(*args)
            assert len(got) == len(want) == (1 if args[-2] == 0 else 6)
            assert all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want)), name
            assert torch.equal(got[0], want[0]) and all(torch.equal(g, w) for g, w in zip(got[1:], want[1:])), name
            torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_eval_ops_hand_back_their_own_memory(device):
    """On a GPU the ops take their steps' tensors from one block (csrc/cuda/scratch_cuda.h).  No result shares its
    storage with an input or another result (a registered op's rule under torch.compile); each result is an
    allocation of its own, which holds no memory of the steps; and it stays as it was while later calls reuse the
    freed blocks.  A call with a float output allocates at most twice (GCN three times), one with a per-column
    quantized output at most four times more (its codes, ranges and row codes)."""
    gin_args, gcn_args = conv_eval_samples(device)
    kept = []
    for name, samples in (("gin_conv_eval", gin_args), ("gcn_conv_eval", gcn_args)):
        op = getattr(torch.ops.pyg_quant, name).default
        for args in samples:
            op(*args)
            before = torch.cuda.memory_stats()["allocation.all.allocated"] if device == "cuda" else 0
            got = op(*args)
            if device == "cuda" and (args[-2] == 0 or args[-1] == 0):  # float or per-column output
                calls = torch.cuda.memory_stats()["allocation.all.allocated"] - before
                assert calls <= 2 + (name == "gcn_conv_eval") + 4 * (len(got) > 1), (name, args[-2:], calls)
            inputs = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor) and t.numel()}
            inputs |= {t.untyped_storage().data_ptr() for a in args if isinstance(a, (list, tuple))
                       for t in a if isinstance(t, torch.Tensor) and t.numel()}
            outputs = [t.untyped_storage().data_ptr() for t in got if t.numel()]
            assert len(set(outputs)) == len(outputs) and not inputs & set(outputs), (name, args[-2:])
            for t in got:  # each result its own allocation, at its start
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size() and not t.storage_offset(), name
            kept.append((got, [t.clone() for t in got]))
    for name, samples in (("gin_conv_eval", gin_args), ("gcn_conv_eval", gcn_args)):
        for args in samples:
            getattr(torch.ops.pyg_quant, name).default(*args)
    for got, copies in kept:
        assert all(torch.equal(g, c) for g, c in zip(got, copies))


def _float_bound(adj_abs: torch.Tensor, h_abs: torch.Tensor, terms: int) -> torch.Tensor:
    """What two float32 evaluations of ``Â·h`` may differ by: each is within ``terms`` float32 rounding steps of the
    exact sum, each step at most ``eps`` of the sum of the magnitudes it adds (|Â|·|h|)."""
    return 2 * terms * torch.finfo(torch.float32).eps * (adj_abs @ h_abs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["gcn", "gin"])
@pytest.mark.parametrize("form", ["csr", "tiles"])
def test_float_layers_take_the_float_short_path(monkeypatch, device, kind, form):
    """A float layer (bits=None) on a BitAdjacency in eval without autograd: one CSR product on the adjacency's
    float matrix (GCN: D^-1/2 Â D^-1/2, its diagonal term folded in or added apart), within the float32 bound of the
    general path's, which adds the same terms in another order; the general path wherever the call leaves that case.
    Both adjacency forms: without tiles the matrix is the residual's CSR as it is."""
    torch.manual_seed(0)
    n = 300
    edge_index = random_edges(n, n, 3000, 5)
    adj = pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1 if kind == "gcn" else 0, min_tile_nnz=4,
                                          adjacency=form).to(device)
    assert (adj.num_tiles > 0) == (form == "tiles")
    x = torch.randn(n, 24, generator=gen(3)).to(device)
    conv = (QGCNConv(24, 20, bits=None) if kind == "gcn" else QGINConv(mlp(24, 32, 20), eps=0.3, bits=None))
    conv = conv.to(device).eval()
    calls = []
    real = getattr(_eval_path, f"_{kind}_float")
    monkeypatch.setattr(_eval_path, f"_{kind}_float", lambda *a: calls.append(real(*a)) or calls[-1])
    fast, slow = short_and_general(monkeypatch, lambda: conv(x, adj))
    assert len(calls) == 1 and calls[0] is not None
    dense = adj.to_dense().double()
    if kind == "gcn":
        dinv = qgcn_module.bit_adjacency_deg_inv_sqrt(adj).double()
        a_abs, h = (dinv.view(-1, 1) * dense * dinv.view(1, -1)).abs(), conv.lin(x).detach().double()
        fast, slow = fast - conv.bias.detach(), slow - conv.bias.detach()  # compare the aggregations
    else:
        a_abs = dense + (1 + conv.eps).double() * torch.eye(n, device=device, dtype=torch.float64)
        h = x.double()
        with torch.no_grad(), monkeypatch.context() as m:  # the aggregations, before the MLP: short, then general
            inputs = []
            m.setattr(conv.nn, "forward", lambda t: inputs.append(t) or t)
            conv(x, adj)
            assert len(calls) == 2 and calls[-1] is not None  # (the short path's aggregation)
            general(m)
            conv(x, adj)
        fast, slow = inputs
    terms = int(dense.sum(1).max().item()) + 2
    assert ((fast.double() - slow.double()).abs() <= _float_bound(a_abs, h.abs(), terms)).all()
    # what keeps the general path: autograd, training, a bipartite size (GIN), a cached graph (GCN)
    calls.clear()
    conv(x, adj)  # gradients asked for
    conv.train()
    with torch.no_grad():
        conv(x, adj)
    conv.eval()
    if kind == "gcn":
        conv.cached = True
        with torch.no_grad():
            conv(x, adj)
    else:
        with torch.no_grad():
            conv(x, adj, size=(n, n))
    assert all(c is None for c in calls)


def test_wide_layers_run_fused_on_the_cpu():
    """The CPU runs a linear layer wider than the GPU kernel's limit as one fused quant_mlp call (Cora's 1,433 input
    features), the same bits as the layer-by-layer reference."""
    from pyg_quant.nn.quant_linear import QUANT_MLP_MAX_WIDTH, runs_fused
    from pyg_quant.ops import reference

    torch.manual_seed(0)
    width = QUANT_MLP_MAX_WIDTH + 45
    lin = QuantLinear(width, 16, bits=4).eval()
    x = torch.randn(70, width, generator=gen(4))
    with torch.no_grad():
        assert runs_fused(lin, None, width)
        got = lin(x)
        chain = pq.nn.quant_linear.chain_args((lin,), (False,))
        assert torch.equal(got, reference.quant_mlp(x, *chain))
        if torch.cuda.is_available():
            assert not runs_fused(lin.cuda(), None, width)
