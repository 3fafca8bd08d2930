"""The examples' inference on the CPU, fp32 against quantized, interleaved (issue 37 item 6).

Trains ``examples/cluster_gcn.py``'s GCN or ``examples/gin.py``'s GIN as the example does (fp32, and QAT then
``qat.convert``; ``--epochs`` each, a few: only the inference is timed), then times evaluation batches as the
examples' ``evaluate`` does (``batch.to("cpu")``, the model, ``argmax``), the fp32 and the quantized model taking
turns: each round the median batch of three passes each; the ratio fp32 / quantized per round, the median over
``--rounds``.  Besides, the time the loader takes to build and hand over a batch (``num_workers=0``, as the
examples run), and the ratio over the whole loop, the loader's batch and the evaluated one together.  A shared CPU drifts by 1.5× between runs, which the turns spread over both models.

Usage (repository root; pin it: ``OMP_NUM_THREADS=1 taskset -c 1``)::

    python benchmarks/examples_cpu.py gin [--small]
    python benchmarks/examples_cpu.py gcn [--small]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import cluster_gcn  # noqa: E402
import gin  # noqa: E402
from pyg_quant import qat  # noqa: E402
from pyg_quant.demo import load_data  # noqa: E402
from pyg_quant.loader import QuantClusterData, QuantClusterLoader  # noqa: E402


def setup(example: str, small: bool, epochs: int):
    """``(fp32 model, converted model, fp32 eval loader, quantized eval loader)``, built as the example builds them."""
    args = cluster_gcn.parse_args(cluster_gcn.parser(),
                                  (["--small"] if small else []) + ["--epochs", str(epochs), "--no-progress"])
    build = cluster_gcn.build_gcn if example == "gcn" else gin.build_gin
    self_loops, feature_dim = (1, 1) if example == "gcn" else (0, 0)
    torch.manual_seed(args.seed)
    data, _ = load_data(args.root, args.synthetic, num_nodes=args.nodes, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        parts = QuantClusterData(data, args.parts, save_dir=tmp, log=False)
    common = dict(batch_size=args.batch_size, self_loops=self_loops, num_workers=0, pin_memory=False)
    classes = int(data.y.max()) + 1
    model = build(data.num_features, classes, args)
    base = build(data.num_features, classes, args)
    base.load_state_dict(model.state_dict())
    cpu = torch.device("cpu")
    fp_eval = QuantClusterLoader(parts, shuffle=False, bits=None, **common)
    cluster_gcn.fit(base, QuantClusterLoader(parts, shuffle=True, bits=None, **common), fp_eval, args.epochs, cpu,
                    args.lr, args.weight_decay, False, "fp32")
    q_eval = QuantClusterLoader(parts, shuffle=False, bits=args.bits, feature_dim=feature_dim, **common)
    model = qat.prepare(model, bits=args.bits, seed=args.seed)
    cluster_gcn.fit(model, QuantClusterLoader(parts, shuffle=True, bits=args.bits, feature_dim=feature_dim, **common),
                    q_eval, args.epochs, cpu, args.lr, args.weight_decay, False, "qat")
    return base.eval(), qat.convert(model).eval(), fp_eval, q_eval


@torch.no_grad()
def batch_times(model, loader, built=None) -> list:
    """Seconds a batch of ``batch.to("cpu")``, the model and ``argmax`` (what the example's ``evaluate`` times);
    with a list ``built``, the seconds the loader took to hand each batch over are appended to it."""
    times = []
    t = time.perf_counter()
    for batch in loader:
        start = time.perf_counter()
        if built is not None:
            built.append(start - t)
        batch = batch.to("cpu")
        model(batch.x, batch.adj).argmax(-1)
        t = time.perf_counter()
        times.append(t - start)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("example", choices=("gcn", "gin"))
    p.add_argument("--small", action="store_true")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    base, converted, fp_eval, q_eval = setup(a.example, a.small, a.epochs)
    for _ in range(3):  # warm-up
        batch_times(base, fp_eval), batch_times(converted, q_eval)
    fp_ms, q_ms, ratios, loop_ratios = [], [], [], []
    fp_built, q_built = [], []
    for _ in range(a.rounds):
        fb, qb = [], []
        f = statistics.median(sum((batch_times(base, fp_eval, fb) for _ in range(3)), []))
        q = statistics.median(sum((batch_times(converted, q_eval, qb) for _ in range(3)), []))
        fp_ms.append(f * 1e3)
        q_ms.append(q * 1e3)
        ratios.append(f / q)
        fp_built.append(statistics.median(fb) * 1e3)
        q_built.append(statistics.median(qb) * 1e3)
        loop_ratios.append((f + statistics.median(fb)) / (q + statistics.median(qb)))
    print(f"{a.example}{' --small' if a.small else ''}: fp32 {statistics.median(fp_ms):.3f} ms, 4-bit "
          f"{statistics.median(q_ms):.3f} ms a batch; fp32 / quantized {statistics.median(ratios):.2f} "
          f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)})")
    print(f"  the loader building a batch: fp32 {statistics.median(fp_built):.3f} ms, 4-bit "
          f"{statistics.median(q_built):.3f} ms; the whole loop (loader + evaluate's batch), fp32 / quantized "
          f"{statistics.median(loop_ratios):.2f} (rounds: {' '.join(f'{r:.2f}' for r in loop_ratios)})")


if __name__ == "__main__":
    main()
