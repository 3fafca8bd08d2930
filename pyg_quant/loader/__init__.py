r"""Cluster-GCN data loading for quantized GNNs (QGTC's data path).

:class:`QuantClusterData` partitions a graph with METIS (pymetis; no pyg-lib
needed) and caches the partition under a key that fingerprints the graph;
:class:`QuantClusterLoader` joins parts into batches carrying a
:class:`~pyg_quant.BitAdjacency` and :class:`~pyg_quant.BitTensor` features
(quantized once per graph), all in one buffer that moves to the GPU in one copy.

Modules: :mod:`.metis` (METIS input and backends), :mod:`.cache` (the cache
key and file), :mod:`.cluster_data`, :mod:`.features` (quantize once, pack
per batch), :mod:`.batch` (the single-buffer batch), :mod:`.cluster_loader`,
:mod:`.prefetching` (``device=``: each batch copied one batch ahead, without waiting).
"""
from .batch import QuantBatch
from .cluster_data import QuantClusterData
from .cluster_loader import QuantClusterLoader
from .features import QuantizedFeatures
from .prefetching import prefetch

__all__ = ["QuantBatch", "QuantClusterData", "QuantClusterLoader", "QuantizedFeatures", "prefetch"]
