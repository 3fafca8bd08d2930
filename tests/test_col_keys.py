"""Column keys: the fused MLP hands the per-column quantizer the extrema of its output (``col_keys``).

``quant_mlp_keys`` / ``quant_mlp_planes_keys`` (``ops.quant_mlp(..., col_keys=True)``) return ``(out, keys)``, the
keys a fresh buffer of each call.  Oracles: the keys are checked against an encoding written here (independent of
``ordered_key.h`` and of ``reference.ordered_keys``) applied to the op's own output; ``quantize_pack_ranges`` with
the keys of ``x`` must return what it returns without them (all five outputs), on every backend; the GPU's keys must
equal the CPU's bit for bit wherever the outputs do (finite values).  The layers that use the keys on CUDA
(QGINConv requantizing per channel, QGCNConv's D^-1/2 X W) must give the bits of the path without them; on the CPU
they do not pass them.
"""
import pytest
import torch
from torch.nn import ReLU, Sequential

import pyg_quant as pq
import pyg_quant.quantization.quantize as quantize_module
import pyg_quant.nn.qgcn_conv as qgcn_module
import pyg_quant.nn.qgin_conv as qgin_module
import pyg_quant.nn.quant_linear as ql_module
from pyg_quant import ops
from pyg_quant.nn import QGCNConv, QGINConv
from pyg_quant.ops import reference as ref

from conftest import CUDA_OK, gen, random_edges, requires_compiled, requires_cuda
from test_quant_mlp import layer_codes, make_case, row_scale_for
from test_quant_mlp_planes import packed_case, planes_args

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if CUDA_OK else [])


# --- the encoding, written out again ------------------------------------------------------
def keys_of(x: torch.Tensor) -> torch.Tensor:
    """key(v) for float32 v with int32 pattern i: i + 2^31 when i >= 0 (the sign bit clear), else -1 - i (the
    complement of the unsigned pattern): an order-preserving uint32, as int64."""
    i = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(i >= 0, i + 2**31, -1 - i)


def expected_keys(out: torch.Tensor) -> torch.Tensor:
    """[max over rows of key | max over rows of 0xffffffff - key], zeros ("nothing seen") for no rows."""
    if out.size(0) == 0:
        return torch.zeros(2 * out.size(1), dtype=torch.int64, device=out.device)
    k = keys_of(out)
    return torch.cat([k.amax(0), (0xFFFFFFFF - k).amax(0)])


def decoded(keys: torch.Tensor):
    """(amin, amax) the keys stand for: the inverse of keys_of on the extreme keys."""
    cols = keys.numel() // 2

    def value(k):
        i = torch.where(k >= 2**31, k - 2**31, -1 - k)
        return i.to(torch.int32).view(torch.float32)

    return value(0xFFFFFFFF - keys[cols:]), value(keys[:cols])


def assert_same_float(a, b):
    """Equal values, NaNs where the other has them (their payloads may differ: amin's NaN is the data's)."""
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a[~nan], b[~nan])


def assert_same_ranges(got, want):
    """quantize_pack_ranges' five outputs: planes, lo, scale, code sums, row codes."""
    assert len(got) == len(want) == 5
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        if g.is_floating_point():
            assert_same_float(g, w)
        else:
            assert torch.equal(g, w), i


def assert_keys_buffer(keys, out):
    """A fresh int64 [2·out_cols] buffer on out's device."""
    assert keys.dtype == torch.int64 and keys.shape == (2 * out.size(1),) and keys.device == out.device
    assert keys.is_contiguous()


def with_nonfinite(args):
    """make_case's chain without ReLUs (which would clear NaNs) on an x whose rows hold inf, -inf, NaNs of both
    signs and float32's largest values, and a row scale that overflows some rows: (args, row_scale), whose output
    holds NaNs of both signs and infinities of both signs."""
    x = args[0].clone()
    x[0, 0] = float("inf")
    x[1, -1] = -float("inf")
    x[3, 0] = float("nan")
    x[4, 0] = -float("nan")
    x[5] = 3.0e38
    x[6, ::2] = -3.0e38
    scale = torch.ones(x.size(0))
    scale[7], scale[8] = 1e38, -1e38
    return (x,) + tuple(args[1:8]) + ([False] * len(args[8]),), scale.to(x.device)


