"""ops.quant_mlp (a chain of QuantLinear bit layers in one kernel) against the composition it fuses.

Oracle: the layer-by-layer bit path itself, ``quantize(h, act_bits, 1, "row")`` then ``bitmm_float`` with the
layer's weight codes, bias and ReLU, called explicitly; the fused op must equal it exactly (``torch.equal``) on
every backend, and the GPU must equal the CPU bit for bit.  QuantLinear and QGINConv in eval under no_grad must
give the same outputs fused as unfused.
"""
import pytest
import torch
from torch.nn import ReLU, Sequential

import pyg_quant as pq
import pyg_quant.nn.qgcn_conv as qgcn_module
import pyg_quant.nn.qgin_conv as qgin_module
import pyg_quant.nn.quant_linear as ql_module
from pyg_quant import ops
from pyg_quant.bit_tensor import BitTensor
from pyg_quant.bitmm import bitmm_float
from pyg_quant.nn import QGCNConv, QGINConv, QuantLinear
from pyg_quant.quantization.quantize import quantize
from pyg_quant.ops import reference as ref

from conftest import CUDA_OK, gen, random_edges, requires_compiled, requires_cuda

WIDTHS = [1, 7, 32, 64, 100, 129, 256]
BIT_PAIRS = [(1, 1), (2, 7), (4, 4), (8, 8), (3, 1), (1, 8), (5, 6), (7, 2), (6, 3), (8, 5)]


def layer_codes(cin, cout, weight_bits, seed, device="cpu"):
    """W [out, in] quantized per output channel as QuantLinear does: (codes, lo, scale, sums, Wᵀ BitTensor)."""
    w = torch.randn(cout, cin, generator=gen(seed)) * (1 + seed % 3)
    wq = quantize(w.to(device), weight_bits, 1, "row")
    wt = BitTensor(wq.planes, (cin, cout), weight_bits, "col", wq.lo, wq.scale, 0)
    codes = ops.unpack_codes(wq.planes, cout, cin, False)
    return codes, wq.lo, wq.scale, wt.code_sums().contiguous(), wt


def composition(x, wts, biases, act_bits, relus):
    h = x
    for wt, bias, bits, relu in zip(wts, biases, act_bits, relus):
        h = bitmm_float(quantize(h, bits, 1, "row"), wt, bias, relu)
    return h


def make_case(i, n=None, device="cpu", widths=None):
    """Chain i: random widths (or `widths`), bit pairs, biases, ReLUs and input kind: (op arguments, Wᵀ BitTensors)."""
    g = gen(1000 + i)
    layers = 1 + i % 3 if widths is None else len(widths) - 1
    pick = lambda: WIDTHS[int(torch.randint(len(WIDTHS), (1,), generator=g))]  # noqa: E731
    widths = [pick() for _ in range(layers + 1)] if widths is None else list(widths)
    n = [1, 37, 1000][i % 3] if n is None else n
    kind = i % 4
    x = torch.randn(n, widths[0], generator=g)
    if kind == 1:
        x = x * 1e4 - 3e3  # large and mostly negative
    elif kind == 2:
        x = -x.abs() - 5.0  # all negative
    elif kind == 3:
        x = x * 0.01 + 0.5
    if n > 3:
        x[2] = 1.25  # a constant row: scale 0, every code 0
    if n > 5:
        x[4] = 0.0
    act_bits, weight_bits = [], []
    for l in range(layers):
        s, t = BIT_PAIRS[(i + 3 * l) % len(BIT_PAIRS)]
        act_bits.append(s)
        weight_bits.append(t)
    ws = [layer_codes(widths[l], widths[l + 1], weight_bits[l], 7 * i + l) for l in range(layers)]
    biases = [torch.randn(widths[l + 1], generator=g) if (i + l) % 2 else None for l in range(layers)]
    relus = [(i + l) % 3 != 0 for l in range(layers)]
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    args = (x.to(device), [to(w[0]) for w in ws], [to(w[1]) for w in ws], [to(w[2]) for w in ws],
            [to(w[3]) for w in ws], [to(b) for b in biases], act_bits, weight_bits, relus)
    return args, [w[4] for w in ws]


CASES = list(range(36))


@requires_compiled
@pytest.mark.parametrize("i", CASES)
def test_op_equals_composition_cpu(i):
    args, wts = make_case(i)
    want = composition(args[0], wts, args[5], args[6], args[8])
    got = torch.ops.pyg_quant.quant_mlp(*args)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(ops.quant_mlp(*args), want)
    assert torch.equal(ref.quant_mlp(*args), want)  # the pure-torch fallback, too


