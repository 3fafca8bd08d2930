r"""QuantClusterLoader: Cluster-GCN mini-batches as a bit adjacency plus low-bit features."""
import gc
import operator
import warnings
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch.utils.data import DistributedSampler
from torch_geometric.loader import ClusterData
from torch_geometric.utils import narrow, select

from ..graph.adjacency_form import check_adjacency_form
from ..graph.bit_adjacency import BitAdjacency
from ..distributed.sampler import DistributedPartSampler
from ..distributed.group import initialized
from ..layout import check_bits
from .batch import QuantBatch
from .features import QuantizedFeatures, check_feature_dim
from .prefetching import check_device, prefetch


_OUTSIDE = -(2**62)  # shift of a part that is not in the batch


class ClusterCollater:
    r"""Turns a list of part ids into a :class:`QuantBatch` (the loader's ``collate_fn``).

    A plain picklable object (not a bound method of the loader), so that
    ``DataLoader`` workers started with ``spawn`` receive only what they need.
    """

    def __init__(self, cluster_data: ClusterData, features: Optional[QuantizedFeatures], node_attrs: List[str],
                 edge_attrs: List[str], self_loops: int, min_tile_nnz: int, return_edge_index: bool,
                 pin_in_main_process: bool, adjacency: str):
        partition = cluster_data.partition
        self.partptr, self.indptr, self.index = partition.partptr, partition.indptr, partition.index
        self.node_perm = partition.node_perm
        self.csr = getattr(partition, "sparse_format", "csr") == "csr"
        self.data = cluster_data.data
        self.features, self.node_attrs, self.edge_attrs = features, node_attrs, edge_attrs
        self.self_loops, self.min_tile_nnz, self.adjacency = self_loops, min_tile_nnz, adjacency
        self.return_edge_index = return_edge_index
        self.pin_in_main_process = pin_in_main_process
        sizes = self.partptr[1:] - self.partptr[:-1]
        # The part of every (renumbered) node, to map edge endpoints to batch-local ids.
        self.part_of = torch.repeat_interleave(torch.arange(sizes.numel(), dtype=torch.int32), sizes)

    def edges(self, parts: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor):
        r"""The batch's edges, exactly as PyG's ``ClusterLoader`` builds them.

        Returns ``(edge_index, edge_ranges, keep)``: int64 ``[2, E_b]`` in batch-local ids
        (the edges between any two nodes of the batch, links between its
        clusters included), in PyG's order; the ranges of the partition's edge
        order that hold the batch's candidate edges; and which candidates were kept.
        """
        majors, minors, edge_ranges = [], [], []
        for part, start, offset in zip(parts.tolist(), starts.tolist(), offsets.tolist()):
            end = int(self.partptr[part + 1])
            ptr = self.indptr[start:end + 1]
            first, last = int(ptr[0]), int(ptr[-1])
            majors.append(torch.repeat_interleave(torch.arange(offset, offset + end - start), ptr[1:] - ptr[:-1],
                                                  output_size=last - first))
            minors.append(self.index[first:last])
            edge_ranges.append((first, last))
        major, minor = torch.cat(majors), torch.cat(minors)
        # A global (renumbered) node j of part p sits at local id j - partptr[p] + offset(p) when p is
        # in the batch: shift[p] holds that difference, and _OUTSIDE marks the parts not in the batch.
        shift = torch.full((self.partptr.numel() - 1,), _OUTSIDE, dtype=torch.int64)
        shift[parts] = offsets - starts
        minor_shift = shift[self.part_of[minor]]
        keep = minor_shift != _OUTSIDE
        major, minor = major[keep], (minor + minor_shift)[keep]
        edge_index = torch.stack([major, minor] if self.csr else [minor, major])
        return edge_index, edge_ranges, keep

    def __call__(self, parts: Sequence[int]) -> QuantBatch:
        parts = torch.as_tensor(parts, dtype=torch.int64).view(-1)
        num_parts = self.partptr.numel() - 1
        if parts.numel() and (int(parts.min()) < 0 or int(parts.max()) >= num_parts):
            raise ValueError(f"part ids must be in [0, {num_parts}), got {parts.tolist()}")
        if torch.unique(parts).numel() != parts.numel():
            raise ValueError(f"a batch names a part twice: {parts.tolist()}")
        # Empty parts (a custom sampler may name them) add nothing; a batch needs a node.
        parts = parts[self.partptr[parts + 1] > self.partptr[parts]]
        if parts.numel() == 0:
            raise ValueError("the batch holds only empty parts; QuantClusterLoader needs at least one node")
        starts, ends = self.partptr[parts], self.partptr[parts + 1]
        sizes = ends - starts
        offsets = torch.cumsum(sizes, 0) - sizes
        num_nodes = int(sizes.sum())
        ranges = list(zip(starts.tolist(), ends.tolist()))
        edge_index, edge_ranges, keep = self.edges(parts, starts, offsets)

        fields: Dict[str, object] = {
            "adj": BitAdjacency.compact_from_edge_index(edge_index, num_nodes, self_loops=self.self_loops,
                                                        min_tile_nnz=self.min_tile_nnz)}
        if self.features is not None:
            fields["x"] = self.features.batch(ranges)
        data = self.data
        for key, value in data.items():
            if key in ("edge_index", "num_nodes") or (key == "x" and self.features is not None):
                continue
            if key in self.node_attrs:
                dim = data.__cat_dim__(key, value)
                fields[key] = _cat([narrow(value, dim, start, end - start) for start, end in ranges], dim)
            elif key in self.edge_attrs:
                if self.return_edge_index:
                    dim = data.__cat_dim__(key, value)
                    edge_id = torch.cat([torch.arange(first, last) for first, last in edge_ranges])
                    fields[key] = select(select(value, edge_id, dim), keep, dim)
            else:
                fields[key] = value  # graph-level attribute, kept as PyG's copy.copy(data) keeps it
        node = torch.cat([torch.arange(start, end) for start, end in ranges])
        fields["n_id"] = self.node_perm[node]
        fields["part"] = parts
        if self.return_edge_index:
            fields["edge_index"] = edge_index
        fields["num_nodes"] = num_nodes
        pin = self.pin_in_main_process and torch.utils.data.get_worker_info() is None
        return QuantBatch.from_fields(fields, pin_memory=pin, adjacency=self.adjacency)


