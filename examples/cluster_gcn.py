"""Cluster-GCN with a quantized GCN: METIS parts -> bit-packed batches -> QAT -> inference on the bit kernels.

    python examples/cluster_gcn.py                      # synthetic planted-class graph, 4 bits
    python examples/cluster_gcn.py --root ../shared/datasets/planetoid   # Cora
    python examples/cluster_gcn.py --bits 2 --parts 80 --batch-size 8 --baseline
    python examples/cluster_gcn.py --small              # a few seconds (what the tests run)

1. ``pyg_quant.loader.QuantClusterData`` partitions the graph with METIS (pymetis);
2. ``pyg_quant.loader.QuantClusterLoader`` joins ``--batch-size`` parts per batch and ships
   each batch as one buffer: the adjacency ``A + I`` as bit tiles (``batch.adj``) and the
   features as ``--bits``-bit planes (``batch.x``), quantized once for the whole graph (on the
   CPU each node over its own range, ``feature_dim=1``: the codes the first layer's per-node
   input quantizer would make, which it multiplies as they are; on a GPU one range per feature,
   which its fused kernel decodes as it loads them);
3. the model is written with ``pyg_quant.QGCNConv`` (``bits=None`` is PyG's GCNConv exactly,
   and it reads the loader's ``BitAdjacency``, which the fp32 ``--baseline`` model needs);
   ``pyg_quant.qat.prepare`` makes it ``--bits`` wide for quantization-aware training (the
   last layer stays fp32; for a model of PyG ``GCNConv`` layers, as a ``QGCNConv(bits=None)``
   too, so a plain PyG model would do for the QAT run alone);
4. ``pyg_quant.qat.convert`` freezes it, and inference runs on the bit kernels, batch by batch.

Runs on the GPU when there is one (``--device``). ``examples/gin.py`` reuses this file's
loop with a GIN.
"""
import argparse
import os
import sys
import statistics
import tempfile
import time
from typing import Callable, Dict

import torch
import torch.nn.functional as F

try:
    import pyg_quant as pq
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import pyg_quant as pq
from pyg_quant import qat  # noqa: E402
from pyg_quant.demo import describe, dropout, load_data  # noqa: E402
from pyg_quant.loader import QuantClusterData, QuantClusterLoader  # noqa: E402


