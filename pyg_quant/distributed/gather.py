r"""Gathering tensors whose first dimension differs from rank to rank: padded to the largest, then trimmed.

``torch.distributed.all_gather`` needs tensors of one shape on every rank; a rank's share of
the nodes of a graph has a size of its own.  Each rank first gathers every rank's row count,
trailing shape and dtype (one small all-gather), then the rows padded to the largest count,
and trims each piece back to its count.  A rank with no rows takes the shape and dtype of the
others'.
"""
from typing import List, Optional

import torch
import torch.distributed as dist

from .group import collective_device, world

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.int8, torch.bool)
_MAX_DIMS = 4


def all_gather_rows(tensor: torch.Tensor) -> List[torch.Tensor]:
    r"""Every rank's ``tensor`` (rows differing from rank to rank), in rank order, on ``tensor``'s device.

    Without a process group (or with one rank) it is ``[tensor]``.  The trailing dimensions and dtype must agree
    across the ranks that have rows (a ValueError on every rank otherwise); a rank with no rows may hold any
    tensor of as many dimensions.
    """
    return _gather_rows(tensor, None)


def gather_rows(tensor: torch.Tensor, dst: int) -> Optional[List[torch.Tensor]]:
    r""":func:`all_gather_rows` to rank ``dst`` only (``torch.distributed.gather``): the list there, None on the
    other ranks, which then never hold the other ranks' rows."""
    return _gather_rows(tensor, dst)


def _gather_rows(tensor: torch.Tensor, dst: Optional[int]) -> Optional[List[torch.Tensor]]:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not 1 <= tensor.dim() <= _MAX_DIMS:
        raise ValueError(f"tensor must have 1 to {_MAX_DIMS} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"tensor's dtype must be one of {_DTYPES}, got {tensor.dtype}")
    rank, size = world()
    if size == 1:
        return [tensor]
    if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < size):
        raise ValueError(f"dst must be a rank in [0, {size}), got {dst!r}")
    device, comm = tensor.device, collective_device()
    meta = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    meta[0], meta[1] = tensor.size(0), _DTYPES.index(tensor.dtype)
    meta[2:1 + tensor.dim()] = torch.tensor(tensor.shape[1:], dtype=torch.int64)
    metas = [torch.empty_like(meta, device=comm) for _ in range(size)]
    dist.all_gather(metas, meta.to(comm))  # every rank checks the shapes, so that all raise together
    metas = [m.cpu() for m in metas]
    filled = [m for m in metas if int(m[0]) > 0] or metas
    if any(not torch.equal(m[1:], filled[0][1:]) for m in filled):
        raise ValueError("all_gather_rows: the ranks' tensors differ in trailing shape or dtype: "
                         f"{[(int(m[0]), _DTYPES[int(m[1])], [int(d) for d in m[2:] if d >= 0]) for m in metas]}")
    dtype = _DTYPES[int(filled[0][1])]
    trailing = [int(d) for d in filled[0][2:1 + tensor.dim()]]
    rows = [int(m[0]) for m in metas]
    padded = torch.zeros([max(max(rows), 1)] + trailing, dtype=dtype, device=comm)
    if rows[rank]:
        padded[:rows[rank]] = tensor.to(comm)
    if dst is None:
        pieces = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(pieces, padded)
    else:
        pieces = [torch.empty_like(padded) for _ in range(size)] if rank == dst else None
        dist.gather(padded, pieces, dst=dst)
        if rank != dst:
            return None
    return [piece[:n].to(device) for piece, n in zip(pieces, rows)]
