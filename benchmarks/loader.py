"""Loader benchmark: QuantClusterData / QuantClusterLoader against PyG's ClusterLoader.

The graph is a synthetic planted partition built in code (fixed seed): ``--nodes``
nodes in planted clusters of ``--cluster-size``, ``--degree`` directed edges a node
(each undirected pair stored in both directions, like ogbn-products), a share
``--p-in`` of them inside the node's cluster; node ids shuffled so that METIS has
to find the clusters.  ``--features`` float32 features, labels and three masks.
The default is products scale: 2.4M nodes, 120M directed edges, 100 features,
clusters of 1,600 and batches of 20 parts (32,000 nodes, ~1.3M edges: the
cluster batch of benchmarks/gpu_kernels.py).

Measured:

* partition: ``QuantClusterData`` stage by stage (undirected simple CSR, pymetis
  alone, PyG's partition layout, permuting the data);
* pack: quantizing the features once (all threads), then one epoch of batches
  built serially on one thread (``num_workers=0``; a DataLoader worker runs
  single-threaded too): time per batch and total; with ``--workers W`` also the
  epoch's wall time with ``W`` workers.  "pack/part" = (quantize once + serial
  epoch) / partition time;
* bytes per batch: our single buffer as it travels (``batch.nbytes``: the
  adjacency's tile plan with a byte per edge, unpadded bit features, narrowed
  labels and node ids, masks) against PyG's ``ClusterLoader`` batch for the same
  parts (float32 ``x``, int64 ``edge_index``, labels, masks), and PyG's time per
  batch on the same parts (one thread as well);
* with a GPU: host-to-device time per batch, ours (one pinned buffer, one copy;
  and the copy plus decoding the adjacency and features on the device) against
  PyG's batch (``Data.pin_memory().to(device, non_blocking=True)`` on a copy of the
  ``Data``, which ``to`` changes in place).

Targets: >= 8x fewer bytes than PyG at 4 bits; packing <= 25% of the partition time.

Usage (from the repository root)::

    python benchmarks/loader.py --small                    # ~1 min on 2 CPU cores
    python benchmarks/loader.py --nodes 200000 --out benchmarks/out/loader_medium.json
    python benchmarks/loader.py --workers 8 --out /tmp/loader_products.json   # products scale, 16 cores
"""
import argparse
import copy
import datetime
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import pyg_quant as pq
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, os.path.dirname(HERE))
    import pyg_quant as pq
from torch_geometric.data import Data  # noqa: E402
from torch_geometric.loader import ClusterLoader  # noqa: E402

from pyg_quant.graph.bit_adjacency import distinct_entries  # noqa: E402
from pyg_quant.loader import QuantClusterData, QuantClusterLoader  # noqa: E402


def planted_graph(nodes: int, degree: int, cluster_size: int, p_in: float, features: int, classes: int,
                  seed: int = 0) -> Data:
    """Planted-partition simple graph; about ``nodes * degree`` directed edges (``nodes * degree / 2`` pairs
    drawn, repeats and self-loops dropped, each stored both ways)."""
    g = torch.Generator().manual_seed(seed)
    pairs = nodes * degree // 2
    src = torch.randint(nodes, (pairs,), generator=g)
    start = torch.div(src, cluster_size, rounding_mode="floor") * cluster_size
    size = (nodes - start).clamp(max=cluster_size)
    inside = start + (torch.rand(pairs, generator=g) * size).long()
    dst = torch.where(torch.rand(pairs, generator=g) < p_in, inside, torch.randint(nodes, (pairs,), generator=g))
    del inside, start, size
    # A simple graph, like ogbn-products: no self-loops, each pair once (then stored both ways).
    low, high = torch.minimum(src, dst), torch.maximum(src, dst)
    keys, _ = distinct_entries((low * nodes + high)[low != high])
    del src, dst, low, high
    src, dst = keys // nodes, keys % nodes
    perm = torch.randperm(nodes, generator=g)
    src, dst = perm[src], perm[dst]
    edge_index = torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])
    del src, dst, keys
    planted = torch.empty(nodes, dtype=torch.long)
    planted[perm] = torch.arange(nodes) // cluster_size
    x = torch.randn(nodes, features, generator=g) + planted.remainder(7).view(-1, 1).float() * 0.1
    split = torch.rand(nodes, generator=g)
    return Data(x=x, edge_index=edge_index, y=planted.remainder(classes), train_mask=split < 0.1,
                val_mask=(split >= 0.1) & (split < 0.12), test_mask=split >= 0.12)


def tensor_bytes(batch) -> int:
    return sum(v.numel() * v.element_size() for _, v in batch.items() if isinstance(v, torch.Tensor))