@requires_compiled
def test_empty_rows_and_non_contiguous_input():
    args, wts = make_case(4)
    x = args[0]
    empty = torch.ops.pyg_quant.quant_mlp(x[:0], *args[1:])
    assert empty.shape == (0, args[1][-1].size(0))
    strided = torch.cat([x, x], 1)[:, : x.size(1)]
    assert not strided.is_contiguous()
    assert torch.equal(torch.ops.pyg_quant.quant_mlp(strided, *args[1:]), torch.ops.pyg_quant.quant_mlp(x, *args[1:]))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("i", CASES)
def test_gpu_equals_cpu(i):
    args, wts = make_case(i)
    cpu = torch.ops.pyg_quant.quant_mlp(*args)
    cuda_args, _ = make_case(i, device="cuda")
    got = torch.ops.pyg_quant.quant_mlp(*cuda_args)
    assert got.is_cuda
    assert torch.equal(got.cpu(), cpu)
    assert torch.equal(got, composition(cuda_args[0], [w.to("cuda") for w in wts], cuda_args[5], cuda_args[6],
                                        cuda_args[8]))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("n", [70_000, 70_003])  # the kernel's warps take 4 rows at a time: a partial last group
@pytest.mark.parametrize("i", [0, 5, 10, 22])
def test_gpu_equals_cpu_grid_stride(i, n):
    args, _ = make_case(i, n=n)
    cuda_args, _ = make_case(i, n=n, device="cuda")
    assert torch.equal(torch.ops.pyg_quant.quant_mlp(*cuda_args).cpu(), torch.ops.pyg_quant.quant_mlp(*args))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("n", [2, 3, 5, 33, 259])  # fewer rows than a warp's group, partial groups in later blocks
@pytest.mark.parametrize("i", [1, 10, 13, 22])  # widest layer 256, 32, 100, 64: every instantiation
def test_gpu_equals_cpu_row_counts(i, n):
    args, _ = make_case(i, n=n)
    cuda_args, _ = make_case(i, n=n, device="cuda")
    assert torch.equal(torch.ops.pyg_quant.quant_mlp(*cuda_args).cpu(), torch.ops.pyg_quant.quant_mlp(*args))


def row_scale_for(n, seed):
    """A per-row scale with zeros (isolated nodes' D^-1/2), negatives and large values."""
    scale = torch.randn(n, generator=gen(seed)) * 3
    scale[::7] = 0.0
    scale[1::11] = 1e20
    return scale


@requires_compiled
@pytest.mark.parametrize("i", CASES[:12])
def test_row_scale_multiplies_the_output_rows_cpu(i):
    args, wts = make_case(i)
    scale = row_scale_for(args[0].size(0), i)
    want = composition(args[0], wts, args[5], args[6], args[8]) * scale.view(-1, 1)
    assert torch.equal(torch.ops.pyg_quant.quant_mlp(*args, scale), want)
    assert torch.equal(ops.quant_mlp(*args, row_scale=scale), want)
    assert torch.equal(ref.quant_mlp(*args, row_scale=scale), want)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("n", [1, 5, 259, 70_003])
@pytest.mark.parametrize("i", [1, 10, 13, 22])  # every instantiation of the kernel
def test_gpu_row_scale_equals_cpu(i, n):
    args, _ = make_case(i, n=n)
    cuda_args, _ = make_case(i, n=n, device="cuda")
    scale = row_scale_for(n, i)
    got = torch.ops.pyg_quant.quant_mlp(*cuda_args, scale.cuda())
    assert torch.equal(got.cpu(), torch.ops.pyg_quant.quant_mlp(*args, scale))


def non_finite_case(i):
    args, wts = make_case(i, n=259)
    x = args[0].clone()
    x[7, 0] = float("nan")
    x[40, -1] = float("inf")
    x[41, 0] = float("-inf")
    x[200, :] = float("nan")
    return (x,) + tuple(args[1:]), wts


def same_values(got, want):
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


@requires_compiled
@pytest.mark.parametrize("i", [0, 5, 10, 13, 22])
def test_non_finite_rows_equal_composition_cpu(i):
    """A NaN makes its row's range NaN (as amin / amax do; a ReLU keeps it, as torch.relu does), an infinity makes
    it infinite: a row that held one is never finite."""
    args, wts = non_finite_case(i)
    got = torch.ops.pyg_quant.quant_mlp(*args)
    assert same_values(got, composition(args[0], wts, args[5], args[6], args[8]))
    assert got[8].isfinite().all()
    assert not got[[7, 40, 41, 200]].isfinite().any()


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("i", [0, 5, 10, 13, 22])
def test_gpu_equals_cpu_non_finite_rows(i):
    """The same values on both devices."""
    args, _ = non_finite_case(i)
    cuda_args = tuple([t.to("cuda") if isinstance(t, torch.Tensor) else t for t in a] if isinstance(a, list) else
                      a.to("cuda") if isinstance(a, torch.Tensor) else a for a in args)
    assert same_values(torch.ops.pyg_quant.quant_mlp(*cuda_args).cpu(), torch.ops.pyg_quant.quant_mlp(*args))


