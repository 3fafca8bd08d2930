r"""A graph partitioned once for all the ranks of a job.

METIS on a large graph takes minutes and much memory; ``R`` ranks of one machine running it
at once would take ``R`` times the memory, and ``R`` writers of one cache file could leave a
reader half a file.  :func:`partition_once` runs it on rank 0 only:

1. rank 0 loads the partition from the cache or computes it (and saves it: the cache file is
   written to a temporary name and renamed, so it is whole whenever it exists), while the other
   ranks wait at a barrier;
2. the other ranks then load the file rank 0 wrote;
3. one all-reduce tells whether every rank got it; if one did not (no ``save_dir``, or a
   ``save_dir`` that is not shared between the machines), rank 0 broadcasts the part vector
   (int64 ``[N]``) to all.

Every rank must call it, in the same order as its other collectives.
"""
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .group import barrier, collective_device, world


def partition_once(compute: Callable[[], Tuple[torch.Tensor, bool]], load: Optional[Callable[[], Optional[torch.Tensor]]],
                   num_nodes: int) -> Tuple[torch.Tensor, str]:
    r"""The part vector on every rank, computed (or loaded) on rank 0 only.

    Args:
        compute: rank 0's ``() -> (cluster, from_cache)``: load the cache or run METIS (and save).
        load: the other ranks' ``() -> cluster or None``, reading the cache rank 0 wrote (None without a cache).
        num_nodes: ``N``, the length of the part vector.

    Returns:
        ``(cluster, how)``: int64 ``[N]`` and how this rank got it: ``"computed"``, ``"cache"`` (rank 0 loaded it,
        or a later rank read rank 0's file) or ``"broadcast"``.
    """
    rank, _ = world()
    cluster, how = None, "cache"
    if rank == 0:
        cluster, from_cache = compute()
        how = "cache" if from_cache else "computed"
    barrier()  # rank 0's file is whole from here on
    if rank != 0 and load is not None:
        cluster = load()
    device = collective_device()
    have = torch.tensor([int(cluster is not None)], dtype=torch.int64, device=device)
    dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if int(have) == 0:
        buffer = (cluster if rank == 0 else torch.empty(num_nodes, dtype=torch.int64)).to(device)
        dist.broadcast(buffer, src=0)
        if rank != 0:
            cluster, how = buffer.cpu(), "broadcast"
    return cluster, how
