"""The models (QGTC's settings): GCN 3 layers 100 → 16 → 16 → 47 and GIN 3 layers of hidden 64, as PyG layers and
as pyg_quant's, with the same parameter names so that one ``state_dict`` loads into both."""
import torch
import torch.nn.functional as F
from torch.nn import Linear, ReLU, Sequential
from torch_geometric.nn import GCNConv, GINConv

import pyg_quant as pq


class Net(torch.nn.Module):
    """``convs`` called in turn as ``conv(x, adj)``, with a ReLU between two layers when ``relu_between`` (GCN; GIN
    carries that ReLU inside its ``nn``)."""

    def __init__(self, convs, relu_between: bool):
        super().__init__()
        self.convs = torch.nn.ModuleList(convs)
        self.relu_between = relu_between

    def forward(self, x, adj):
        last = len(self.convs) - 1
        for i, conv in enumerate(self.convs):
            x = conv(x, adj)
            if self.relu_between and i < last:
                x = F.relu(x)
        return x


def gin_mlp(cin: int, hidden: int, cout: int, last: bool) -> Sequential:
    """A GIN layer's ``nn``: Linear(cin, hidden)-ReLU-Linear(hidden, cout), and for every layer but the ``last`` a
    final ReLU, the one between layers (the same function, written here so that ``QGINConv``'s ``out_bits`` can
    requantize after it)."""
    layers = [Linear(cin, hidden), ReLU(), Linear(hidden, cout)]
    return Sequential(*layers) if last else Sequential(*layers, ReLU())


def gcn_dims(args):
    """GCN's widths, input to output: ``[features, gcn_hidden, ..., classes]`` (default ``[100, 16, 16, 47]``)."""
    return [args.features] + [args.gcn_hidden] * (args.layers - 1) + [args.classes]


def gin_dims(args):
    """GIN's widths, input to output: ``[features, gin_hidden, ..., classes]`` (default ``[100, 64, 64, 47]``)."""
    return [args.features] + [args.gin_hidden] * (args.layers - 1) + [args.classes]


def make_pyg(args, kind: str, normalize: bool = True) -> Net:
    """PyG's model ``kind`` (``"GCN"``: ``GCNConv`` layers, ``normalize`` passed on, False for a pre-normalized CSR;
    ``"GIN"``: ``GINConv`` layers) on the CPU in fp32, initialized from torch's global generator."""
    if kind == "GCN":
        d = gcn_dims(args)
        return Net([GCNConv(d[i], d[i + 1], normalize=normalize) for i in range(args.layers)], True)
    d = gin_dims(args)
    return Net([GINConv(gin_mlp(d[i], args.gin_hidden, d[i + 1], i == args.layers - 1))
                for i in range(args.layers)], False)


def make_pq(args, kind: str, bits: int, requantize: bool = True) -> Net:
    """pyg_quant's model ``kind`` at ``bits``: ``QGCNConv`` layers (ReLU on floats between them), or ``QGINConv`` layers
    whose hidden outputs are requantized to ``bits`` (``out_bits``) and whose last output is float (``requantize``
    False: none requantized, :func:`make_pyg`'s GIN with ``QGINConv`` in place of ``GINConv``, floats between the
    layers); on the CPU, :func:`make_pyg`'s shapes and parameter names."""
    if kind == "GCN":
        d = gcn_dims(args)
        return Net([pq.QGCNConv(d[i], d[i + 1], bits=bits) for i in range(args.layers)], True)
    d = gin_dims(args)
    last = args.layers - 1
    return Net([pq.QGINConv(gin_mlp(d[i], args.gin_hidden, d[i + 1], i == last), bits=bits,
                            out_bits=None if i == last or not requantize else bits)
                for i in range(args.layers)], False)