# --- layers -----------------------------------------------------------------------------
def count_calls(monkeypatch):
    calls = []
    original = ops.quant_mlp

    def counted(*args):
        calls.append(len(args[1]))
        return original(*args)

    monkeypatch.setattr(ql_module.ops, "quant_mlp", counted)
    return calls


DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if CUDA_OK else [])


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [(1, 1), (2, 7), (4, 4), (8, 8)])
def test_quant_linear_fused_equals_unfused(monkeypatch, device, bits):
    weight_bits, act_bits = bits
    torch.manual_seed(0)
    for bias in (True, False):
        lin = QuantLinear(48, 100, bias=bias, weight_bits=weight_bits, act_bits=act_bits).to(device).eval()
        x = (torch.randn(3, 37, 48, generator=gen(3)) * 4 - 1).to(device)
        calls = count_calls(monkeypatch)
        with torch.no_grad():
            got = lin(x)
            x2 = x.reshape(-1, 48)
            want = lin._bit_linear(quantize(x2, act_bits, 1, "row")).reshape(3, 37, 100)  # today's path
        assert calls == [1]
        assert torch.equal(got, want)
        # the cached codes are reused, and refreshed when the weight changes
        codes = lin.fused_weight()
        assert lin.fused_weight() is codes
        with torch.no_grad():
            lin.weight.mul_(-2)
            assert lin.fused_weight() is not codes
            assert torch.equal(lin(x), lin._bit_linear(quantize(x2, act_bits, 1, "row")).reshape(3, 37, 100))


@requires_compiled
def test_quant_linear_not_fused(monkeypatch):
    calls = count_calls(monkeypatch)
    wide = QuantLinear(300, 8, bits=4).eval()  # wider than the GPU kernel's limit: fused on the CPU alone
    x = torch.randn(5, 300)
    with torch.no_grad():
        assert torch.equal(wide(x), wide._bit_linear(quantize(x, 4, 1, "row")))
        assert calls == [1]
        calls.clear()
        xb = pq.to_bit(torch.randn(5, 8), 4, dim=1)  # BitTensor inputs keep their path
        lin = QuantLinear(8, 8, bits=4).eval()
        lin(xb)
        assert calls == []
    lin.train()  # training: fake quantization
    lin(torch.randn(5, 8))
    assert calls == []


def gin_graph(n=300, d=64, seed=0, device="cpu"):
    x = torch.randn(n, d, generator=gen(seed)).to(device)
    return x, random_edges(n, n, 6 * n, seed + 1).to(device)


def unfused(monkeypatch, conv, *args):
    with monkeypatch.context() as m:
        m.setattr(qgin_module, "run_fused_mlp", lambda module, x, col_keys=False: None)
        m.setattr(QuantLinear, "_fusable", lambda self: False)
        return conv(*args)


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layers,final_relu", [(1, False), (2, True), (3, False)])
@pytest.mark.parametrize("bits", [(4, 4), (2, 7), (8, 8)])
def test_qgin_conv_fused_equals_unfused(monkeypatch, device, layers, final_relu, bits):
    weight_bits, act_bits = bits
    torch.manual_seed(layers)
    modules = []
    for l in range(layers):
        modules.append(torch.nn.Linear(64 if l == 0 else 96, 96 if l + 1 < layers else 32))
        if l + 1 < layers or final_relu:
            modules.append(ReLU())
    conv = QGINConv(Sequential(*modules), weight_bits=weight_bits, act_bits=act_bits).to(device).eval()
    x, edge_index = gin_graph(device=device)
    calls = count_calls(monkeypatch)
    with torch.no_grad():
        got = conv(x, edge_index)
        assert calls == [layers]
        want = unfused(monkeypatch, conv, x, edge_index)
        assert calls == [layers]
        assert torch.equal(got, want)
        # the explicit composition on the aggregated features
        aggregated = unfused(monkeypatch, QGINConv(torch.nn.Identity(), weight_bits=weight_bits, act_bits=act_bits)
                             .to(device).eval(), x, edge_index)
        h, children = aggregated, list(conv.nn)
        for lin in children:
            if isinstance(lin, QuantLinear):
                h = bitmm_float(quantize(h, act_bits, 1, "row"), lin.quantized_weight(), lin.bias.detach())
            else:
                h = torch.relu(h)
        assert torch.equal(got, h)
        # a BitTensor input takes the fused self-term aggregation, then the fused MLP
        xb = pq.to_bit(x, act_bits, dim=0, layout="col")
        assert torch.equal(conv(xb, edge_index), unfused(monkeypatch, conv, xb, edge_index))


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
def test_long_chains_are_split(monkeypatch, device):
    """Layers whose codes exceed one block's shared memory, or more than 8 layers, run as several exact calls."""
    calls = count_calls(monkeypatch)
    for widths, groups in (([64, 256, 256, 256, 32], [1, 1, 2]), ([16] * 11, [8, 2])):
        torch.manual_seed(len(widths))
        modules = []
        for l in range(len(widths) - 1):
            modules += [torch.nn.Linear(widths[l], widths[l + 1]), ReLU()]
        conv = QGINConv(Sequential(*modules[:-1]), bits=4).to(device).eval()
        x, edge_index = gin_graph(d=widths[0], device=device)
        calls.clear()
        with torch.no_grad():
            got = conv(x, edge_index)
            assert calls == groups
            assert torch.equal(got, unfused(monkeypatch, conv, x, edge_index))


