"""Accuracy of quantization-aware training (pyg_quant.qat): fp32 against 8/4/2/1 bits, stochastic vs nearest.

Protocol (Kipf & Welling's, as in PyG's examples/gcn.py): Cora's public split
(140/500/1000 nodes), row-normalised features, a 2-layer model with 16 hidden
channels, dropout 0.5 on the input and hidden features, Adam (lr 0.01,
weight decay 5e-4 on every parameter), 200 full-batch epochs; the reported
number is the test accuracy at the epoch of best validation accuracy (the first
such epoch), mean ± sample sd over ``--seeds`` seeds (seed s fixes the weights,
the dropout masks and the rounding noise).

Models: GCN (GCNConv 1433→16→7) and GIN (GINConv with MLPs 1433→16→16 and
16→16→7).  Quantized runs come from ``pyg_quant.qat.prepare(model, bits=b,
stochastic=...)`` with its defaults: every layer but the last (TANGO's rule:
``skip_last=True``) quantized, weights per output channel, Linear inputs per
node, aggregated features per channel with a moving average of the MSE-optimal
clipping range (``agg_observer="mse"``); validation and test run the QAT model
in ``eval()`` under ``no_grad``, i.e. on the bit kernels with round-to-nearest
codes.  ``--all-layers`` adds rows with the last layer quantized too.  After
every quantized run, the best-validation weights are loaded, the model is
``convert``-ed and its validation and test accuracies must equal the QAT
model's (checked; the script fails otherwise).

Input dropout on Cora's bag-of-words draws its mask for the non-zero entries
only (:func:`sparse_dropout`; the same distribution as dropout over the whole
matrix, whose dense mask was most of an fp32 epoch).

Cluster-GCN: a synthetic graph with planted classes (``--cluster-nodes`` nodes
in communities of 100, a share ``--p-out`` (0.3) of the edges leaving the
community, class = community mod ``--classes``, features = ``--snr`` (0.1) × a
±1 class signature + N(0, 1) noise: hard enough that fp32 stays well below 100%
and neighbours matter), trained with the GCN above through pyg_quant.loader's
QuantClusterData / QuantClusterLoader (METIS parts, ``--parts`` parts,
``--batch-parts`` per batch, float features, edge_index shipped with each
batch) for ``--cluster-epochs`` epochs; validation / test on the full graph.
Its quantized runs use ``pyg_quant.qat.CLUSTER_GCN_OBSERVERS`` (``"dynamic_mse"``
ranges for Linear inputs per node with the input dropout's zeros kept exact in
training, ranges learned with the weights per output channel (LSQ+), and one
``"dynamic_mse"`` range for all aggregated features; ``--cluster-observers default``
gives prepare's defaults): a static aggregation range learnt on the batches is too
wide for the full graph.
``--only-cluster`` runs this part alone and replaces its rows in an existing
``--json`` (the Cora rows are kept).

Writes a markdown table to stdout, the numbers to ``--json`` and a plot to
``--png`` (needs matplotlib).

Usage (from the repository root)::

    python benchmarks/accuracy.py                      # full table, 10 seeds
    python benchmarks/accuracy.py --seeds 2 --bits 8 2 --no-cluster    # quick look
    python benchmarks/accuracy.py --only-cluster       # Cluster-GCN rows only, merged into --json
"""
import argparse
import copy
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import pyg_quant as pq
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, os.path.dirname(HERE))
    import pyg_quant as pq
from torch.nn import Linear, ReLU, Sequential  # noqa: E402
from torch_geometric.data import Data  # noqa: E402
from torch_geometric.datasets import Planetoid  # noqa: E402
from torch_geometric.nn import GCNConv, GINConv  # noqa: E402
from torch_geometric.transforms import NormalizeFeatures  # noqa: E402

from pyg_quant import qat  # noqa: E402
from pyg_quant.synthetic import planted_class_graph  # noqa: E402

CORA_RAW = "/work/shared/datasets/planetoid/Cora/raw"
TARGETS = {8: 0.5, 4: 1.5, 2: 5.0}  # allowed drop vs fp32, accuracy points