class GCN(torch.nn.Module):
    """GCN layers written with QGCNConv: ``forward(x, adj)`` reads a BitTensor ``x`` and a BitAdjacency ``adj``.

    The one-line change from a PyG model is ``GCNConv(...)`` -> ``QGCNConv(...)``; with ``bits=None``
    (the default here) the layer is GCNConv, and ``qat.prepare`` picks the widths.
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 2,
                 dropout: float = 0.5):
        super().__init__()
        sizes = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        self.convs = torch.nn.ModuleList(pq.QGCNConv(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.dropout = dropout

    def forward(self, x, adj):
        for i, conv in enumerate(self.convs):
            x = dropout(x, self.dropout, self.training and i > 0)  # x may still be a BitTensor at layer 0
            x = conv(x, adj)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x


def pyg_batch_nbytes(batch) -> int:
    """Bytes the same batch takes as PyG ships it: float32 ``x``, int64 ``edge_index``, the other fields alike."""
    x, adj = batch.x, batch.adj
    num_nodes, num_features = (x.rows, x.cols) if isinstance(x, pq.BitTensor) else x.shape
    # adj.nnz counts the distinct edges; the self-loop term lives in adj.diag (PyG's GCNConv adds it itself).
    return batch.nbytes - x.nbytes - adj.nbytes + num_nodes * num_features * 4 + 2 * adj.nnz * 8


def train_epoch(model, loader, optimizer, device) -> Dict[str, float]:
    """One pass over the loader; batches without training nodes are skipped (Cluster-GCN's parts may hold none)."""
    model.train()
    total_loss, total_nodes, skipped = 0.0, 0, 0
    for batch in loader:
        batch = batch.to(device)
        mask = batch.train_mask
        n = int(mask.sum())
        if n == 0:
            skipped += 1
            continue
        optimizer.zero_grad()
        out = model(batch.x, batch.adj)
        loss = F.cross_entropy(out[mask], batch.y[mask])
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * n
        total_nodes += n
    return {"loss": total_loss / max(total_nodes, 1), "skipped": skipped}


@torch.no_grad()
def evaluate(model, loader, device, timing: bool = False, passes: int = 3) -> Dict[str, float]:
    """Accuracy on the val/test nodes over all batches (every node is in exactly one), plus bytes and time per batch.

    With ``timing``, the batches are run ``passes`` times and the time per batch is the median over all of them (on
    a shared machine one pass's mean is noisy, and the first call of a kernel pays its one-time setup)."""
    model.eval()
    correct = {"val": 0, "test": 0}
    count = {"val": 0, "test": 0}
    ours = pyg = batches = 0
    seconds = []
    for repeat in range(passes if timing else 1):
        for batch in loader:
            start = time.perf_counter()
            batch = batch.to(device)
            pred = model(batch.x, batch.adj).argmax(-1)
            if timing and device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
            if repeat:
                continue
            for split in ("val", "test"):
                mask = batch[f"{split}_mask"]
                correct[split] += int((pred[mask] == batch.y[mask]).sum())
                count[split] += int(mask.sum())
            ours += batch.nbytes
            pyg += pyg_batch_nbytes(batch)
            batches += 1
    return {"val": correct["val"] / max(count["val"], 1), "test": correct["test"] / max(count["test"], 1),
            "batch_bytes": ours / batches, "pyg_batch_bytes": pyg / batches,
            "ms_per_batch": 1e3 * statistics.median(seconds)}


def fit(model, train_loader, eval_loader, epochs: int, device, lr: float, weight_decay: float,
        progress: bool, desc: str) -> Dict[str, float]:
    """Trains, keeping the weights of the best validation epoch (evaluated every epoch on the bit kernels)."""
    from tqdm.auto import tqdm

    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    best, state, skipped = {"val": -1.0}, None, 0
    bar = tqdm(range(1, epochs + 1), desc=desc, unit="epoch", disable=not progress, file=sys.stdout,
               mininterval=0.5, dynamic_ncols=True)
    for epoch in bar:
        stats = train_epoch(model, train_loader, optimizer, device)
        skipped += stats["skipped"]
        result = evaluate(model, eval_loader, device)
        if result["val"] > best["val"]:
            best = dict(result, epoch=epoch)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        bar.set_postfix(loss=f"{stats['loss']:.3f}", val=f"{result['val']:.3f}", refresh=False)
    bar.close()
    if state is not None:
        model.load_state_dict(state)
    best["skipped_batches"] = skipped
    return best


def parser(description: str = __doc__.splitlines()[0], **defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--root", default=None, help="Planetoid root holding Cora/raw (default: found, else synthetic)")
    p.add_argument("--synthetic", action="store_true", help="use the planted-class graph even if Cora is found")
    p.add_argument("--nodes", type=int, default=20000, help="nodes of the synthetic graph")
    p.add_argument("--bits", type=int, default=4, help="bits of weights, features and activations (1..8)")
    p.add_argument("--parts", type=int, default=40, help="METIS parts")
    p.add_argument("--batch-size", type=int, default=4, help="parts per batch")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers building the batches")
    p.add_argument("--cache", default=None, help="directory to cache the METIS partition in (default: none)")
    p.add_argument("--baseline", action="store_true",
                   help="also train the fp32 model on the same batches (float features)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--small", action="store_true",
                   help="quick run (the tests'): defaults of 2,000 synthetic nodes, 8 parts, 2 per batch, "
                        "hidden 32, 15 epochs; options given still apply")
    p.set_defaults(**defaults)
    return p


SMALL = dict(synthetic=True, nodes=2000, parts=8, batch_size=2, hidden=32, epochs=15)


def parse_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``p.parse_args(argv)``, with :data:`SMALL` as the defaults when ``--small`` is given."""
    if "--small" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMALL)
    return p.parse_args(argv)


def run(args, build_model: Callable[[int, int, argparse.Namespace], torch.nn.Module], self_loops: int,
        name: str, feature_dim: int = 0) -> Dict[str, object]:
    """Data -> partition -> loaders -> (fp32 baseline) -> QAT -> convert -> quantized inference; prints and returns.

    ``feature_dim``: the quantized loaders' (see ``QuantClusterLoader``): 1 where the model's first step is a linear
    layer, 0 where it is an aggregation."""
    device, progress = torch.device(args.device), not args.no_progress
    torch.manual_seed(args.seed)
    data, source = load_data(args.root, args.synthetic, num_nodes=args.nodes, seed=args.seed)
    print(f"data: {source}\n      {describe(data)}")

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cluster_data = QuantClusterData(data, args.parts, save_dir=args.cache or tmp, log=progress)
    print(f"METIS: {args.parts} parts in {time.perf_counter() - start:.1f} s")
    loader_kwargs = dict(batch_size=args.batch_size, bits=args.bits, self_loops=self_loops,
                         num_workers=args.workers, pin_memory=device.type == "cuda")
    quant_kwargs = dict(loader_kwargs, feature_dim=feature_dim)
    train_loader = QuantClusterLoader(cluster_data, shuffle=True, **quant_kwargs)
    eval_loader = QuantClusterLoader(cluster_data, shuffle=False, **quant_kwargs)
    num_classes = int(data.y.max()) + 1
    results: Dict[str, object] = {"data": source}

    model = build_model(data.num_features, num_classes, args).to(device)
    if args.baseline:  # the fp32 model, from the same initial weights, on the same batches with float features
        baseline = build_model(data.num_features, num_classes, args).to(device)
        baseline.load_state_dict(model.state_dict())
        float_kwargs = dict(loader_kwargs, bits=None)
        float_eval = QuantClusterLoader(cluster_data, shuffle=False, **float_kwargs)
        best = fit(baseline, QuantClusterLoader(cluster_data, shuffle=True, **float_kwargs), float_eval,
                   args.epochs, device, args.lr, args.weight_decay, progress, f"fp32 {name}")
        results["fp32"] = evaluate(baseline, float_eval, device, timing=True)
        results["fp32"]["best_epoch"] = best["epoch"]

    model = qat.prepare(model, bits=args.bits, seed=args.seed)
    best = fit(model, train_loader, eval_loader, args.epochs, device, args.lr, args.weight_decay, progress,
               f"{args.bits}-bit {name} (QAT)")
    inference = qat.convert(model)
    quant = evaluate(inference, eval_loader, device, timing=True)
    quant.update(best_epoch=best["epoch"], skipped_batches=best["skipped_batches"])
    results["quant"] = quant

    print(f"\n{args.bits}-bit {name} after qat.convert, inference on the bit kernels ({device}):")
    if "fp32" in results:
        fp = results["fp32"]
        print(f"  fp32 baseline       val {100 * fp['val']:.1f} %  test {100 * fp['test']:.1f} %  "
              f"{fp['ms_per_batch']:.1f} ms/batch")
    print(f"  {args.bits}-bit quantized     val {100 * quant['val']:.1f} %  test {100 * quant['test']:.1f} %  "
          f"{quant['ms_per_batch']:.1f} ms/batch (best epoch {quant['best_epoch']})")
    print(f"  bytes per batch     {quant['batch_bytes']:,.0f} (PyG's float32 x + int64 edge_index: "
          f"{quant['pyg_batch_bytes']:,.0f}, {quant['pyg_batch_bytes'] / quant['batch_bytes']:.1f}x more)")
    if quant["skipped_batches"]:
        print(f"  {quant['skipped_batches']} training batches held no training node and were skipped")
    return results


def build_gcn(in_channels: int, num_classes: int, args) -> torch.nn.Module:
    return GCN(in_channels, args.hidden, num_classes, num_layers=args.layers)


def main(argv=None) -> Dict[str, object]:
    args = parse_args(parser(), argv)
    # GCN aggregates over A + I, after the product X·W: on the CPU its one-op eval path multiplies per-node codes as
    # they are (on a GPU that op reads per-feature codes, and per-node ones take the layer's general path)
    feature_dim = 1 if torch.device(args.device).type == "cpu" else 0
    return run(args, build_gcn, self_loops=1, name="GCN", feature_dim=feature_dim)


if __name__ == "__main__":
    main()
