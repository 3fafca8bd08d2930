"""GIN on bit-packed Cluster-GCN batches: QGINConv + QuantClusterLoader + QAT + inference on the bit kernels.

    python examples/gin.py                     # synthetic planted-class graph, 4 bits
    python examples/gin.py --bits 8 --parts 80 --batch-size 8 --baseline
    python examples/gin.py --small             # a few seconds (what the tests run)

The same pipeline as ``examples/cluster_gcn.py`` (whose loop it reuses) with a GIN:
``QGINConv(mlp)`` in place of PyG's ``GINConv(mlp)`` (``bits=None``: exactly GINConv, and it reads
the loader's ``BitAdjacency``), a Linear classifier on top. GIN sums over the neighbours and adds
``(1 + eps)·x`` itself, so the loader packs ``A`` without self-loops (``self_loops=0``), and the
features arrive as per-channel bit planes: the operand ``A·X`` reads. ``qat.prepare`` quantizes
both GIN layers (their MLPs too) and keeps the classifier fp32.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn import Linear, ReLU, Sequential

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_gcn import parse_args, parser, run  # noqa: E402  (data, loaders, QAT loop, inference, report)

import pyg_quant as pq  # noqa: E402
from pyg_quant.demo import dropout  # noqa: E402


class GIN(torch.nn.Module):
    """``num_layers`` QGINConv layers with 2-layer MLPs (trainable eps), then a Linear classifier."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 2,
                 dropout: float = 0.5):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        for i in range(num_layers):
            mlp = Sequential(Linear(in_channels if i == 0 else hidden_channels, hidden_channels), ReLU(),
                             Linear(hidden_channels, hidden_channels))
            self.convs.append(pq.QGINConv(mlp, train_eps=True))
        self.classifier = Linear(hidden_channels, out_channels)
        self.dropout = dropout

    def forward(self, x, adj):
        for conv in self.convs:
            x = F.relu(conv(x, adj))
            x = dropout(x, self.dropout, self.training)
        return self.classifier(x)


def build_gin(in_channels: int, num_classes: int, args) -> torch.nn.Module:
    return GIN(in_channels, args.hidden, num_classes, num_layers=args.layers)


def main(argv=None):
    args = parse_args(parser(__doc__.splitlines()[0]), argv)
    return run(args, build_gin, self_loops=0, name="GIN")  # GIN adds (1 + eps)·x itself


if __name__ == "__main__":
    main()
