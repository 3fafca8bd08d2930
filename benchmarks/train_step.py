"""Where a training step's time goes: PyG fp32 against pyg_quant (QAT, and its layers) on one products-scale batch.

One cluster batch of ``benchmarks/layers.py`` (32,000 nodes, ~1.27M edges; 100 input features,
47 classes), the models of ``benchmarks/workload`` (GIN 3×64, GCN 3×16), one training step
(forward, cross-entropy, backward, Adam) per variant: PyG fp32 on ``edge_index`` and in CSR, the model
``qat.prepare``-d with each ``--agg-observers``, and the same model written with ``QGCNConv`` / ``QGINConv``
(``bits`` set, no QAT: the layers' built-in quantizers) on ``edge_index``:

* ``step ms``: median wall time of a step with a device synchronisation after it;
* ``host ms``: median time for the Python call of a step to return, without synchronising
  (the launch queue is deep enough that a host-bound step shows host ≈ step);
* ``ops``: ATen operators dispatched per step, ``launches``: CUDA kernels (``torch.profiler``);
* the operators with the most self CPU time and the kernels with the most GPU time.

``--count-ops`` counts instead of timing (any device, meant for the CPU): the ATen operators
dispatched per step through a ``TorchDispatchMode`` (forward with the loss, backward, optimizer
step with ``zero_grad``; a fused ``pyg_quant::`` op counts as one), the host syncs among them
(``.item()`` / ``bool()`` on a tensor, ops whose output size depends on the data, and
``Tensor.tolist`` calls), and the losses of a few fixed-seed steps (``--losses-out``; compare two
runs' files with ``--check-losses``: bit-identical or a non-zero exit).

Usage (from the repository root)::

    python benchmarks/train_step.py --out benchmarks/out/train_step.json
    python benchmarks/train_step.py --small              # a CPU check
    python benchmarks/train_step.py --small --count-ops --losses-out before.json
    python benchmarks/train_step.py --small --count-ops --check-losses before.json
"""
import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workload import Net, gin_mlp  # noqa: E402
from layers import cluster_batch  # noqa: E402

try:
    import pyg_quant as pq
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, os.path.dirname(HERE))
    import pyg_quant as pq
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch_geometric.nn import GCNConv, GINConv  # noqa: E402


def make_model(kind: str, features: int, classes: int, bits: Optional[int] = None) -> Net:
    """PyG's GCN / GIN, or with ``bits`` the same model written with pyg_quant's layers at that width (their GIN
    MLPs' Linears quantized too)."""
    if kind == "GCN":
        d = [features, 16, 16, classes]
        conv = GCNConv if bits is None else (lambda a, b: pq.QGCNConv(a, b, bits=bits))
        return Net([conv(d[i], d[i + 1]) for i in range(3)], True)
    d = [features, 64, 64, classes]
    conv = GINConv if bits is None else (lambda nn: pq.QGINConv(nn, bits=bits))
    return Net([conv(gin_mlp(d[i], 64, d[i + 1], i == 2)) for i in range(3)], False)


#: The variant whose model is :func:`make_model`'s with ``bits`` (no QAT config).
Q_LAYERS = "layers"


def variants(args):
    out = [("PyG fp32 edge_index", None), ("PyG fp32 CSR", None)]
    for observer in args.agg_observers:
        out.append((f"QAT {args.bits}-bit agg={observer}", dict(bits=args.bits, agg_observer=observer)))
    if args.cluster_gcn:
        out.append((f"QAT {args.bits}-bit CLUSTER_GCN", dict(bits=args.bits, **pq.qat.CLUSTER_GCN_OBSERVERS)))
    out.append((f"pyg_quant {args.bits}-bit layers", Q_LAYERS))
    return out


def build_model(kind: str, qat, args) -> torch.nn.Module:
    """The model of one variant, in ``train()``, its weights from ``args.seed``."""
    torch.manual_seed(args.seed)
    if qat == Q_LAYERS:
        return make_model(kind, args.features, args.classes, args.bits).train()
    model = make_model(kind, args.features, args.classes)
    return (pq.qat.prepare(model, **qat) if qat is not None else model).train()