@requires_compiled
def test_qgin_conv_other_mlps_not_fused(monkeypatch):
    calls = count_calls(monkeypatch)
    x, edge_index = gin_graph()
    for nn in (Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), ReLU(), torch.nn.Linear(32, 8)),
               Sequential(ReLU(), torch.nn.Linear(64, 8)),
               torch.nn.Linear(64, 8)):
        conv = QGINConv(nn, bits=4).eval()
        with torch.no_grad():
            got = conv(x, edge_index)
            assert torch.equal(got, unfused(monkeypatch, conv, x, edge_index))
    # a single QuantLinear inside is still fused as a layer
    assert all(n == 1 for n in calls)
    # past the GPU kernel's width the chain is fused on the CPU alone (tests/test_eval_path.py checks the GPU's rule)
    conv = QGINConv(Sequential(torch.nn.Linear(64, 300), ReLU(), torch.nn.Linear(300, 8)), bits=4).eval()
    calls.clear()
    with torch.no_grad():
        got = conv(x, edge_index)
        assert calls == [2] and torch.equal(got, unfused(monkeypatch, conv, x, edge_index))
    # with a hook on a layer, or in training, or with autograd on: today's path
    conv = QGINConv(Sequential(torch.nn.Linear(64, 32), ReLU(), torch.nn.Linear(32, 8)), bits=4).eval()
    calls.clear()
    handle = conv.nn[0].register_forward_hook(lambda *a: None)
    with torch.no_grad():
        conv(x, edge_index)
    handle.remove()
    assert 2 not in calls
    calls.clear()
    conv(x, edge_index)  # eval with autograd on: the float path
    conv.train()
    conv(x, edge_index)
    assert calls == []


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [(4, 4), (2, 7), (8, 8)])
def test_qgcn_conv_folds_its_normalization_into_the_linear_layer(monkeypatch, device, bits):
    """Eval QGCNConv runs D^-1/2 (X W) as one quant_mlp call with a row scale: the same bits as the layer then a
    multiply, on edge_index and on a BitAdjacency, from floats and from column codes; float64 features and a hooked
    layer keep the layer-then-multiply path."""
    weight_bits, act_bits = bits
    torch.manual_seed(0)
    conv = QGCNConv(100, 16, weight_bits=weight_bits, act_bits=act_bits).to(device).eval()
    x, edge_index = gin_graph(d=100, device=device)
    scaled = []
    original, original_planes = ops.quant_mlp, ops.quant_mlp_planes

    def counted(*args):
        scaled.append(len(args) > 9 and args[9] is not None)  # row_scale
        return original(*args)

    def counted_planes(*args):  # the column codes, read by the kernel itself
        scaled.append(len(args) > 15 and args[15] is not None)
        return original_planes(*args)

    monkeypatch.setattr(ql_module.ops, "quant_mlp", counted)
    monkeypatch.setattr(ql_module.ops, "quant_mlp_planes", counted_planes)
    # the general path (on a BitAdjacency the eval path runs the same steps in one op: tests/test_eval_path.py)
    monkeypatch.setattr(qgcn_module, "gcn_eval", lambda *args: None)
    adjacency = pq.BitAdjacency.from_edge_index(edge_index, x.size(0), self_loops=1)
    column_codes = pq.to_bit(x, 4, dim=0, layout="col")  # the loader's features: read as the floats they hold
    with torch.no_grad():
        for features, adj in ((x, edge_index), (x, adjacency), (column_codes, adjacency)):
            scaled.clear()
            got = conv(features, adj)
            assert scaled == [True]
            with monkeypatch.context() as m:
                m.setattr(qgcn_module, "run_row_scaled_linear", lambda lin, x, scale, col_keys=False: None)
                scaled.clear()
                want = conv(features, adj)
                assert scaled == [False]
            assert torch.equal(got, want)
        scaled.clear()
        conv(x.double(), edge_index)  # float64 features: the layer, then the multiply
        assert scaled == [False]
    handle = conv.lin.register_forward_hook(lambda *a: None)  # a hook must see the layer run
    with torch.no_grad():
        scaled.clear()
        conv(x, edge_index)
    handle.remove()
    assert scaled == [False]