# --- ops: quant_mlp_keys and quant_mlp_planes_keys return the keys -------------------------
@requires_compiled
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("i", range(12))
def test_quant_mlp_keys_describe_its_output(i, scaled):
    args, _ = make_case(i)
    n = args[0].size(0)
    scale = row_scale_for(n, i) if scaled else None
    out, keys = torch.ops.pyg_quant.quant_mlp_keys(*args, scale)
    assert_keys_buffer(keys, out)
    assert torch.equal(out, torch.ops.pyg_quant.quant_mlp(*args, scale))  # the output is the plain op's
    assert torch.equal(keys, expected_keys(out))
    lo, hi = decoded(keys)
    assert torch.equal(lo, out.amin(0)) and torch.equal(hi, out.amax(0))
    # the wrapper (keyword or positional col_keys) and the pure-torch fallback give them alike
    for fn in (lambda *a: ops.quant_mlp(*a, col_keys=True), lambda *a: ops.quant_mlp(*a, True),
               ref.quant_mlp_keys):
        got, again = fn(*args, scale)
        assert torch.equal(got, out)
        assert_keys_buffer(again, got)
        assert torch.equal(again, keys)
    # without col_keys, the wrapper and the fallback give the output alone
    for plain in (ops.quant_mlp(*args, scale), ops.quant_mlp(*args, scale, col_keys=False),
                  ref.quant_mlp(*args, scale)):
        assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


@requires_compiled
def test_keys_of_two_calls_combine():
    """Each call's keys are fresh, and keys combine by torch.maximum: two calls' keys, combined, are the keys of
    both outputs (and of one call on both inputs); a call on no rows returns zeros ("nothing seen"), which
    torch.maximum leaves any keys unchanged by."""
    args, _ = make_case(4, n=37)
    other, _ = make_case(4, n=12)
    other = (other[0] * 3 - 1,) + args[1:]
    out_cols = args[1][-1].size(0)
    a, keys_a = torch.ops.pyg_quant.quant_mlp_keys(*args, None)
    b, keys_b = torch.ops.pyg_quant.quant_mlp_keys(*other, None)
    assert torch.equal(keys_a, expected_keys(a)) and torch.equal(keys_b, expected_keys(b))  # nothing carried over
    assert keys_a.data_ptr() != keys_b.data_ptr()
    both = torch.maximum(keys_a, keys_b)
    assert torch.equal(both, expected_keys(torch.cat([a, b])))
    together, keys_together = torch.ops.pyg_quant.quant_mlp_keys(torch.cat([args[0], other[0]]), *args[1:], None)
    assert torch.equal(together, torch.cat([a, b])) and torch.equal(keys_together, both)
    for fn in (torch.ops.pyg_quant.quant_mlp_keys, ref.quant_mlp_keys, lambda *a: ops.quant_mlp(*a, col_keys=True)):
        empty, keys = fn(args[0][:0], *args[1:], None)  # no rows: nothing seen
        assert empty.shape == (0, out_cols)
        assert_keys_buffer(keys, empty)
        assert torch.equal(keys, torch.zeros(2 * out_cols, dtype=torch.int64))
        assert torch.equal(torch.maximum(both, keys), both)
    # the planes of no rows (column layout, per-column ranges: zero codes in the words 0 rows are padded to)
    x, layers = packed_case(4, n=37)
    no_rows = (torch.zeros_like(x.planes), 0) + planes_args(x)[2:]
    for fn in (torch.ops.pyg_quant.quant_mlp_planes_keys, ref.quant_mlp_planes_keys,
               lambda *a: ops.quant_mlp_planes(*a, col_keys=True)):
        empty, keys = fn(*no_rows, *layers, None)
        assert empty.shape == (0, out_cols)
        assert_keys_buffer(keys, empty)
        assert torch.equal(keys, torch.zeros(2 * out_cols, dtype=torch.int64))


