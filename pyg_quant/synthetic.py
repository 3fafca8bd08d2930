"""Synthetic graphs for benchmarks and tests, generated in code (no downloads).

:func:`planted_partition_graph` is the "products-scale cluster batch" of the
benchmarks: clusters of equal size, a fraction ``inside`` of each node's edges
inside its own cluster, the rest anywhere.
"""
import torch


def planted_partition_graph(num_clusters: int, cluster_size: int, avg_degree: int, inside: float,
                            generator: torch.Generator) -> torch.Tensor:
    """``edge_index [2, num_clusters·cluster_size·avg_degree]`` of directed edges (repeats and loops possible).

    Edge ``e`` leaves a uniformly drawn source and lands, with probability
    ``inside``, on a uniform node of the source's cluster, else on any node.
    """
    if num_clusters < 1 or cluster_size < 1 or avg_degree < 0:
        raise ValueError("num_clusters and cluster_size must be positive and avg_degree non-negative")
    if not 0.0 <= inside <= 1.0:
        raise ValueError(f"inside must be a fraction in [0, 1], got {inside}")
    num_nodes = num_clusters * cluster_size
    num_edges = num_nodes * avg_degree
    src = torch.randint(num_nodes, (num_edges,), generator=generator)
    local = torch.rand(num_edges, generator=generator) < inside
    same_cluster = src // cluster_size * cluster_size + torch.randint(cluster_size, (num_edges,), generator=generator)
    anywhere = torch.randint(num_nodes, (num_edges,), generator=generator)
    return torch.stack([src, torch.where(local, same_cluster, anywhere)])
