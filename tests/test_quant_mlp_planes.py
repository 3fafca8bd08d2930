"""ops.quant_mlp_planes (the fused chain of bit layers reading a packed tensor's codes) against its definition.

Oracle: ``quant_mlp(dequantize(planes, ...), ...)`` -- the op must equal it exactly (``torch.equal``) on the CPU,
the GPU must equal the CPU bit for bit, in both layouts and for every range layout (per tensor, column, row), every
input width 1..8 bits and row counts that leave partial groups.  Layers fed a BitTensor they read as the floats it
holds (QuantLinear, QGCNConv's first layer) must take the op and give what the dequantize path gives.
"""
import pytest
import torch

import pyg_quant as pq
import pyg_quant.nn.quant_linear as ql_module
from pyg_quant import ops
from pyg_quant.bit_tensor import BitTensor
from pyg_quant.nn import QGCNConv, QuantLinear
from pyg_quant.ops import reference as ref

from conftest import gen, random_edges, requires_compiled, requires_cuda
from test_quant_mlp import make_case, row_scale_for

LAYOUTS = ["col", "row"]
DIMS = [0, None, 1]


def packed_case(i, n=None, layout="col", dim=0, device="cpu"):
    """make_case's chain, its input x quantized to 1..8 bits in `layout` with ranges over `dim`: (BitTensor, the
    op's layer arguments)."""
    args, _ = make_case(i, n=n)
    bits = 1 + i % 8
    x = pq.to_bit(args[0], bits, dim=dim, layout=layout)
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    layers = tuple([to(t) for t in a] if isinstance(a, list) else a for a in args[1:])
    return x.to(device), layers


def planes_args(x: BitTensor):
    return (x.planes, x.rows, x.cols, x.layout == "col", x.lo, x.scale, -1 if x.dim is None else x.dim)


def definition(x: BitTensor, layers, row_scale=None):
    return torch.ops.pyg_quant.quant_mlp(pq.to_val(x), *layers, row_scale)


@requires_compiled
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("i", range(16))
def test_op_equals_definition_cpu(i, layout, dim):
    x, layers = packed_case(i, layout=layout, dim=dim)
    want = definition(x, layers)
    got = torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(ops.quant_mlp_planes(*planes_args(x), *layers), want)
    assert torch.equal(ref.quant_mlp_planes(*planes_args(x), *layers), want)  # the pure-torch fallback


@requires_compiled
def test_row_scale_and_empty_rows_cpu():
    x, layers = packed_case(3, n=37)
    scale = row_scale_for(37, 3)
    assert torch.equal(torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers, scale),
                       definition(x, layers, scale))
    planes, _, cols, col_layout, lo, scale, dim = planes_args(x)
    out = torch.ops.pyg_quant.quant_mlp_planes(planes, 0, cols, col_layout, lo, scale, dim, *layers)  # no rows
    assert out.shape == (0, layers[0][-1].size(0))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("i", range(16))
def test_gpu_equals_cpu(i, layout, dim):
    x, layers = packed_case(i, layout=layout, dim=dim)
    cpu = torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers)
    xc, layers_c = packed_case(i, layout=layout, dim=dim, device="cuda")
    got = torch.ops.pyg_quant.quant_mlp_planes(*planes_args(xc), *layers_c)
    assert got.is_cuda
    assert torch.equal(got.cpu(), cpu)
    assert torch.equal(got, definition(xc, layers_c))  # the GPU's own dequantize + quant_mlp


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("n", [1, 5, 33, 259, 70_003])  # partial warps' and blocks' groups, grid-stride trips
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("i", [1, 10, 13, 22])  # widest layer 256, 32, 100, 64: every instantiation
def test_gpu_equals_cpu_row_counts(i, layout, n):
    x, layers = packed_case(i, n=n, layout=layout)
    xc, layers_c = packed_case(i, n=n, layout=layout, device="cuda")
    scale = row_scale_for(n, i)
    got = torch.ops.pyg_quant.quant_mlp_planes(*planes_args(xc), *layers_c, scale.cuda())
    assert torch.equal(got.cpu(), torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers, scale))


# --- errors -----------------------------------------------------------------------------
@requires_compiled
def test_errors_name_the_argument():
    x, layers = packed_case(1, n=37)
    op = torch.ops.pyg_quant.quant_mlp_planes
    planes, rows, cols, col_layout, lo, scale, dim = planes_args(x)
    bad = [
        ((planes.float(), rows, cols, col_layout, lo, scale, dim), "planes"),
        ((planes, rows, cols + 1000, col_layout, lo, scale, dim), "rows/cols"),
        ((planes, rows, cols, col_layout, lo[:-1], scale, dim), "lo and scale"),
        ((planes, rows, cols, col_layout, lo, scale.double(), dim), "lo and scale"),
        ((planes, rows, cols, col_layout, lo, scale, 2), "dim"),
        ((planes, rows, cols + 1, col_layout, torch.cat([lo, lo[:1]]), torch.cat([scale, scale[:1]]), dim),
         r"weight_codes\[0\] has"),
    ]
    for bad_args, name in bad:
        with pytest.raises(ValueError, match=name):
            op(*bad_args, *layers)
    with pytest.raises(ValueError, match=r"row_scale must be float32 \[37\] \(one scale per row of planes\)"):
        op(*planes_args(x), *layers, torch.ones(38))