@requires_compiled
@pytest.mark.parametrize("dim", [0, None, 1])
@pytest.mark.parametrize("layout", ["col", "row"])
@pytest.mark.parametrize("i", range(8))
def test_quant_mlp_planes_keys_describe_its_output(i, layout, dim):
    x, layers = packed_case(i, n=[1, 37, 300][i % 3], layout=layout, dim=dim)
    scale = row_scale_for(x.rows, i) if i % 2 else None
    out, keys = torch.ops.pyg_quant.quant_mlp_planes_keys(*planes_args(x), *layers, scale)
    assert_keys_buffer(keys, out)
    assert torch.equal(out, torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers, scale))
    assert torch.equal(keys, expected_keys(out))
    for fn in (lambda *a: ops.quant_mlp_planes(*a, col_keys=True), lambda *a: ops.quant_mlp_planes(*a, True),
               ref.quant_mlp_planes_keys):
        got, again = fn(*planes_args(x), *layers, scale)
        assert torch.equal(got, out)
        assert_keys_buffer(again, got)
        assert torch.equal(again, keys)
    for plain in (ops.quant_mlp_planes(*planes_args(x), *layers, scale),
                  ops.quant_mlp_planes(*planes_args(x), *layers, scale, col_keys=False),
                  ref.quant_mlp_planes(*planes_args(x), *layers, scale)):
        assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


NONFINITE_CASES = [1, 2, 4, 5, 7, 8, 11, 13, 14]  # 37 and 1000 rows, two and three layers, widths 1 to 256


@requires_compiled
@pytest.mark.parametrize("i", NONFINITE_CASES)
def test_nonfinite_outputs(i):
    """NaN and infinite outputs: the keys still describe the output, and a column with a NaN gets a NaN range from
    the keys exactly as from amin / amax."""
    args, scale = with_nonfinite(make_case(i)[0])
    out, keys = torch.ops.pyg_quant.quant_mlp_keys(*args, scale)
    assert torch.equal(out.view(torch.int32), torch.ops.pyg_quant.quant_mlp(*args, scale).view(torch.int32))
    nan_cols = torch.isnan(out).any(0)
    assert nan_cols.any() and torch.isinf(out).any()
    assert torch.equal(keys, expected_keys(out))
    for bits in (1, 4, 8):
        want = torch.ops.pyg_quant.quantize_pack_ranges(out, bits, 0, True, None, True)
        assert_same_ranges(torch.ops.pyg_quant.quantize_pack_ranges(out, bits, 0, True, None, True, keys), want)
        assert_same_ranges(ref.quantize_pack_ranges(out, bits, 0, True, None, True, keys), want)
    lo, hi = ref.extrema_from_col_keys(keys)
    assert torch.isnan(lo[0, nan_cols]).all() and torch.isnan(hi[0, nan_cols]).all()
    assert torch.equal(lo[0, ~nan_cols], out[:, ~nan_cols].amin(0))
    assert torch.equal(hi[0, ~nan_cols], out[:, ~nan_cols].amax(0))
    # without the NaN rows: columns that hold +inf and -inf get the range amin / amax give
    rows = torch.tensor([2, 7, 8, 9])
    inf_out, keys = torch.ops.pyg_quant.quant_mlp_keys(args[0][rows], *args[1:], scale[rows])
    assert torch.isinf(inf_out).any() and not torch.isnan(inf_out).any()
    assert torch.equal(keys, expected_keys(inf_out))
    lo, hi = ref.extrema_from_col_keys(keys)
    assert torch.equal(lo[0], inf_out.amin(0)) and torch.equal(hi[0], inf_out.amax(0))
    for bits in (1, 4, 8):
        want = torch.ops.pyg_quant.quantize_pack_ranges(inf_out, bits, 0, True, None, True)
        assert_same_ranges(torch.ops.pyg_quant.quantize_pack_ranges(inf_out, bits, 0, True, None, True, keys), want)


