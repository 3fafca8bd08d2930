"""pyg_quant in one minute: quantize, pack, multiply; show exactness, sizes and speed.

Run with ``python -m pyg_quant.demo`` (``--device cuda`` on a GPU machine).
"""
import argparse
import time

import torch

import pyg_quant as pq


def planted_partition_graph(num_clusters: int, cluster_size: int, avg_degree: int, inside: float,
                            generator: torch.Generator) -> torch.Tensor:
    """Directed edges, a fraction ``inside`` of them within their source's cluster."""
    num_nodes = num_clusters * cluster_size
    num_edges = num_nodes * avg_degree
    src = torch.randint(num_nodes, (num_edges,), generator=generator)
    local = torch.rand(num_edges, generator=generator) < inside
    same_cluster = src // cluster_size * cluster_size + torch.randint(cluster_size, (num_edges,), generator=generator)
    anywhere = torch.randint(num_nodes, (num_edges,), generator=generator)
    return torch.stack([src, torch.where(local, same_cluster, anywhere)])


def timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=16000)
    parser.add_argument("--features", type=int, default=128)
    args = parser.parse_args(argv)
    device, bits = torch.device(args.device), args.bits
    gen = torch.Generator().manual_seed(0)
    print(f"pyg_quant {pq.__version__}  torch {torch.__version__}  device {device}  backends {pq.backends()}")

    print(f"\n[1/3] quantize + pack: X [{args.nodes} x {args.features}] to {bits} bits, one range per column")
    x = torch.randn(args.nodes, args.features, generator=gen).to(device)
    xq = pq.to_bit(x, bits, dim=0, layout="col")
    step = float(xq.scale.max())
    print(f"      {xq}")
    print(f"      bytes: float32 {x.numel() * 4:,} -> packed {xq.nbytes:,} ({x.numel() * 4 / xq.nbytes:.1f}x smaller)")
    print(f"      max |to_val(q) - x| = {float((pq.to_val(xq) - x).abs().max()):.4f} <= step/2 = {step / 2:.4f}")

    print(f"\n[2/3] bitmm: {bits}-bit X [{args.nodes} x {args.features}] @ {bits}-bit W [{args.features} x 64]")
    w = torch.randn(args.features, 64, generator=gen).to(device)
    xa = pq.to_bit(x, bits, dim=1, layout="row")
    wb = pq.to_bit(w, bits, dim=0, layout="col")
    out = pq.bitmm(xa, wb)
    ref = pq.to_val(xa).double() @ pq.to_val(wb).double()
    print(f"      relative error vs float64 product of the dequantized operands: {relative_error(out, ref):.2e}")
    t_bit, t_fp32 = timed(lambda: pq.bitmm(xa, wb)), timed(lambda: x @ w)
    print(f"      median time: bitmm {t_bit:.2f} ms, torch fp32 matmul {t_fp32:.2f} ms")

    print(f"\n[3/3] bit_spmm: A·X on a planted-partition graph ({args.nodes} nodes, clusters of 1600)")
    num_clusters = max(1, args.nodes // 1600)
    edge_index = planted_partition_graph(num_clusters, 1600, 40, 0.8, gen).to(device)
    n = num_clusters * 1600
    adj = pq.BitAdjacency.from_edge_index(edge_index, n)
    xg = pq.to_bit(x[:n], bits, dim=0, layout="col")
    out = pq.bit_spmm(adj, xg)
    dense_ref = torch.zeros(n, args.features, dtype=torch.float64, device=device)
    dense_ref.index_add_(0, edge_index[1], pq.to_val(xg).double()[edge_index[0]])
    print(f"      {adj}")
    print(f"      bytes: edge_index int64 {edge_index.numel() * 8:,} -> bit tiles {adj.nbytes:,}")
    print(f"      relative error vs float64 scatter-sum: {relative_error(out, dense_ref):.2e}")
    csr = torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.size(1), device=device),
                                  (n, n)).coalesce().to_sparse_csr()
    t_bit, t_csr = timed(lambda: pq.bit_spmm(adj, xg)), timed(lambda: csr @ x[:n])
    print(f"      median time: bit_spmm {t_bit:.2f} ms, torch fp32 CSR SpMM {t_csr:.2f} ms")


if __name__ == "__main__":
    main()
