"""ops.quant_mlp_row_codes / ops.quant_mlp_planes_row_codes (the fused chain of bit layers whose output is quantized
per column with fixed ranges, stored as packed row codes) and ops.planes_from_row_codes (the column-layout planes of
row codes, which a BitTensor held as row codes makes when asked) against their definition.  Each row-codes op is
checked through the pair (planes_from_row_codes(row codes), row codes), so that both forms meet the oracles below.

Oracles:

* **The definition**, composed of the ops it fuses, called explicitly: ``out = quant_mlp(...)`` (resp.
  ``quant_mlp_planes``), ``planes = quantize_pack(out, out_lo[None], out_inv_scale[None], out_bits, col_layout=True)``
  and ``row_codes = pack_row_codes(planes, out_cols, True)``; the op must equal it exactly (``torch.equal``) on the
  CPU, and so must the pure-torch reference.
* **The codes themselves**, decoded independently of the packers (:func:`decode_planes`, :func:`decode_row_codes`,
  written out here from the layout rules) against ``clamp(floor((out - lo)·inv + 0.5), 0, 2^b - 1)`` evaluated in
  torch on the float output, with every padding row and column zero.
* **The GPU** must equal the CPU bit for bit (planes and row codes, padding included) for every instantiation of the
  kernel: chunk counts 1, 2, 4, 8, the wide-first kernels, float / column-code / row-code inputs, every out_bits,
  row counts that leave partial 32-row groups, 256-row padding and grid-stride trips; the caching allocator is
  filled with garbage before each call so that a word the kernel leaves unwritten shows.
"""
import pytest
import torch

import pyg_quant as pq
from pyg_quant import ops
from pyg_quant.ops import reference as ref

from conftest import DEVICES, gen, random_edges, requires_compiled, requires_cuda, round_up
from test_quant_mlp import make_case, row_scale_for
from test_quant_mlp_planes import packed_case, planes_args



def _with_planes(row_codes_op, planes_op, rows_of):
    """``(planes, row codes)`` of a row-codes op: its row codes and ``planes_op`` of them."""
    def run(*args):
        row_codes = row_codes_op(*args)
        return planes_op(row_codes, rows_of(args), args[-3].numel(), args[-1]), row_codes
    return run


def _rows_of_x(args):
    return args[0].size(0)


def _rows_of_planes(args):
    return args[1]


OP_CODES = _with_planes(lambda *a: torch.ops.pyg_quant.quant_mlp_row_codes(*a),
                        lambda *a: torch.ops.pyg_quant.planes_from_row_codes(*a), _rows_of_x)
OP_PLANES_CODES = _with_planes(lambda *a: torch.ops.pyg_quant.quant_mlp_planes_row_codes(*a),
                               lambda *a: torch.ops.pyg_quant.planes_from_row_codes(*a), _rows_of_planes)
OPS_CODES = _with_planes(ops.quant_mlp_row_codes, ops.planes_from_row_codes, _rows_of_x)
OPS_PLANES_CODES = _with_planes(ops.quant_mlp_planes_row_codes, ops.planes_from_row_codes, _rows_of_planes)
REF_CODES = _with_planes(ref.quant_mlp_row_codes, ref.planes_from_row_codes, _rows_of_x)
REF_PLANES_CODES = _with_planes(ref.quant_mlp_planes_row_codes, ref.planes_from_row_codes, _rows_of_planes)

ALL_BITS = range(1, 9)
RANGE_KINDS = ["exact", "clip", "zero"]

# (widths, seed): one output column, widths that are and are not multiples of 4 / 16 / 32, a wide first layer
# (100 -> 64, 100 -> 16), four chunks without it, and the widest (256) chains.
CHAINS = [([16, 1], 0), ([7, 16], 1), ([47, 47, 47], 2), ([64, 32, 64], 3), ([100, 64], 4), ([100, 16], 5),
          ([128, 100, 47], 6), ([256, 64, 256], 7), ([33, 256, 1], 8)]


# --- oracles ----------------------------------------------------------------------------
def container_of(bits: int) -> int:
    """Bits of a row-code container (the layout's rule, written out again here)."""
    return {1: 1, 2: 2, 3: 4, 4: 4}.get(bits, 8)