# --- quantize_pack_ranges reads them ------------------------------------------------------
def awkward(rows, cols, seed):
    g = gen(seed)
    x = torch.randn(rows, cols, generator=g) * (1 + seed % 5)
    if rows > 4:
        x[:, 0] = 0.5  # a constant column: scale 0
        x[1] = -0.0
        x[2, ::3] = 0.0  # -0 and +0 in the same columns
        x[3] = x[3] * 1e30
    return x


@requires_compiled
@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (33, 5), (257, 100)])
@pytest.mark.parametrize("bits", range(1, 9))
def test_quantize_with_keys_equals_without(bits, shape, noise):
    x = awkward(*shape, seed=bits)
    u = torch.rand(shape, generator=gen(bits + 100)) if noise else None
    keys = expected_keys(x)
    for row_codes in (False, True):
        want = torch.ops.pyg_quant.quantize_pack_ranges(x, bits, 0, True, u, row_codes)
        assert_same_ranges(torch.ops.pyg_quant.quantize_pack_ranges(x, bits, 0, True, u, row_codes, keys), want)
        assert_same_ranges(ops.quantize_pack_ranges(x, bits, 0, True, u, row_codes, keys), want)
        assert_same_ranges(ref.quantize_pack_ranges(x, bits, 0, True, u, row_codes, keys), want)
    assert torch.equal(ref.col_keys_of(x), keys)


@requires_compiled
def test_quantize_layer_helper_takes_keys():
    x = awkward(40, 9, 3)
    got = quantize_module.quantize(x, 4, 0, "col", expected_keys(x))
    want = quantize_module.quantize(x, 4, 0, "col")
    assert torch.equal(got.planes, want.planes) and torch.equal(got.lo, want.lo)
    assert torch.equal(got.scale, want.scale) and torch.equal(got._code_sums, want._code_sums)
    for dim, layout in ((1, "row"), (0, "row"), (None, "col"), (1, "col")):
        with pytest.raises(ValueError, match="col_keys"):
            quantize_module.quantize(x, 4, dim, layout, expected_keys(x))


# --- errors -------------------------------------------------------------------------------
@requires_compiled
def test_errors_name_col_keys():
    """quantize_pack_ranges still takes a keys buffer (quant_mlp makes its own: there is none to check)."""
    y = awkward(33, 5, 1)
    keys = expected_keys(y)
    for fn in (torch.ops.pyg_quant.quantize_pack_ranges, ref.quantize_pack_ranges):
        with pytest.raises(ValueError, match=r"col_keys must be int64 \[10\] \(two keys per column of x\)"):
            fn(y, 4, 0, True, None, False, keys[:-1])
        with pytest.raises(ValueError, match=r"col_keys must be int64 \[10\]"):
            fn(y, 4, 0, True, None, False, keys.double())
        with pytest.raises(ValueError, match=r"col_keys needs per-column ranges in the column layout \(dim=0, "
                                             r"col_layout=True\), got dim=1, col_layout=False"):
            fn(y, 4, 1, False, None, False, expected_keys(y.t()))
        with pytest.raises(ValueError, match=r"col_keys needs .*got dim=0, col_layout=False"):
            fn(y, 4, 0, False, None, False, keys)
        with pytest.raises(ValueError, match=r"col_keys needs .*got dim=1, col_layout=True"):
            fn(y, 4, 1, True, None, False, expected_keys(y.t()))
    with pytest.raises(ValueError, match="col_keys is on meta but x is on cpu"):
        ref.quantize_pack_ranges(y, 4, 0, True, None, False, keys.to("meta"))


@pytest.mark.cuda
@requires_cuda
def test_gpu_errors_name_col_keys():
    y = awkward(33, 5, 1).cuda()
    with pytest.raises(ValueError, match="col_keys is on cpu but x is on cuda"):
        torch.ops.pyg_quant.quantize_pack_ranges(y, 4, 0, True, None, False, expected_keys(y).cpu())
    with pytest.raises(ValueError, match="col_keys needs"):
        torch.ops.pyg_quant.quantize_pack_ranges(y, 4, 1, False, None, False, expected_keys(y.t()))


