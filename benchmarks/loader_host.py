"""Where the loader loop's time goes beyond the resident epoch (pyg_quant at ``--bits``, the products-scale workload of
``benchmarks/workload``, ``eval()`` under ``torch.inference_mode()``).

Per model, wall time and the host's time to issue (equal when the host is the bound), median of 5 epochs: the
resident epoch (batches decoded once), the prefetch epoch (``pyg_quant.loader.prefetch``, what
``QuantClusterLoader(..., device="cuda")`` iterates with), the prefetch iteration with only the decode (``x`` and
``adj`` read, no model), with only the copies, and pinned ``.to`` + decode on the compute stream.  Then one QAT model
trained on the loader's batches (``edge_index`` and 4-bit ``x`` decoded per batch): its host synchronizations per
step (``torch.cuda.set_sync_debug_mode``) and where they come from.

Usage (repository root, on the GPU; ~1 min after the build): ``python benchmarks/loader_host.py``; ``--small`` for a
CPU check (the CPU decodes in place: the decode rows there measure nothing).
"""
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
import user_paths as up  # noqa: E402
import workload  # noqa: E402
import pyg_quant as pq  # noqa: E402
from pyg_quant.loader import QuantBatch, prefetch  # noqa: E402


def main(argv=None):
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    args = up.parse_args(["--pyg", "fp32 CSR", "--compile", "", "--out", ""] + (sys.argv[1:] if argv is None else argv))
    device, _, runner, data = workload.probe_workload(args)
    cuda = device.type == "cuda"
    bits = args.bits[-1]

    def timed(fn, reps=5):
        walls, hosts = [], []
        for _ in range(reps):
            runner.sync()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            runner.sync()
            walls.append((time.perf_counter() - t0) * 1e3)
            hosts.append((t1 - t0) * 1e3)
        return f"wall {statistics.median(walls):7.2f} host {statistics.median(hosts):7.2f} ms"

    label = f"pyg_quant {bits}-bit"
    for kind in args.models:
        torch.manual_seed(args.seed)
        state = workload.make_pyg(args, kind).state_dict()
        paths = up.Paths(data, kind, label, device, cuda)
        model = up.make_model(args, kind, label, state, device)

        def decode_only():
            for batch in prefetch(paths.pinned, device):
                batch.x, batch.adj

        def copies_only():  # each batch copied and handed over, no field read
            for _ in prefetch(paths.pinned, device):
                continue

        def to_and_decode():
            for host_batch in paths.pinned:
                batch = host_batch.to(device)
                batch.x, batch.adj

        with torch.inference_mode():
            for args_ in paths.resident:
                model(*args_)
            for what, fn in (("resident", lambda: paths.epoch("resident", model)),
                             ("prefetch", lambda: paths.epoch("prefetch", model)),
                             ("prefetch, decode only", decode_only), ("prefetch, copies only", copies_only),
                             ("pinned .to + decode", to_and_decode)):
                print(f"{kind} {label} {what:24s} {timed(fn)}", flush=True)

    # QAT training on the loader's batches: host synchronizations a step, and where
    for kind in args.models:
        torch.manual_seed(args.seed)
        model = pq.qat.prepare(workload.make_pyg(args, kind).to(device), bits=bits).train()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        batches = [QuantBatch.from_fields({"x": data.feats[bits][b], "edge_index": data.edge_index[b],
                                           "y": data.y[b]}, pin_memory=cuda) for b in range(min(3, data.nb))]
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for host_batch in batches:
                batch = host_batch.to(device)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(batch.x, batch.edge_index), batch.y).backward()
                opt.step()
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [f"{w.filename.split('/')[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        print(f"{kind} QAT {bits}-bit on the loader's batches: {len(syncs) / len(batches):.1f} host syncs a step "
              f"{sorted(set(syncs))}", flush=True)


if __name__ == "__main__":
    main()
