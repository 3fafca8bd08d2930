"""The command line: the workload's options, and the whole of the products-scale benchmark's."""
import argparse
import os

import torch

from pyg_quant.graph.adjacency_form import ADJACENCY_FORMS, DEFAULT_ADJACENCY

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_workload_arguments(p, part_size=None, avg_degree=None) -> None:
    """The workload's options (graph, batches, models) on parser ``p``; ``--num-parts`` and ``--parts-per-batch``
    default to None, for the caller to fill."""
    p.add_argument("--num-parts", type=int, default=None)
    p.add_argument("--part-size", type=int, default=part_size)
    p.add_argument("--parts-per-batch", type=int, default=None)
    p.add_argument("--avg-degree", type=int, default=avg_degree, help="directed edges per node before dropping repeats")
    p.add_argument("--inside", type=float, default=0.8, help="fraction of edges inside a part")
    p.add_argument("--features", type=int, default=100)
    p.add_argument("--classes", type=int, default=47)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--gcn-hidden", type=int, default=16)
    p.add_argument("--gin-hidden", type=int, default=64)


def parse_args(argv=None, description=None):
    """``e2e.py``'s command line (``host_profile.py`` passes it the options it does not take itself): the workload's
    options at products scale (``--small``: 25 parts of 1,600 nodes, 5 a batch), the sections' options, and the
    defaults filled in; ``--bits`` and the other lists come back as tuples."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true",
                   help="CPU check: 25 parts of 1,600 nodes, 5 parts a batch (5 batches of 8,000 nodes)")
    add_workload_arguments(p, part_size=1600, avg_degree=50)
    p.add_argument("--bits", default="8,4,2,1")
    p.add_argument("--kernel-bits", default="8,4,1", help="bit widths of the pq-kernels diagnostic")
    p.add_argument("--static-bits", default="8,4", help="bit widths run again with calibrated (static) ranges")
    p.add_argument("--calibration-batches", type=int, default=4)
    p.add_argument("--adjacency", default=DEFAULT_ADJACENCY, choices=ADJACENCY_FORMS,
                   help="form of the decoded pyg_quant batches: bit tiles, tile-free CSR, or by tile fill")
    p.add_argument("--qat-bits", type=int, default=4)
    p.add_argument("--models", default="GIN,GCN")
    p.add_argument("--sections", default="inference,training,transfer")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="skip the CUDA-graph variants")
    p.add_argument("--streams", type=int, default=3,
                   help="graph variants again with batch i on stream i %% STREAMS (<= 1: skip them)")
    p.add_argument("--reps", type=int, default=None, help="timed epochs per measurement (median)")
    p.add_argument("--train-reps", type=int, default=None)
    p.add_argument("--train-variants", default=None, type=lambda s: s.split(","),
                   help="only the training variants whose label contains one of these (comma-separated)")
    p.add_argument("--train-rounds", type=int, default=5,
                   help="after a model's variants are measured, this many rounds of one resident epoch of each, "
                        "in turn (the medians are the comparison that the host's drift spreads over all alike)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which configurations are skipped (default 280 on the GPU, 110 --small)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: 1 for a CPU run: on a shared machine OpenMP's waiting threads "
                        "slowed the bit kernels 10-25x; torch's default on a GPU run)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/out/e2e[_small].json); '' for none")
    p.add_argument("--png", default=None, help="plot path (default: the JSON path with .png)")
    args = p.parse_args(argv)
    if args.num_parts is None:
        args.num_parts = 25 if args.small else 1500
    if args.parts_per_batch is None:
        args.parts_per_batch = 5 if args.small else 20
    if args.reps is None:
        args.reps = 1 if args.small else 3
    if args.train_reps is None:
        args.train_reps = 1 if args.small else 3
    if args.time_budget is None:
        args.time_budget = 110.0 if args.small else 280.0
    args.bits = tuple(int(b) for b in args.bits.split(",") if b)
    args.kernel_bits = tuple(int(b) for b in args.kernel_bits.split(",") if b and int(b) in args.bits)
    args.static_bits = tuple(int(b) for b in args.static_bits.split(",") if b and int(b) in args.bits)
    args.models = tuple(m.strip().upper() for m in args.models.split(",") if m.strip())
    args.sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    if args.out is None:
        args.out = os.path.join(BENCHMARKS, "out", "e2e_small.json" if args.small else "e2e.json")
    if args.out and args.png is None:
        args.png = os.path.splitext(args.out)[0] + ".png"
    return args
