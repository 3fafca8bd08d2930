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
  order (:mod:`.inference`, :class:`BatchGather`);
  :func:`all_gather_rows` / :func:`gather_rows` for tensors whose rows differ from rank to rank.

Modules: :mod:`.group` (rank, world size, the collectives' device, seeds), :mod:`.ranges`, :mod:`.data_parallel`,
:mod:`.sampler`, :mod:`.partition`, :mod:`.gather`, :mod:`.inference`.
"""
import importlib

# Loaded when first asked for: the quantizers below nn and qat (pyg_quant.quantization) import .group and .ranges
# without bringing in DDP, the sampler or the inference helpers.
_EXPORTS = {"ddp": "data_parallel", "all_gather_rows": "gather", "gather_rows": "gather", "BatchGather": "gather",
            "sharded_inference": "inference", "local_ranges": "ranges", "DistributedPartSampler": "sampler",
            "rank_seed": "group", "seed_everything": "group", "world": "group"}
_MODULES = ("data_parallel", "gather", "group", "inference", "partition", "ranges", "sampler")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_MODULES))