def breakdown(batch) -> dict:
    """Bytes of the batch's buffer by field, as they travel (the wire form), and the decoded adjacency."""
    wire = batch.wire_tensors()
    adj_wire = sum(t.numel() * t.element_size() for k, t in wire.items() if k.startswith("adj."))
    x_wire = sum(t.numel() * t.element_size() for k, t in wire.items() if k.startswith("x."))
    adj = batch.adj
    return {"adj": adj_wire, "x": x_wire, "rest": batch.nbytes - adj_wire - x_wire, "adj_decoded": adj.nbytes,
            "tiles": adj.num_tiles, "fill": adj.fill_ratio, "res_nnz": adj.res_nnz, "nnz": adj.nnz}


def epoch(loader):
    """Builds every batch of one epoch on one thread (as a DataLoader worker does: torch runs each
    worker single-threaded); returns the batches and the seconds each took."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _epoch(loader)
    finally:
        torch.set_num_threads(threads)


def _epoch(loader):
    batches, times = [], []
    it = iter(loader)
    while True:
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        times.append(time.perf_counter() - start)
        batches.append(batch)
    return batches, times


def h2d_times(batches, make_pyg, device) -> dict:
    """Median host-to-device seconds per batch: ours (pinned buffer, one copy; and one copy plus decoding the
    adjacency and features on the device) and PyG's (pinned Data, every tensor copied)."""
    ours, decoded, theirs = [], [], []
    for batch in batches[:10]:
        pinned = batch.pin_memory()
        ref = make_pyg(batch).pin_memory()
        for _ in range(5):
            for kind, out in (("ours", ours), ("decoded", decoded), ("pyg", theirs)):
                torch.cuda.synchronize()
                start = time.perf_counter()
                if kind == "pyg":
                    copy.copy(ref).to(device, non_blocking=True)  # Data.to works in place: copy the shell first
                else:
                    moved = pinned.to(device, non_blocking=True)
                    if kind == "decoded":
                        moved.adj, moved.x
                torch.cuda.synchronize()
                out.append(time.perf_counter() - start)

    def median_ms(values):
        return 1e3 * sorted(values)[len(values) // 2]
    return {"ours_ms": median_ms(ours), "ours_decoded_ms": median_ms(decoded), "pyg_ms": median_ms(theirs)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2_400_000)
    parser.add_argument("--degree", type=int, default=50, help="directed edges per node")
    parser.add_argument("--cluster-size", type=int, default=1600)
    parser.add_argument("--p-in", type=float, default=0.8)
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--classes", type=int, default=47)
    parser.add_argument("--num-parts", type=int, default=None, help="default: nodes / cluster size")
    parser.add_argument("--batch-size", type=int, default=20, help="parts per batch")
    parser.add_argument("--bits", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--min-tile-nnz", type=int, default=16)
    parser.add_argument("--workers", type=int, default=0, help="also time an epoch with this many workers")
    parser.add_argument("--pyg-batches", type=int, default=10, help="PyG batches built for bytes and time")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--small", action="store_true", help="100k nodes, degree 20, clusters of 500 (CPU)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.small:
        args.nodes, args.degree, args.cluster_size, args.features = 100_000, 20, 500, 100
    if args.threads:
        torch.set_num_threads(args.threads)
    num_parts = args.num_parts or max(2, args.nodes // args.cluster_size)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
              "args": vars(args), "num_parts": num_parts}
    print(f"graph: {args.nodes:,} nodes, {args.nodes * args.degree:,} directed edges, clusters of "
          f"{args.cluster_size}, p_in={args.p_in}, {args.features} features; {num_parts} parts, "
          f"{args.batch_size} per batch; {torch.get_num_threads()} threads", flush=True)

    start = time.perf_counter()
    data = planted_graph(args.nodes, args.degree, args.cluster_size, args.p_in, args.features, args.classes)
    result["generate_s"] = time.perf_counter() - start

    start = time.perf_counter()
    cd = QuantClusterData(data, num_parts, log=True)
    partition_s = time.perf_counter() - start
    result["partition"] = {"total_s": partition_s, **{f"{k}_s": v for k, v in cd.timings.items()},
                           "empty_parts": cd.num_empty_parts}
    src, dst = data.edge_index
    result["partition"]["edge_cut"] = float((cd.cluster[src] != cd.cluster[dst]).float().mean())
    del src, dst

    def make_pyg(batch):
        loader = ClusterLoader(cd, batch_size=len(batch.part), sampler=batch.part.tolist())
        return next(iter(loader))

    result["bits"] = {}
    for bits in args.bits:
        start = time.perf_counter()
        cd.quantized_features(bits)
        quantize_s = time.perf_counter() - start
        loader = QuantClusterLoader(cd, batch_size=args.batch_size, bits=bits, min_tile_nnz=args.min_tile_nnz)
        batches, times = epoch(loader)
        row = {"quantize_once_s": quantize_s, "batches": len(batches), "epoch_serial_s": sum(times),
               "batch_ms_mean": 1e3 * sum(times) / len(times), "pack_s": quantize_s + sum(times),
               "bytes_mean": sum(b.nbytes for b in batches) / len(batches),
               "nodes_mean": sum(b.num_nodes for b in batches) / len(batches)}
        parts = [breakdown(b) for b in batches]
        for key in ("adj", "x", "rest", "adj_decoded", "tiles", "res_nnz", "nnz"):
            row[f"{key}_mean"] = sum(p[key] for p in parts) / len(parts)
        row["fill_mean"] = sum(p["fill"] for p in parts) / len(parts)
        pyg_bytes, pyg_times = [], []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as ours
        for batch in batches[:args.pyg_batches]:
            start = time.perf_counter()
            ref = make_pyg(batch)
            pyg_times.append(time.perf_counter() - start)
            pyg_bytes.append(tensor_bytes(ref))
            loops = int((ref.edge_index[0] == ref.edge_index[1]).sum())  # in adj.diag, not in row_sums
            assert ref.num_nodes == batch.num_nodes
            assert ref.edge_index.size(1) == int(batch.adj.row_sums.sum()) + loops
        torch.set_num_threads(threads)
        ours_same = [b.nbytes for b in batches[:args.pyg_batches]]
        row.update(pyg_bytes_mean=sum(pyg_bytes) / len(pyg_bytes),
                   pyg_batch_ms_mean=1e3 * sum(pyg_times) / len(pyg_times),
                   bytes_ratio=sum(pyg_bytes) / sum(ours_same))
        if args.workers:
            loader = QuantClusterLoader(cd, batch_size=args.batch_size, bits=bits, num_workers=args.workers,
                                        min_tile_nnz=args.min_tile_nnz)
            start = time.perf_counter()
            count = sum(1 for _ in loader)
            row["epoch_workers_s"] = time.perf_counter() - start
            assert count == len(batches)
        if torch.cuda.is_available():
            row["h2d"] = h2d_times(batches, make_pyg, torch.device("cuda"))
        result["bits"][bits] = row
        del batches
        print(f"  {bits} bits done", flush=True)

    report(result)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return result


def report(result):
    p = result["partition"]
    print(f"\npartition ({result['num_parts']} parts, {p['empty_parts']} empty, edge cut {p['edge_cut']:.3f}):")
    print(f"  QuantClusterData total {p['total_s']:8.2f} s = undirected CSR {p['undirected_csr_s']:.2f} + "
          f"pymetis {p['metis_s']:.2f} + partition layout {p['partition_s']:.2f} + permute {p['permute_s']:.2f}")
    header = (f"{'bits':>4} {'nodes/b':>8} {'ours KB/b':>10} {'adj KB':>9} {'x KB':>8} {'rest KB':>8} "
              f"{'fill':>6} {'PyG KB/b':>10} {'ratio':>6} {'ours ms/b':>9} {'PyG ms/b':>8} "
              f"{'quant s':>7} {'pack s':>7} {'pack/part':>9}")
    print("\n" + header)
    for bits, r in result["bits"].items():
        print(f"{bits:>4} {r['nodes_mean']:>8.0f} {r['bytes_mean'] / 1e3:>10.1f} {r['adj_mean'] / 1e3:>9.1f} "
              f"{r['x_mean'] / 1e3:>8.1f} {r['rest_mean'] / 1e3:>8.1f} {r['fill_mean']:>6.3f} "
              f"{r['pyg_bytes_mean'] / 1e3:>10.1f} {r['bytes_ratio']:>6.2f} {r['batch_ms_mean']:>9.1f} "
              f"{r['pyg_batch_ms_mean']:>8.1f} {r['quantize_once_s']:>7.2f} {r['pack_s']:>7.2f} "
              f"{r['pack_s'] / p['total_s']:>9.1%}")
        extras = []
        if "epoch_workers_s" in r:
            extras.append(f"epoch with {result['args']['workers']} workers {r['epoch_workers_s']:.2f} s "
                          f"(serial {r['epoch_serial_s']:.2f} s)")
        if "h2d" in r:
            extras.append(f"H2D per batch: ours {r['h2d']['ours_ms']:.3f} ms (+ decode {r['h2d']['ours_decoded_ms']:.3f} "
                          f"ms), PyG {r['h2d']['pyg_ms']:.3f} ms")
        if extras:
            print("     " + "; ".join(extras))
    if 4 in result["bits"]:
        r = result["bits"][4]
        print(f"\ntargets at 4 bits: bytes ratio {r['bytes_ratio']:.2f}x (target >= 8x: "
              f"{'met' if r['bytes_ratio'] >= 8 else 'missed'}); pack {r['pack_s'] / p['total_s']:.1%} of the "
              f"partition time (target <= 25%: {'met' if r['pack_s'] <= 0.25 * p['total_s'] else 'missed'})")


if __name__ == "__main__":
    main()
