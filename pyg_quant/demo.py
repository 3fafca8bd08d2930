"""pyg_quant's main job: a GCN and its 4-bit QGCN, trained, converted and compared.

Run with ``python -m pyg_quant.demo`` (``--help`` for the options). It

1. loads Cora (Planetoid's public split) when a Planetoid root is given with
   ``--root`` or found (``$PYG_QUANT_DATA``, or ``../shared/datasets/planetoid``
   next to the repository or the working directory), else builds a synthetic
   planted-class graph (:func:`planted_class_graph`): no network needed;
2. trains a 2-layer GCN (``torch_geometric.nn.GCNConv``) in fp32;
3. trains the same model, from the same initial weights, made 4-bit by
   :func:`pyg_quant.qat.prepare` (quantization-aware training, stochastic
   rounding; the last layer stays fp32 as a ``QGCNConv(bits=None)``, so the
   whole model reads the graph as a :class:`pyg_quant.BitAdjacency`), then
   :func:`pyg_quant.qat.convert`-s it to the bit kernels;
4. prints accuracy, model bytes, batch bytes and inference time of both, and
   checks the bit kernels against float64 on the side (within their epilogues' bound).

It uses the GPU when there is one (``--device`` to choose). The helpers here
(data, model, training loop, byte counts) are shared by ``examples/`` and the
notebook.
"""
import argparse
import copy
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch_geometric.data import Data

import pyg_quant as pq
from pyg_quant import qat
from pyg_quant.ops.reference import EPILOGUE_BOUND
from pyg_quant.quantization.quantize import exact_values, term_magnitudes
from pyg_quant.synthetic import planted_class_graph  # noqa: F401  (re-exported: examples use demo's helpers)