# --- data -------------------------------------------------------------------------------
def load_cora(raw_dir: str) -> Data:
    """Cora from its raw Planetoid files, offline: copied to a temporary ``<root>/Cora/raw``."""
    root = tempfile.mkdtemp(prefix="cora_")
    try:
        shutil.copytree(raw_dir, os.path.join(root, "Cora", "raw"))
        data = Planetoid(root, "Cora", transform=NormalizeFeatures())[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return data


# --- models -----------------------------------------------------------------------------
def dense_dropout(x, p: float, training: bool):
    """Inverted dropout, as F.dropout; drawn with torch.rand, which is ~5x faster than torch's CPU
    bernoulli."""
    if not training or p == 0.0:
        return x
    return x * (torch.rand_like(x) >= p).to(x.dtype) * (1.0 / (1.0 - p))


_NONZERO = {}


def sparse_dropout(x, p: float, training: bool):
    """:func:`dense_dropout` of a mostly-zero input (Cora's bag-of-words, 1.3% non-zero), drawing the mask for the
    non-zero entries only: a zero stays zero whatever its mask, so the result has exactly the distribution of
    dropout over the whole matrix, at a small part of its cost (the dense mask was most of an fp32 epoch).
    The non-zero positions of the last input are kept (with the input, so that its identity stays its own)."""
    if not training or p == 0.0:
        return x
    cached = _NONZERO.get("last")
    if cached is None or cached[0] is not x or cached[1] != x._version:
        index = x.nonzero(as_tuple=True)
        cached = _NONZERO["last"] = (x, x._version, index, x[index])
    _, _, index, values = cached
    keep = (torch.rand(values.shape, device=x.device) >= p).to(x.dtype)
    out = torch.zeros_like(x)
    out[index] = values * keep * (1.0 / (1.0 - p))
    return out


class GCN(torch.nn.Module):
    def __init__(self, in_channels: int, hidden: int, out_channels: int, dropout: float = 0.5,
                 sparse_input: bool = False):
        super().__init__()
        self.dropout = dropout
        self.input_dropout = sparse_dropout if sparse_input else dense_dropout
        self.conv1 = GCNConv(in_channels, hidden, cached=True)
        self.conv2 = GCNConv(hidden, out_channels, cached=True)

    def forward(self, x, edge_index):
        x = self.input_dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, edge_index))
        x = dense_dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


class GIN(torch.nn.Module):
    def __init__(self, in_channels: int, hidden: int, out_channels: int, dropout: float = 0.5,
                 sparse_input: bool = False):
        super().__init__()
        self.dropout = dropout
        self.input_dropout = sparse_dropout if sparse_input else dense_dropout
        self.conv1 = GINConv(Sequential(Linear(in_channels, hidden), ReLU(), Linear(hidden, hidden)))
        self.conv2 = GINConv(Sequential(Linear(hidden, hidden), ReLU(), Linear(hidden, out_channels)))

    def forward(self, x, edge_index):
        x = self.input_dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, edge_index))
        x = dense_dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


MODELS = {"gcn": GCN, "gin": GIN}


def build(kind: str, data: Data, seed: int, bits, stochastic: bool, all_layers: bool, device):
    torch.manual_seed(seed)
    model = MODELS[kind](data.num_features, 16, int(data.y.max()) + 1, sparse_input=True)
    if bits is not None:
        model = qat.prepare(model, bits=bits, stochastic=stochastic, skip_last=not all_layers)
    return model.to(device)


# --- training ---------------------------------------------------------------------------
@torch.no_grad()
def accuracies(model, data, edge_index):
    model.eval()
    pred = model(data.x, edge_index).argmax(-1)
    return [float((pred[m] == data.y[m]).float().mean()) for m in (data.val_mask, data.test_mask)]


