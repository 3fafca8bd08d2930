"""A loader batch's adjacency decoded from its wire buffer, two ways in one process, the two taking turns.

* ``one op``: what ``QuantBatch`` runs, :meth:`CompactAdjacency.expand_wire` (the ``expand_wire`` op: the parts read
  in place as they travel, widened, expanded);
* ``composed``: the same steps as separate ops from Python, as the decode ran before that op: each part's view of the
  buffer (:meth:`QuantBatch.wire_tensors`), its integers widened back, then :meth:`CompactAdjacency.expand`.

Per batch: host µs (the decodes of ``--batches`` batches issued back to back, over their count; the median of
``--rounds`` rounds), wall µs (the same with a synchronization at the end), and the kernels and top-level ops of one
decode (``torch.profiler``, after the timing).  The products-scale workload of ``benchmarks/workload`` (``--num-parts
300``: 15 batches of 32,000 nodes), GIN's adjacency (no self loops) and GCN's (the diagonal term), in the
``--adjacency`` form the loader picks.

Usage (repository root): ``python benchmarks/wire_decode.py`` on a GPU; ``--small --device cpu`` on a CPU.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402
from pyg_quant.graph.bit_adjacency import CompactAdjacency  # noqa: E402
from pyg_quant.loader import QuantBatch  # noqa: E402

WIDE = {"tile_key": torch.int32, "res_row": torch.int32, "res_col": torch.int32, "res_val": torch.int32}


def composed(batch: QuantBatch):
    """The pre-op decode: one view a part, the narrowed integers widened, ``from_tensors(...).expand(...)``."""
    parts = {name.split(".", 1)[1]: view for name, view in batch.wire_tensors().items() if name.startswith("adj.")}
    parts = {name: view.to(WIDE[name]) if name in WIDE and view.dtype != WIDE[name] else
             view.to(torch.int16) if name == "row_count" and view.dtype == torch.int8 else view
             for name, view in parts.items()}
    compact = CompactAdjacency.from_tensors(parts, batch._meta["objects"]["adj"][1])
    return compact.expand(tiles=compact.wants_tiles(batch.adjacency))


def one_op(batch: QuantBatch):
    return QuantBatch(batch.buffer, batch._specs, batch._meta).adj


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    args, rest = p.parse_known_args()
    wargs = workload.parse_args(["--num-parts", "300", "--parts-per-batch", "20", "--out", ""] + rest)
    device, _, runner, data = workload.probe_workload(wargs)
    for kind in wargs.models:
        batches = [b.to(device) for b in workload.pq_host_batches(data, kind, 4, runner.cuda)]
        for a, b in ((one_op(x), composed(x)) for x in batches[:2]):  # the same BitAdjacency both ways
            for name in a._TENSORS:
                u, v = getattr(a, name), getattr(b, name)
                assert (u is None) == (v is None) and (u is None or torch.equal(u, v)), name
        ways = {"one op": one_op, "composed": composed}
        times = {name: ([], []) for name in ways}
        with torch.inference_mode():
            for round_ in range(args.rounds + 1):
                for name, decode in ways.items():
                    runner.sync()
                    t0 = time.perf_counter()
                    for batch in batches:
                        decode(batch)
                    t1 = time.perf_counter()
                    runner.sync()
                    if round_:  # the first round warms up
                        times[name][0].append((t1 - t0) * 1e6 / len(batches))
                        times[name][1].append((time.perf_counter() - t0) * 1e6 / len(batches))
            for name, decode in ways.items():
                prof = workload.profile_batch(runner, lambda: decode(batches[0]))
                host, wall = (statistics.median(t) for t in times[name])
                print(f"{kind} adjacency ({batches[0].adjacency}), {name:8s}: host {host:7.1f} us, wall {wall:7.1f} us "
                      f"a batch; kernels {prof.get('kernels')}, top-level ops {prof.get('top_level_ops')}", flush=True)


if __name__ == "__main__":
    main()
