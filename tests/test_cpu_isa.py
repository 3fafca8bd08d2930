"""The CPU kernels' instruction-set paths agree bit for bit.

The CPU kernels pick AVX-512 code at run time where the CPU has it, else AVX2 code (csrc/cpu/cpu_features.h);
``PYG_QUANT_CPU_ISA=generic`` forces the portable kernels and ``PYG_QUANT_CPU_ISA=avx2`` the AVX2 ones.  Subprocesses
compute every dispatched op on the same operands with the portable kernels, with the AVX2 ones, and with the ones the
CPU picks: the integers and the float32 bits must be equal (where the CPU lacks an instruction set, its run takes the
next path down, so that its comparison holds trivially).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pyg_quant as pq

pytestmark = pytest.mark.skipif(not pq.backends()["cpu"], reason="needs the compiled CPU kernels")

# Writes the outputs of the dispatched ops on seeded operands (garbage in the planes' padding included) to argv[1].
OPS_SCRIPT = textwrap.dedent("""
    import sys, torch, pyg_quant as pq
    ops = torch.ops.pyg_quant
    g = torch.Generator().manual_seed(0)
    def bits(shape):
        return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)
    bits_of = bits
    out = {}
    for s, t in [(1, 1), (2, 3), (4, 4), (7, 8), (8, 7), (8, 8), (5, 2)]:
        for m, k, n in [(5, 3, 7), (37, 300, 19), (70, 1433, 16), (3, 64, 33)]:
            a = pq.to_bit(torch.randn(m, k, generator=g), s, dim=1, layout="row")
            b = pq.to_bit(torch.randn(k, n, generator=g), t, dim=0, layout="col")
            for name, (pa, pb) in {"codes": (a.planes, b.planes), "garbage": (bits(a.planes.shape), bits(b.planes.shape))}.items():
                for wide in (False, True):
                    out[f"bitmm {s} {t} {m} {k} {n} {name} {wide}"] = ops.bitmm_int(pa, pb, m, n, wide)
            out[f"sums {s} {m} {k}"] = ops.packed_code_sums(bits(a.planes.shape))
    planes = torch.full((8, 64, 2 * 1100 * 2), -1, dtype=torch.int32)  # wide sums past 2^31
    out["bitmm past 2^31"] = ops.bitmm_int(planes, planes[:7, :16], 64, 16, True)
    for m, n in [(1, 1), (7, 5), (33, 16), (100, 70)]:
        for dtype, hi in [(torch.int32, 2**31 - 1), (torch.int64, 2**40)]:
            p = torch.randint(-hi, hi, (m, n), generator=g, dtype=torch.int64).to(dtype)
            rs, cs = torch.randint(-2**40, 2**40, (m,), generator=g), torch.randint(-2**40, 2**40, (n,), generator=g)
            la, ra, lb, rb = torch.randn(m, generator=g), torch.rand(m, generator=g), torch.randn(n, generator=g), torch.rand(n, generator=g)
            la[0] = -0.0
            for bias in (None, torch.randn(n, generator=g)):
                for relu in (False, True):
                    key = f"affine {m} {n} {dtype} {bias is None} {relu}"
                    out[key] = ops.bitmm_affine(p, rs, cs, la, ra, lb, rb, 1433, bias, relu).view(torch.int32)
    for r, c in [(1, 1), (37, 300), (2708, 16), (100, 17)]:
        for col in (False, True):
            for b in (1, 4, 8):
                shape = (b, (c if col else r) + 64, ((r if col else c) + 255) // 256 * 8)
                out[f"unpack {r} {c} {col} {b}"] = ops.unpack_codes(bits(shape), r, c, col)
    for n, e, cols in [(300, 3000, 16), (1000, 20000, 7), (257, 100, 33)]:
        edge_index = torch.randint(n, (2, e), generator=g)
        for min_tile in (None, 4):
            adj = pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1, min_tile_nnz=min_tile)
            values = torch.randint(0, 50, adj.res_col.shape, generator=g, dtype=torch.int32)
            for weighted in (False, True):
                for b in (1, 4, 8):
                    y = pq.to_bit(torch.randn(n, cols, generator=g), b, dim=0, layout="col")
                    for wide in (False, True):
                        out[f"spmm {n} {e} {cols} {min_tile} {weighted} {b} {wide}"] = ops.bit_spmm_int(
                            adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col,
                            values if weighted else None, y.planes, adj.num_rows, cols, wide, None)
    # bit_spmm on tiles (sparse ones walked, dense ones popcounted: a third of the edges point into 64 columns) and
    # the residual; weights that are non-negative, negative, or so large that rows sum in int64; a_bits > 1; column
    # counts past one 256-column pass; the affine epilogue with and without each optional operand.
    for n, e, cols in [(300, 6000, 16), (90, 3000, 300), (200, 4000, 23)]:
        edge_index = torch.randint(n, (2, e), generator=g)
        edge_index[1, : e // 3] %= 64
        for min_tile in (None, 1):
            adj = pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1, min_tile_nnz=min_tile)
            for a_bits in (1, 3):
                tiles = adj.tile_bits[:1].repeat(a_bits, 1, 1, 1)
                if a_bits > 1:
                    tiles &= bits(tiles.shape)
                for weights in ("none", "small", "signed", "int64"):
                    values = {"none": None,
                              "small": torch.randint(0, 50, adj.res_col.shape, generator=g, dtype=torch.int32),
                              "signed": torch.randint(-2**20, 2**20, adj.res_col.shape, generator=g, dtype=torch.int32),
                              "int64": torch.randint(2**23, 2**25, adj.res_col.shape, generator=g, dtype=torch.int32)}[weights]
                    operands = (adj.window_ptr, adj.tile_col, tiles, adj.res_ptr, adj.res_col, values)
                    for b in (1, 4, 8):
                        y = pq.to_bit(torch.randn(n, cols, generator=g), b, dim=0, layout="col")
                        key = f"spmm2 {n} {e} {cols} {min_tile} {a_bits} {weights} {b}"
                        for wide in (False, True):
                            out[f"{key} {wide}"] = ops.bit_spmm_int(*operands, y.planes, n, cols, wide, None)
                        lo, scale = torch.randn(cols, generator=g), torch.rand(cols, generator=g)
                        row_sums = torch.randint(-1000, 1000, (n,), generator=g)
                        for i, (self_w, row_scale, bias, relu) in enumerate([
                                (None, None, None, False),
                                (torch.randn(n, generator=g), torch.rand(n, generator=g), torch.randn(cols, generator=g), True),
                                (torch.randn(1, generator=g), None, torch.randn(cols, generator=g), True)]):
                            out[f"{key} affine {i}"] = ops.bit_spmm_affine(
                                *operands, y.planes, lo, scale, row_sums, self_w, row_scale, bias, relu, n, cols, True,
                                None).view(torch.int32)
    from pyg_quant.nn.quant_linear import QuantLinear, chain_args
    for bits in (2, 4, 7, 8):
        for rows, widths in [(1, (5, 3)), (37, (40, 17, 9)), (300, (256, 64, 64)), (2500, (33, 64))]:
            torch.manual_seed(bits + rows)
            layers = [QuantLinear(a, b, bits=bits) for a, b in zip(widths[:-1], widths[1:])]
            relus = [i < len(layers) - 1 for i in range(len(layers))]
            x = torch.randn(rows, widths[0], generator=g) * 3
            x[0, 0] = -0.0
            if rows >= 3 and widths[0] >= 7:  # zero extrema of both signs: the sign of the row's first zero
                x[1] = x[1].abs()
                x[1, 3], x[1, 5] = -0.0, 0.0
                x[2] = -x[2].abs()
                x[2, 4], x[2, 6] = 0.0, -0.0
            scale = torch.rand(rows, generator=g)
            for row_scale in (None, scale):
                got = ops.quant_mlp(x, *chain_args(layers, relus), row_scale)
                out[f"quant_mlp {bits} {rows} {widths} {row_scale is None}"] = got.view(torch.int32)
                # the output's column keys (the rows' last steps): a row of NaNs reaches one slot of each column
                got, keys = ops.quant_mlp_keys(x if rows < 3 else torch.cat([x, torch.full_like(x[:1], float("nan"))]),
                                               *chain_args(layers, relus),
                                               None if row_scale is None else torch.cat([row_scale, row_scale[:1]])
                                               if rows >= 3 else row_scale)
                out[f"quant_mlp keys {bits} {rows} {widths} {row_scale is None}"] = torch.cat(
                    [got.view(torch.int32).flatten(), keys.to(torch.int32)])
    # codes of x read straight from column-layout planes (ranges per column or per tensor, garbage in the padding
    # rows and columns): dequantize, and quant_mlp_planes across a word and a block boundary
    for bits in range(1, 9):
        for rows, cols in [(1, 1), (31, 17), (70, 1433), (2100, 40)]:
            planes = bits_of((bits, cols + 64, (rows + 255) // 256 * 8))
            for dim in (0, -1):
                n = cols if dim == 0 else 1
                lo, scale = torch.randn(n, generator=g), torch.rand(n, generator=g)
                lo[0] = -0.0
                key = f"planes {bits} {rows} {cols} {dim}"
                out[f"dequantize {key}"] = ops.dequantize(planes, rows, cols, True, lo, scale, dim).view(torch.int32)
                torch.manual_seed(bits + rows)
                layers = [QuantLinear(cols, 9, bits=4), QuantLinear(9, 5, bits=8)]
                got = ops.quant_mlp_planes(planes, rows, cols, True, lo, scale, dim, *chain_args(layers, (True, False)),
                                           torch.rand(rows, generator=g))
                out[f"quant_mlp_planes {key}"] = got.view(torch.int32)
    # codes of x taken as they are from row-layout planes (ranges per row or per tensor, garbage in the padding
    # columns, which the op must neither read nor sum): quant_mlp_quantized across a 64-code word and a block
    for bits in range(1, 9):
        for rows, cols in [(1, 1), (31, 65), (70, 1433), (2100, 40)]:
            planes = bits_of((bits, rows + 64, (cols + 255) // 256 * 8))
            for dim in (1, -1):
                n = rows if dim == 1 else 1
                lo, scale = torch.randn(n, generator=g), torch.rand(n, generator=g)
                torch.manual_seed(bits + rows)
                layers = [QuantLinear(cols, 9, bits=8), QuantLinear(9, 5, bits=4)]
                got = ops.quant_mlp_quantized(planes, rows, cols, False, lo, scale, dim,
                                              *chain_args(layers, (True, False)), torch.rand(rows, generator=g))
                out[f"quant_mlp_quantized {bits} {rows} {cols} {dim}"] = got.view(torch.int32)
    torch.save(out, sys.argv[1])
""")


def test_generic_and_dispatched_kernels_agree(tmp_path):
    script = tmp_path / "ops.py"
    script.write_text(OPS_SCRIPT)
    outputs = {}
    for isa in ("generic", "avx2", "default"):
        env = dict(os.environ)
        env.pop("PYG_QUANT_CPU_ISA", None)
        if isa != "default":
            env["PYG_QUANT_CPU_ISA"] = isa
        path = tmp_path / f"{isa}.pt"
        subprocess.run([sys.executable, str(script), str(path)], env=env, check=True)
        outputs[isa] = torch.load(path)
    generic = outputs["generic"]
    for isa in ("avx2", "default"):
        other = outputs[isa]
        assert generic.keys() == other.keys()
        for key in generic:
            assert generic[key].dtype == other[key].dtype and torch.equal(generic[key], other[key]), (isa, key)