class _PartIds(torch.utils.data.Dataset):
    """The loader's dataset: index ``i`` is part ``i`` (as in PyG), checked."""

    def __init__(self, num_parts: int):
        self.num_parts = num_parts

    def __len__(self) -> int:
        return self.num_parts

    def __getitem__(self, part) -> int:
        try:
            index = operator.index(part)  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            index = None
        if isinstance(part, bool) or index is None or not 0 <= index < self.num_parts:
            raise ValueError(f"the sampler yielded {part!r}; part ids must be ints in [0, {self.num_parts})")
        return index


def _cat(values, dim: int):
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values, dim=dim)
    return [item for value in values for item in value]  # list-valued node attributes


class QuantClusterLoader(torch.utils.data.DataLoader):
    r"""Cluster-GCN batches (PyG's :class:`~torch_geometric.loader.ClusterLoader`) shipped as bits.

    Each batch joins ``batch_size`` parts of ``cluster_data``: the same nodes, in
    the same order, and the same edges as ``ClusterLoader`` (every edge between
    two nodes of the batch, the links between its parts included).  It is a
    :class:`~pyg_quant.loader.QuantBatch` with the fields

    * ``adj`` (:class:`~pyg_quant.BitAdjacency`): the batch's adjacency
      ``[num_nodes, num_nodes]`` plus ``self_loops·I``, rows = targets;
    * ``x`` (:class:`~pyg_quant.BitTensor`): the features, ``bits`` bits, one range
      per column (``dim=0``) taken once over the whole graph, ``layout="col"``
      (what :func:`~pyg_quant.bit_spmm` reads); with ``feature_dim=1``, each node
      over its own range (``dim=1``), ``layout="row"``; a float tensor when ``bits=None``;
    * ``deg``: float32 ``[num_nodes]``, ``adj.degree()`` (GCN's degree, self-loop
      term included), computed where the batch is;
    * every other node-level attribute of the graph as is (``y``, ``train_mask``, ...);
    * ``n_id`` (int64): the original id of every node; ``part`` (int64): the
      batch's part ids in order; ``num_nodes``;
    * with ``return_edge_index=True``, ``edge_index`` (int64, PyG's order) and the
      edge-level attributes (otherwise they are left out: the bit adjacency is
      unweighted, and a warning says so).

    A batch travels as one ``uint8`` buffer in a compact wire form (the adjacency as
    its tile plan, one byte per edge; features without padding; integers narrowed:
    see :mod:`pyg_quant.loader.batch`); ``batch.to(device)`` moves it in one
    (non-blocking) copy and the fields are decoded on the device when first read
    (no host synchronisation). ``pin_memory=True`` pins the buffer (it is allocated
    pinned directly when batches are built in the main process).

    Parts that METIS left empty are skipped, so every batch has nodes.  As in PyG, a custom
    ``sampler`` / ``batch_sampler`` yields part ids.

    **Several processes** (``torch.distributed`` initialized, e.g. under ``torchrun``; or ``num_replicas`` /
    ``rank`` given; or a ``torch.utils.data.DistributedSampler`` passed as ``sampler``): the loader shards
    itself.  Its sampler is then a :class:`~pyg_quant.distributed.DistributedPartSampler` over the non-empty
    parts: at every epoch each rank gets a disjoint share of them, in an order that is the same on every rank
    (shuffled with seed ``seed + epoch`` when ``shuffle``), the shares together cover every part, and every rank
    gets the same number of parts, hence of batches (the order is padded by repeating its first parts, as
    ``DistributedSampler`` does, so a few parts come twice in an epoch; a rank running out of batches while the
    others all-reduce gradients would hang the job).  Call :meth:`set_epoch` before each epoch to reshuffle.  A
    ``DistributedSampler`` passed in gives its ``num_replicas``, ``rank``, ``shuffle``, ``seed`` and
    ``drop_last`` (``True``: the tail of the order is dropped instead of padded), and its ``set_epoch`` is
    followed; its dataset is not read (a sampler Lightning wraps around this loader's own shards the parts
    afresh).  ``shard=False``: the loader does not shard by itself (one process
    using the whole graph under a process group, e.g. rank 0 evaluating alone); a ``DistributedSampler``
    passed in still shards it.

    Lightning's DDP strategy needs no code: the loader's sampler is a ``DistributedSampler``, so Lightning keeps
    it (``use_distributed_sampler`` replaces only other samplers) and calls its ``set_epoch`` every epoch.  A
    loader Lightning does re-create (``shard=False``, or its prediction loop) gets Lightning's sampler through
    ``sampler=`` and shards by it as described.

    Args:
        cluster_data (ClusterData): a :class:`~pyg_quant.loader.QuantClusterData`
            (or a PyG ``ClusterData``), on the CPU.
        batch_size (int): parts per batch.
        shuffle (bool): reshuffle the parts every epoch.
        bits (int or None): feature bits, 1..8; ``None`` keeps ``x`` as float.
        feature_dim (int): what the features' ranges are taken over (as ``dim`` of :func:`~pyg_quant.to_bit`).
            ``0`` (the default): one range per feature over all nodes, in the column layout: the operand of an
            aggregation ``A·X`` (GIN's first step).  ``1``: each node over its own range, in the row layout: the
            codes a per-node input quantizer makes (that of a QAT layer, ``qat.prepare``'s default, or a
            :class:`~pyg_quant.QGCNConv`'s), which a model whose first step is a linear layer (GCN's ``X·W``)
            multiplies as they are, with no dequantize / requantize round trip.
        self_loops (int): 0, 1 (``A + I``, GCN) or 2 (``A + 2I``); see
            :meth:`~pyg_quant.BitAdjacency.from_edge_index`.  Use 0 for GIN.
        min_tile_nnz (int): blocks with fewer entries go to the CSR residual of
            the plan that travels (a tile entry travels in 1–2 bytes, a residual one
            in 4–8).
        adjacency (str, optional): the form ``batch.adj`` decodes to on the device:
            ``"tiles"`` decodes the planned tiles (the default, None, is
            :data:`~pyg_quant.graph.adjacency_form.DEFAULT_ADJACENCY`, ``"auto"``); ``"auto"`` keeps none when the plan's tiles would be less than
            :data:`~pyg_quant.graph.adjacency_form.MIN_TILE_FILL` full (METIS cluster
            batches are ~2% full, and ``bit_spmm``'s CSR gather runs 2× faster than
            the tiles there on CUDA); ``"csr"`` never.  The bytes that travel are the same.
        return_edge_index (bool): also ship ``edge_index`` and edge attributes.
        device (str or torch.device, optional): where the batches are handed over.  None (the default) or
            ``"cpu"``: on the CPU, as built.  A CUDA device (``"cuda"``: the current one when the epoch starts):
            each batch's buffer is copied there one batch ahead, without waiting, on the current stream
            (:func:`~pyg_quant.loader.prefetch`; ``prefetch(loader, "cuda", side_stream=True)`` copies beside
            the previous batch's kernels instead), and the fields are decoded there when first read.
            ``pin_memory`` then defaults to True (buffers built pinned, or pinned by the DataLoader's pin thread
            with workers; with ``pin_memory=False`` the host waits for every copy).  ``batch.to("cuda")`` on such
            a batch returns it as is.  Any other device: each batch moved with ``batch.to(device)`` as it is
            handed over.
        shard (bool, optional): None (the default): shard when ``torch.distributed`` is initialized, when
            ``num_replicas`` or ``rank`` is given, or when ``sampler`` is a ``DistributedSampler`` (see above);
            True: shard (a ValueError when none of those says how); False: only by a ``DistributedSampler``
            passed as ``sampler``.
        num_replicas, rank (int, optional): the ranks to shard over and this one's (default: the process
            group's).
        seed (int): base seed of the sharded order (epoch ``e`` uses ``seed + e`` on every rank).
        **kwargs: :class:`torch.utils.data.DataLoader` arguments (``num_workers``,
            ``pin_memory``, ``drop_last``, ``persistent_workers``, ...).
    """

    def __init__(self, cluster_data: ClusterData, batch_size: int = 1, shuffle: bool = False,
                 bits: Optional[int] = 4, self_loops: int = 1, min_tile_nnz: int = 16, feature_dim: int = 0,
                 return_edge_index: bool = False, adjacency: Optional[str] = None,
                 device: Union[str, int, torch.device, None] = None, shard: Optional[bool] = None,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None, seed: int = 0, **kwargs):
        if not isinstance(cluster_data, ClusterData) or not hasattr(cluster_data, "partition"):
            raise TypeError(f"cluster_data must be a partitioned ClusterData (e.g. QuantClusterData), "
                            f"got {type(cluster_data).__name__}")
        # A loader re-created from its attributes (Lightning, for a loader made outside its hooks) hands back the
        # dataset and collate_fn this class made: those are dropped, anything else is refused.
        if isinstance(kwargs.get("dataset"), _PartIds):
            del kwargs["dataset"]
        if isinstance(kwargs.get("collate_fn"), ClusterCollater):
            del kwargs["collate_fn"]
        for name in ("collate_fn", "dataset"):
            if name in kwargs:
                raise TypeError(f"QuantClusterLoader sets {name} itself; do not pass it")
        if shard is not None and not isinstance(shard, bool):
            raise TypeError(f"shard must be None or a bool, got {type(shard).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if bits is not None:
            bits = check_bits(bits)
        check_feature_dim(feature_dim, "feature_dim")
        if isinstance(self_loops, bool) or self_loops not in (0, 1, 2):
            raise ValueError(f"self_loops must be 0, 1 or 2, got {self_loops!r}")
        if isinstance(min_tile_nnz, bool) or not isinstance(min_tile_nnz, int) or min_tile_nnz < 1:
            raise ValueError(f"min_tile_nnz must be a positive int, got {min_tile_nnz!r}")
        adjacency = check_adjacency_form(adjacency)
        device = check_device(device)
        if device is not None and device.type == "cuda":
            kwargs.setdefault("pin_memory", True)  # a non-blocking copy from pageable memory waits for the host
        if not isinstance(return_edge_index, bool):
            raise TypeError(f"return_edge_index must be a bool, got {type(return_edge_index).__name__}")
        data = cluster_data.data
        for key, value in data.items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                raise ValueError(f"cluster_data.data.{key} is on {value.device}; the loader builds batches "
                                 "on the CPU (move the data there and the batches to the GPU)")

        node_attrs = getattr(cluster_data, "node_attrs", None)
        edge_attrs = getattr(cluster_data, "edge_attrs", None)
        if node_attrs is None:  # a PyG ClusterData: decide from the permuted data
            node_attrs = [k for k, v in data.items() if data.is_node_attr(k)]
            edge_attrs = [k for k, v in data.items() if data.is_edge_attr(k) and k not in node_attrs]
        clashes = [key for key in ("n_id", "part") if key in data]
        if clashes:
            warnings.warn(f"data attributes {clashes} are replaced in the batches by the loader's own "
                          "(n_id: original node ids, part: the batch's part ids)", UserWarning, stacklevel=2)
        if edge_attrs and not return_edge_index:
            warnings.warn(f"edge attributes {edge_attrs} are not put into the batches (the bit adjacency is "
                          "unweighted); pass return_edge_index=True to get them with edge_index",
                          UserWarning, stacklevel=2)

        features = None
        x = getattr(data, "x", None)
        if bits is not None and x is not None:
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
                raise TypeError("cluster_data.data.x must be a floating-point [num_nodes, num_features] tensor "
                                "to be quantized; pass bits=None to ship it as is")
            if hasattr(cluster_data, "quantized_features"):
                features = cluster_data.quantized_features(bits, feature_dim)  # once per graph, width and dim
            else:
                features = QuantizedFeatures.from_tensor(x, bits, dim=feature_dim)

        self.cluster_data, self.bits, self.self_loops, self.feature_dim = cluster_data, bits, self_loops, feature_dim
        self.device = device
        # The other constructor arguments too, under their names (Lightning re-creates a loader from them).
        self.min_tile_nnz, self.return_edge_index, self.adjacency = min_tile_nnz, return_edge_index, adjacency
        self.shuffle, self.shard, self.seed = shuffle, shard, seed
        # Built pinned in this process only: a forked worker cannot touch CUDA (the DataLoader's pin thread pins
        # the workers' batches instead).
        pin_in_collate = bool(kwargs.get("pin_memory")) and not kwargs.get("num_workers") and torch.cuda.is_available()
        self.collater = ClusterCollater(cluster_data, features, node_attrs, edge_attrs, self_loops, min_tile_nnz,
                                        return_edge_index, pin_in_collate, adjacency)
        sizes = cluster_data.partition.partptr[1:] - cluster_data.partition.partptr[:-1]
        self.parts = torch.nonzero(sizes).view(-1).tolist()
        # As in PyG, the dataset index *is* the part id (a custom sampler yields part ids);
        # the default samplers draw from the non-empty parts only.
        sharded = self._part_sampler(kwargs, shuffle, shard, num_replicas, rank, seed)
        if sharded is not None:
            kwargs["sampler"], shuffle = sharded, False
        elif kwargs.get("sampler") is None and kwargs.get("batch_sampler") is None:
            if shuffle:
                kwargs["sampler"] = torch.utils.data.SubsetRandomSampler(self.parts, kwargs.get("generator"))
            else:
                kwargs["sampler"] = self.parts
            shuffle = False
        super().__init__(_PartIds(sizes.numel()), batch_size=batch_size, shuffle=shuffle, collate_fn=self.collater,
                         **kwargs)

    def _part_sampler(self, kwargs, shuffle: bool, shard: Optional[bool], num_replicas, rank,
                      seed: int) -> Optional[DistributedPartSampler]:
        """The sharding sampler (see the class docstring), or None when the loader does not shard."""
        sampler, batch_sampler = kwargs.get("sampler"), kwargs.get("batch_sampler")
        explicit = num_replicas is not None or rank is not None
        if shard is False and explicit:
            raise ValueError("num_replicas / rank shard the loader; they contradict shard=False")
        if isinstance(sampler, DistributedPartSampler):
            if explicit:
                raise ValueError("give either a DistributedPartSampler or num_replicas / rank, not both")
            return sampler
        if isinstance(sampler, DistributedSampler):
            if explicit:
                raise ValueError("give either a DistributedSampler or num_replicas / rank, not both")
            return DistributedPartSampler.following(sampler, self.parts)
        if shard is False:
            return None
        if sampler is not None or batch_sampler is not None:
            if shard or explicit:
                raise ValueError("a custom sampler / batch_sampler cannot be sharded by the loader; pass a "
                                 "torch.utils.data.DistributedSampler, or shard=False to use it as it is")
            return None
        if shard is None and not explicit and not initialized():
            return None
        if shard and not explicit and not initialized():
            raise ValueError("shard=True needs torch.distributed initialized, or num_replicas and rank")
        return DistributedPartSampler(self.parts, num_replicas, rank, shuffle=shuffle, seed=seed)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of a sharded loader's order (every rank the same epoch: see the class docstring); a
        loader that does not shard ignores it (its ``shuffle`` draws a new order every epoch anyway)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
                return

    def __iter__(self):
        if self.num_workers > 0 and torch.cuda.is_initialized():
            # Forked workers inherit the parent's unreachable CUDA tensors; a garbage collection there frees them
            # through a CUDA context the child cannot use and aborts it, so collect before the workers fork (whatever
            # the batches' device: the README's loop moves them itself).
            gc.collect()
        batches = super().__iter__()
        if self.device is None or self.device.type == "cpu":
            return batches
        return prefetch(batches, self.device)
