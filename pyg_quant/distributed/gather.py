r"""Gathering tensors whose first dimension differs from rank to rank.

``torch.distributed.all_gather`` needs tensors of one shape on every rank; a rank's share of
the nodes of a graph has a size of its own.  Each rank first gathers every rank's row counts,
trailing shapes and dtypes (one small all-gather for all the tensors of a call, read on the host),
then every rank sends its rows, as they are, to each rank that receives (point-to-point, grouped
into one batch: nothing padded, staged or trimmed).  A rank with no rows sends nothing and gets
pieces of the others' shape and dtype.
"""
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .group import collective_device, world

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.int8, torch.bool)
_MAX_DIMS = 4

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def all_gather_rows(tensors: Tensors) -> Union[List[torch.Tensor], List[List[torch.Tensor]]]:
    r"""Every rank's ``tensors`` (rows differing from rank to rank), in rank order, on each tensor's device.

    Args:
        tensors (Tensor or sequence of Tensors): this rank's rows; several tensors are gathered with one exchange
            of their shapes (every rank passes as many).

    Returns:
        for one tensor, its pieces ``[rank 0's, rank 1's, ...]`` (this rank's is ``tensor`` itself); for a sequence,
        such a list per tensor.  Without a process group (or with one rank) a piece is the tensor itself.

    The trailing dimensions and dtype of a tensor must agree across the ranks that have rows (a ValueError on every
    rank otherwise); a rank with no rows may hold any tensor of as many dimensions.
    """
    return _gather_rows(tensors, None)


def gather_rows(tensors: Tensors, dst: int) -> Optional[Union[List[torch.Tensor], List[List[torch.Tensor]]]]:
    r""":func:`all_gather_rows` to rank ``dst`` only: the pieces there, None on the other ranks, which then never
    hold the other ranks' rows."""
    return _gather_rows(tensors, dst)


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    """``[rows, dtype index, trailing sizes..., -1 ...]`` of ``tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not 1 <= tensor.dim() <= _MAX_DIMS:
        raise ValueError(f"tensor must have 1 to {_MAX_DIMS} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"tensor's dtype must be one of {_DTYPES}, got {tensor.dtype}")
    meta = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    meta[0], meta[1] = tensor.size(0), _DTYPES.index(tensor.dtype)
    meta[2:1 + tensor.dim()] = torch.tensor(tensor.shape[1:], dtype=torch.int64)
    return meta


def _piece_spec(metas: torch.Tensor, dims: int):
    """``(rows by rank, dtype, trailing shape)`` of one tensor from every rank's meta (``[size, 2 + _MAX_DIMS]``)."""
    filled = [m for m in metas if int(m[0]) > 0] or list(metas)
    if any(not torch.equal(m[1:], filled[0][1:]) for m in filled):
        raise ValueError("all_gather_rows: the ranks' tensors differ in trailing shape or dtype: "
                         f"{[(int(m[0]), _DTYPES[int(m[1])], [int(d) for d in m[2:] if d >= 0]) for m in metas]}")
    return ([int(m[0]) for m in metas], _DTYPES[int(filled[0][1])],
            [int(d) for d in filled[0][2:1 + dims]])


def _gather_rows(tensors: Tensors, dst: Optional[int]):
    single = isinstance(tensors, torch.Tensor)
    if not single and not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a Tensor or a list or tuple of Tensors, got {type(tensors).__name__}")
    items = [tensors] if single else list(tensors)
    if not items:
        raise ValueError("tensors must hold at least one tensor")
    metas = torch.stack([_meta(t) for t in items])
    rank, size = world()
    if size == 1:
        out = [[t] for t in items]
        return out[0] if single else out
    if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < size):
        raise ValueError(f"dst must be a rank in [0, {size}), got {dst!r}")
    comm = collective_device()
    every = torch.empty((size,) + tuple(metas.shape), dtype=torch.int64, device=comm)
    _all_gather(every, metas.to(comm), size)  # every rank checks the shapes, so that all raise together
    every = every.cpu()
    specs = [_piece_spec(every[:, i], t.dim()) for i, t in enumerate(items)]
    receives = dst is None or rank == dst
    ops, received = [], []
    for t, (rows, dtype, trailing) in zip(items, specs):
        mine = t.to(comm).contiguous() if rows[rank] else None
        bufs = {}
        for r in range(size):
            if r == rank:
                continue
            if mine is not None and (dst is None or r == dst):
                ops.append((dist.isend, mine, r))
            if receives and rows[r]:
                bufs[r] = torch.empty([rows[r]] + trailing, dtype=dtype, device=comm)
                ops.append((dist.irecv, bufs[r], r))
        received.append(bufs)
    _exchange(ops, comm)
    if not receives:
        return None
    out = []
    for t, (rows, dtype, trailing), bufs in zip(items, specs, received):
        out.append([t if r == rank and rows[r] else bufs[r].to(t.device) if rows[r] else
                    torch.empty([0] + trailing, dtype=dtype, device=t.device) for r in range(size)])
    return out[0] if single else out


def _exchange(ops, comm: torch.device) -> None:
    """Runs the point-to-point ``(isend or irecv, tensor, peer)`` ops and waits for them: on NCCL as one group
    (its sends wait for the matching receives, which could otherwise queue behind them), elsewhere one by one."""
    if not ops:
        return
    if comm.type == "cuda":
        requests = dist.batch_isend_irecv([dist.P2POp(op, tensor, peer) for op, tensor, peer in ops])
    else:
        requests = [op(tensor, peer) for op, tensor, peer in ops]
    for request in requests:
        request.wait()


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, size: int) -> None:
    """Every rank's ``tensor`` into ``out`` (``size`` of them along a new first dimension): NCCL gathers into one
    tensor; other backends into a list of views of it."""
    if out.is_cuda:
        dist.all_gather_into_tensor(out, tensor)
    else:
        dist.all_gather(list(out.unbind(0)), tensor)