@pytest.mark.cuda
@requires_cuda
def test_gpu_errors():
    x, layers = packed_case(1, n=37, device="cuda")
    op = torch.ops.pyg_quant.quant_mlp_planes
    with pytest.raises(ValueError, match=r"weight_codes\[0\] is on cpu but planes is on cuda"):
        op(*planes_args(x), [layers[0][0].cpu()] + layers[0][1:], *layers[1:])
    wide = pq.to_bit(torch.randn(5, 300, device="cuda"), 4, dim=0, layout="col")
    one = ([torch.zeros(1, 300, dtype=torch.uint8, device="cuda")], [torch.zeros(1, device="cuda")],
           [torch.ones(1, device="cuda")], [torch.zeros(1, dtype=torch.int64, device="cuda")], [None], [4], [4],
           [False])
    with pytest.raises(ValueError, match="planes: the CUDA kernel takes widths up to 256"):
        op(*planes_args(wide), *one)


# --- torch.compile ----------------------------------------------------------------------
@requires_compiled
def test_opcheck_and_compile():
    x, layers = packed_case(6, n=37)
    torch.library.opcheck(torch.ops.pyg_quant.quant_mlp_planes.default, planes_args(x) + layers)

    def f(planes, lo, scale):
        return ops.quant_mlp_planes(planes, x.rows, x.cols, True, lo, scale, 0, *layers)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x.planes, x.lo, x.scale), f(x.planes, x.lo, x.scale))


# --- layers -----------------------------------------------------------------------------
def count_ops(monkeypatch):
    calls = []
    for name in ("quant_mlp", "quant_mlp_planes"):
        original = getattr(ops, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(ql_module.ops, name, counted)
    return calls


DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dim", [0, None])
def test_quant_linear_reads_codes(monkeypatch, device, layout, dim):
    """A QuantLinear fed codes it does not multiply as they stand reads them in the fused kernel: the result of
    the dequantize path, bit for bit."""
    lin = QuantLinear(100, 16, bits=4).to(device).eval()
    x = pq.to_bit((torch.randn(300, 100, generator=gen(5)) * 3).to(device), 3, dim=dim, layout=layout)
    calls = count_ops(monkeypatch)
    with torch.no_grad():
        got = lin(x)
        assert calls == ["quant_mlp_planes"]
        want = lin(pq.to_val(x))
    assert torch.equal(got, want)
    got_grad = lin(x)  # autograd on (the weight asks for a gradient): the float path, not the kernel
    assert got_grad.requires_grad and calls == ["quant_mlp_planes", "quant_mlp"]


@requires_compiled
def test_quant_linear_codes_with_non_finite_values():
    """Ranges whose values overflow are refused as the dequantized floats are; ranges that only could (codes
    that never reach the end of the range) fall back to the dequantize path and still run."""
    lin = QuantLinear(8, 4, bits=4).eval()
    x = pq.to_bit(torch.randn(10, 8, generator=gen(1)), 4, dim=0, layout="col")
    inf = x._replace(scale=torch.full_like(x.scale, float("inf")))
    with torch.no_grad(), pytest.raises(ValueError, match="x holds NaN or inf"):
        lin(inf)
    zeros = pq.to_bit(torch.zeros(10, 8), 4, dim=0, layout="col")  # every code 0
    edge = zeros._replace(lo=torch.full_like(zeros.lo, 3e38), scale=torch.full_like(zeros.scale, 1e37))
    with torch.no_grad():
        assert torch.equal(lin(edge), lin(pq.to_val(edge)))


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
def test_qgcn_conv_first_layer_reads_the_loaders_codes(monkeypatch, device):
    """QGCNConv on the loader's column codes folds D^-1/2 into a quant_mlp_planes call; the same bits as the
    dequantized features."""
    conv = QGCNConv(100, 16, bits=4).to(device).eval()
    x = (torch.randn(500, 100, generator=gen(2)) * 2).to(device)
    edge_index = random_edges(500, 500, 4000, seed=3).to(device)
    codes = pq.to_bit(x, 4, dim=0, layout="col")
    calls = count_ops(monkeypatch)
    with torch.no_grad():
        got = conv(codes, edge_index)
        assert calls == ["quant_mlp_planes"]
        want = conv(pq.to_val(codes), edge_index)
    assert torch.equal(got, want)
