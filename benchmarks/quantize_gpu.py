"""Quantization on the GPU (per-row ranges in row layout, per-column ranges in column layout): the fused
``quantize_pack_ranges`` kernels against the composed path they replaced
(torch ``amin``/``amax`` + the range arithmetic + ``quantize_pack`` + ``packed_code_sums``) and against a plain copy
of the input (the bandwidth floor: the kernel reads the matrix and writes bits/32 of it); per-column ranges also
with the column keys handed over, as ``quant_mlp`` makes them, and the row codes written (``keys_graph_us``, code sums
included); then ``dequantize`` (the way back, both layouts) against a copy of its output.

Usage (from the repository root, on a GPU): ``python benchmarks/quantize_gpu.py --out quantize_gpu.json``
"""
import argparse
import datetime
import itertools
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from pyg_quant import ops  # noqa: E402
from pyg_quant.ops import reference  # noqa: E402
from gpu_kernels import cuda_ms, graph_ms  # noqa: E402  (this folder: the benchmarks' CUDA-event timers)


def median_us(fn):
    return 1e3 * cuda_ms(fn, reps=50, warmup=5)


def composed(x, bits, dim, col):
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / torch.full_like(hi, float(2**bits - 1))
    inv = torch.where(scale > 0, torch.ones_like(scale) / scale, torch.zeros_like(scale))
    planes = ops.quantize_pack(x, lo, inv, bits, col, None)
    return planes, lo, scale, ops.packed_code_sums(planes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    for shape in ((32000, 64), (32000, 100), (32000, 16), (2708, 1433)):
        x = torch.randn(shape, device=device)
        copy_us = median_us(lambda: x.clone())
        for (dim, col), bits in itertools.product(((1, False), (0, True)), (1, 4, 8)):
            fused = ops.quantize_pack_ranges(x, bits, dim, col)
            ref = reference.quantize_pack_ranges(x, bits, dim, col)
            assert all(torch.equal(a, b) for a, b in zip(fused, ref)), (shape, bits, dim)
            row = dict(shape=shape, bits=bits, ranges="per row" if dim == 1 else "per column",
                       layout="col" if col else "row", copy_us=copy_us,
                       fused_us=median_us(lambda: ops.quantize_pack_ranges(x, bits, dim, col)),
                       composed_us=median_us(lambda: composed(x, bits, dim, col)),
                       fused_graph_us=1e3 * graph_ms(lambda: ops.quantize_pack_ranges(x, bits, dim, col), reps=20, inner=20),
                       copy_graph_us=1e3 * graph_ms(lambda: x.clone(), reps=20, inner=20))
            if col:  # extrema handed over as column keys (quant_mlp's col_keys): one pass
                keys = reference.col_keys_of(x)
                with_keys = ops.quantize_pack_ranges(x, bits, dim, col, None, True, keys)
                assert all(torch.equal(a, b) for a, b in zip(with_keys[:4], fused[:4])), (shape, bits, "keys")
                row["keys_graph_us"] = 1e3 * graph_ms(
                    lambda: ops.quantize_pack_ranges(x, bits, dim, col, None, True, keys), reps=20, inner=20)
            row["fused_vs_composed"] = row["composed_us"] / row["fused_us"]
            rows.append(row)
            print(f"{str(shape):14s} {row['ranges']:10s} {bits} bits: fused {row['fused_us']:7.1f} us "
                  f"(in a CUDA graph {row['fused_graph_us']:6.1f}), composed {row['composed_us']:7.1f} us "
                  f"({row['fused_vs_composed']:.1f}x), copy of x {copy_us:6.1f} us (graph "
                  f"{row['copy_graph_us']:5.1f})"
                  + (f", with column keys + row codes {row['keys_graph_us']:6.1f} us in a graph" if col else ""),
                  flush=True)
    # The way back: dequantize (lo + scale * q, float32) from both layouts, against a copy of its output (the
    # floor: it writes rows * cols * 4 bytes and reads bits/32 of that).
    back = []
    for shape in ((32000, 100), (32000, 64), (32000, 16)):
        x = torch.randn(shape, device=device)
        for (dim, col), bits in itertools.product(((1, False), (0, True)), (1, 4, 8)):
            planes, lo, scale, _, _ = ops.quantize_pack_ranges(x, bits, dim, col)
            args_ = (planes, shape[0], shape[1], col, lo, scale, dim)
            got = ops.dequantize(*args_)
            assert torch.equal(got, reference.dequantize(*args_)), (shape, bits, dim)
            row = dict(shape=shape, bits=bits, ranges="per row" if dim == 1 else "per column",
                       layout="col" if col else "row",
                       dequantize_graph_us=1e3 * graph_ms(lambda: ops.dequantize(*args_), reps=20, inner=20),
                       copy_graph_us=1e3 * graph_ms(lambda: got.clone(), reps=20, inner=20))
            back.append(row)
            print(f"{str(shape):14s} {row['ranges']:10s} {bits} bits: dequantize {row['dequantize_graph_us']:6.1f} us "
                  f"in a CUDA graph, copy of its output {row['copy_graph_us']:5.1f} us", flush=True)
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, dequantize=back)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
