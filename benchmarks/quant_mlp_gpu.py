"""ops.quant_mlp (one kernel for a chain of QuantLinear bit layers) against the layer-by-layer bit path.

GPU timings (median of CUDA-event timings, eager and, where capturable, 20 calls in one CUDA graph) on a
32,000-node batch with 64 features: GCN's first layer (QuantLinear 100→16 times D^-1/2) on the loader's 4-bit
codes, read by the kernel itself (quant_mlp_planes) vs dequantize + quant_mlp; the MLP alone (QuantLinear 64→64, ReLU, 64→64, ReLU, 64→64 at 1, 4, 8 bits, and
GIN's first and last MLPs 100→64→64 and 64→64→47; fused vs quantize + bitmm_float per layer) and a whole eval
QGINConv forward on a BitAdjacency (fused vs unfused).  Every fused output is checked equal (torch.equal) to the
unfused one.

    python benchmarks/quant_mlp_gpu.py --out results.json
"""
import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import pyg_quant as pq  # noqa: E402
import pyg_quant.nn.qgin_conv as qgin_module  # noqa: E402
from pyg_quant.bitmm import bitmm_float  # noqa: E402
from pyg_quant.nn import QGINConv, QuantLinear  # noqa: E402
from pyg_quant.quantization.quantize import quantize  # noqa: E402
from pyg_quant.nn.quant_linear import _quant_mlp  # noqa: E402
from pyg_quant.synthetic import planted_partition_graph  # noqa: E402


def time_eager(fn, reps=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_graph(fn, calls=20, reps=20):
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as error:  # noqa: BLE001
        return f"not capturable: {type(error).__name__}: {error}"[:200]
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(0), "rows": []}
    n, d = 32_000, 64
    x = torch.randn(n, d, device=device)
    # GIN 3x64's MLPs on a products-scale batch (the first layer reads 100 features, the last gives 47 classes)
    chains = [([d, d, d, d], bits) for bits in (1, 4, 8)] + [([100, d, d], 4), ([d, d, 47], 4), ([d, d, 47], 8)]
    for widths, bits in chains:
        torch.manual_seed(bits)
        lins = [QuantLinear(widths[i], widths[i + 1], bits=bits).to(device).eval() for i in range(len(widths) - 1)]
        relus = [True] * (len(lins) - 1) + [False]
        h0 = x if widths[0] == d else torch.randn(n, widths[0], device=device)

        def fused():
            return _quant_mlp(h0, lins, relus)

        def unfused():
            h = h0
            for lin, relu in zip(lins, relus):
                h = bitmm_float(quantize(h, bits, 1, "row"), lin.quantized_weight(), lin.bias.detach(), relu)
            return h

        with torch.no_grad():
            same = torch.equal(fused(), unfused())
            row = {"what": f"MLP {'-'.join(map(str, widths))}, {bits} bits, {n} rows", "equal": same,
                   "fused_us": time_eager(fused), "unfused_us": time_eager(unfused),
                   "fused_graph_us": time_graph(fused), "unfused_graph_us": time_graph(unfused)}
        print(row, flush=True)
        results["rows"].append(row)

    # GCN's first layer on the loader's codes: the kernel decodes them vs dequantize, then the float kernel
    torch.manual_seed(0)
    lin = QuantLinear(100, 16, bits=4).to(device).eval()
    row_scale = torch.rand(n, device=device)
    features = torch.randn(n, 100, device=device)
    for layout, dim in (("col", 0), ("row", 0), ("col", None)):
        codes = pq.to_bit(features, 4, dim=dim, layout=layout)

        def planes():
            return _quant_mlp(codes, [lin], [False], row_scale)

        def dequantized():
            return _quant_mlp(pq.to_val(codes), [lin], [False], row_scale)

        with torch.no_grad():
            row = {"what": f"GCN layer 1: 100->16 x row scale on 4-bit {layout}-layout codes (dim={dim}), {n} rows",
                   "equal": torch.equal(planes(), dequantized()),
                   "fused_us": time_eager(planes), "unfused_us": time_eager(dequantized),
                   "fused_graph_us": time_graph(planes), "unfused_graph_us": time_graph(dequantized)}
        print(row, flush=True)
        results["rows"].append(row)

    # a whole QGINConv forward on a BitAdjacency
    edge_index = planted_partition_graph(20, 1600, 40, 0.8, torch.Generator().manual_seed(0)).to(device)
    adj = pq.BitAdjacency.from_edge_index(edge_index, n)
    for bits in (1, 4, 8):
        torch.manual_seed(bits)
        nn = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d), torch.nn.ReLU(),
                                 torch.nn.Linear(d, d))
        conv = QGINConv(nn, bits=bits).to(device).eval()
        original = qgin_module.run_fused_mlp
        with torch.inference_mode():
            got = conv(x, adj)
            fused_us = time_eager(lambda: conv(x, adj))
            qgin_module.run_fused_mlp = lambda module, h, col_keys=False: None
            try:
                want = conv(x, adj)
                unfused_us = time_eager(lambda: conv(x, adj))
            finally:
                qgin_module.run_fused_mlp = original
        row = {"what": f"QGINConv forward (BitAdjacency), MLP 3x{d}, {bits} bits", "equal": torch.equal(got, want),
               "fused_us": fused_us, "unfused_us": unfused_us}
        print(row, flush=True)
        results["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
