r"""Inference over all of a graph's cluster batches, the batches shared across the ranks, the output in node order.

The batches are the loader's own unshuffled ones (its non-empty parts in id order, ``batch_size``
at a time: what ``QuantClusterLoader(..., shuffle=False)`` yields in one process), and rank ``r``
takes batches ``r, r + R, ...``.  A batch gives the same outputs whichever rank runs it, so the
gathered ``[N, C]`` output equals the one-process loop's over the same loader.  Ranks differ by at
most one batch.  Every rank knows every batch's size from the partition, so nothing is exchanged
while the batches run; at the end each rank's node ids and rows travel in one group of transfers
(:class:`~pyg_quant.distributed.gather.BatchGather`).

A model wrapped in ``DistributedDataParallel`` is run as its ``.module``: DDP's forward
broadcasts buffers, a collective the ranks' unequal batch counts would leave waiting.
"""
from typing import Callable, Optional, Union

import torch

from .gather import BatchGather
from .group import world


def _default_forward(model, batch):
    return model(batch.x, batch.adj)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def rank_batches(parts, batch_size: int, rank: int, world_size: int):
    """The part lists of rank ``rank``'s batches: batches ``rank, rank + world_size, ...`` of ``parts`` in order."""
    batches = [list(parts[i:i + batch_size]) for i in range(0, len(parts), batch_size)]
    return batches[rank::world_size]


@torch.no_grad()
def sharded_inference(model: torch.nn.Module, loader, *, forward: Optional[Callable] = None,
                      device: Union[str, torch.device, None] = None, dst: Optional[int] = None,
                      ) -> Optional[torch.Tensor]:
    r"""The model's output for every node of ``loader``'s graph, ``[N, C]`` in the original node order.

    Each rank runs its share of the batches (see the module docstring) in ``eval()`` under ``no_grad`` (the
    model's mode is restored afterwards); every rank must call it.  Without a process group it runs every batch
    here.

    Args:
        model (torch.nn.Module): maps a batch to ``[batch nodes, C]`` rows (a QAT model, a converted one, a DDP
            wrapper: its ``.module`` is run).
        loader (QuantClusterLoader): the batches' source: its graph, parts, ``batch_size``, batch building
            (``bits``, ``self_loops``, ...) and ``num_workers`` / ``pin_memory`` / ``device`` settings are used, its
            sampler (sharded or not) is not.
        forward (callable, optional): ``forward(model, batch)`` (default ``model(batch.x, batch.adj)``).
        device (str or torch.device, optional): where batches go (default: the loader's ``device``, else where
            the model's parameters are); a CUDA device prefetches as the loader does.
        dst (int, optional): the rank that gets the output (the others get None); default None: every rank.

    Returns:
        float ``[N, C]`` on the outputs' device (None on ranks other than ``dst``).
    """
    from torch.utils.data import DataLoader

    from ..loader import QuantClusterLoader
    from ..loader.prefetching import check_device, prefetch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(loader, QuantClusterLoader):
        raise TypeError(f"loader must be a QuantClusterLoader, got {type(loader).__name__}")
    if forward is not None and not callable(forward):
        raise TypeError(f"forward must be callable, got {type(forward).__name__}")
    rank, size = world()
    if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < size):
        raise ValueError(f"dst must be None or a rank in [0, {size}), got {dst!r}")
    model = _unwrap(model)
    forward = forward or _default_forward
    device = check_device(device) if device is not None else loader.device
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))

    partptr = loader.cluster_data.partition.partptr
    sizes = (partptr[1:] - partptr[:-1]).tolist()
    batches_by_rank = [rank_batches(loader.parts, loader.batch_size, r, size) for r in range(size)]
    rows_by_rank = [[sum(sizes[p] for p in parts) for parts in batches] for batches in batches_by_rank]
    batches = batches_by_rank[rank]
    mine = DataLoader(loader.dataset, batch_sampler=batches, collate_fn=loader.collate_fn,
                      num_workers=loader.num_workers if batches else 0, pin_memory=loader.pin_memory)
    # The parts cover every node once, so the batches' node ids together name each output row once.
    gather = BatchGather(rows_by_rank, int(loader.cluster_data.data.num_nodes), dst=dst, device=device)
    was_training = model.training
    model.eval()
    try:
        for batch in prefetch(mine, device):
            out = forward(model, batch)
            if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.size(0) != batch.num_nodes:
                raise ValueError(f"forward must return a [batch nodes, C] tensor, got "
                                 f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__} for a "
                                 f"batch of {batch.num_nodes} nodes")
            gather.add(batch.n_id.to(out.device), out)
    finally:
        model.train(was_training)
    return gather.result()
