"""CPU ``quantize_pack`` timing: nearest vs stochastic, row vs col layout, 1/4/8 bits.

Usage (from the repository root, after ``python setup.py build_ext --inplace``)::

    python benchmarks/quantize_pack_cpu.py [--rows 2708 --cols 1433 --threads N --repeat 20]

Prints the median time of ``torch.ops.pyg_quant.quantize_pack`` per setting, next to
torch elementwise ops over the same matrix for scale (one ``x * 2`` and the float
code recipe ``floor((x - lo) * inv + 0.5)``).  Ranges are per column for ``col`` and
per row for ``row`` (the layouts' usual ranges); the noise is pre-drawn, not timed.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pyg_quant  # noqa: E402,F401  (loads the extension)


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2708)
    parser.add_argument("--cols", type=int, default=1433)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols)
    noise = torch.rand_like(x)
    op = torch.ops.pyg_quant.quantize_pack
    print(f"x {args.rows}x{args.cols} float32, {torch.get_num_threads()} threads, torch {torch.__version__}")
    lo_r, hi_r = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    print(f"torch x * 2: {median_ms(lambda: x * 2, args.repeat):.2f} ms; "
          f"floor((x - lo) * inv + 0.5): {median_ms(lambda: torch.floor((x - lo_r) * 0.5 + 0.5), args.repeat):.2f} ms")
    print("| layout | rounding | bits | ms |")
    print("|---|---|---|---|")
    for layout in ("row", "col"):
        dim = 1 if layout == "row" else 0
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        for stochastic in (False, True):
            for bits in (1, 4, 8):
                inv = float(2**bits - 1) / (hi - lo)
                nz = noise if stochastic else None
                ms = median_ms(lambda: op(x, lo, inv, bits, layout == "col", nz), args.repeat)
                print(f"| {layout} | {'stochastic' if stochastic else 'nearest'} | {bits} | {ms:.2f} |")


if __name__ == "__main__":
    main()
