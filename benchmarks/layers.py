"""Layer benchmark: one QGCNConv / QGINConv forward against PyG's GCNConv / GINConv.

The graph is a products-scale cluster batch, built in code (fixed seed) like the one of
``benchmarks/gpu_kernels.py``: a planted partition of 20 clusters of 1,600 nodes (32,000
nodes), 40 directed edges a node, 80% of them inside the source's cluster, then made
simple (repeated edges and self-loops dropped: ~1.27M edges), 64 input and output
features.  ``--small`` uses 4 clusters of 1,024 nodes (4,096 nodes, ~160K edges), for a
CPU check.

Timed, one forward each, in ``eval()`` under ``torch.inference_mode()`` (so the quantized
layers run their bit kernels):

* PyG ``GCNConv`` (``cached=True``: the normalization is computed once, as a
  transductive model would) and ``GINConv`` (``nn = Linear(64, 64), ReLU, Linear(64,
  64)``), fp32 and bf16, with ``edge_index`` and with a torch CSR ``adj_t``;
* ``QGCNConv`` / ``QGINConv`` at 1, 2, 4 and 8 bits with the graph as a
  ``pyg_quant.BitAdjacency`` (what the loader hands over; ``self_loops=1`` for GCN),
  ``cached=True`` for GCN like PyG's;
* ``QGCNConv`` / ``QGINConv`` at 4 bits with ``edge_index`` and no cache, i.e. with the
  packing of the bit tiles inside every call.

Median wall time: CUDA events on a GPU (after warm-up, repetitions within a time
budget), ``torch.utils.benchmark.Timer.blocked_autorange`` on a CPU.  ``rel. err`` is
``‖out − out_fp32‖ / ‖out_fp32‖`` against PyG's fp32 layer with the same parameters and
``edge_index``; ``speed-up`` is against that layer's time.

Usage (from the repository root)::

    python benchmarks/layers.py                      # GPU if there is one, else CPU
    python benchmarks/layers.py --small --out benchmarks/out/layers_cpu_small.json
"""
import argparse
import datetime
import json
import os
import platform
import sys

import torch
import torch.utils.benchmark as benchmark
from torch.nn import Linear, ReLU, Sequential

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import pyg_quant as pq
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, os.path.dirname(HERE))
    import pyg_quant as pq
import torch_geometric  # noqa: E402
from torch_geometric.nn import GCNConv, GINConv  # noqa: E402
from torch_geometric.utils import coalesce, remove_self_loops, to_torch_csr_tensor  # noqa: E402

from pyg_quant.synthetic import planted_partition_graph  # noqa: E402

BITS = [1, 2, 4, 8]


def cluster_batch(small: bool, seed: int):
    clusters, size = (4, 1024) if small else (20, 1600)
    edge_index = planted_partition_graph(clusters, size, 40, 0.8, torch.Generator().manual_seed(seed))
    edge_index, _ = remove_self_loops(edge_index)
    return coalesce(edge_index, num_nodes=clusters * size), clusters * size