def param_groups(model, weight_decay: float) -> list:
    """The optimizer's parameter groups: ``weight_decay`` on the model's weights, none on learned quantization ranges.

    A learned range (LSQ+: ``range_lo``, ``log_step`` of a :class:`~pyg_quant.qat.LearnedObserver`) is fitted to
    the values it quantizes; decay would pull its offset to 0 and its step to 1 (``log_step`` to 0), which is not a
    regulariser of the model.  LSQ and LSQ+ leave their step sizes undecayed as well.
    """
    ranges = {id(p) for m in model.modules() if isinstance(m, qat.LearnedObserver) for p in m.parameters()}
    groups = [{"params": [p for p in model.parameters() if id(p) not in ranges], "weight_decay": weight_decay}]
    if ranges:
        groups.append({"params": [p for p in model.parameters() if id(p) in ranges], "weight_decay": 0.0})
    return groups


def train_full_batch(model, data, epochs: int, lr: float = 0.01, weight_decay: float = 5e-4):
    """200 epochs of full-batch Adam; returns (test acc at best val, best val, state at best val)."""
    optimizer = torch.optim.Adam(param_groups(model, weight_decay), lr=lr)
    best = (-1.0, 0.0, None)
    for _ in range(epochs):
        model.train()
        optimizer.zero_grad()
        out = model(data.x, data.edge_index)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        optimizer.step()
        val, test = accuracies(model, data, data.edge_index)
        if val > best[0]:
            best = (val, test, copy.deepcopy(model.state_dict()))
    return best[1], best[0], best[2]


def check_convert(model, state, data, val_acc: float, test_acc: float) -> None:
    """The converted best-validation model must score exactly what the QAT model scored."""
    model.load_state_dict(state)
    val, test = accuracies(qat.convert(model), data, data.edge_index)
    if (val, test) != (val_acc, test_acc):
        raise AssertionError(f"converted model scores val {val:.4f} / test {test:.4f}, the QAT model "
                             f"{val_acc:.4f} / {test_acc:.4f}")


def train_cluster(model, data, loader, epochs: int, device, lr: float = 0.01, weight_decay: float = 5e-4):
    optimizer = torch.optim.Adam(param_groups(model, weight_decay), lr=lr)
    full = data.to(device)
    best = (-1.0, 0.0, None)
    for _ in range(epochs):
        model.train()
        for batch in loader:
            batch = batch.to(device)
            mask = batch.train_mask
            if not bool(mask.any()):
                continue
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)
            F.cross_entropy(out[mask], batch.y[mask]).backward()
            optimizer.step()
        val, test = accuracies(model, full, full.edge_index)
        if val > best[0]:
            best = (val, test, copy.deepcopy(model.state_dict()))
    return best[1], best[0], best[2]


# --- report -----------------------------------------------------------------------------
def summary(values):
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return 100 * mean, 100 * sd


def label(bits, stochastic, all_layers=False):
    if bits is None:
        return "fp32"
    return f"{bits}-bit {'stochastic' if stochastic else 'nearest'}{' (all layers)' if all_layers else ''}"


