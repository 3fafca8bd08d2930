r"""QuantClusterData: PyG's ClusterData, partitioned with pymetis, with a graph-keyed cache."""
import copy
import dataclasses
import os
import sys
import time
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch_geometric.data import Data
from torch_geometric.loader import ClusterData
from torch_geometric.utils import select

from ..distributed.partition import partition_once
from ..graph.bit_adjacency import check_edge_index_form
from ..distributed.group import world, world_size
from ..layout import check_bits
from . import cache
from .features import QuantizedFeatures, check_feature_dim
from .metis import BACKENDS, partition_nodes, undirected_csr


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_edge_index(data: Data, num_nodes: int) -> torch.Tensor:
    edge_index = getattr(data, "edge_index", None)
    if edge_index is None:
        raise ValueError("data.edge_index is required (ClusterData partitions the graph's edges)")
    edge_index = check_edge_index_form(edge_index, "data.edge_index").detach().to("cpu", torch.int64)
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
        raise ValueError(f"data.edge_index holds node indices outside [0, num_nodes={num_nodes})")
    return edge_index


def _check_cluster(cluster, num_nodes: int, num_parts: int, backend: str) -> None:
    if (not isinstance(cluster, torch.Tensor) or cluster.dtype != torch.int64 or cluster.shape != (num_nodes,)
            or (num_nodes and (int(cluster.min()) < 0 or int(cluster.max()) >= num_parts))):
        raise RuntimeError(f"backend {backend!r} returned an invalid partition (expected int64 [{num_nodes}] "
                           f"with values in [0, {num_parts}))")


def make_partition(**fields):
    """PyG's ``Partition`` record, filled with the fields this PyG version declares."""
    from torch_geometric.loader.cluster import Partition

    names = {field.name for field in dataclasses.fields(Partition)}
    return Partition(**{name: value for name, value in fields.items() if name in names})


def build_partition(edge_index: torch.Tensor, cluster: torch.Tensor, num_parts: int, sparse_format: str):
    r"""PyG's ``Partition`` from a part vector, as ``ClusterData`` lays it out.

    Args:
        edge_index (Tensor): int64 ``[2, E]`` of the original graph.
        cluster (Tensor): int64 ``[N]``, the part of every node.

    Returns ``Partition(indptr, index, partptr, node_perm, edge_perm, sparse_format)``:
    nodes renumbered part by part (``node_perm[k]`` is the original id of new
    node ``k``; a stable sort, so each part keeps the original node order), part
    ``p`` holding new nodes ``partptr[p]:partptr[p + 1]`` (empty parts have equal
    bounds), and the renumbered edges as CSR over sources (``"csr"``) or CSC over
    targets (``"csc"``), sorted by (major, minor) with ``edge_perm`` giving the
    original position of every stored edge.
    """
    num_nodes = cluster.numel()
    node_perm = torch.sort(cluster, stable=True).indices
    partptr = torch.zeros(num_parts + 1, dtype=torch.int64)
    partptr[1:] = torch.cumsum(torch.bincount(cluster, minlength=num_parts), 0)
    rank = torch.empty_like(node_perm)
    rank[node_perm] = torch.arange(num_nodes)
    row, col = rank[edge_index[0]], rank[edge_index[1]]
    major, minor = (row, col) if sparse_format == "csr" else (col, row)
    keys, edge_perm = torch.sort(major * num_nodes + minor, stable=True)
    del row, col, major, minor
    # The sorted keys give both ends back; cheaper than two random gathers through edge_perm.
    major = torch.div(keys, num_nodes, rounding_mode="floor")
    minor = keys - major * num_nodes
    indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(major, minlength=num_nodes), 0)
    return make_partition(indptr=indptr, index=minor, partptr=partptr, node_perm=node_perm,
                          edge_perm=edge_perm, sparse_format=sparse_format)


