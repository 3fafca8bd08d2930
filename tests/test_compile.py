"""The registered ops pass torch.library.opcheck and trace under torch.compile without graph breaks."""
import pytest
import torch

import pyg_quant as pq
from pyg_quant import ops
from pyg_quant.ops import reference as ref

from conftest import DEVICES, gen, randn, random_edges, requires_compiled

pytestmark = requires_compiled


def _bitmm_operands():
    a = pq.to_bit(randn(37, 300, 1), 3, dim=1)
    b = pq.to_bit(randn(300, 19, 2), 5, dim=0, layout="col")
    return a, b


def _spmm_operands(min_tile_nnz=16):
    adj = pq.BitAdjacency.from_edge_index(random_edges(300, 300, 4000, 3), 300, self_loops=1, min_tile_nnz=min_tile_nnz)
    x = pq.to_bit(randn(300, 12, 4), 4, dim=0, layout="col")
    assert adj.res_nnz > 0 and adj.num_tiles > 0  # both parts present
    return adj, x


def _spmm_args(adj, x, wide=False):
    return (adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val,
            x.planes, adj.num_rows, x.cols, wide)


def _samples():
    x = randn(31, 70, 0)
    lo, inv = x.amin(0, keepdim=True), 7.0 / (x.amax(0, keepdim=True) - x.amin(0, keepdim=True))
    noise = torch.rand(31, 70, generator=gen(1))
    a, b = _bitmm_operands()
    adj, xs = _spmm_operands()
    adj_dup = pq.BitAdjacency.from_edge_index(random_edges(40, 40, 900, 5), 40)  # duplicates: res_val set
    assert adj_dup.bits > 1 and adj_dup.res_val is not None
    x_dup = pq.to_bit(randn(40, 6, 5), 2, layout="col")
    return {
        "quantize_pack": [(x, lo, inv, 3, False, None), (x, lo, inv, 3, True, noise),
                          (x, x.min().view(1, 1), inv.amax().view(1, 1), 8, True, None)],
        "unpack_codes": [(a.planes, 37, 300, False), (b.planes, 300, 19, True)],
        "packed_code_sums": [(a.planes,), (b.planes,)],
        "bitmm_int": [(a.planes, b.planes, 37, 19, False), (a.planes, b.planes, 37, 19, True)],
        "bit_spmm_int": [_spmm_args(adj, xs), _spmm_args(adj, xs, True), _spmm_args(adj_dup, x_dup)],
        "pack_row_codes": [(b.planes, 19, True), (a.planes, 300, False)],
        "quantize_pack_ranges": [(x, 4, 0, True, None, True), (x, 3, 1, False, None, False),
                                 (x, 2, 1, False, noise, True)],
        "mlp_weight_codes": [([x], [4]), ([x, randn(9, 31, 6).double()], [3, 8])],
    }


SAMPLES = None


def samples():
    global SAMPLES
    if SAMPLES is None:
        SAMPLES = _samples()
    return SAMPLES


def _storages(value) -> list:
    """The storages (data pointers) of the non-empty tensors in ``value`` (a tensor, or a list or tuple of them)."""
    if isinstance(value, torch.Tensor):
        return [value.untyped_storage().data_ptr()] if value.numel() else []
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _storages(v)]
    return []


def assert_own_storage(args, result, name: str) -> None:
    """No tensor of ``result`` shares its storage with an input or another result (torch.compile's rule for a
    registered op, which it checks only with a warning)."""
    outputs = _storages(result)
    assert len(set(outputs)) == len(outputs), f"{name}: results share storage"
    assert not set(outputs) & set(_storages(args)), f"{name}: a result shares an input's storage"


def _to(value, device):
    """``value`` (a tensor, or a list or tuple of them among other arguments) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["quantize_pack", "unpack_codes", "packed_code_sums", "bitmm_int", "bit_spmm_int",
                                  "pack_row_codes", "quantize_pack_ranges", "mlp_weight_codes"])
def test_opcheck(name, device):
    """opcheck (schema, fake kernel, no result aliasing an input or another result) on each device's kernels."""
    op = getattr(torch.ops.pyg_quant, name).default
    for args in samples()[name]:
        args = _to(args, device)
        torch.library.opcheck(op, args)
        # and the compiled result equals the pure-torch reference
        got, want = op(*args), getattr(ref, name)(*args)
        assert_own_storage(args, got, name)
        if isinstance(got, torch.Tensor):
            got, want = (got,), (want,)
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want)), name