#: Operators whose output size depends on the data: on a GPU each waits for the device (a host sync).
SYNCING_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique",
               "aten._unique", "aten.repeat_interleave.Tensor", "aten.item")


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched under it by phase (``phase`` is set from outside), and the host syncs."""

    def __init__(self):
        super().__init__()
        self.phase = None
        self.ops = collections.Counter()  # (phase, op name) -> calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[(self.phase, str(func))] += 1
        return func(*args, **(kwargs or {}))

    def count(self, phase=None) -> int:
        return sum(n for (p, _), n in self.ops.items() if phase is None or p == phase)

    def syncs(self, phase=None) -> int:
        return sum(n for (p, op), n in self.ops.items()
                   if op.startswith(SYNCING_OPS) and (phase is None or p == phase))


class count_tolist:
    """Counts ``Tensor.tolist`` calls (they read the data on the host without dispatching an operator)."""

    def __enter__(self):
        self.calls, self._tolist = 0, torch.Tensor.tolist

        def tolist(tensor, *args, **kwargs):
            self.calls += 1
            return self._tolist(tensor, *args, **kwargs)
        torch.Tensor.tolist = tolist
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist


def count_ops(args):
    """Per variant: the ops of one training step (after ``--warmup`` steps) by phase, and ``--loss-steps`` losses."""
    edge_index, n = cluster_batch(args.small, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(n, args.features, generator=g)
    y = torch.randint(args.classes, (n,), generator=g)
    from torch_geometric.utils import to_torch_csr_tensor
    adj_t = to_torch_csr_tensor(edge_index.flip(0), size=(n, n))
    rows = []
    print(f"pyg_quant from {os.path.dirname(pq.__file__)}")
    for kind in args.models:
        for label, qat in variants(args):
            model = build_model(kind, qat, args)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            adj = adj_t if "CSR" in label else edge_index
            counter, losses = OpCounter(), []
            for i in range(max(args.warmup + 1, args.loss_steps)):
                counting = i == args.warmup
                with (counter if counting else contextlib.nullcontext()), \
                        (count_tolist() if counting else contextlib.nullcontext()) as tolist:
                    counter.phase = "forward"
                    loss = F.cross_entropy(model(x, adj), y)
                    counter.phase = "backward"
                    loss.backward()
                    counter.phase = "optimizer"
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if counting:
                    tolist_calls = tolist.calls
                losses.append(loss.item())
            # Adam's .item() on its step counters reads CPU tensors (not a device sync on a GPU): counted apart.
            row = dict(model=kind, label=label, forward=counter.count("forward"),
                       backward=counter.count("backward"), optimizer=counter.count("optimizer"),
                       total=counter.count(), syncs=counter.syncs("forward") + counter.syncs("backward") + tolist_calls,
                       optimizer_item_calls=counter.syncs("optimizer"),
                       losses=[float.hex(v) for v in losses[:args.loss_steps]],
                       ops=sorted(([p, op, k] for (p, op), k in counter.ops.items()), key=lambda r: -r[2]))
            rows.append(row)
            print(f"{kind} {label:28s} ops/step {row['total']:4d}: forward {row['forward']:4d}  backward "
                  f"{row['backward']:4d}  optimizer {row['optimizer']:4d}  host syncs (fwd+bwd) {row['syncs']}  "
                  f"optimizer .item() {row['optimizer_item_calls']}", flush=True)
            if args.verbose:
                for phase in ("forward", "backward", "optimizer"):
                    top = [(op, k) for p, op, k in row["ops"] if p == phase]
                    print(f"   {phase}: {top}")
    return rows


def check_losses(rows, path) -> bool:
    """Whether every variant's losses equal those saved in ``path`` bit for bit (prints the ones that differ)."""
    with open(path) as f:
        saved = {(r["model"], r["label"]): r["losses"] for r in json.load(f)["rows"]}
    same = True
    for row in rows:
        want = saved.get((row["model"], row["label"]))
        if want is None:
            print(f"{row['model']} {row['label']}: not in {path}")
        elif want[:len(row["losses"])] != row["losses"][:len(want)]:
            same = False
            print(f"{row['model']} {row['label']}: losses differ: {[float.fromhex(v) for v in want]} -> "
                  f"{[float.fromhex(v) for v in row['losses']]}")
    print("losses bit-identical" if same else "LOSSES DIFFER")
    return same


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
            model = build_model(kind, qat, args).to(device)
            adj = adj_t if "CSR" in label else edge_index
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
    p.add_argument("--cluster-gcn", action="store_true", help="also QAT with qat.CLUSTER_GCN_OBSERVERS")
    p.add_argument("--count-ops", action="store_true", help="count ops and host syncs per step instead of timing")
    p.add_argument("--loss-steps", type=int, default=8, help="--count-ops: losses recorded (fixed seeds)")
    p.add_argument("--losses-out", default=None, help="--count-ops: write the counts and losses (JSON)")
    p.add_argument("--check-losses", default=None, help="--count-ops: compare the losses with a --losses-out file")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.count_ops:
        rows = count_ops(args)
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                               argv=sys.argv[1:], rows=rows), f, indent=1)
        if args.check_losses and not check_losses(rows, args.check_losses):
            sys.exit(1)
        return
    rows = run(args)
    if args.out:
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        with open(args.out, "w") as f:
            json.dump(dict(device=name, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           torch=torch.__version__, argv=sys.argv[1:], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
