"""Per-channel requantization with calibrated (static) ranges against dynamic ranges, kernel by kernel.

GIN's and GCN's MLP steps on a 32,000-node batch, as the layers run them on CUDA in ``eval()``:

* dynamic: ``quant_mlp`` (or ``quant_mlp_planes``) handing its output's column keys to the column quantizer
  (``quantize_pack_ranges``: per-column ranges from the keys, column-layout planes and row codes) -- the keys'
  zeroed buffer (a fresh one the MLP op returns, ``col_keys=True``), the MLP kernel, the quantizer kernel;
* static: ``quant_mlp_row_codes`` (``quant_mlp_planes_row_codes``), which quantizes with fixed per-column ranges as it
  stores the rows and writes their packed row codes (what the CSR gather reads) -- one kernel; and, for an
  aggregation that reads planes (bit tiles), the same followed by ``planes_from_row_codes``.

Every static result is checked equal (row codes, and the planes made from them, ``torch.equal``) to the dynamic one
when the fixed ranges are the output's own extrema (what calibrating on that batch gives), then timed with ranges
clipping 10% of each column's span.  Median of CUDA-event timings over replays of a CUDA graph of 20 calls (µs a
call), and each variant's kernels (torch.profiler, µs a call).

    python benchmarks/static_ranges_gpu.py --out results.json
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import pyg_quant as pq  # noqa: E402
from pyg_quant import ops  # noqa: E402
from pyg_quant.quantization.fixed import FixedRanges  # noqa: E402
from quant_mlp_gpu import time_graph  # noqa: E402  (graph replay of 20 calls, median µs a call)


def kernel_times(fn, calls=10):
    """Mean µs a call of each CUDA kernel ``fn`` launches (torch.profiler, ``calls`` eager calls)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("(")[0].replace("void ", "").replace("pyg_quant::", "")[:48]
            totals[name] = totals.get(name, 0.0) + e.device_time / calls
    return {k: round(v, 2) for k, v in totals.items()}


def chain(widths, bits, gen, device):
    """Random layer arguments of quant_mlp (ReLU between layers, none after the last)."""
    layers = ([], [], [], [], [], [], [], [])
    for i, (cin, cout) in enumerate(zip(widths[:-1], widths[1:])):
        w = torch.randint(0, 2**bits, (cout, cin), generator=gen, dtype=torch.uint8)
        for lst, t in zip(layers, (w, torch.randn(cout, generator=gen) * 0.1, torch.rand(cout, generator=gen) * 0.02 + 1e-3,
                                   w.long().sum(1), torch.randn(cout, generator=gen) * 0.1)):
            lst.append(t.to(device))
        layers[5].append(bits)
        layers[6].append(bits)
        layers[7].append(i < len(widths) - 2)
    return layers


def case(name, widths, bits, rows, device, gen, planes_input=False, row_scale=False):
    layers = chain(widths, bits, gen, device)
    x = torch.randn(rows, widths[0], generator=gen).to(device)
    scale = (torch.rand(rows, generator=gen) + 0.5).to(device) if row_scale else None
    xb = pq.to_bit(x, 4, dim=0, layout="col") if planes_input else None
    planes_args = (xb.planes, xb.rows, xb.cols, True, xb.lo, xb.scale, 0) if planes_input else None
    out_cols = widths[-1]

    def dynamic():
        if planes_input:
            y, keys = ops.quant_mlp_planes(*planes_args, *layers, scale, col_keys=True)
        else:
            y, keys = ops.quant_mlp(x, *layers, scale, col_keys=True)
        return ops.quantize_pack_ranges(y, bits, 0, True, None, True, keys, False)

    def static(ranges):
        if planes_input:
            return ops.quant_mlp_planes_row_codes(*planes_args, *layers, scale, ranges.lo, ranges.inv_scale, bits)
        return ops.quant_mlp_row_codes(x, *layers, scale, ranges.lo, ranges.inv_scale, bits)

    def static_planes(ranges):
        return ops.planes_from_row_codes(static(ranges), rows, out_cols, bits)

    planes, lo, scale_d, _, codes = dynamic()
    y = (ops.quant_mlp_planes(*planes_args, *layers, scale) if planes_input else ops.quant_mlp(x, *layers, scale))
    own = FixedRanges.from_extrema(y.amin(0), y.amax(0), bits)
    s_codes = static(own)
    equal = bool(torch.equal(s_codes, codes) and torch.equal(ops.planes_from_row_codes(s_codes, rows, out_cols, bits),
                                                              planes)
                 and torch.equal(own.lo, lo) and torch.equal(own.scale, scale_d))
    span = y.amax(0) - y.amin(0)
    clipped = FixedRanges.from_extrema(y.amin(0) + 0.05 * span, y.amax(0) - 0.05 * span, bits)
    row = dict(case=name, bits=bits, rows=rows, widths=list(widths), planes_input=planes_input,
               equal_to_dynamic=equal, dynamic_us=time_graph(dynamic), static_us=time_graph(lambda: static(clipped)),
               static_with_planes_us=time_graph(lambda: static_planes(clipped)))
    row["saved_us"] = row["dynamic_us"] - row["static_us"]
    row["dynamic_kernels_us"] = kernel_times(dynamic)
    row["static_with_planes_kernels_us"] = kernel_times(lambda: static_planes(clipped))
    print(f"{name:34s} {bits}-bit  dynamic {row['dynamic_us']:7.1f} us  static {row['static_us']:7.1f} us  "
          f"(+ planes {row['static_with_planes_us']:7.1f})  saved {row['saved_us']:6.1f}  equal {equal}\n"
          f"    dynamic kernels {row['dynamic_kernels_us']}\n"
          f"    static + planes kernels {row['static_with_planes_kernels_us']}", flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32000)
    p.add_argument("--bits", default="8,4")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not (torch.cuda.is_available() and pq.backends()["cuda"]):
        raise SystemExit("needs a CUDA GPU and pyg_quant's CUDA backend")
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bits in (int(b) for b in args.bits.split(",")):
        rows.append(case("GIN layer 1: 100->64->64", (100, 64, 64), bits, args.rows, device, gen))
        rows.append(case("GIN layer 2: 64->64->64", (64, 64, 64), bits, args.rows, device, gen))
        rows.append(case("GCN layer 1: 4-bit codes 100->16 · D^-1/2", (100, 16), bits, args.rows, device, gen,
                         planes_input=True, row_scale=True))
        rows.append(case("GCN layer 2: 16->16 · D^-1/2", (16, 16), bits, args.rows, device, gen, row_scale=True))
        rows.append(case("GCN layer 3: 16->47 · D^-1/2", (16, 47), bits, args.rows, device, gen, row_scale=True))
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