class QuantClusterData(ClusterData):
    r"""Clusters a graph with METIS, like :class:`torch_geometric.loader.ClusterData`, without pyg-lib.

    The graph handed to METIS is ``data.edge_index`` made undirected, with
    self-loops and repeated edges removed (METIS needs a simple undirected
    graph; ``data`` itself is not changed).  The result has PyG's layout
    (``partition``, ``data`` permuted part by part, ``cluster_data[i]``), so PyG's
    :class:`~torch_geometric.loader.ClusterLoader` works on it too;
    :class:`~pyg_quant.loader.QuantClusterLoader` turns it into bit-packed batches.

    Args:
        data (Data): the graph; CPU or GPU (METIS runs on the CPU).
        num_parts (int): number of parts, ``1 <= num_parts < data.num_nodes``.
            METIS may leave some parts empty (e.g. ``num_parts`` close to the node
            count): they get empty node ranges, and ``QuantClusterLoader`` skips them.
        recursive (bool): multilevel recursive bisection instead of k-way.
        save_dir (str, optional): cache directory.  The part vector is stored
            under a key made of a fingerprint of the graph (node count, edge count,
            SHA-256 of ``edge_index``), ``num_parts``, ``recursive`` and ``backend``;
            a different graph or setting never reuses it, and an unreadable or
            mismatching file is recomputed with a warning.
        filename (str, optional): cache file name inside ``save_dir`` (default:
            derived from the key); the key stored in it is still checked.
        log (bool): progress bars and messages on stderr.
        keep_inter_cluster_edges (bool): as in PyG, for ``cluster_data[i]``.
        sparse_format (str): ``"csr"`` or ``"csc"``, as in PyG.
        backend (str): ``"pymetis"`` (default), or ``"pyg_lib"`` / ``"torch_sparse"``
            (their METIS, used only when asked for; ImportError when missing).
        across_ranks (bool, optional): partition once for all the ranks of a multi-process job
            (:func:`pyg_quant.distributed.partition.partition_once`): METIS runs (or the cache is read) on rank
            0 only while the others wait, then they read the cache file rank 0 wrote to ``save_dir``, or without
            one (or where they cannot read it) receive the part vector from rank 0 by broadcast; every rank must
            then construct it.  None (the default): when ``torch.distributed`` is initialized with several
            processes.  False: this process alone, as without a process group (e.g. rank 0 evaluating by itself).

    Attributes (besides PyG's ``partition``, ``data``, ``num_parts``, ...):
        cluster (Tensor): int64 ``[N]``, the part of every original node.
        node_attrs, edge_attrs (list of str): ``data``'s node-level and
            edge-level attributes, decided once on the original graph.
        cache_path (str or None), from_cache (bool): where the cache is and
            whether this partition came from it.
        timings (dict): seconds spent per stage (``"fingerprint"``, ``"load"``,
            ``"undirected_csr"``, ``"metis"``, ``"save"``, ``"partition"``, ``"permute"``; ``"wait"`` on the ranks
            that waited for rank 0's partition).
    """

    def __init__(self, data: Data, num_parts: int, recursive: bool = False, save_dir: Optional[str] = None,
                 filename: Optional[str] = None, log: bool = True, keep_inter_cluster_edges: bool = False,
                 sparse_format: str = "csr", backend: str = "pymetis", across_ranks: Optional[bool] = None):
        # PyG's __init__ is not called: it would run its own METIS lookup and cache.
        if not isinstance(data, Data):
            raise TypeError(f"data must be a torch_geometric.data.Data (homogeneous graph), "
                            f"got {type(data).__name__}")
        if isinstance(num_parts, bool) or not isinstance(num_parts, int):
            raise TypeError(f"num_parts must be an int, got {type(num_parts).__name__}")
        _check_bool(recursive, "recursive")
        _check_bool(log, "log")
        _check_bool(keep_inter_cluster_edges, "keep_inter_cluster_edges")
        if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"save_dir must be a str or os.PathLike, got {type(save_dir).__name__}")
        if filename is not None:
            if not isinstance(filename, str):
                raise TypeError(f"filename must be a str, got {type(filename).__name__}")
            if save_dir is None:
                raise ValueError("filename is only used together with save_dir")
        if across_ranks is not None:
            _check_bool(across_ranks, "across_ranks")
        across_ranks = world_size() > 1 if across_ranks is None else across_ranks and world_size() > 1
        if sparse_format not in ("csr", "csc"):
            raise ValueError(f"sparse_format must be 'csr' or 'csc', got {sparse_format!r}")
        if not isinstance(backend, str) or backend.replace("-", "_") not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        backend = backend.replace("-", "_")
        num_nodes = data.num_nodes
        if num_nodes is None or num_nodes < 1:
            raise ValueError(f"data must have at least one node, got num_nodes={num_nodes}")
        if not 1 <= num_parts < num_nodes:
            raise ValueError(f"num_parts must satisfy 1 <= num_parts < data.num_nodes={num_nodes}, "
                             f"got {num_parts}")
        edge_index = _check_edge_index(data, num_nodes)

        self.num_parts, self.recursive, self.backend, self.log = num_parts, recursive, backend, log
        self.keep_inter_cluster_edges, self.sparse_format = keep_inter_cluster_edges, sparse_format
        self.timings: Dict[str, float] = {}
        self.cache_path: Optional[str] = None
        self.from_cache = False
        self._features: Dict[Tuple[int, int], QuantizedFeatures] = {}

        from tqdm.auto import tqdm

        # steps: [fingerprint, load,] undirected_csr, metis, [save,] partition, permute
        cached = save_dir is not None
        with tqdm(total=4 + 3 * cached, desc="QuantClusterData", disable=not log, file=sys.stderr,
                  unit="step") as bar:
            key = None
            if cached:
                fingerprint = self._stage(bar, "fingerprint", cache.graph_fingerprint, edge_index, num_nodes)
                key = cache.cache_key(fingerprint, num_parts, recursive, backend)
                self.cache_path = cache.cache_path(os.fspath(save_dir), filename, key)

            def load() -> Optional[torch.Tensor]:
                return self._stage(bar, "load", cache.load_cluster, self.cache_path, key)

            def compute():
                cluster = load() if cached else None
                if cluster is not None:
                    bar.total -= 3  # nothing to compute or save
                    bar.refresh()
                    return cluster, True
                indptr, index = self._stage(bar, "undirected_csr", undirected_csr, edge_index, num_nodes)
                cluster = self._stage(bar, f"metis ({backend}, {num_parts} parts)", partition_nodes, indptr,
                                      index, num_parts, recursive, backend, timing="metis")
                del indptr, index
                _check_cluster(cluster, num_nodes, num_parts, backend)
                if cached:
                    self._stage(bar, "save", self._save, key, cluster)
                return cluster, False

            if across_ranks:  # METIS on rank 0 only; the others read its cache file or receive its result
                start = time.perf_counter()
                cluster, how = partition_once(compute, load if cached else None, num_nodes)
                if world()[0] != 0:
                    self.timings["wait"] = time.perf_counter() - start - self.timings.get("load", 0.0)
                    bar.total = bar.n + 2
                    bar.refresh()
                    _check_cluster(cluster, num_nodes, num_parts, backend)
                self.from_cache = how == "cache"
            else:
                cluster, self.from_cache = compute()
            self.cluster = cluster
            self.partition = self._stage(bar, "partition", build_partition, edge_index, cluster, num_parts,
                                         sparse_format)
            # Node first, as PyG decides, when a count matches both nodes and edges.
            self.node_attrs = [k for k, _ in data.items() if k != "edge_index" and data.is_node_attr(k)]
            self.edge_attrs = [k for k, _ in data.items()
                               if k != "edge_index" and k not in self.node_attrs and data.is_edge_attr(k)]
            self.data = self._stage(bar, "permute", self._permute, data)
        if log and self.num_empty_parts:
            print(f"QuantClusterData: METIS left {self.num_empty_parts} of {num_parts} parts empty",
                  file=sys.stderr)

    def _stage(self, bar, name: str, fn, *args, timing: Optional[str] = None):
        bar.set_postfix_str(name)
        start = time.perf_counter()
        out = fn(*args)
        self.timings[timing or name] = time.perf_counter() - start
        bar.update(1)
        return out

    def _save(self, key, cluster: torch.Tensor) -> None:
        try:
            cache.save_cluster(self.cache_path, key, cluster)
        except OSError as error:  # a cache that cannot be written only costs time later
            warnings.warn(f"could not write the partition cache {self.cache_path!r}: {error}",
                          RuntimeWarning, stacklevel=4)

    def _permute(self, data: Data) -> Data:
        # PyG's layout: node attributes in part order, edge attributes in the
        # stored edge order, edge_index dropped (the partition holds it).
        out = copy.copy(data)
        partition = self.partition
        for key, value in data.items():
            if key in self.node_attrs:
                out[key] = select(value, partition.node_perm.to(_device(value)), dim=data.__cat_dim__(key, value))
            elif key in self.edge_attrs:
                out[key] = select(value, partition.edge_perm.to(_device(value)), dim=data.__cat_dim__(key, value))
        out.edge_index = None
        # Stated explicitly: with edge_index gone PyG could not infer it for a graph without x.
        out.num_nodes = data.num_nodes
        return out

    # --- parts ----------------------------------------------------------------------------
    @property
    def part_sizes(self) -> torch.Tensor:
        """int64 ``[num_parts]``: nodes in every part."""
        return self.partition.partptr[1:] - self.partition.partptr[:-1]

    @property
    def num_empty_parts(self) -> int:
        return int((self.part_sizes == 0).sum())

    def nonempty_parts(self) -> List[int]:
        return torch.nonzero(self.part_sizes).view(-1).tolist()

    def quantized_features(self, bits: int, dim: int = 0) -> QuantizedFeatures:
        r"""``data.x`` quantized to ``bits`` bits, one range per column over all nodes (``dim=0``) or each node over
        its own (``dim=1``), in part order.

        Computed once per ``bits`` and ``dim`` and kept: every loader over this graph (train,
        evaluation, every epoch) packs its batches from these codes.
        """
        bits = check_bits(bits)
        check_feature_dim(dim)
        if (bits, dim) not in self._features:
            x = getattr(self.data, "x", None)
            if x is None:
                raise ValueError("data.x is None: there are no features to quantize")
            self._features[bits, dim] = QuantizedFeatures.from_tensor(x, bits, progress=self.log, dim=dim)
        return self._features[bits, dim]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.num_parts}, backend={self.backend!r})"


def _device(value) -> torch.device:
    return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
