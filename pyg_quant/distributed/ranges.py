r"""Observed ranges kept equal on every rank: each training batch's range is all-reduced before it is recorded.

Under ``DistributedDataParallel`` every rank trains on its own batches, so a static observer
(``"minmax"``, ``"ema"``, ``"percentile"``, ``"mse"``) would record a range of its own on every
rank, and the ranks' models would quantize differently.  ``DistributedDataParallel`` does not
fix that: its buffer broadcast (``broadcast_buffers=True``) hands rank 0's ranges to the others
at each forward, so the ranks' own batches are never counted, and after the last step the
ranks' ranges differ.  Instead, when ``torch.distributed`` is initialized with several
processes, a static observer reduces each batch's range over the ranks before combining it
with its stored range (the same value on every rank, so the stored ranges stay equal bit for bit):

* ``"minmax"`` and ``"ema"`` record batch extrema: the minimum of the ranks' minima and the
  maximum of their maxima, the extrema of the union of the ranks' batches (what one process
  stepping on that union would record);
* ``"percentile"`` and ``"mse"`` record statistics that do not decompose over the ranks'
  batches: their mean over the ranks.

It costs one small all-reduce per static quantizer and training step (and, at the first one, one
more that checks that every rank has the same number of ranges).  Every rank must therefore run
the same training forwards in the same order, as DDP requires anyway.  Nothing else needs it:
dynamic ranges are each tensor's own, weights' ranges are taken from weights DDP keeps equal, and
learned ranges (``"learned"``) are parameters, initialised from those equal weights and trained
by all-reduced gradients.  ``local_ranges()`` turns the reduction off (every rank records its own
batches; DDP's buffer broadcast then decides what the ranks use).
"""
import contextvars
from typing import ContextManager

import torch
import torch.distributed as dist

from .._utils import context_value, is_compiling
from .group import collective_device, world_size

_sync: contextvars.ContextVar = contextvars.ContextVar("pyg_quant_sync_ranges", default=True)

#: How an observer's batch ranges are reduced over the ranks.
REDUCTIONS = ("extrema", "mean")


def local_ranges() -> ContextManager[None]:
    """Inside this block, observers record their own rank's batches only (no all-reduce; see the module docstring)."""
    return context_value(_sync, False)


def syncing() -> bool:
    """Whether observed ranges are reduced over the ranks now (several processes, not in :func:`local_ranges`).
    A region ``torch.compile`` traces cannot read the context variable: there, several processes always reduce."""
    if is_compiling():
        return world_size() > 1
    return _sync.get() and world_size() > 1


@torch.no_grad()
def all_reduce_range_rows(lo: torch.Tensor, hi: torch.Tensor, how: str) -> torch.Tensor:
    """``(lo, hi)`` reduced over the ranks in one all-reduce, as the rows of one float32 ``[2, n]`` tensor on ``lo``'s
    device (the same on every rank): ``"extrema"`` (min of ``lo``, max of ``hi``) or ``"mean"``."""
    if how not in REDUCTIONS:
        raise ValueError(f"how must be one of {REDUCTIONS}, got {how!r}")
    device, n = lo.device, lo.numel()
    lo, hi = lo.reshape(-1).to(torch.float32), hi.reshape(-1).to(torch.float32)
    extrema = how == "extrema"
    both = torch.cat((lo.neg() if extrema else lo, hi))  # negation is exact: one MAX does both extrema
    target = collective_device()
    both = both if both.device == target else both.to(target)
    dist.all_reduce(both, op=dist.ReduceOp.MAX if extrema else dist.ReduceOp.SUM)
    both = both if both.device == device else both.to(device)
    if extrema:
        both[:n].neg_()
    else:
        both.div_(float(world_size()))
    return both.view(2, n)


def check_same_count(count: int, what: str) -> None:
    """Raises the same ValueError on every rank unless every rank passes the same ``count`` (one all-reduce)."""
    counts = torch.tensor([count, -count], dtype=torch.int64, device=collective_device())
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    largest, smallest = int(counts[0]), -int(counts[1])
    if largest != smallest:
        raise ValueError(f"{what}: the ranks have between {smallest} and {largest} ranges; ranges reduced over the "
                         "ranks need the same number on every rank (per-row ranges of varying rows need a dynamic "
                         "observer)")