def row_bytes_of(cols: int, bits: int) -> int:
    """Bytes of one node's row codes: ``cols`` containers padded to 16 bytes."""
    return round_up(cols * container_of(bits), 128) // 8


def decode_planes(planes: torch.Tensor) -> torch.Tensor:
    """Column-layout planes int32 [bits, outer_pad, words] -> int64 codes [words·32, outer_pad] (padding too)."""
    words = planes.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32)) & 1  # [bits, outer, words, 32], LSB = first node of the word
    bits = bits.flatten(-2)  # [bits, outer, nodes]
    weights = (1 << torch.arange(planes.size(0))).view(-1, 1, 1)
    return (bits * weights).sum(0).t()


def decode_row_codes(row_codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [nodes, row_bytes] -> int64 codes [nodes, row_bytes · 8 / container] (containers LSB first)."""
    container = container_of(bits)
    per_byte = 8 // container
    b = row_codes.to(torch.int64).unsqueeze(-1)
    shifts = torch.arange(per_byte) * container
    return ((b >> shifts) & ((1 << container) - 1)).flatten(-2)


def expected_codes(out: torch.Tensor, lo: torch.Tensor, inv: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.floor((out - lo.view(1, -1)) * inv.view(1, -1) + 0.5).clamp(0, 2**bits - 1).to(torch.int64)


def check_codes(planes, row_codes, out, lo, inv, bits):
    """Shapes, the codes of every logical entry and zero padding, in both forms, decoded here."""
    rows, cols = out.shape
    words = round_up(rows, 256) // 32
    assert planes.dtype == torch.int32 and planes.shape == (bits, round_up(cols, 64), words)
    assert row_codes.dtype == torch.uint8 and row_codes.shape == (words * 32, row_bytes_of(cols, bits))
    want = torch.zeros(words * 32, round_up(cols, 64), dtype=torch.int64)
    want[:rows, :cols] = expected_codes(out, lo, inv, bits)
    assert torch.equal(decode_planes(planes.cpu()), want)
    from_rows = decode_row_codes(row_codes.cpu(), bits)
    assert from_rows.shape[1] >= cols
    assert torch.equal(from_rows[:, :cols], want[:, :cols])
    assert not from_rows[:, cols:].any()  # the containers past the last column
    return want[:rows, :cols]


# --- cases --------------------------------------------------------------------------------
def out_ranges(out: torch.Tensor, kind: str, bits: int, seed: int = 0):
    """Fixed ranges ``(out_lo, out_inv_scale)`` for the output ``out``: its own extrema ("exact"), 0.7 of them about
    their middle (both ends clip), or some columns with lo == hi (scale and inv_scale 0).  Inverse scales as the
    layers make them: ``1/scale`` in float32, 0 where the scale is 0."""
    cols = out.size(1)
    if out.size(0) == 0:
        lo = torch.randn(cols, generator=gen(seed))
        hi = lo + torch.rand(cols, generator=gen(seed + 1)) * 4
    else:
        lo, hi = out.amin(0), out.amax(0)
    if kind == "clip":
        mid, half = (lo + hi) / 2, (hi - lo) / 2 * 0.7
        lo, hi = mid - half, mid + half
    elif kind == "zero":
        lo, hi = lo.clone(), hi.clone()
        mid = (lo + hi) / 2
        lo[::3] = mid[::3]
        hi[::3] = mid[::3]
    scale = (hi - lo) / torch.full_like(hi, float(2**bits - 1))
    inv = torch.where(scale > 0, torch.ones_like(scale) / scale, torch.zeros_like(scale))
    return lo.contiguous(), inv.contiguous()


def definition(args, row_scale, lo, inv, bits):
    out = torch.ops.pyg_quant.quant_mlp(*args, row_scale)
    planes = torch.ops.pyg_quant.quantize_pack(out, lo.view(1, -1), inv.view(1, -1), bits, True, None)
    return out, planes, torch.ops.pyg_quant.pack_row_codes(planes, out.size(1), True)


def planes_definition(x, layers, row_scale, lo, inv, bits):
    out = torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers, row_scale)
    planes = torch.ops.pyg_quant.quantize_pack(out, lo.view(1, -1), inv.view(1, -1), bits, True, None)
    return out, planes, torch.ops.pyg_quant.pack_row_codes(planes, out.size(1), True)


def assert_pair_equal(got, want):
    assert isinstance(got, tuple) and len(got) == 2
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    assert torch.equal(got[0], want[0]), "planes differ"
    assert torch.equal(got[1], want[1]), "row codes differ"


# --- CPU: the op equals its definition ----------------------------------------------------
@requires_compiled
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("kind", RANGE_KINDS)
@pytest.mark.parametrize("k", range(len(CHAINS)))
def test_op_equals_definition_cpu(k, kind, scaled):
    widths, seed = CHAINS[k]
    n = [37, 259][k % 2]
    args, _ = make_case(seed, n=n, widths=widths)
    scale = row_scale_for(n, seed) if scaled else None
    for bits in ALL_BITS:
        out = torch.ops.pyg_quant.quant_mlp(*args, scale)
        lo, inv = out_ranges(out, kind, bits, seed)
        _, planes, row_codes = definition(args, scale, lo, inv, bits)
        got = OP_CODES(*args, scale, lo, inv, bits)
        assert_pair_equal(got, (planes, row_codes))
        assert_pair_equal(OPS_CODES(*args, scale, lo, inv, bits), (planes, row_codes))
        assert_pair_equal(REF_CODES(*args, scale, lo, inv, bits), (planes, row_codes))  # pure torch
        codes = check_codes(got[0], got[1], out, lo, inv, bits)
        if kind == "clip":  # the ranges really clip, at both ends: codes below 0 and above 2^b - 1 before clamping
            raw = torch.floor((out - lo.view(1, -1)) * inv.view(1, -1) + 0.5)
            assert (out < lo.view(1, -1)).any()
            if bits >= 3:  # (at 1 or 2 bits half a step is more than the 15 % cut off each end)
                assert (raw < 0).any() and (raw > 2**bits - 1).any()
        if kind == "zero":
            assert not codes[:, ::3].any()  # a zero scale: every code 0
            if bits > 1 and widths[-1] > 1:
                assert codes[:, 1::3].any()


@requires_compiled
@pytest.mark.parametrize("dim", [0, None, 1])
@pytest.mark.parametrize("layout", ["col", "row"])
@pytest.mark.parametrize("i", range(8))
def test_planes_op_equals_definition_cpu(i, layout, dim):
    x, layers = packed_case(i, n=[37, 259][i % 2], layout=layout, dim=dim)
    scale = row_scale_for(x.rows, i) if i % 3 == 1 else None
    kind = RANGE_KINDS[i % 3]
    for bits in ALL_BITS:
        out = torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers, scale)
        lo, inv = out_ranges(out, kind, bits, i)
        _, planes, row_codes = planes_definition(x, layers, scale, lo, inv, bits)
        got = OP_PLANES_CODES(*planes_args(x), *layers, scale, lo, inv, bits)
        assert_pair_equal(got, (planes, row_codes))
        assert_pair_equal(OPS_PLANES_CODES(*planes_args(x), *layers, scale, lo, inv, bits),
                          (planes, row_codes))
        assert_pair_equal(REF_PLANES_CODES(*planes_args(x), *layers, scale, lo, inv, bits),
                          (planes, row_codes))
        check_codes(got[0], got[1], out, lo, inv, bits)


ROW_COUNTS = [0, 1, 31, 32, 33, 255, 257, 1000]


@requires_compiled
@pytest.mark.parametrize("n", ROW_COUNTS)
@pytest.mark.parametrize("widths", [[47, 64, 47], [100, 16], [16, 1]])
def test_row_counts_shapes_and_padding_cpu(widths, n):
    """Partial 32-row groups and the 256-row padding: the shapes, and zero codes in every padding row and column of
    both outputs (decoded here), for float and code inputs."""
    args, _ = make_case(3, n=n, widths=widths)
    full, _ = make_case(3, n=300, widths=widths)
    ref_out = torch.ops.pyg_quant.quant_mlp(*full)
    for bits in ALL_BITS:
        lo, inv = out_ranges(ref_out, "clip", bits)
        got = OP_CODES(*args, None, lo, inv, bits)
        out, planes, row_codes = definition(args, None, lo, inv, bits)
        assert out.shape == (n, widths[-1])
        assert_pair_equal(got, (planes, row_codes))
        check_codes(got[0], got[1], out, lo, inv, bits)
        assert_pair_equal(REF_CODES(*args, None, lo, inv, bits), (planes, row_codes))
        # the same rows read from column codes
        xb = pq.to_bit(args[0], 4, dim=0, layout="col") if n else None
        if xb is not None:
            got = OP_PLANES_CODES(*planes_args(xb), *args[1:], None, lo, inv, bits)
            out, planes, row_codes = planes_definition(xb, args[1:], None, lo, inv, bits)
            assert_pair_equal(got, (planes, row_codes))
            check_codes(got[0], got[1], out, lo, inv, bits)


@requires_compiled
def test_planes_op_without_rows_cpu():
    x, layers = packed_case(3, n=37)
    lo, inv = out_ranges(torch.empty(0, layers[0][-1].size(0)), "exact", 5)
    planes, _, cols, col_layout, lo_x, scale_x, dim = planes_args(x)
    got = OP_PLANES_CODES(planes, 0, cols, col_layout, lo_x, scale_x, dim, *layers, None,
                                                     lo, inv, 5)
    out_cols = layers[0][-1].size(0)
    assert got[0].shape == (5, round_up(out_cols, 64), 8) and got[1].shape == (256, row_bytes_of(out_cols, 5))
    assert not got[0].any() and not got[1].any()


@requires_compiled
def test_non_contiguous_arguments_cpu():
    args, _ = make_case(2, n=100, widths=[47, 47, 47])
    out = torch.ops.pyg_quant.quant_mlp(*args)
    lo, inv = out_ranges(out, "clip", 4)
    want = OP_CODES(*args, None, lo, inv, 4)
    x = torch.cat([args[0], args[0]], 1)[:, :47]
    lo2, inv2 = torch.stack([lo, lo], 1)[:, 0], torch.stack([inv, inv], 1)[:, 0]
    assert not x.is_contiguous() and not lo2.is_contiguous() and not inv2.is_contiguous()
    assert_pair_equal(OP_CODES(x, *args[1:], None, lo2, inv2, 4), want)


# --- errors -------------------------------------------------------------------------------
def bad_out_arguments(cols, lo, inv):
    """(out_lo, out_inv_scale, out_bits, the argument the error must name)."""
    bad = []
    for name in ("out_lo", "out_inv_scale"):
        for wrong in (torch.zeros(cols + 1), torch.zeros(cols - 1) if cols > 1 else torch.zeros(0),
                      torch.zeros(cols, dtype=torch.float64), torch.zeros(1, cols),
                      torch.zeros(cols, dtype=torch.int32)):
            bad.append((wrong, inv, 4, name) if name == "out_lo" else (lo, wrong, 4, name))
    bad += [(lo, inv, 0, "out_bits"), (lo, inv, 9, "out_bits"), (lo, inv, -1, "out_bits")]
    return bad


@requires_compiled
def test_errors_name_the_argument():
    args, _ = make_case(1, n=37, widths=[32, 20])
    out = torch.ops.pyg_quant.quant_mlp(*args)
    lo, inv = out_ranges(out, "exact", 4)
    x, layers = packed_case(1, n=37)
    out_p = torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers)
    lo_p, inv_p = out_ranges(out_p, "exact", 4)
    for fn in (OP_CODES, OPS_CODES, REF_CODES):
        for bad_lo, bad_inv, bits, name in bad_out_arguments(20, lo, inv):
            with pytest.raises(ValueError, match=name):
                fn(*args, None, bad_lo, bad_inv, bits)
    for fn in (OP_PLANES_CODES, OPS_PLANES_CODES, REF_PLANES_CODES):
        for bad_lo, bad_inv, bits, name in bad_out_arguments(out_p.size(1), lo_p, inv_p):
            with pytest.raises(ValueError, match=name):
                fn(*planes_args(x), *layers, None, bad_lo, bad_inv, bits)
    # the layer arguments are still checked, and named, as quant_mlp's are
    with pytest.raises(ValueError, match=r"act_bits\[0\]"):
        OP_CODES(*args[:6], [9], *args[7:], None, lo, inv, 4)
    with pytest.raises(ValueError, match="row_scale"):
        OP_CODES(*args, torch.ones(38), lo, inv, 4)


# --- torch.compile --------------------------------------------------------------------------
@requires_compiled
def test_opcheck_and_compile():
    args, _ = make_case(7, n=37, widths=[40, 24, 19])
    out = torch.ops.pyg_quant.quant_mlp(*args)
    lo, inv = out_ranges(out, "clip", 3)
    scale = row_scale_for(37, 7)
    for row_scale in (None, scale):
        torch.library.opcheck(torch.ops.pyg_quant.quant_mlp_row_codes.default, args + (row_scale, lo, inv, 3))
    x, layers = packed_case(6, n=37, layout="row", dim=1)
    out_p = torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers)
    lo_p, inv_p = out_ranges(out_p, "clip", 6)
    for row_scale in (None, scale):
        torch.library.opcheck(torch.ops.pyg_quant.quant_mlp_planes_row_codes.default,
                              planes_args(x) + layers + (row_scale, lo_p, inv_p, 6))

    def f(x_in, lo_in, inv_in):
        return OPS_CODES(x_in, *args[1:], None, lo_in, inv_in, 3)

    def g(planes, lo_x, scale_x):
        return OPS_PLANES_CODES(planes, x.rows, x.cols, False, lo_x, scale_x, 1, *layers, scale, lo_p,
                                          inv_p, 6)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert_pair_equal(compiled(args[0], lo, inv), f(args[0], lo, inv))
    compiled_g = torch.compile(g, backend="aot_eager", fullgraph=True)
    assert_pair_equal(compiled_g(x.planes, x.lo, x.scale), g(x.planes, x.lo, x.scale))


# --- GPU: bit for bit the CPU's ---------------------------------------------------------------
# Every instantiation: widest layer <= 32, <= 64, <= 128 (not wide-first), <= 256 (chunks 1, 2, 4, 8), and the
# wide-first kernels (a first layer of 65..128 inputs, later widths <= 32 or <= 64).
GPU_CHAINS = [([16, 32, 1], 10), ([47, 64, 47], 11), ([128, 100, 47], 12), ([33, 256, 16], 13), ([100, 16], 14),
              ([65, 32, 1], 15), ([100, 64, 64], 16), ([128, 64, 47], 17)]
INPUTS = ["float", "col", "row"]


def dirty_cuda_cache(like):
    """Leave blocks of the outputs' sizes full of ones in the caching allocator, which hands them to the op's
    outputs next: a word the kernel must write but does not shows."""
    junk = [torch.full(t.shape, 255 if t.dtype == torch.uint8 else -1, dtype=t.dtype, device="cuda") for t in like]
    del junk


def gpu_case(k, n, kind, device):
    widths, seed = GPU_CHAINS[k]
    args, _ = make_case(seed, n=n, widths=widths)
    if kind == "float":
        layers = tuple([t.to(device) if isinstance(t, torch.Tensor) else t for t in a] if isinstance(a, list) else a
                       for a in args[1:])
        return args[0].to(device), layers
    dim = [0, None, 1][seed % 3]
    if n == 0:  # to_bit takes no empty tensor: one row's codes, read as none (the padding is the same)
        one = pq.to_bit(make_case(seed, n=1, widths=widths)[0][0], 1 + seed % 8, dim=dim, layout=kind)
        x = one._replace(shape=(0, one.cols), lo=one.lo[:0] if dim == 1 else one.lo,
                         scale=one.scale[:0] if dim == 1 else one.scale)
    else:
        x = pq.to_bit(args[0], 1 + seed % 8, dim=dim, layout=kind)
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return x.to(device), tuple([to(t) for t in a] if isinstance(a, list) else a for a in args[1:])


def run_codes(x, layers, row_scale, lo, inv, bits):
    if isinstance(x, torch.Tensor):
        return OP_CODES(x, *layers, row_scale, lo, inv, bits)
    return OP_PLANES_CODES(*planes_args(x), *layers, row_scale, lo, inv, bits)


def run_float(x, layers, row_scale):
    if isinstance(x, torch.Tensor):
        return torch.ops.pyg_quant.quant_mlp(x, *layers, row_scale)
    return torch.ops.pyg_quant.quant_mlp_planes(*planes_args(x), *layers, row_scale)


def gpu_matches_cpu(k, n, kind, bits_list, scaled_list, range_kind="clip"):
    x, layers = gpu_case(k, n, kind, "cpu")
    xc, layers_c = gpu_case(k, n, kind, "cuda")
    for scaled in scaled_list:
        scale = row_scale_for(n, k) if scaled else None
        out = run_float(x, layers, scale)
        for bits in bits_list:
            lo, inv = out_ranges(out, range_kind, bits, k)
            want = run_codes(x, layers, scale, lo, inv, bits)
            dirty_cuda_cache(want)
            got = run_codes(xc, layers_c, None if scale is None else scale.cuda(), lo.cuda(), inv.cuda(), bits)
            assert got[0].is_cuda and got[1].is_cuda
            assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
            assert torch.equal(got[0].cpu(), want[0]), f"planes differ (bits={bits}, scaled={scaled})"
            assert torch.equal(got[1].cpu(), want[1]), f"row codes differ (bits={bits}, scaled={scaled})"


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("range_kind", RANGE_KINDS)
@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("k", range(len(GPU_CHAINS)))
def test_gpu_equals_cpu_every_out_bits(k, kind, range_kind):
    gpu_matches_cpu(k, 259, kind, ALL_BITS, (False, True), range_kind)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("n", [0, 1, 33, 257, 70_003])  # no rows, partial groups, 256-row padding, grid stride
@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("k", range(len(GPU_CHAINS)))
def test_gpu_equals_cpu_row_counts(k, kind, n):
    bits_list = ALL_BITS if n < 1000 else (1 + (k + len(kind)) % 8, 8 - (k % 4))
    gpu_matches_cpu(k, n, kind, bits_list, (False, True))


@pytest.mark.cuda
@requires_cuda
def test_gpu_equals_gpu_definition_and_errors():
    """The GPU op also equals its definition composed of the GPU's own ops; arguments on another device are named."""
    x, layers = gpu_case(1, 1000, "float", "cuda")
    out = torch.ops.pyg_quant.quant_mlp(x, *layers)
    lo, inv = out_ranges(out.cpu(), "clip", 5)
    lo, inv = lo.cuda(), inv.cuda()
    _, planes, row_codes = definition((x,) + layers, None, lo, inv, 5)
    assert_pair_equal(OP_CODES(x, *layers, None, lo, inv, 5), (planes, row_codes))
    assert_pair_equal(OPS_CODES(x, *layers, None, lo, inv, 5), (planes, row_codes))
    with pytest.raises(ValueError, match="out_lo is on cpu"):
        OP_CODES(x, *layers, None, lo.cpu(), inv, 5)
    with pytest.raises(ValueError, match="out_inv_scale is on cpu"):
        OP_CODES(x, *layers, None, lo, inv.cpu(), 5)
    xb, layers_b = gpu_case(1, 1000, "col", "cuda")
    with pytest.raises(ValueError, match="out_lo is on cpu"):
        OP_PLANES_CODES(*planes_args(xb), *layers_b, None, lo.cpu(), inv, 5)
    for bad_lo, bad_inv, bits, name in bad_out_arguments(lo.numel(), lo, inv):
        with pytest.raises(ValueError, match=name):
            OP_CODES(x, *layers, None, bad_lo.cuda(), bad_inv.cuda(), bits)


# --- planes_from_row_codes and BitTensors held as row codes ------------------------------------------------
def random_codes(rows, cols, bits, seed):
    """Random codes, every value of the width present where there is room (never all zeros)."""
    codes = torch.randint(0, 2**bits, (rows, cols), generator=gen(seed))
    if rows * cols >= 2**bits:
        codes.view(-1)[:2**bits] = torch.arange(2**bits)
    return codes


@requires_compiled
@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("rows, cols", [(1, 1), (33, 7), (256, 64), (257, 47), (1000, 100), (37, 256)])
def test_planes_from_row_codes_inverts_pack_row_codes_cpu(rows, cols, bits):
    codes = random_codes(rows, cols, bits, rows + cols + bits)
    zero = torch.zeros(1, 1)
    planes = torch.ops.pyg_quant.quantize_pack(codes.float(), zero, zero + 1, bits, True, None)
    row_codes = torch.ops.pyg_quant.pack_row_codes(planes, cols, True)
    for fn in (torch.ops.pyg_quant.planes_from_row_codes, ops.planes_from_row_codes, ref.planes_from_row_codes):
        got = fn(row_codes, rows, cols, bits)
        assert got.dtype == torch.int32 and torch.equal(got, planes)
    assert torch.equal(decode_planes(planes)[:rows, :cols].long(), codes)  # the planes hold the codes
    torch.library.opcheck(torch.ops.pyg_quant.planes_from_row_codes.default, (row_codes, rows, cols, bits))


@requires_compiled
def test_planes_from_row_codes_errors():
    planes = torch.ops.pyg_quant.quantize_pack(torch.rand(40, 20), torch.zeros(1, 1), torch.full((1, 1), 3.0), 2,
                                               True, None)
    row_codes = torch.ops.pyg_quant.pack_row_codes(planes, 20, True)  # [256, 16]
    for fn in (torch.ops.pyg_quant.planes_from_row_codes, ref.planes_from_row_codes):
        with pytest.raises(ValueError, match="bits"):
            fn(row_codes, 40, 20, 9)
        with pytest.raises(ValueError, match="row_codes"):
            fn(row_codes, 40, 20, 8)  # 8-bit rows of 20 codes take 32 bytes
        with pytest.raises(ValueError, match="row_codes"):
            fn(row_codes, 300, 20, 2)  # more rows than the codes hold
        with pytest.raises(ValueError, match="row_codes"):
            fn(row_codes.int(), 40, 20, 2)
        with pytest.raises(ValueError, match="cols"):
            fn(row_codes, 40, 0, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_bit_tensor_from_row_codes_makes_planes_on_demand(device):
    x = torch.randn(300, 24, generator=gen(3)).to(device)
    want = pq.to_bit(x, 5, dim=0, layout="col")
    lazy = pq.BitTensor.from_row_codes(want.row_codes(), want.shape, 5, want.lo, want.scale, 0)
    assert not lazy.has_planes and lazy.device == want.device and lazy.layout == "col"
    assert lazy.nbytes == want.row_codes().numel() + 2 * 24 * 4
    moved = lazy.to("cpu")
    assert not moved.has_planes and torch.equal(moved.row_codes(), want.row_codes().cpu())
    assert torch.equal(lazy.planes, want.planes) and lazy.has_planes
    assert torch.equal(pq.to_val(lazy), pq.to_val(want))
    with pytest.raises(ValueError, match="row_codes"):
        pq.BitTensor.from_row_codes(want.row_codes()[:-1], want.shape, 5, want.lo, want.scale, 0)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("bits", ALL_BITS)
def test_planes_from_row_codes_gpu_equals_cpu(bits):
    for rows, cols in [(1, 1), (257, 47), (1000, 64), (70_003, 100), (300, 256)]:
        codes = random_codes(rows, cols, bits, rows + bits)
        zero = torch.zeros(1, 1)
        planes = torch.ops.pyg_quant.quantize_pack(codes.float(), zero, zero + 1, bits, True, None)
        row_codes = torch.ops.pyg_quant.pack_row_codes(planes, cols, True)
        dirty_cuda_cache([planes])
        got = torch.ops.pyg_quant.planes_from_row_codes(row_codes.cuda(), rows, cols, bits)
        assert got.is_cuda and torch.equal(got.cpu(), planes), f"{rows} x {cols}"


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("adjacency", ["csr", "tiles"])
def test_aggregating_a_row_code_tensor_gpu(adjacency):
    """bit_spmm on a BitTensor held as row codes: over a CSR adjacency the kernels read only the row codes (the planes
    stay unmade), over tiles the planes are made; either way the result is the planed tensor's, bit for bit."""
    n, cols = 3000, 40
    x = torch.randn(n, cols, generator=gen(9)).cuda()
    src, dst = random_edges(n, n, 40_000, 11)
    adj = pq.BitAdjacency.from_edge_index(torch.stack((src, dst)).cuda(), n, self_loops=1, adjacency=adjacency)
    for bits in (1, 4, 8):
        planed = pq.to_bit(x, bits, dim=0, layout="col")
        lazy = pq.BitTensor.from_row_codes(planed.row_codes(), planed.shape, bits, planed.lo, planed.scale, 0)
        want = pq.bit_spmm(adj, planed, self_weight=1.5)
        got = pq.bit_spmm(adj, lazy, self_weight=1.5)
        assert torch.equal(got, want)
        assert lazy.has_planes == (adj.tile_col.numel() > 0)
        assert (adj.tile_col.numel() > 0) == (adjacency == "tiles")
