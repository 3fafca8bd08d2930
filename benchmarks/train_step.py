"""Where a training step's time goes: PyG fp32 against pyg_quant QAT on one products-scale cluster batch.

One cluster batch of ``benchmarks/layers.py`` (32,000 nodes, ~1.27M edges; 100 input features,
47 classes), the models of ``benchmarks/e2e.py`` (GIN 3×64, GCN 3×16), one training step
(forward, cross-entropy, backward, Adam) per variant:

* ``step ms``: median wall time of a step with a device synchronisation after it;
* ``host ms``: median time for the Python call of a step to return, without synchronising
  (the launch queue is deep enough that a host-bound step shows host ≈ step);
* ``ops``: ATen operators dispatched per step, ``launches``: CUDA kernels (``torch.profiler``);
* the operators with the most self CPU time and the kernels with the most GPU time.

Usage (from the repository root)::

    python benchmarks/train_step.py --out benchmarks/out/train_step.json
    python benchmarks/train_step.py --small              # a CPU check
"""
import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e import Net, gin_mlp  # noqa: E402
from layers import cluster_batch  # noqa: E402

try:
    import pyg_quant as pq
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, os.path.dirname(HERE))
    import pyg_quant as pq
from torch_geometric.nn import GCNConv, GINConv  # noqa: E402


def make_model(kind: str, features: int, classes: int) -> Net:
    if kind == "GCN":
        d = [features, 16, 16, classes]
        return Net([GCNConv(d[i], d[i + 1]) for i in range(3)], True)
    d = [features, 64, 64, classes]
    return Net([GINConv(gin_mlp(d[i], 64, d[i + 1], i == 2)) for i in range(3)], False)


def variants(args):
    out = [("PyG fp32 edge_index", None), ("PyG fp32 CSR", None)]
    for observer in args.agg_observers:
        out.append((f"QAT {args.bits}-bit agg={observer}", dict(bits=args.bits, agg_observer=observer)))
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(args):
    device = torch.device(args.device)
    edge_index, n = cluster_batch(args.small, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(n, args.features, generator=g).to(device)
    y = torch.randint(args.classes, (n,), generator=g).to(device)
    edge_index = edge_index.to(device)
    from torch_geometric.utils import to_torch_csr_tensor
    adj_t = to_torch_csr_tensor(edge_index.flip(0), size=(n, n))
    rows = []
    for kind in args.models:
        for label, qat in variants(args):
            torch.manual_seed(args.seed)
            model = make_model(kind, args.features, args.classes).to(device)
            adj = adj_t if "CSR" in label else edge_index
            if "CSR" in label and kind == "GCN":
                model = make_model(kind, args.features, args.classes).to(device)
            if qat is not None:
                model = pq.qat.prepare(model, **qat)
            model.train()
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)

            def step():
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x, adj), y)
                loss.backward()
                opt.step()
                return loss

            for _ in range(args.warmup):
                step()
            sync(device)
            full, host = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                step()
                t1 = time.perf_counter()
                sync(device)
                t2 = time.perf_counter()
                host.append((t1 - t0) * 1e3)
                full.append((t2 - t0) * 1e3)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                step()
                sync(device)
            events = prof.events()
            ops = sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None
                      or e.name.startswith("aten::") and not e.cpu_parent.name.startswith("aten::"))
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            by_kernel = collections.Counter()
            for e in kernels:
                by_kernel[e.name[:60]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time
            by_op = collections.Counter()
            for e in prof.key_averages():
                if e.key.startswith("aten::"):
                    by_op[e.key] += e.self_cpu_time_total
            row = dict(model=kind, label=label, step_ms=statistics.median(full), host_ms=statistics.median(host),
                       ops=ops, launches=len(kernels), gpu_ms=sum(by_kernel.values()) / 1e3,
                       top_cpu=[(k, round(v / 1e3, 3)) for k, v in by_op.most_common(args.top)],
                       top_gpu=[(k, round(v / 1e3, 3)) for k, v in by_kernel.most_common(args.top)])
            rows.append(row)
            print(f"{kind} {label:28s} step {row['step_ms']:8.2f} ms  host {row['host_ms']:8.2f} ms  "
                  f"ops {ops:5d}  launches {len(kernels):5d}  kernels {row['gpu_ms']:7.2f} ms", flush=True)
            if args.verbose:
                print("   cpu:", row["top_cpu"])
                print("   gpu:", row["top_gpu"])
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="4,096 nodes (a CPU check)")
    p.add_argument("--models", default="GIN,GCN", type=lambda s: s.split(","))
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--agg-observers", default="mse,ema", type=lambda s: s.split(","))
    p.add_argument("--features", type=int, default=100)
    p.add_argument("--classes", type=int, default=47)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = run(args)
    if args.out:
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        with open(args.out, "w") as f:
            json.dump(dict(device=name, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           torch=torch.__version__, argv=sys.argv[1:], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
