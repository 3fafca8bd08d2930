r"""Several processes (one per GPU): data-parallel QAT on cluster batches, and sharded inference.

What a ``torchrun`` script (or Lightning's DDP strategy) gets once the process group exists:

* :class:`~pyg_quant.loader.QuantClusterData` partitions once: METIS on rank 0, the others read its
  cache file or receive its result (:mod:`.partition`);
* :class:`~pyg_quant.loader.QuantClusterLoader` gives each rank a disjoint share of the parts every
  epoch, all shares together covering every part, the same number of batches on every rank
  (:class:`DistributedPartSampler`, :mod:`.sampler`); ``loader.set_epoch(epoch)`` reshuffles;
* QAT under ``DistributedDataParallel``: static observers reduce each batch's range over the ranks, so
  every rank keeps the same ranges (:mod:`.ranges`, :func:`local_ranges` to opt out), and :func:`ddp` wraps
  the model without DDP's buffer broadcast before every forward; stochastic rounding draws different,
  reproducible noise on every rank (:func:`rank_seed`, :func:`seed_everything`);
* :func:`sharded_inference`: every batch run once, on some rank, the ``[N, C]`` output gathered in node
  order (:mod:`.inference`, :func:`all_gather_rows`).

Modules: :mod:`.group` (rank, world size, the collectives' device, seeds), :mod:`.ranges`, :mod:`.data_parallel`,
:mod:`.sampler`, :mod:`.partition`, :mod:`.gather`, :mod:`.inference`.
"""
from .data_parallel import ddp
from .gather import all_gather_rows, gather_rows
from .inference import sharded_inference
from .ranges import local_ranges
from .sampler import DistributedPartSampler
from .group import rank_seed, seed_everything, world

__all__ = ["DistributedPartSampler", "all_gather_rows", "ddp", "gather_rows", "local_ranges", "rank_seed",
           "seed_everything", "sharded_inference", "world"]