# --- torch.compile / opcheck ----------------------------------------------------------------
@requires_compiled
def test_opcheck():
    args, _ = make_case(7, n=37)
    x, layers = packed_case(6, n=37)
    for scale in (None, row_scale_for(37, 1)):
        for op in (torch.ops.pyg_quant.quant_mlp_keys.default, torch.ops.pyg_quant.quant_mlp.default):
            torch.library.opcheck(op, args + (scale,))
        for op in (torch.ops.pyg_quant.quant_mlp_planes_keys.default, torch.ops.pyg_quant.quant_mlp_planes.default):
            torch.library.opcheck(op, planes_args(x) + layers + (scale,))
    y = awkward(33, 5, 2)
    for row_codes in (False, True):
        torch.library.opcheck(torch.ops.pyg_quant.quantize_pack_ranges.default,
                              (y, 3, 0, True, None, row_codes, expected_keys(y)))


@requires_compiled
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile(backend):
    """The functional form (ops.quant_mlp / ops.quant_mlp_planes with col_keys=True, the keys handed to
    quantize_pack_ranges) under torch.compile(fullgraph=True): the eager results exactly; inductor (the default
    backend, which could not lower the old mutable col_keys argument) calls the compiled ops, not a lowering of
    the references."""
    args, _ = make_case(7, n=37)
    x, layers = packed_case(6, n=37)

    def f(h, planes):
        out, keys = ops.quant_mlp(h, *args[1:], None, col_keys=True)
        out_p, keys_p = ops.quant_mlp_planes(planes, *planes_args(x)[1:], *layers, None, col_keys=True)
        return (out, keys, ops.quantize_pack_ranges(out, 4, 0, True, None, True, keys), out_p, keys_p,
                ops.quantize_pack_ranges(out_p, 3, 0, True, None, True, keys_p))

    torch._dynamo.reset()
    if backend == "aot_eager":
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        got = compiled(args[0], x.planes)
    else:
        from torch._inductor.utils import run_and_get_code
        compiled = torch.compile(f, fullgraph=True)
        got, code = run_and_get_code(compiled, args[0], x.planes)
        code = "\n".join(code)
        for op in ("quant_mlp_keys", "quant_mlp_planes_keys", "quantize_pack_ranges"):
            assert f"pyg_quant.{op}" in code, op
    want = f(args[0], x.planes)
    assert len(got) == len(want) == 6
    for i in (0, 1, 3, 4):
        assert got[i].dtype == want[i].dtype and torch.equal(got[i], want[i]), i
    assert torch.equal(got[1], expected_keys(want[0])) and torch.equal(got[4], expected_keys(want[3]))
    assert torch.equal(want[0], torch.ops.pyg_quant.quant_mlp(*args, None))  # the kernel's bits
    assert torch.equal(want[3], torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers, None))
    assert_same_ranges(got[2], want[2])
    assert_same_ranges(got[5], want[5])


# --- CUDA: the kernels' keys ---------------------------------------------------------------
def chain_case(width, n, seed, device="cpu"):
    """One or two layers whose widest is `width` (the instantiation: 1, 2, 4, 8 values a lane for 32, 64, 128,
    256), the output narrower than a multiple of 32 where it can be."""
    widths = {32: [32, 17], 64: [40, 64, 33], 128: [100, 128, 77], 256: [256, 129]}[width]
    x = torch.randn(n, widths[0], generator=gen(seed)) * 3
    layers = [layer_codes(widths[l], widths[l + 1], 4 + l, seed + l) for l in range(len(widths) - 1)]
    biases = [torch.randn(widths[l + 1], generator=gen(seed + 10 + l)) for l in range(len(widths) - 1)]
    act_bits, weight_bits = [5, 3][: len(layers)], [4, 5][: len(layers)]
    relus = [True, False][: len(layers)]
    to = lambda t: t.to(device)  # noqa: E731
    return (to(x), [to(w[0]) for w in layers], [to(w[1]) for w in layers], [to(w[2]) for w in layers],
            [to(w[3]) for w in layers], [to(b) for b in biases], act_bits, weight_bits, relus)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("n", [1, 5, 33, 259, 70_003])  # partial groups and blocks, grid-stride trips
