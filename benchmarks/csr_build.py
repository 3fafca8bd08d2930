"""Building a float aggregation's ``A`` and ``Aᵀ`` in CSR from an ``edge_index``: ``pyg_quant.ops.csr_pair`` (one op)
against its torch reference (a stable ``torch.sort`` per direction and the ops around it), on one products-scale
cluster batch's size (32,000 nodes, 1.27M random edges).

Per case and implementation: the wall time of one call (synchronized; median of ``--reps``), the host's time to issue
one (``--reps`` calls back to back without a synchronization, over ``--reps``), and the kernels one call launches.
"GIN": ``A`` and ``Aᵀ`` of the edges; "GCN": ``D^-1/2 (A + I)`` with the self-loops masked out of ``A``.

Usage (repository root): ``python benchmarks/csr_build.py [--device cuda]``.
"""
import argparse
import statistics
import time

import torch

from pyg_quant import ops


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--nodes", type=int, default=32_000)
    p.add_argument("--edges", type=int, default=1_270_000)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    n = args.nodes
    edge_index = torch.randint(n, (2, args.edges), generator=g).to(device)
    src, dst = edge_index[0], edge_index[1]
    dinv = (torch.rand(n, generator=g) + 0.5).to(device)
    cases = {
        "GIN": (dst, src, None, None, None, None, n, n, torch.float32),
        "GCN": (dst, src, None, src != dst, dinv, torch.ones(n, device=device), n, n, torch.float32),
    }
    impls = {"csr_pair op": ops.csr_pair, "torch reference": ops.reference.csr_pair}
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"{n} nodes, {args.edges} edges; µs a call")
    print("| case | implementation | wall µs | host µs | kernels |")
    print("|---|---|---:|---:|---:|")
    for case, call_args in cases.items():
        want = ops.reference.csr_pair(*call_args)
        for name, fn in impls.items():
            got = fn(*call_args)
            assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want)), (case, name)
            for _ in range(3):
                fn(*call_args)
            sync()
            walls = []
            for _ in range(args.reps):
                t = time.perf_counter()
                fn(*call_args)
                sync()
                walls.append(time.perf_counter() - t)
            t = time.perf_counter()
            for _ in range(args.reps):
                fn(*call_args)
            host = (time.perf_counter() - t) / args.reps
            sync()
            kernels = "-"
            if device.type == "cuda":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    fn(*call_args)
                    sync()
                kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"| {case} | {name} | {statistics.median(walls) * 1e6:.1f} | {host * 1e6:.1f} | {kernels} |")


if __name__ == "__main__":
    main()