def _same(a, b) -> bool:
    """Equal dtype, shape and values, a NaN equal to a NaN (a row holding one has a NaN range)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a, b) if not a.is_floating_point() else bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_mlp_weight_codes_are_the_packed_weights_codes(device):
    """One op a chain gives what quant_mlp took from each packed weight (fused_codes of the per-row codes QuantLinear
    packs), on random weights (a NaN in a row, float64, more weights than one CUDA launch takes), the GPU's kernel
    what the CPU's composition gives; and it raises naming its arguments."""
    from pyg_quant.nn.quant_linear import fused_codes
    from pyg_quant.quantization.quantize import quantize

    if device == "cuda" and not ops.use_compiled("mlp_weight_codes", torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and pyg_quant's compiled CUDA backend")
    nan_row = randn(5, 40, 10)
    nan_row[2, 7] = float("nan")
    weights = [randn(32, 24, 7), randn(7, 32, 8) * 3, randn(300, 70, 9), nan_row, randn(3, 1, 11).double()]
    weights += [randn(16 + i, 33, 12 + i) for i in range(6)]  # 11 weights: more than a CUDA launch takes (8)
    weights = [w.to(device) for w in weights]
    bits = [4, 2, 8, 3, 1] + [1 + i for i in range(6)]
    got = ops.mlp_weight_codes(weights, bits)
    assert len(got) == len(weights)
    if device == "cuda":  # the GPU's kernel against the CPU's composition
        on_cpu = ops.mlp_weight_codes([w.cpu() for w in weights], bits)
        for parts, cpu_parts in zip(got, on_cpu):
            assert all(_same(g.cpu(), c) for g, c in zip(parts, cpu_parts))
    for w, b, parts in zip(weights, bits, got):
        packed = quantize(w, b, 1, "row")
        want = fused_codes(pq.BitTensor(packed.planes, (w.size(1), w.size(0)), b, "col", packed.lo, packed.scale, 0))
        assert [p.dtype for p in parts] == [torch.uint8, torch.float32, torch.float32, torch.int64]
        assert all(_same(g, h) for g, h in zip(parts, want))
    op = torch.ops.pyg_quant.mlp_weight_codes.default
    with pytest.raises(ValueError, match="one entry per layer"):
        op(weights, [4])
    with pytest.raises(ValueError, match="weights\\[0\\] must be a non-empty 2-D"):
        op([weights[0][0]], [4])
    with pytest.raises(TypeError, match="weights\\[0\\] must be floating point"):
        op([weights[0].int()], [4])
    with pytest.raises(ValueError, match="bits\\[1\\] must be in 1..8"):
        op(weights[:2], [4, 9])


def _count_graph_breaks(fn, *args):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    return explanation.graph_break_count, explanation.graph_count


def test_dynamo_explain_no_graph_breaks():
    a, b = _bitmm_operands()

    def f(a_planes, b_planes):
        return ops.bitmm_int(a_planes, b_planes, 37, 19, False)

    f(a.planes, b.planes)
    breaks, graphs = _count_graph_breaks(f, a.planes, b.planes)
    assert breaks == 0 and graphs == 1


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def test_compile_bitmm_int():
    a, b = _bitmm_operands()

    def f(a_planes, b_planes):
        return ops.bitmm_int(a_planes, b_planes, 37, 19, False) * 2 + 1

    want = f(a.planes, b.planes)
    got = _compile(f)(a.planes, b.planes)
    assert torch.equal(got, want)
    assert torch.equal(got, ref.bitmm_int(a.planes, b.planes, 37, 19, False) * 2 + 1)


def test_compile_quantize_unpack_sums():
    x = randn(45, 77, 9)

    def f(x, noise):
        lo = x.amin(0, keepdim=True)
        inv = 15.0 / (x.amax(0, keepdim=True) - lo)
        planes = ops.quantize_pack(x, lo, inv, 4, True, noise)
        return planes, ops.unpack_codes(planes, 45, 77, True), ops.packed_code_sums(planes)

    noise = torch.rand(45, 77, generator=gen(3))
    want = f(x, noise)
    got = _compile(f)(x, noise)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_compile_bit_spmm_int():
    adj, x = _spmm_operands()
    args = _spmm_args(adj, x)

    def f(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes):
        return ops.bit_spmm_int(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, 300, 12, False)

    want = f(*args[:7])
    got = _compile(f)(*args[:7])
    assert torch.equal(got, want)
    assert torch.equal(got, ref.bit_spmm_int(*args))


_FIRST_USE_UNDER_COMPILE = """
import torch, pyg_quant
from pyg_quant import ops
device = torch.device(DEVICE)
a = pyg_quant.to_bit(torch.randn(37, 300, device=device), 3, layout="row")
b = pyg_quant.to_bit(torch.randn(300, 19, device=device), 2, dim=0, layout="col")
f = torch.compile(lambda p, q: ops.bitmm_int(p, q, 37, 19, False), backend="aot_eager", fullgraph=True)
got = f(a.planes, b.planes)
want = ops.reference.bitmm_int(a.planes, b.planes, 37, 19, False)
assert torch.equal(got, want), "compiled result differs"
print("ok")
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compile_as_the_first_use_of_an_op(device):
    """In a fresh process, the backend choice (kernel table, GPU capability) must not break a fullgraph trace."""
    import subprocess
    import sys

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # to_bit runs eagerly first in the script only for its inputs; bitmm_int's
    # first call is the traced one.
    script = _FIRST_USE_UNDER_COMPILE.replace("DEVICE", repr(device))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_each_fake_kernel_registered_once():
    """torch before 2.13 refuses a second ``register_fake`` of one op at import (later versions replace the first):
    every op's fake kernel is registered once."""
    import collections
    import inspect
    import re

    names = re.findall(r'register_fake\("pyg_quant::(\w+)"\)', inspect.getsource(ops))
    twice = [name for name, count in collections.Counter(names).items() if count > 1]
    assert names and not twice, twice
