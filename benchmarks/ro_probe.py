"""Where a ``torch.compile`` call's time goes (the default mode and ``mode="reduce-overhead"``), against eager: one
products-scale batch (the workload of ``benchmarks/workload/``), GIN and GCN at 4 bits and PyG fp32 CSR (not with
``--quant-only``), the same batch each call; host µs a call (30 calls without a synchronization, median of 7
blocks), wall µs a call, and five profiled calls' kernels (the replay's input copies included) and host ops, a call.
"RO + freezing": reduce-overhead with inductor's freezing on (``torch._inductor.config.freezing``), which folds the
weights' quantization into constants.  First, the floor of a reduce-overhead call on this host: a compiled function
of one and of eight one-element inputs (one kernel), against the same calls eager.

    python3 benchmarks/ro_probe.py [--floor-only] [--quant-only] [--default-only] [--tree]

``--tree``: each compiled call's host call tree, three levels deep (total µs and calls a call).
"""
import collections
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402
from host_profile import time_block  # noqa: E402


def host_wall(fn, runner, reps=30, rounds=7):
    """Median host and wall µs a call of ``fn`` over ``rounds`` of host_profile's blocks of ``reps`` calls."""
    blocks = [time_block(fn, (), runner, reps) for _ in range(rounds)]
    return (1e6 * statistics.median(h for h, _ in blocks), 1e6 * statistics.median(w for _, w in blocks))


def profiled(call, calls=5):
    """Kernels (count, device µs) and the top host ops (self µs, count) a call, over ``calls`` profiled calls."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    count, device_us = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:60]
            count[name] += 1
            device_us[name] += e.device_time_total
    kernels = [(n, c / calls, device_us[n] / calls) for n, c in count.most_common(12)]
    host = sorted(((e.key, e.self_cpu_time_total / calls, e.count / calls) for e in prof.key_averages()),
                  key=lambda r: -r[1])[:8]
    # the host's call tree three levels deep: where a call's host time goes (total µs a call, calls a call)
    tree_us, tree_n = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        depth, parent = 0, e.cpu_parent
        while parent is not None:
            depth, parent = depth + 1, parent.cpu_parent
        if depth <= 2:
            key = "  " * depth + e.name[:70]
            tree_us[key] += e.cpu_time_total / calls
            tree_n[key] += 1 / calls
    tree = [(k, t, tree_n[k]) for k, t in tree_us.most_common(16)]
    return kernels, host, tree


def ro_floor(runner) -> None:
    """Host and wall µs a call of the cheapest reduce-overhead graph with 1 and 8 inputs: what any compiled model's
    call costs on this host before its own kernels (Dynamo's guards, the cudagraph tree's wrapper and input copies,
    the graph launch)."""
    from torch._inductor import cudagraph_trees

    def f(*xs):
        return sum(x * 2 for x in xs)

    for n in (1, 8):
        xs = [torch.ones(1, device="cuda") for _ in range(n)]
        with torch.inference_mode():
            eager_host, eager_wall = host_wall(lambda: f(*xs), runner)
            torch._dynamo.reset()
            compiled = torch.compile(f, mode="reduce-overhead")

            def call():
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(*xs)

            for _ in range(4):
                call()
            ro_host, ro_wall = host_wall(call, runner)
        print(f"floor, {n} one-element input(s): eager host {eager_host:7.1f} wall {eager_wall:7.1f} | RO host "
              f"{ro_host:7.1f} wall {ro_wall:7.1f} us a call", flush=True)
        del compiled
        cudagraph_trees.reset_cudagraph_trees()


def main():
    floor_only, quant_only = "--floor-only" in sys.argv[1:], int("--quant-only" in sys.argv[1:])
    default_only = "--default-only" in sys.argv[1:]
    args = workload.parse_args(["--num-parts", "20", "--parts-per-batch", "20", "--out", ""])
    device = torch.device("cuda")
    rec = workload.Recorder("", {}, "cuda")
    runner = workload.Runner(args, device, rec)
    ro_floor(runner)
    if floor_only:
        return
    data = workload.build_graph(args, device, rec)
    data.adjacency = args.adjacency
    workload.build_formats(args, device, data, rec, runner)
    from torch._inductor import cudagraph_trees
    for kind in ("GIN", "GCN"):
        torch.manual_seed(0)
        pyg = workload.make_pyg(args, kind, normalize=kind != "GCN").to(device).eval()
        quant = workload.make_pq(args, kind, 4)
        quant.load_state_dict(pyg.state_dict())
        variants = [("PyG fp32 CSR", pyg, workload.pyg_inputs(data, kind, "CSR", "fp32", device).resident[0]),
                    ("pyg_quant 4-bit", quant.to(device).eval(),
                     workload.pq_inputs(data, kind, 4, device, False).resident[0])][quant_only:]
        for label, model, inputs in variants:
            with torch.inference_mode():
                eager_host, eager_wall = host_wall(lambda: model(*inputs), runner)
            modes = (("default", False), ("RO", False), ("RO + freezing", True))
            for mode, frozen in modes[:1] if default_only else modes:
                with torch.inference_mode(), torch._inductor.config.patch(freezing=frozen):
                    torch._dynamo.reset()
                    compiled = torch.compile(model, **({} if mode == "default" else {"mode": "reduce-overhead"}))

                    def call():
                        torch.compiler.cudagraph_mark_step_begin()
                        return compiled(*inputs)

                    for _ in range(4):  # compile, warm-up, record
                        call()
                    ro_host, ro_wall = host_wall(call, runner)
                    kernels, host, tree = profiled(call)
                    print(f"{kind} {label:16s} eager host {eager_host:7.1f} wall {eager_wall:7.1f} | {mode} host "
                          f"{ro_host:7.1f} wall {ro_wall:7.1f} us a call", flush=True)
                    print(f"   {mode} kernels a call:", ", ".join(f"{n} x{c:g} {t:.1f}us" for n, c, t in kernels))
                    print(f"   {mode} host ops a call:", ", ".join(f"{k} {t:.1f}us x{c:g}" for k, t, c in host))
                    if "--tree" in sys.argv[1:]:
                        for k, t, c in tree:
                            print(f"   {mode} tree {t:8.1f}us x{c:g} {k}")
                    del compiled
                    cudagraph_trees.reset_cudagraph_trees()


if __name__ == "__main__":
    main()
