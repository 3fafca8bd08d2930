"""Synthetic graphs for benchmarks and tests, generated in code (no downloads).

:func:`planted_partition_graph` is the "products-scale cluster batch" of the
benchmarks: clusters of equal size, a fraction ``inside`` of each node's edges
inside its own cluster, the rest anywhere.

:func:`planted_class_graph` is a node-classification graph with planted classes,
where the neighbours matter (the demo's and the accuracy benchmark's default data).
"""
import torch
from torch_geometric.data import Data


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


def planted_class_graph(num_nodes: int = 3000, num_classes: int = 6, num_features: int = 256,
                        community: int = 50, degree: int = 8, p_out: float = 0.3, snr: float = 0.09,
                        train: float = 0.1, val: float = 0.1, seed: int = 0) -> Data:
    r"""A graph with planted classes where the neighbours matter.

    Nodes form communities of ``community`` nodes; each node draws ``degree / 2``
    undirected edges on average, a share ``p_out`` of them to a uniformly random node
    and the rest inside its community. A node's class is its community's index mod
    ``num_classes``; its features are ``snr`` times its class's random ±1 signature
    plus standard Gaussian noise, so one node alone is hard to classify and its
    neighbourhood averages the noise away. Node ids are shuffled (METIS has to find
    the communities), and the masks split the nodes ``train`` / ``val`` / the rest.
    Deterministic in ``seed``.
    """
    if num_nodes < 2 or num_classes < 2 or community < 2:
        raise ValueError("need num_nodes >= 2, num_classes >= 2 and community >= 2")
    g = torch.Generator().manual_seed(seed)
    pairs = num_nodes * degree // 2
    src = torch.randint(num_nodes, (pairs,), generator=g)
    start = torch.div(src, community, rounding_mode="floor") * community
    size = (num_nodes - start).clamp(max=community)
    inside = start + (torch.rand(pairs, generator=g) * size).long()
    dst = torch.where(torch.rand(pairs, generator=g) < p_out, torch.randint(num_nodes, (pairs,), generator=g), inside)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    perm = torch.randperm(num_nodes, generator=g)
    edge_index = perm[torch.unique(torch.stack([torch.cat([src, dst]), torch.cat([dst, src])]), dim=1)]
    y = torch.empty(num_nodes, dtype=torch.long)
    y[perm] = (torch.arange(num_nodes) // community) % num_classes
    signature = torch.randint(0, 2, (num_classes, num_features), generator=g).float() * 2 - 1
    x = snr * signature[y] + torch.randn(num_nodes, num_features, generator=g)
    split = torch.rand(num_nodes, generator=g)
    return Data(x=x, edge_index=edge_index, y=y, train_mask=split < train,
                val_mask=(split >= train) & (split < train + val), test_mask=split >= train + val)
