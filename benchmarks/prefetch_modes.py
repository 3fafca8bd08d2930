"""The loader's prefetch modes against a plain pinned ``.to`` loop: ms a batch, wall and host (median of 5 epochs,
the loops taking turns), for the decode alone (``x`` and ``adj`` read) and with the 4-bit model, GIN and GCN, on 15
products-scale batches (``benchmarks/workload``, ``--num-parts 300``), ``eval()`` under ``torch.inference_mode()``.

* ``prefetch``: ``pyg_quant.loader.prefetch(batches, "cuda")`` (``QuantClusterLoader(..., device="cuda")``): each
  batch's copy queued one batch ahead on the compute stream;
* ``prefetch, side stream``: ``side_stream=True``, the copies on a stream of their own beside the kernels;
* ``pinned .to``: ``batch.to("cuda")`` from pinned memory as each batch comes.

Usage (repository root, on a GPU): ``python benchmarks/prefetch_modes.py``; ``--small --device cpu`` runs the loops
on a tiny graph (where every mode is the same loop).
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402
from pyg_quant.loader import prefetch  # noqa: E402


def main():
    args = workload.parse_args(["--num-parts", "300", "--parts-per-batch", "20", "--out", ""] + sys.argv[1:])
    device, _, runner, data = workload.probe_workload(args)
    modes = {"prefetch": lambda bs: prefetch(bs, device),
             "prefetch, side stream": lambda bs: prefetch(bs, device, side_stream=True),
             "pinned .to": lambda bs: (hb.to(device) for hb in bs)}
    for kind in args.models:
        torch.manual_seed(args.seed)
        model = workload.make_pq(args, kind, 4)
        model.load_state_dict(workload.make_pyg(args, kind, normalize=kind != "GCN").state_dict())
        model = model.to(device).eval()
        pinned = workload.pq_inputs(data, kind, 4, device, runner.cuda).host
        resident = workload.pq_inputs(data, kind, 4, device, False).resident
        loops = [("resident", lambda: [model(*a) for a in resident])]
        for name, batches in modes.items():
            loops.append((name + ", decode", lambda b=batches: [(x.x, x.adj) for x in b(pinned)]))
            loops.append((name + ", model", lambda b=batches: [model(x.x, x.adj) for x in b(pinned)]))
        times = {name: ([], []) for name, _ in loops}
        with torch.inference_mode():
            for _ in range(2):
                for _, loop in loops:
                    loop()
            for _ in range(5):
                for name, loop in loops:
                    runner.sync()
                    t0 = time.perf_counter()
                    loop()
                    t1 = time.perf_counter()
                    runner.sync()
                    times[name][0].append((time.perf_counter() - t0) * 1e3 / len(pinned))
                    times[name][1].append((t1 - t0) * 1e3 / len(pinned))
        for name, (wall, host) in times.items():
            print(f"{kind} {name:30s} ms a batch: wall {statistics.median(wall):.3f} host {statistics.median(host):.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