@pytest.mark.parametrize("width", [32, 64, 128, 256])
def test_gpu_keys_equal_cpu(width, n):
    args, cuda_args = chain_case(width, n, width + n), chain_case(width, n, width + n, "cuda")
    scale = row_scale_for(n, width)
    inputs = {"x": (args, cuda_args)}
    for layout in ("col", "row"):
        xb = pq.to_bit(args[0], 4, dim=0, layout=layout)
        inputs[layout] = ((xb,) + tuple(args[1:]), (xb.to("cuda"),) + tuple(cuda_args[1:]))
    for name, (cpu_in, gpu_in) in inputs.items():
        for row_scale in (None, scale):
            gpu_scale = None if row_scale is None else row_scale.cuda()
            if name == "x":
                out, keys = torch.ops.pyg_quant.quant_mlp_keys(*cpu_in, row_scale)
                got, gpu_keys = torch.ops.pyg_quant.quant_mlp_keys(*gpu_in, gpu_scale)
            else:
                out, keys = torch.ops.pyg_quant.quant_mlp_planes_keys(*planes_args(cpu_in[0]), *cpu_in[1:],
                                                                      row_scale)
                got, gpu_keys = torch.ops.pyg_quant.quant_mlp_planes_keys(*planes_args(gpu_in[0]), *gpu_in[1:],
                                                                          gpu_scale)
            assert_keys_buffer(keys, out)
            assert_keys_buffer(gpu_keys, got)
            assert torch.equal(got.cpu(), out), name
            assert torch.equal(gpu_keys.cpu(), keys), name
            assert torch.equal(gpu_keys, expected_keys(got)), name
            # without keys the kernel is another instantiation: the same output
            plain = (torch.ops.pyg_quant.quant_mlp(*gpu_in, gpu_scale) if name == "x" else
                     torch.ops.pyg_quant.quant_mlp_planes(*planes_args(gpu_in[0]), *gpu_in[1:], gpu_scale))
            assert torch.equal(plain, got), name
            for bits in (1, 4, 7):
                want = torch.ops.pyg_quant.quantize_pack_ranges(got, bits, 0, True, None, True)
                assert_same_ranges(torch.ops.pyg_quant.quantize_pack_ranges(got, bits, 0, True, None, True,
                                                                            gpu_keys), want)
                cpu = torch.ops.pyg_quant.quantize_pack_ranges(out, bits, 0, True, None, True, keys)
                assert_same_ranges(tuple(t.cpu() for t in want), cpu)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("i", NONFINITE_CASES)
def test_gpu_nonfinite_outputs(i):
    """NaN / inf outputs (NaNs' signs and payloads may differ from the CPU's): the GPU's keys describe its own
    output, and its quantizer gives the same with them as without."""
    args, scale = with_nonfinite(make_case(i, device="cuda")[0])
    out, keys = torch.ops.pyg_quant.quant_mlp_keys(*args, scale)
    assert_keys_buffer(keys, out)
    assert torch.isnan(out).any() and torch.isinf(out).any()
    assert torch.equal(keys, expected_keys(out))
    for bits in (1, 4, 8):
        want = torch.ops.pyg_quant.quantize_pack_ranges(out, bits, 0, True, None, True)
        assert_same_ranges(torch.ops.pyg_quant.quantize_pack_ranges(out, bits, 0, True, None, True, keys), want)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (33, 5), (257, 100), (70_003, 64)])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_gpu_quantize_with_keys(bits, shape, noise):
    x = awkward(*shape, seed=bits)
    u = torch.rand(shape, generator=gen(bits + 100)) if noise else None
    xc, uc = x.cuda(), None if u is None else u.cuda()
    keys = expected_keys(xc)
    cpu = torch.ops.pyg_quant.quantize_pack_ranges(x, bits, 0, True, u, True)
    want = torch.ops.pyg_quant.quantize_pack_ranges(xc, bits, 0, True, uc, True)
    got = torch.ops.pyg_quant.quantize_pack_ranges(xc, bits, 0, True, uc, True, keys)
    assert_same_ranges(got, want)
    assert_same_ranges(tuple(t.cpu() for t in got), cpu)