# --- errors -----------------------------------------------------------------------------
@requires_compiled
def test_errors_name_the_argument():
    args, _ = make_case(1)  # two layers
    op = torch.ops.pyg_quant.quant_mlp

    def replaced(index, value):
        new = list(args)
        new[index] = value
        return new

    def layer(index, value, l=0):
        lst = list(args[index])
        lst[l] = value
        return replaced(index, lst)

    x, codes = args[0], args[1]
    bad = [
        (replaced(0, x.double()), "x"),
        (replaced(0, x[0]), "x"),
        (replaced(1, []), "weight_codes"),
        (replaced(2, args[2][:1]), "weight_lo"),
        (replaced(5, args[5] + [None]), "bias"),
        (replaced(6, args[6][:1]), "act_bits"),
        (replaced(7, args[7] + [1]), "weight_bits"),
        (replaced(8, args[8][:1]), "relu"),
        (layer(1, codes[0].int()), r"weight_codes\[0\]"),
        (layer(1, codes[1][:, :-1].contiguous(), 1), r"weight_codes\[1\]"),
        (layer(2, args[2][0][:-1]), r"weight_lo\[0\]"),
        (layer(3, args[3][1].double(), 1), r"weight_scale\[1\]"),
        (layer(4, args[4][0].int()), r"weight_sums\[0\]"),
        (layer(5, torch.zeros(3)), r"bias\[0\]"),
        (layer(6, 0), r"act_bits\[0\]"),
        (layer(6, 9, 1), r"act_bits\[1\]"),
        (layer(7, 0), r"weight_bits\[0\]"),
    ]
    bad += [(list(args) + [scale], "row_scale") for scale in
            (torch.ones(x.size(0) + 1), torch.ones(x.size(0)).double(), torch.ones(x.size(0), 1))]
    for bad_args, name in bad:
        with pytest.raises(ValueError, match=name):
            op(*bad_args)
    with pytest.raises(ValueError, match="row_scale"):
        ref.quant_mlp(*args, row_scale=torch.ones(x.size(0) + 1))
    # the int32 bound: 40,000 inputs of 8 x 8 bits
    wide = (torch.randn(2, 40_000), [torch.zeros(1, 40_000, dtype=torch.uint8)], [torch.zeros(1)], [torch.ones(1)],
            [torch.zeros(1, dtype=torch.int64)], [None], [8], [8], [False])
    with pytest.raises(ValueError, match=r"weight_codes\[0\].*overflows int32"):
        op(*wide)


@pytest.mark.cuda
@requires_cuda
def test_gpu_errors():
    args, _ = make_case(1, device="cuda")
    op = torch.ops.pyg_quant.quant_mlp
    with pytest.raises(ValueError, match=r"weight_codes\[0\] is on cpu"):
        op(args[0], [args[1][0].cpu()] + args[1][1:], *args[2:])
    wide = (torch.randn(2, 300, device="cuda"), [torch.zeros(1, 300, dtype=torch.uint8, device="cuda")],
            [torch.zeros(1, device="cuda")], [torch.ones(1, device="cuda")],
            [torch.zeros(1, dtype=torch.int64, device="cuda")], [None], [4], [4], [False])
    with pytest.raises(ValueError, match="x: the CUDA kernel takes widths up to 256"):
        op(*wide)


# --- torch.compile ----------------------------------------------------------------------
@requires_compiled
def test_opcheck_and_compile():
    args, _ = make_case(7)
    torch.library.opcheck(torch.ops.pyg_quant.quant_mlp.default, args)

    def f(x):
        return ops.quant_mlp(x, *args[1:])

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(args[0]), f(args[0]))