CORA_RAW_FILES = tuple(f"ind.cora.{name}" for name in ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index"))
#: How to get scipy, which Planetoid needs to read Cora's raw files (pyg_quant's ``data`` extra installs it).
SCIPY_HINT = "pip install scipy, or pip install -e \".[data]\" in a checkout"


# --- data ----------------------------------------------------------------------------------
def _has_cora(root: str) -> bool:
    raw = os.path.join(root, "Cora", "raw")
    return all(os.path.isfile(os.path.join(raw, name)) for name in CORA_RAW_FILES)


def find_planetoid_root(root: Optional[str] = None) -> Optional[str]:
    """A Planetoid root holding Cora's raw files: ``root`` if given (and holding them), else
    ``$PYG_QUANT_DATA``, else ``../shared/datasets/planetoid`` beside the repository or the working
    directory. None when there is none."""
    if root is not None:
        return root if _has_cora(root) else None
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, for a checkout
    candidates = [os.environ.get("PYG_QUANT_DATA"),
                  os.path.join(here, "..", "shared", "datasets", "planetoid"),
                  os.path.join(os.getcwd(), "..", "shared", "datasets", "planetoid")]
    for candidate in candidates:
        if candidate and _has_cora(candidate):
            return os.path.normpath(candidate)
    return None


def load_cora(root: str) -> Data:
    """Cora (public split, row-normalised features) from the raw files under ``root/Cora/raw``.

    The raw files are processed in a temporary copy, so ``root`` may be read-only or shared.
    """
    from torch_geometric.datasets import Planetoid
    from torch_geometric.transforms import NormalizeFeatures

    tmp = tempfile.mkdtemp(prefix="pyg_quant_cora_")
    try:
        shutil.copytree(os.path.join(root, "Cora", "raw"), os.path.join(tmp, "Cora", "raw"))
        stderr, sys.stderr = sys.stderr, open(os.devnull, "w")  # Planetoid's "Processing..." chatter
        try:
            dataset = Planetoid(tmp, "Cora", transform=NormalizeFeatures())
        finally:
            sys.stderr.close()
            sys.stderr = stderr
        return dataset[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_data(root: Optional[str] = None, synthetic: bool = False, **synthetic_kwargs) -> Tuple[Data, str]:
    """``(data, description)``: Cora when a Planetoid root is given or found, else the planted-class graph.

    A ``root`` that is given but holds no Cora raw files is an error (FileNotFoundError; no download is
    tried), and so is one given without scipy installed (ImportError naming scipy); a root that is only
    found falls back to the planted-class graph then, and the description says why.
    """
    if not synthetic:
        found = find_planetoid_root(root)
        if root is not None and found is None:
            raise FileNotFoundError(f"no Cora raw files under {os.path.join(root, 'Cora', 'raw')} "
                                    f"(expected {', '.join(CORA_RAW_FILES)})")
        if found is not None:
            if _has_scipy():
                return load_cora(found), f"Cora (Planetoid raw files in {found})"
            missing = f"Cora found at {found} but scipy, which reads it, is not installed ({SCIPY_HINT})"
            if root is not None:
                raise ImportError(missing, name="scipy")
            return planted_class_graph(**synthetic_kwargs), f"{missing}: using the synthetic planted-class graph"
    data = planted_class_graph(**synthetic_kwargs)
    return data, "synthetic planted-class graph (no Planetoid root given or found)"


def _has_scipy() -> bool:
    try:
        import scipy  # noqa: F401  (Planetoid unpickles scipy sparse matrices)
    except ImportError:
        return False
    return True


def describe(data: Data) -> str:
    masks = "/".join(str(int(getattr(data, m).sum())) for m in ("train_mask", "val_mask", "test_mask"))
    return (f"{data.num_nodes:,} nodes, {data.num_edges:,} edges, {data.num_features} features, "
            f"{int(data.y.max()) + 1} classes, train/val/test {masks}")


# --- model and training --------------------------------------------------------------------------
def dropout(x, p: float, training: bool):
    """Inverted dropout like ``F.dropout``, identity outside training (so ``x`` may be a BitTensor then).

    The mask comes from ``torch.rand``: several times faster than torch's CPU ``bernoulli`` on a
    dense ``[N, F]`` input such as Cora's 2708 x 1433 features."""
    if not training or p == 0.0:
        return x
    return x * (torch.rand_like(x) >= p).to(x.dtype) * (1.0 / (1.0 - p))


class GCN(torch.nn.Module):
    r"""Kipf & Welling's 2-layer GCN; ``conv`` is :class:`torch_geometric.nn.GCNConv` or :class:`pyg_quant.QGCNConv`.

    ``forward(x, graph)`` takes any adjacency the convolution reads (``edge_index``, a sparse
    tensor, or a :class:`pyg_quant.BitAdjacency` for ``QGCNConv``) and ``x`` as a Tensor or
    (for ``QGCNConv``) a :class:`pyg_quant.BitTensor`. Dropout runs in training only.
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, conv: Optional[Callable] = None,
                 dropout: float = 0.5, cached: bool = False, **conv_kwargs):
        super().__init__()
        if conv is None:
            from torch_geometric.nn import GCNConv as conv
        self.dropout = dropout
        self.conv1 = conv(in_channels, hidden_channels, cached=cached, **conv_kwargs)
        self.conv2 = conv(hidden_channels, out_channels, cached=cached, **conv_kwargs)

    def forward(self, x, graph):
        x = dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, graph))
        x = dropout(x, self.dropout, self.training)
        return self.conv2(x, graph)


@torch.no_grad()
def accuracies(model: torch.nn.Module, x, graph, y: torch.Tensor, *masks: torch.Tensor):
    """Accuracy of ``model(x, graph)`` on each mask (the model is put in ``eval()``)."""
    model.eval()
    pred = model(x, graph).argmax(-1)
    return [float((pred[mask] == y[mask]).float().mean()) if bool(mask.any()) else float("nan") for mask in masks]


def train(model: torch.nn.Module, data: Data, graph, epochs: int = 200, lr: float = 0.01,
          weight_decay: float = 5e-4, progress: bool = True, desc: str = "train") -> Dict[str, float]:
    r"""Full-batch training with Adam on ``data.train_mask``; keeps the weights of the best validation epoch.

    Returns ``{"val": best validation accuracy, "test": test accuracy at that epoch, "epoch",
    "seconds"}``; ``model`` ends in ``eval()`` holding the best weights.
    """
    from tqdm.auto import tqdm

    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    best = {"val": -1.0, "test": 0.0, "epoch": 0}
    state = None
    start = time.perf_counter()
    bar = tqdm(range(1, epochs + 1), desc=desc, disable=not progress, leave=True, unit="epoch",
               file=sys.stdout, dynamic_ncols=True, mininterval=0.5)
    for epoch in bar:
        model.train()
        optimizer.zero_grad()
        out = model(data.x, graph)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        loss.backward()
        optimizer.step()
        val, test = accuracies(model, data.x, graph, data.y, data.val_mask, data.test_mask)
        if val > best["val"]:
            best = {"val": val, "test": test, "epoch": epoch}
            state = copy.deepcopy(model.state_dict())
        bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val:.3f}", best_val=f"{best['val']:.3f}", refresh=False)
    bar.close()
    if state is not None:
        model.load_state_dict(state)
    model.eval()
    best["seconds"] = time.perf_counter() - start
    return best


# --- sizes and speed -----------------------------------------------------------------------------
def model_nbytes(model: torch.nn.Module) -> int:
    r"""Bytes a model needs for inference: its parameters and buffers, with the weight of every
    quantized linear layer counted as its packed bit planes (padding and ranges included) instead
    of its fp32 master copy."""
    from pyg_quant.nn import QuantLinear

    total, packed = 0, set()
    for module in model.modules():
        if isinstance(module, qat.QATLinear) and module.weight_quant is not None:
            total += module.packed_weight().nbytes
            packed.add(id(module.weight))
        elif isinstance(module, QuantLinear) and not isinstance(module, qat.QATLinear) \
                and module.weight_bits is not None:
            total += module.quantized_weight().nbytes
            packed.add(id(module.weight))
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in packed:
            total += tensor.numel() * tensor.element_size()
    return total


def float_batch_nbytes(data: Data) -> int:
    """Bytes of PyG's batch: float32 ``x`` and int64 ``edge_index``."""
    return data.num_nodes * data.num_features * 4 + data.edge_index.numel() * 8


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    """Median wall time of ``fn()`` in milliseconds (after two warm-up calls; synchronised on CUDA)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def kernel_check(device: torch.device, bits: int, seed: int = 0) -> Dict[str, float]:
    """Errors of ``bitmm`` and ``bit_spmm`` against the float64 products of the dequantized operands, norm-wise over
    the magnitudes of the terms their float32 epilogues add (at most ``EPILOGUE_BOUND``)."""
    gen = torch.Generator().manual_seed(seed)
    a = pq.to_bit(torch.randn(1000, 300, generator=gen).to(device), bits, dim=1)
    w = pq.to_bit(torch.randn(300, 64, generator=gen).to(device), bits, dim=0, layout="col")
    ref = exact_values(a) @ exact_values(w)
    terms = term_magnitudes(a) @ term_magnitudes(w)
    bitmm_error = float((pq.bitmm(a, w).double() - ref).norm() / terms.norm())
    edge_index = torch.randint(1000, (2, 20000), generator=gen).to(device)
    x = pq.to_bit(torch.randn(1000, 64, generator=gen).to(device), bits, dim=0, layout="col")
    adj = pq.BitAdjacency.from_edge_index(edge_index, 1000, self_loops=1)
    dense = torch.zeros(1000, 1000, dtype=torch.float64, device=device)
    dense.index_put_((edge_index[1], edge_index[0]), torch.ones(edge_index.size(1), dtype=torch.float64,
                                                                device=device), accumulate=True)
    dense.diagonal().masked_fill_(dense.diagonal() == 0, 1.0)  # A + I where there is no self-loop
    ref = dense @ exact_values(x)
    terms = dense @ term_magnitudes(x)
    spmm_error = float((pq.bit_spmm(adj, x).double() - ref).norm() / terms.norm())
    return {"bitmm": bitmm_error, "bit_spmm": spmm_error}


# --- main ----------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyg_quant.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None,
                        help="Planetoid root holding Cora/raw (default: $PYG_QUANT_DATA or ../shared/datasets/"
                             "planetoid if found, else the synthetic graph)")
    parser.add_argument("--synthetic", action="store_true", help="use the planted-class graph even if Cora is found")
    parser.add_argument("--nodes", type=int, default=3000, help="nodes of the synthetic graph")
    parser.add_argument("--bits", type=int, default=4, help="bits of the quantized model (1..8)")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=20, help="timed inference runs (the median is shown)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: the demo's graphs are small, one thread runs them about as "
                             "fast as two and is not slowed down by other processes' load; 0 keeps torch's default)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-kernel-check", action="store_true", help="skip the float64 check of the kernels")
    return parser


def main(argv=None) -> Dict[str, object]:
    """Runs the demo; returns the numbers it printed (``"fp32"`` and ``"quant"`` dicts, ...).

    A ``--root`` without Cora's raw files, or given while scipy is not installed, exits with one error line
    (SystemExit), as a bad argument does."""
    args = _parser().parse_args(argv)
    device, bits, progress = torch.device(args.device), args.bits, not args.no_progress
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, device, bits, progress)
    finally:
        torch.set_num_threads(threads)  # main() may be called from other code (the tests)


def _run(args, device: torch.device, bits: int, progress: bool) -> Dict[str, object]:
    backends = pq.backends()
    threads = torch.get_num_threads()
    print(f"pyg_quant {pq.__version__} | torch {torch.__version__} | device {device} ({threads} CPU "
          f"thread{'s' if threads != 1 else ''}) | compiled kernels: cpu={'yes' if backends['cpu'] else 'no'}, "
          f"cuda={'yes' if backends['cuda'] else 'no'}")

    try:
        data, source = load_data(args.root, args.synthetic, num_nodes=args.nodes, seed=args.seed)
    except (FileNotFoundError, ImportError) as error:
        if isinstance(error, ImportError) and error.name != "scipy":
            raise
        # A --root without Cora or without scipy is a usage error: one line, no traceback.
        raise SystemExit(f"python -m pyg_quant.demo: error: {error}") from None
    print(f"\n[1/4] data: {source}\n      {describe(data)}")
    data = data.to(device)
    num_classes = int(data.y.max()) + 1

    torch.manual_seed(args.seed)
    gcn = GCN(data.num_features, args.hidden, num_classes, cached=True).to(device)
    # The quantized model is a copy of the same GCN, made before training (the same initial weights):
    # prepare() makes every layer but the last one `bits` wide and keeps the last one fp32 as a
    # QGCNConv(bits=None), which, like the QAT layers, also reads a BitAdjacency.
    qgcn = qat.prepare(gcn, bits=bits, seed=args.seed)
    print(f"\n[2/4] fp32 GCN (torch_geometric.nn.GCNConv {data.num_features}→{args.hidden}→{num_classes}), "
          f"{args.epochs} epochs")
    fp32 = train(gcn, data, data.edge_index, args.epochs, progress=progress, desc="fp32 GCN")

    # The graph as the quantized model reads it: A + I on 16 x 256 bit tiles, packed once.
    adj = pq.BitAdjacency.from_edge_index(data.edge_index, data.num_nodes, self_loops=1)
    print(f"\n[3/4] {bits}-bit QGCN: qat.prepare(gcn, bits={bits}) (stochastic rounding, last layer fp32), "
          f"{args.epochs} epochs of QAT, then qat.convert")
    quant = train(qgcn, data, adj, args.epochs, progress=progress, desc=f"{bits}-bit QGCN (QAT)")
    inference = qat.convert(qgcn)

    # What each model is fed: PyG's float32 x + int64 edge_index, or bit planes.
    xq = pq.to_bit(data.x, bits, dim=1, layout="row")  # per node: what the first layer's X·W reads
    with torch.no_grad():
        pred_float = inference(data.x, adj).argmax(-1)
        pred_packed = inference(xq, adj).argmax(-1)
    mask = data.test_mask
    fp32["test"] = accuracies(gcn, data.x, data.edge_index, data.y, mask)[0]
    quant["test"] = float((pred_packed[mask] == data.y[mask]).float().mean())
    quant["same_predictions"] = bool(torch.equal(pred_float, pred_packed))
    fp32["model_bytes"], quant["model_bytes"] = model_nbytes(gcn), model_nbytes(inference)
    fp32["batch_bytes"], quant["batch_bytes"] = float_batch_nbytes(data), xq.nbytes + adj.nbytes
    with torch.no_grad():
        fp32["ms"] = median_ms(lambda: gcn(data.x, data.edge_index), device, args.repeats)
        quant["ms"] = median_ms(lambda: inference(data.x, adj), device, args.repeats)
        quant["ms_packed"] = median_ms(lambda: inference(xq, adj), device, args.repeats)

    print(f"\n[4/4] results on the test nodes ({int(mask.sum())}), weights of the best validation epoch")
    rows = [
        ("test accuracy", f"{100 * fp32['test']:.1f} %", f"{100 * quant['test']:.1f} %",
         f"{100 * (quant['test'] - fp32['test']):+.1f} pt"),
        ("model bytes", f"{fp32['model_bytes']:,}", f"{quant['model_bytes']:,}",
         f"{fp32['model_bytes'] / quant['model_bytes']:.1f}x smaller"),
        ("batch bytes (x + graph)", f"{fp32['batch_bytes']:,}", f"{quant['batch_bytes']:,}",
         f"{fp32['batch_bytes'] / quant['batch_bytes']:.1f}x smaller"),
        ("inference, whole graph", f"{fp32['ms']:.2f} ms", f"{quant['ms']:.2f} ms",
         f"{fp32['ms'] / quant['ms']:.2f}x speed"),
        ("  from the packed x", "", f"{quant['ms_packed']:.2f} ms", f"{fp32['ms'] / quant['ms_packed']:.2f}x speed"),
        ("training time", f"{fp32['seconds']:.1f} s", f"{quant['seconds']:.1f} s", ""),
    ]
    header = ("", "fp32 GCN", f"{bits}-bit QGCN", "")
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(4)]
    for row in [header] + rows:
        print("      " + "  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                                   for i, (cell, width) in enumerate(zip(row, widths))).rstrip())
    print(f"      fp32 reads float32 x and int64 edge_index. The {bits}-bit model stores the weights of its quantized\n"
          f"      layers as bit planes (padded to 64 x 256 bits; the last layer stays fp32) and reads A + I as bit\n"
          f"      tiles, and x either as float32 (quantizing it per node itself) or as {bits}-bit planes per node\n"
          f"      (the batch bytes above). Same predictions from both: {'yes' if quant['same_predictions'] else 'NO'}.")

    result: Dict[str, object] = {"data": source, "device": str(device), "bits": bits, "fp32": fp32, "quant": quant}
    if not args.no_kernel_check:
        errors = kernel_check(device, bits, args.seed)
        print(f"\n      kernels vs float64 products of the dequantized operands (error over the terms' "
              f"magnitudes): bitmm {errors['bitmm']:.1e}, bit_spmm {errors['bit_spmm']:.1e} "
              f"(bound {EPILOGUE_BOUND:.1e})")
        result["kernel_errors"] = errors
        if not all(math.isfinite(e) and e <= EPILOGUE_BOUND for e in errors.values()):
            raise RuntimeError(f"the bit kernels disagree with float64: {errors}")
    return result


if __name__ == "__main__":
    main()
