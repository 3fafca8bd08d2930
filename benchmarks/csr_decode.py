"""Tiles or CSR for a decoded batch adjacency: decode and bit_spmm times against the tile fill (CUDA).

For graphs whose 16 x 256 tiles are filled from ~1% to ~50% (clusters of 256 nodes aligned with the tile
columns, every edge inside its cluster, average degree d: fill about d / 256) plus the products-scale cluster
batch of benchmarks/gpu_kernels.py, times (CUDA graph replay, ms per call):

* decode: CompactAdjacency.expand(tiles=True) (expand_tiles) and expand(tiles=False) (expand_csr);
* bit_spmm(adj, x) with x at 1 and 4 bits, d = 64, on each form;

and what MIN_TILE_FILL's "auto" picks.  Usage: python benchmarks/csr_decode.py [--out results.json]
"""
import argparse
import json

import torch

import pyg_quant as pq
from pyg_quant.graph.adjacency_form import MIN_TILE_FILL
from pyg_quant.graph.bit_adjacency import CompactAdjacency
from pyg_quant.synthetic import planted_partition_graph

from gpu_kernels import graph_ms

INNER = 20


def graphs():
    g = torch.Generator().manual_seed(0)
    for degree in (4, 8, 16, 32, 64, 128):
        yield f"aligned clusters, d={degree}", planted_partition_graph(125, 256, degree, 1.0, g), 32000
    yield "products-scale batch", torch.unique(planted_partition_graph(20, 1600, 40, 0.8, g), dim=1), 32000  # binary


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for name, edge_index, n in graphs():
        compact = pq.BitAdjacency.compact_from_edge_index(edge_index, n, self_loops=1)
        gpu = CompactAdjacency.from_tensors({k: v.cuda() for k, v in compact.tensors().items()}, compact.scalars())
        row = {"graph": name, "nnz": compact.nnz, "tiles": compact.num_tiles, "fill": round(compact.tile_fill, 4),
               "tile_entries": compact.entry_col.numel(), "residual": compact.res_row.numel(),
               "auto": "tiles" if compact.wants_tiles("auto") else "csr",
               "decode_tiles_ms": graph_ms(lambda: gpu.expand(tiles=True), inner=INNER),
               "decode_csr_ms": graph_ms(lambda: gpu.expand(tiles=False), inner=INNER)}
        forms = {"tiles": gpu.expand(tiles=True), "csr": gpu.expand(tiles=False)}
        x = torch.randn(n, 64, device="cuda")
        for bits in (1, 4):
            xb = pq.to_bit(x, bits, dim=0, layout="col")
            results = {}
            for form, adj in forms.items():
                row[f"spmm_{form}_{bits}bit_ms"] = graph_ms(lambda: pq.bit_spmm(adj, xb), inner=INNER)
                results[form] = pq.bit_spmm(adj, xb)
            assert torch.equal(results["tiles"], results["csr"])
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"min_tile_fill": MIN_TILE_FILL, "device": torch.cuda.get_device_name(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