# --- layers ---------------------------------------------------------------------------------
def watch_keys(monkeypatch):
    """The layers' general path (on a BitAdjacency their eval path runs the same steps in one op, whose bits
    tests/test_eval_path.py compares with it) with every call recorded: for every"""
    monkeypatch.setattr(qgin_module, "gin_eval", lambda *args: None)
    monkeypatch.setattr(qgcn_module, "gcn_eval", lambda *args: None)
    return _watch_keys(monkeypatch)


def _watch_keys(monkeypatch):
    """Records, for every quant_mlp / quant_mlp_planes and quantize_pack_ranges call, whether col_keys was asked
    for (quant_mlp*: ``col_keys=True``, a bool, positional or keyword) or given (quantize_pack_ranges: a keys
    tensor).  Checks on the way that a quant_mlp* call asking for keys returns ``(out, keys)``, and that keys given
    to quantize_pack_ranges are the very buffer the latest such call returned and describe the x they come with."""
    seen, returned = [], []
    originals = {name: getattr(ops, name) for name in ("quant_mlp", "quant_mlp_planes", "quantize_pack_ranges")}
    positions = {"quant_mlp": 10, "quant_mlp_planes": 16, "quantize_pack_ranges": 6}

    def watcher(name):
        quantizer = name == "quantize_pack_ranges"

        def call(*args, **kwargs):
            default = None if quantizer else False
            keys = args[positions[name]] if len(args) > positions[name] else kwargs.get("col_keys", default)
            if quantizer:
                given = keys is not None
                if given:
                    assert isinstance(keys, torch.Tensor) and returned and keys is returned[-1]
                    assert torch.equal(keys, expected_keys(args[0]))
            else:
                assert isinstance(keys, bool), (name, keys)  # a flag: the op makes the buffer
                given = keys
            seen.append((name, given))
            result = originals[name](*args, **kwargs)
            if given and not quantizer:
                assert isinstance(result, tuple) and len(result) == 2
                returned.append(result[1])
            elif not quantizer:
                assert isinstance(result, torch.Tensor)
            return result
        return call

    for name in ("quant_mlp", "quant_mlp_planes"):
        monkeypatch.setattr(ql_module.ops, name, watcher(name))
    monkeypatch.setattr(quantize_module.ops, "quantize_pack_ranges", watcher("quantize_pack_ranges"))
    return seen


def assert_same_bit_tensor(got, want):
    assert isinstance(got, pq.BitTensor) and isinstance(want, pq.BitTensor)
    assert (got.rows, got.cols, got.bits, got.layout, got.dim) == (want.rows, want.cols, want.bits, want.layout,
                                                                   want.dim)
    for name in ("planes", "lo", "scale"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.code_sums(), want.code_sums())
    got_codes, want_codes = getattr(got, "_row_codes", None), getattr(want, "_row_codes", None)
    assert (got_codes is None) == (want_codes is None)
    if got_codes is not None:
        assert torch.equal(got_codes, want_codes)


def without_keys(monkeypatch, call):
    """`call()` with the fused kernels run as before: a layer asking for col_keys gets none."""
    fused, scaled = ql_module.run_fused_mlp, ql_module.run_row_scaled_linear

    def no_keys(out, col_keys):
        return out if not col_keys or out is None else (out, None)

    with monkeypatch.context() as m:
        m.setattr(qgin_module, "gin_eval", lambda *args: None)  # the general path (the eval path asks for keys)
        m.setattr(qgcn_module, "gcn_eval", lambda *args: None)
        m.setattr(qgin_module, "run_fused_mlp", lambda module, x, col_keys=False: no_keys(fused(module, x), col_keys))
        m.setattr(qgcn_module, "run_row_scaled_linear",
                  lambda lin, x, scale, col_keys=False: no_keys(scaled(lin, x, scale), col_keys))
        return call()