def table(rows, fp32) -> str:
    lines = ["| model | setting | test acc % (mean ± sd) | drop vs fp32 (pt) | target | met | seeds | s/run |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        mean, sd = summary(row["test"])
        base = summary(fp32[row["model"]]["test"])[0]
        drop = base - mean
        target = TARGETS.get(row["bits"]) if row["bits"] is not None and not row["all_layers"] else None
        met = "" if target is None else ("yes" if drop <= target else "no")
        lines.append(f"| {row['model']} | {label(row['bits'], row['stochastic'], row['all_layers'])} | "
                     f"{mean:.2f} ± {sd:.2f} | {'' if row['bits'] is None else f'{drop:+.2f}'} | "
                     f"{'' if target is None else f'≤ {target}'} | {met} | {len(row['test'])} | "
                     f"{row['seconds'] / len(row['test']):.1f} |")
    return "\n".join(lines)


def plot(rows, fp32, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return False
    models = list(dict.fromkeys(row["model"] for row in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        base_mean, base_sd = summary(fp32[model]["test"])
        ax.axhspan(base_mean - base_sd, base_mean + base_sd, color="0.85")
        ax.axhline(base_mean, color="k", lw=1, label="fp32")
        for stochastic, all_layers, style in ((True, False, "o-"), (False, False, "s--"), (True, True, "^:"),
                                              (False, True, "v:")):
            points = [r for r in rows if r["model"] == model and r["bits"] is not None
                      and r["stochastic"] == stochastic and r["all_layers"] == all_layers]
            if not points:
                continue
            points.sort(key=lambda r: r["bits"])
            stats = [summary(r["test"]) for r in points]
            ax.errorbar([r["bits"] for r in points], [s[0] for s in stats], yerr=[s[1] for s in stats],
                        fmt=style, capsize=3, label=label("b", stochastic, all_layers).replace("b-bit ", ""))
        bits = sorted(TARGETS)
        ax.plot(bits, [base_mean - TARGETS[b] for b in bits], "r_", ms=14, mew=2, label="target (fp32 − allowed drop)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_xlim(0.8, 10)
        ax.set_xlabel("bits (weights and activations)")
        ax.set_ylabel("test accuracy %")
        ax.set_title(model)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("pyg_quant.qat: accuracy vs bit width (mean ± sd over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def replot(path: str, png: str) -> None:
    with open(path) as f:
        saved = json.load(f)
    rows = saved["rows"]
    fp32 = {row["model"]: row for row in rows if row["bits"] is None}
    print(table(rows, fp32))
    if png and plot(rows, fp32, png):
        print(f"plot: {png}")


# --- main -------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4, 2, 1])
    parser.add_argument("--models", nargs="+", default=["gcn", "gin"], choices=sorted(MODELS))
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--rounding", nargs="+", default=["stochastic", "nearest"],
                        choices=["stochastic", "nearest"])
    parser.add_argument("--all-layers", action="store_true", help="also quantize the last layer (extra rows)")
    parser.add_argument("--no-cluster", action="store_true", help="skip the Cluster-GCN part")
    parser.add_argument("--only-cluster", action="store_true",
                        help="run only the Cluster-GCN part; its rows replace those of an existing --json")
    parser.add_argument("--cluster-observers", choices=["cluster", "default"], default="cluster",
                        help="Cluster-GCN quantizers: qat.CLUSTER_GCN_OBSERVERS (default) or prepare's defaults")
    parser.add_argument("--cluster-seeds", type=int, default=None, help="default: --seeds")
    parser.add_argument("--cluster-nodes", type=int, default=20000)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--parts", type=int, default=40)
    parser.add_argument("--batch-parts", type=int, default=4)
    parser.add_argument("--cluster-epochs", type=int, default=20)
    parser.add_argument("--cluster-bits", type=int, nargs="+", default=None, help="default: --bits")
    parser.add_argument("--snr", type=float, default=0.1, help="planted graph: feature signal-to-noise ratio")
    parser.add_argument("--p-out", type=float, default=0.3, help="planted graph: share of edges leaving a community")
    parser.add_argument("--cora-raw", default=CORA_RAW)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="no training: print the table of a JSON this script wrote and redraw --png from it")
    parser.add_argument("--json", default=os.path.join(HERE, "accuracy.json"))
    parser.add_argument("--png", default=os.path.join(HERE, "accuracy.png"))
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.replot, args.png)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.only_cluster and args.no_cluster:
        parser.error("--only-cluster and --no-cluster exclude each other")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    settings = [(None, True)] + [(b, r == "stochastic") for b in args.bits for r in args.rounding]
    started = time.perf_counter()
    rows, fp32 = [], {}

    cora = None if args.only_cluster else load_cora(args.cora_raw).to(device)
    for kind in ([] if args.only_cluster else args.models):
        layer_options = [False] + ([True] if args.all_layers else [])
        for bits, stochastic in settings:
            for all_layers in layer_options:
                if bits is None and all_layers:
                    continue
                row = {"model": f"Cora {kind.upper()}", "bits": bits, "stochastic": stochastic,
                       "all_layers": all_layers, "test": [], "val": []}
                t0 = time.perf_counter()
                for seed in range(args.seeds):
                    model = build(kind, cora, seed, bits, stochastic, all_layers, device)
                    test, val, state = train_full_batch(model, cora, args.epochs)
                    if bits is not None:
                        check_convert(model, state, cora, val, test)
                    row["test"].append(test)
                    row["val"].append(val)
                row["seconds"] = time.perf_counter() - t0
                rows.append(row)
                if bits is None:
                    fp32[row["model"]] = row
                print(f"[{time.perf_counter() - started:6.0f}s] {row['model']} {label(bits, stochastic, all_layers)}: "
                      f"{summary(row['test'])[0]:.2f} ± {summary(row['test'])[1]:.2f}", file=sys.stderr, flush=True)

    cluster_note = None
    if not args.no_cluster:
        from pyg_quant.loader import QuantClusterData, QuantClusterLoader

        graph = planted_class_graph(args.cluster_nodes, args.classes, num_features=64, community=100, degree=10,
                                    p_out=args.p_out, snr=args.snr)
        cache = tempfile.mkdtemp(prefix="qat_cluster_")
        try:
            cluster_data = QuantClusterData(graph, args.parts, save_dir=cache, log=False)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        loader = QuantClusterLoader(cluster_data, batch_size=args.batch_parts, shuffle=True, bits=None,
                                    self_loops=1, return_edge_index=True)
        cluster_note = (f"{args.cluster_nodes} nodes, {graph.num_edges} directed edges, {args.classes} classes, "
                        f"SNR {args.snr}, {args.p_out:.0%} of edges leaving their community, "
                        f"{args.parts} METIS parts, {args.batch_parts} parts a batch, {args.cluster_epochs} epochs")
        cluster_bits = args.cluster_bits or args.bits
        observers = qat.CLUSTER_GCN_OBSERVERS if args.cluster_observers == "cluster" else {}
        cluster_note += f", observers {observers or 'prepare defaults'}"
        cluster_settings = [(None, True)] + [(b, r == "stochastic") for b in cluster_bits for r in args.rounding]
        for bits, stochastic in cluster_settings:
            row = {"model": "Cluster-GCN planted", "bits": bits, "stochastic": stochastic, "all_layers": False,
                   "test": [], "val": []}
            t0 = time.perf_counter()
            for seed in range(args.cluster_seeds or args.seeds):
                torch.manual_seed(seed)
                model = GCN(graph.num_features, 16, args.classes)
                for conv in (model.conv1, model.conv2):
                    conv.cached = False  # the graph changes from batch to batch
                if bits is not None:
                    model = qat.prepare(model, bits=bits, stochastic=stochastic, **observers)
                model = model.to(device)
                test, val, state = train_cluster(model, graph, loader, args.cluster_epochs, device)
                if bits is not None:
                    check_convert(model, state, graph.to(device), val, test)
                row["test"].append(test)
                row["val"].append(val)
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            if bits is None:
                fp32[row["model"]] = row
            print(f"[{time.perf_counter() - started:6.0f}s] {row['model']} {label(bits, stochastic)}: "
                  f"{summary(row['test'])[0]:.2f} ± {summary(row['test'])[1]:.2f}", file=sys.stderr, flush=True)

    total = time.perf_counter() - started
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "machine": platform.platform(), "torch": torch.__version__, "device": str(device),
            "threads": torch.get_num_threads(), "seconds": total, "cluster": cluster_note,
            "loadavg_at_end": os.getloadavg()}
    if args.only_cluster and args.json and os.path.exists(args.json):
        # Keep the other rows (and the metadata of the run that made them); this run's go under "cluster_run".
        with open(args.json) as f:
            saved = json.load(f)
        ours = {row["model"] for row in rows}
        rows = [row for row in saved["rows"] if row["model"] not in ours] + rows
        fp32 = {row["model"]: row for row in rows if row["bits"] is None}
        meta = {**{k: v for k, v in saved.items() if k != "rows"}, "cluster": cluster_note, "cluster_run": meta}
    print(table(rows, fp32))
    if cluster_note:
        print(f"\nCluster-GCN graph: {cluster_note}.")
    print(f"\nTotal {total:.0f} s on {device} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"seeds {args.seeds}, epochs {args.epochs}.")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    if args.png and plot(rows, fp32, args.png):
        print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
