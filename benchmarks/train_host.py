"""Where an eager training epoch's host time goes: PyG fp32 CSR against ``qat.prepare(model, bits=4)`` on
``edge_index``, over the products-scale workload's 75 resident batches (``benchmarks/workload``; e2e.py's training
epoch), and the same QAT model on the loader's batches (``BitAdjacency`` and 4-bit ``x``, resident).

Per model and variant: the epoch's wall time and the host's time to issue it (equal when the host is the bound),
launches and kernel ms a step (``torch.profiler`` over 5 steps), the top self-CPU ops; for the QAT variant (and for
PyG with ``--cprofile-pyg``) a ``cProfile`` of one epoch: Python functions by own time, then pyg_quant's by
cumulative time.

Usage (repository root, on the GPU; ~1 min after the build): ``python benchmarks/train_host.py > train_host.log``;
``--small`` for a CPU check.
"""
import argparse
import cProfile
import collections
import io
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
import workload  # noqa: E402
from workload.inputs import pq_inputs, pyg_inputs  # noqa: E402
from workload.models import make_pyg  # noqa: E402
import pyg_quant as pq  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cprofile-pyg", action="store_true")
    own, rest = p.parse_known_args(argv)
    args = workload.parse_args(["--time-budget", "1000"] + rest)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rec = workload.Recorder("", {}, device.type)
    data = workload.build_graph(args, device, rec)
    data.adjacency = args.adjacency
    args.bits = (args.qat_bits,)
    workload.build_formats(args, device, data, rec, workload.Runner(args, device, rec))
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    variants = []
    for kind in args.models:
        torch.manual_seed(args.seed)
        init = make_pyg(args, kind).state_dict()
        qb = args.qat_bits
        for label, adjacency in (("PyG fp32 CSR", "CSR"), (f"QAT {qb}-bit edge_index", "edge_index"),
                                 (f"QAT {qb}-bit BitAdjacency, {qb}-bit x", "BitAdjacency")):
            model = make_pyg(args, kind, normalize=(adjacency != "CSR" or kind != "GCN"))
            model.load_state_dict(init)
            model = model.to(device)
            if not label.startswith("PyG"):
                model = pq.qat.prepare(model, bits=args.qat_bits)
            model.train()
            opt = torch.optim.Adam(model.parameters(), lr=args.lr)
            if adjacency == "BitAdjacency":  # the loader's batches as QuantClusterLoader hands them over
                inp = pq_inputs(data, kind, args.qat_bits, device, cuda)
            else:
                inp = pyg_inputs(data, kind, adjacency, "fp32", device)
            batches = [(x, adj, data.y[b]) for b, (x, adj) in enumerate(inp.resident)]
            variants.append((kind, label, model, opt, batches))

    def step(model, opt, x, adj, y):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, adj), y).backward()
        opt.step()

    for kind, label, model, opt, batches in variants:
        for batch in batches:  # warm-up epoch
            step(model, opt, *batch)
        sync()
        walls, hosts = [], []
        for _ in range(3):
            t0, host = time.perf_counter(), 0.0
            for batch in batches:
                h0 = time.perf_counter()
                step(model, opt, *batch)
                host += time.perf_counter() - h0
            sync()
            walls.append((time.perf_counter() - t0) * 1e3)
            hosts.append(host * 1e3)
        print(f"## {kind} {label}: epoch wall {statistics.median(walls):.1f} ms, host issue "
              f"{statistics.median(hosts):.1f} ms", flush=True)
    # The profilers after all timing: a CUDA profiler session slows every later launch of the process.
    for kind, label, model, opt, batches in variants:
        with torch.profiler.profile(activities=activities) as prof:
            for batch in batches[:5]:
                step(model, opt, *batch)
            sync()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum(getattr(e, "device_time_total", 0) for e in kernels) / 5 / 1e3
        self_cpu, calls = collections.Counter(), collections.Counter()
        for e in prof.key_averages():
            self_cpu[e.key] += e.self_cpu_time_total
            calls[e.key] += e.count
        print(f"\n## {kind} {label}: a step: {len(kernels) / 5:.0f} launches, {kernel_ms:.2f} ms of kernels")
        by_kernel, kernel_calls = collections.Counter(), collections.Counter()
        for e in kernels:
            by_kernel[e.name[:60]] += getattr(e, "device_time_total", 0)
            kernel_calls[e.name[:60]] += 1
        print("   kernels a step (µs, launches):",
              [(k, round(v / 5, 1), kernel_calls[k] / 5) for k, v in by_kernel.most_common(25)])
        print("   top self-CPU (ms over 5 steps, calls):",
              [(k[:50], round(v / 1e3, 2), calls[k]) for k, v in self_cpu.most_common(20)])
        if not label.startswith("PyG") or own.cprofile_pyg:
            profiler = cProfile.Profile()
            profiler.enable()
            for batch in batches:
                step(model, opt, *batch)
            sync()
            profiler.disable()
            out = io.StringIO()
            stats = pstats.Stats(profiler, stream=out)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumtime").print_stats("pyg_quant", 40)
            print(out.getvalue())

if __name__ == "__main__":
    main()
