"""Where a QAT training step's time goes on one GPU and on two (``pyg_quant.distributed.ddp``, NCCL).

``qat.prepare(model, bits=4)`` of PyG's GIN (3 × 64) or GCN (100 → 16 → 16 → 47) with the default QConfig, trained
on random graphs of a products-scale cluster batch's size (32,000 nodes, 1.27M edges, 100 features, 47 classes;
``--batches`` of them, rank r taking r, r + R, ...).  Per world size: ms a step (an epoch over the rank's batches,
synchronized at its ends, over its steps) and the host's time to issue one (the same without waiting for the
device), then rank 0's profile of one epoch, a step's share: kernels and their device ms (NCCL's apart), the
top-level ops, and the ops with the most self CPU time.

Usage (repository root, on a host with two GPUs): ``python benchmarks/ddp_step.py [--models GIN,GCN]``;
``--device cpu`` runs gloo on the CPU (a check of the script).
"""
import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload.models import make_pyg  # noqa: E402

import pyg_quant as pq  # noqa: E402
from pyg_quant import distributed as pqd  # noqa: E402


def batches(args, device):
    out = []
    for b in range(args.batches):
        g = torch.Generator().manual_seed(b)
        out.append((torch.randn(args.nodes, 100, generator=g).to(device),
                    torch.randint(args.nodes, (2, args.edges), generator=g).to(device),
                    torch.randint(47, (args.nodes,), generator=g).to(device)))
    return out


def summarize(prof, steps: int) -> dict:
    kernels = collections.Counter()
    device_us = collections.Counter()
    by_name = collections.Counter()
    for e in prof.events():
        # (a record_function's range on the GPU, e.g. "Optimizer.step#Adam.step", is no kernel)
        annotation = getattr(e, "is_user_annotation", False) or e.name.startswith(("DistributedDataParallel",
                                                                                   "Optimizer.", "nccl:"))
        if e.device_type == torch.autograd.DeviceType.CUDA and not annotation:
            kind = "nccl" if "nccl" in e.name.lower() else "other"
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            kernels[kind] += 1
            device_us[kind] += us
            by_name[e.name[:70]] += us
    top = collections.Counter()
    for e in prof.events():
        if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU:
            top[e.name] += 1
    self_cpu = sorted(((e.key, e.count / steps, e.self_cpu_time_total / steps) for e in prof.key_averages()),
                      key=lambda r: -r[2])[:15]
    return {"kernels": {k: v / steps for k, v in kernels.items()},
            "kernel_ms": {k: v / steps / 1e3 for k, v in device_us.items()},
            "top_level_ops": sum(top.values()) / steps, "self_cpu": self_cpu,
            "top_kernels": [(name, us / steps) for name, us in by_name.most_common(8)]}


def worker(rank, world, args, store_path, queue):
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    data = batches(args, device)
    mine = data[rank::world]
    shape = SimpleNamespace(features=100, classes=47, layers=3, gin_hidden=64, gcn_hidden=16)
    results = {}
    for kind in args.models.split(","):
        pqd.seed_everything(0)
        model = pq.qat.prepare(make_pyg(shape, kind), bits=4).to(device)
        if world > 1:
            model = pqd.ddp(model, device_ids=[rank] if cuda else None)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)

        def epoch():
            for x, edge_index, y in mine:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x, edge_index), y).backward()
                opt.step()

        def barrier():
            sync()
            if world > 1:
                dist.barrier()

        for _ in range(2):
            epoch()
        walls, hosts = [], []
        for _ in range(args.reps):
            barrier()
            t = time.perf_counter()
            epoch()
            hosts.append(time.perf_counter() - t)
            barrier()
            walls.append(time.perf_counter() - t)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        barrier()
        with torch.profiler.profile(activities=activities) as prof:
            epoch()
            barrier()
        steps = len(mine)
        results[kind] = {"step_ms": statistics.median(walls) / steps * 1e3,
                         "host_ms": statistics.median(hosts) / steps * 1e3, **summarize(prof, steps)}
    if rank == 0:
        queue.put(results)
    if world > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="GIN,GCN")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--nodes", type=int, default=32_000)
    p.add_argument("--edges", type=int, default=1_270_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--worlds", default="1,2")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    for world in (int(w) for w in args.worlds.split(",")):
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=worker, args=(r, world, args, os.path.join(tmp, "store"), queue))
                     for r in range(world)]
            for proc in procs:
                proc.start()
            results = queue.get(timeout=600)
            for proc in procs:
                proc.join()
        for kind, r in results.items():
            print(f"## {kind}, {world} GPU(s): {r['step_ms']:.2f} ms a step, host issue {r['host_ms']:.2f} ms; "
                  f"a step: {r['top_level_ops']:.0f} top-level ops, kernels {r['kernels']}, kernel ms "
                  f"{ {k: round(v, 3) for k, v in r['kernel_ms'].items()} }")
            for name, count, us in r["self_cpu"]:
                print(f"    {name:60s} {count:7.1f} calls {us:9.1f} µs self CPU")
            for name, us in r["top_kernels"]:
                print(f"    kernel {name:70s} {us:9.1f} µs a step")


if __name__ == "__main__":
    main()