def cuda_ms(fn, budget_ms: float = 500.0, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    spent = 0.0
    while len(times) < 5 or (spent < budget_ms and len(times) < 100):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
        spent += times[-1]
    times.sort()
    return times[len(times) // 2]


def cpu_ms(fn, min_run_time: float) -> float:
    fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def relative_error(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def gin_mlp(channels: int) -> Sequential:
    return Sequential(Linear(channels, channels), ReLU(), Linear(channels, channels))


def run(args):
    device = torch.device(args.device)
    edge_index, num_nodes = cluster_batch(args.small, args.seed)
    channels = args.channels
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(num_nodes, channels, generator=gen).to(device)
    edge_index = edge_index.to(device)
    csr = to_torch_csr_tensor(edge_index.flip(0), size=(num_nodes, num_nodes))  # adj_t: rows are targets
    adj_gcn = pq.BitAdjacency.from_edge_index(edge_index, num_nodes, self_loops=1)
    adj_gin = pq.BitAdjacency.from_edge_index(edge_index, num_nodes)
    measure = (lambda fn: cuda_ms(fn)) if device.type == "cuda" else (lambda fn: cpu_ms(fn, args.min_run_time))

    graph_info = dict(nodes=num_nodes, edges=int(edge_index.size(1)), channels=channels,
                      bit_adjacency=dict(tiles=adj_gin.num_tiles, fill=round(adj_gin.fill_ratio, 4),
                                         residual_entries=adj_gin.res_nnz, nbytes=adj_gin.nbytes),
                      csr_nbytes=sum(t.numel() * t.element_size()
                                     for t in (csr.crow_indices(), csr.col_indices(), csr.values())))
    print(f"graph: {num_nodes} nodes, {graph_info['edges']} edges, {channels} channels; bit adjacency "
          f"{adj_gin.num_tiles} tiles (fill {adj_gin.fill_ratio:.3f}), {adj_gin.res_nnz} residual entries, "
          f"{adj_gin.nbytes / 2**20:.2f} MiB (CSR fp32 {graph_info['csr_nbytes'] / 2**20:.2f} MiB)", flush=True)

    rows = []

    def add(layer, impl, precision, adjacency, fn, reference):
        try:
            with torch.inference_mode():
                out = fn()
                ms = measure(fn)
        except (RuntimeError, NotImplementedError) as error:
            reason = str(error).splitlines()[0][:100]
            print(f"  {layer} {impl} {precision} {adjacency}: unsupported here ({reason})", flush=True)
            rows.append(dict(layer=layer, impl=impl, precision=precision, adjacency=adjacency,
                             median_ms=None, error=reason))
            return None
        out = pq.to_val(out) if isinstance(out, pq.BitTensor) else out
        err = relative_error(out, reference) if reference is not None else 0.0
        rows.append(dict(layer=layer, impl=impl, precision=precision, adjacency=adjacency, median_ms=ms,
                         rel_err=err))
        print(f"  {layer:3s} {impl:9s} {precision:6s} {adjacency:28s} {ms:9.3f} ms  rel. err {err:.2e}", flush=True)
        return out

    torch.manual_seed(args.seed)
    layers = {
        "GCN": (GCNConv(channels, channels, cached=True),
                lambda bits, **kw: pq.QGCNConv(channels, channels, bits=bits, **kw),
                adj_gcn, dict(cached=True)),
        "GIN": (GINConv(gin_mlp(channels)),
                lambda bits, **kw: pq.QGINConv(gin_mlp(channels), bits=bits, **kw),
                adj_gin, dict()),
    }
    for name, (float_layer, make_quantized, bit_adj, cache) in layers.items():
        float_layer = float_layer.to(device).eval()
        state = float_layer.state_dict()
        with torch.inference_mode():
            reference = float_layer(x, edge_index).clone()
        float_name = type(float_layer).__name__
        add(name, float_name, "fp32", "edge_index", lambda: float_layer(x, edge_index), reference)
        fresh = type(float_layer)(channels, channels, cached=True) if name == "GCN" else GINConv(gin_mlp(channels))
        fresh.load_state_dict(state)
        fresh = fresh.to(device).eval()
        add(name, float_name, "fp32", "CSR", lambda: fresh(x, csr), reference)
        for adjacency, graph in (("edge_index", edge_index), ("CSR", csr)):
            half = type(float_layer)(channels, channels, cached=True) if name == "GCN" else GINConv(gin_mlp(channels))
            half.load_state_dict(state)
            half = half.to(device, torch.bfloat16).eval()
            x_half = x.to(torch.bfloat16)
            graph_half = graph if adjacency == "edge_index" else graph.to(torch.bfloat16)
            add(name, float_name, "bf16", adjacency, lambda: half(x_half, graph_half), reference)
        bit_adj = bit_adj.to(device)
        for bits in BITS:
            quantized = make_quantized(bits, **cache)
            quantized.load_state_dict(state)
            quantized = quantized.to(device).eval()
            add(name, f"Q{float_name}", f"{bits}-bit", "BitAdjacency", lambda: quantized(x, bit_adj), reference)
        quantized = make_quantized(4)
        quantized.load_state_dict(state)
        quantized = quantized.to(device).eval()
        add(name, f"Q{float_name}", "4-bit", "edge_index (packs each call)", lambda: quantized(x, edge_index),
            reference)

    for row in rows:
        base = next(r for r in rows if r["layer"] == row["layer"] and r["impl"] in ("GCNConv", "GINConv")
                    and r["precision"] == "fp32" and r["adjacency"] == "edge_index")
        if row["median_ms"] is not None:
            row["speedup"] = base["median_ms"] / row["median_ms"]
    return graph_info, rows


def table(rows) -> str:
    lines = ["| layer | implementation | precision | adjacency | median ms | speed-up | rel. err |",
             "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        if r["median_ms"] is None:
            lines.append(f"| {r['layer']} | {r['impl']} | {r['precision']} | {r['adjacency']} | "
                         f"unsupported | | |")
        else:
            lines.append(f"| {r['layer']} | {r['impl']} | {r['precision']} | {r['adjacency']} | "
                         f"{r['median_ms']:.3f} | {r['speedup']:.2f}x | {r['rel_err']:.2e} |")
    return "\n".join(lines)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="4,096 nodes, ~160K edges (a CPU check)")
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--min-run-time", type=float, default=0.5,
                        help="seconds per CPU measurement (torch.utils.benchmark blocked_autorange)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    print(f"# pyg_quant layer benchmark ({datetime.datetime.now().isoformat(timespec='seconds')})")
    print(f"device {device} ({device_name(device)}), torch {torch.__version__}, torch_geometric "
          f"{torch_geometric.__version__}, pyg_quant backends {pq.backends()}, threads {torch.get_num_threads()}")
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    graph_info, rows = run(args)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print()
    print(table(rows))
    busy = device.type == "cpu" and load_after is not None and max(load_before, load_after) > os.cpu_count() + 0.5
    if busy:  # our own threads count too, so only a load beyond the machine's cores says "disturbed"
        print(f"\nWARNING: 1-min load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs: "
              f"other processes were running, CPU timings are unreliable; rerun on a quiet machine")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        result = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=str(device),
                      device_name=device_name(device), torch=torch.__version__,
                      torch_geometric=torch_geometric.__version__, backends=pq.backends(),
                      threads=torch.get_num_threads(), small=args.small, graph=graph_info, rows=rows,
                      load_average=dict(before=load_before, after=load_after), disturbed=busy,
                      command=" ".join([os.path.basename(sys.executable)] + sys.argv))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