def gin_setup(device, bits=4):
    n, d = 300, 64
    x = torch.randn(n, d, generator=gen(5)).to(device)
    edge_index = random_edges(n, n, 6 * n, 6).to(device)
    adj = pq.BitAdjacency.from_edge_index(edge_index, n)
    torch.manual_seed(bits)
    nn = Sequential(torch.nn.Linear(d, 96), ReLU(), torch.nn.Linear(96, 48))
    return QGINConv(nn, bits=bits, out_bits=bits).to(device).eval(), x, adj


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
def test_qgin_conv_passes_keys_on_cuda_only(monkeypatch, device):
    conv, x, adj = gin_setup(device)
    codes = pq.to_bit(x, 4, dim=0, layout="col")
    with torch.no_grad():
        conv(x, adj)  # the weights' codes, made once
    seen = watch_keys(monkeypatch)
    with torch.no_grad():
        got = conv(x, adj)  # x quantized per channel for A·X (no kernel made it: no keys), then the MLP
        got_codes = conv(codes, adj)  # codes that fit: the self term runs in the aggregation's epilogue
    on_cuda = device == "cuda"
    mlp = [("quant_mlp", on_cuda), ("quantize_pack_ranges", on_cuda)]
    assert seen == [("quantize_pack_ranges", False)] + mlp + mlp
    seen.clear()
    with torch.no_grad():
        want = without_keys(monkeypatch, lambda: conv(x, adj))
        want_codes = without_keys(monkeypatch, lambda: conv(codes, adj))
    assert seen == [("quantize_pack_ranges", False)] + [("quant_mlp", False), ("quantize_pack_ranges", False)] * 2
    assert_same_bit_tensor(got, want)
    assert_same_bit_tensor(got_codes, want_codes)
    # the unfused layers give the same bits, too
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(qgin_module, "run_fused_mlp", lambda module, x, col_keys=False: None)
        m.setattr(qgin_module, "gin_eval", lambda *args: None)
        assert_same_bit_tensor(conv(x, adj), got)
    # per-node or per-tensor ranges, or no requantization: no keys
    for out_dim in (1, None):
        conv.out_dim = out_dim
        seen.clear()
        with torch.no_grad():
            conv(x, adj)
        assert ("quant_mlp", True) not in seen and ("quantize_pack_ranges", True) not in seen


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
def test_qgcn_conv_passes_keys_on_cuda_only(monkeypatch, device):
    n = 300
    x = torch.randn(n, 100, generator=gen(7)).to(device)
    edge_index = random_edges(n, n, 6 * n, 8).to(device)
    adj = pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1)
    torch.manual_seed(0)
    conv = QGCNConv(100, 16, bits=4).to(device).eval()
    with torch.no_grad():
        conv(x, edge_index)  # the weight's codes, made once
    seen = watch_keys(monkeypatch)
    on_cuda = device == "cuda"
    codes = pq.to_bit(x, 4, dim=0, layout="col")  # the loader's features: the kernel reads their codes
    for features, graph, kernel in ((x, edge_index, "quant_mlp"), (x, adj, "quant_mlp"),
                                    (codes, adj, "quant_mlp_planes")):
        seen.clear()
        with torch.no_grad():
            got = conv(features, graph)
        assert seen == [(kernel, on_cuda), ("quantize_pack_ranges", on_cuda)]
        seen.clear()
        with torch.no_grad():
            want = without_keys(monkeypatch, lambda: conv(features, graph))
        assert seen == [(kernel, False), ("quantize_pack_ranges", False)]
        assert torch.equal(got, want)
    conv.out_bits, conv.out_dim = 4, 0  # the output's requantization is not fed keys (no fused kernel made it)
    seen.clear()
    with torch.no_grad():
        conv(x, adj)
    assert seen[-1] == ("quantize_pack_ranges", False)
