r"""Gathering tensors whose first dimension differs from rank to rank.

:class:`BatchGather` gathers batch outputs whose sizes every rank knows in advance (what sharded inference makes);
:func:`all_gather_rows` / :func:`gather_rows` gather tensors of any sizes:

``torch.distributed.all_gather`` needs tensors of one shape on every rank; a rank's share of
the nodes of a graph has a size of its own.  Each rank first gathers every rank's row counts,
trailing shapes and dtypes (one small all-gather for all the tensors of a call, read on the host),
then every rank sends its rows, as they are, to each rank that receives (point-to-point, grouped
into one batch: nothing padded, staged or trimmed).  A rank with no rows sends nothing and gets
pieces of the others' shape and dtype.
"""
from typing import List, Optional, Sequence, Union
import zlib

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


def _piece_spec(metas: torch.Tensor):
    """``(rows by rank, dtype, trailing shape)`` of one tensor from every rank's meta (``[size, 2 + _MAX_DIMS]``):
    the ranks with rows must agree (a ValueError on every rank otherwise)."""
    filled = [m for m in metas if int(m[0]) > 0] or list(metas)
    if any(not torch.equal(m[1:], filled[0][1:]) for m in filled):
        raise ValueError("the ranks' tensors differ in trailing shape or dtype: "
                         f"{[(int(m[0]), _DTYPES[int(m[1])], [int(d) for d in m[2:] if d >= 0]) for m in metas]}")
    return [int(m[0]) for m in metas], _DTYPES[int(filled[0][1])], [int(d) for d in filled[0][2:] if d >= 0]


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
    every = _all_metas(metas, size, comm)  # every rank checks the shapes, so that all raise together
    specs = [_piece_spec(every[:, i]) for i in range(len(items))]
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


def _all_metas(metas: torch.Tensor, size: int, comm: torch.device) -> torch.Tensor:
    """Every rank's int64 ``metas`` (``[size, *metas.shape]`` on the CPU): one all-gather, read on the host."""
    every = torch.empty((size,) + tuple(metas.shape), dtype=torch.int64, device=comm)
    _all_gather(every, metas.to(comm), size)
    return every.cpu()


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, size: int) -> None:
    """Every rank's ``tensor`` into ``out`` (``size`` of them along a new first dimension): NCCL gathers into one
    tensor; other backends into a list of views of it."""
    if out.is_cuda:
        dist.all_gather_into_tensor(out, tensor)
    else:
        dist.all_gather(list(out.unbind(0)), tensor)


class BatchGather:
    r"""Batch outputs made on every rank, gathered into one ``[num_rows, ...]`` tensor in row order.

    Every rank makes the same object (the same ``rows_by_rank``) and passes its own batches in order to
    :meth:`add` (each batch's row ids and rows); :meth:`result` moves them and puts every row in place.
    Because every rank knows every rank's batch sizes, nothing is exchanged while the batches run and
    nothing waits for the device there: a rank that sends copies each batch's rows after the previous ones
    into one buffer (a receiving rank keeps its own).  :meth:`result` first checks that the ranks agree on
    the rows' trailing shape and dtype and on ``rows_by_rank`` and ``dst`` (one small all-gather: where they
    differ every rank raises the same ValueError), then sends each sending rank's rows and row ids to each
    receiving rank in one group of point-to-point transfers (NCCL: one launch), and the receivers scatter
    them into place.  Sending earlier, while the later batches run, was slower: the transfers' host work
    and kernels slowed the batches more than they saved (``benchmarks/RESULTS.md``, "Several GPUs").

    Args:
        rows_by_rank (sequence of sequences of int): ``rows_by_rank[r][k]``: the rows of rank ``r``'s batch ``k``.
        num_rows (int): rows of the result; the batches' rows together must be as many.
        dst (int, optional): the rank that gets the result (the others get None); default None: every rank.
        device (optional): where the result goes on a rank that adds no batch (default: the device collectives
            run on); otherwise it is on the batches' rows' device.

    The row ids of all ranks' batches together must name each of ``[0, num_rows)`` once: they are not checked
    (a check would wait for the device), and a row no batch names holds whatever its memory held.  Every rank
    must add its batches and call :meth:`result`.
    """

    def __init__(self, rows_by_rank: Sequence[Sequence[int]], num_rows: int, *, dst: Optional[int] = None,
                 device: Union[str, torch.device, None] = None):
        rank, size = world()
        if not isinstance(rows_by_rank, (list, tuple)) or len(rows_by_rank) != size or any(
                not isinstance(rows, (list, tuple)) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                                                           for n in rows) for rows in rows_by_rank):
            raise ValueError(f"rows_by_rank must hold a list of non-negative row counts for each of the {size} ranks")
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows != sum(map(sum, rows_by_rank)):
            raise ValueError(f"num_rows must be the batches' rows together, {sum(map(sum, rows_by_rank))}, "
                             f"got {num_rows!r}")
        if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < size):
            raise ValueError(f"dst must be None or a rank in [0, {size}), got {dst!r}")
        self.rank, self.size, self.dst = rank, size, dst
        self.rows_by_rank = [list(rows) for rows in rows_by_rank]
        self.num_rows = num_rows
        self.device = torch.device(device) if device is not None else None
        self.comm = collective_device()
        self.receives = dst is None or dst == rank
        self.sends_to = [r for r in range(size) if r != rank and (dst is None or r == dst)]
        self.ids, self.rows = [], []  # this rank's batches (rows: where nothing is staged)
        self.staged, self.offset = None, 0  # a sending rank's rows, batch after batch
        self.spec = None  # this rank's first batch's (dtype, trailing shape, meta (_meta), device index)
        self.done = False

    def add(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """This rank's next batch: ``rows[i]`` is row ``ids[i]`` of the result (``ids`` int64 ``[n]``, ``rows``
        ``[n, ...]`` on one device)."""
        if self.done:
            raise RuntimeError("BatchGather.add after result()")
        k = len(self.ids)
        mine = self.rows_by_rank[self.rank]
        if k >= len(mine):
            raise ValueError(f"rank {self.rank} has {len(mine)} batches in rows_by_rank; got one more")
        spec = self.spec
        # (one expression for the usual batch: a sharded inference loop is bound by its host's time)
        if spec is None or not (type(rows) is torch.Tensor and type(ids) is torch.Tensor
                                and rows.shape[:1] == (mine[k],) and rows.shape[1:] == spec[1]
                                and rows.dtype is spec[0] and ids.dtype is torch.int64 and ids.shape == (mine[k],)
                                and rows.get_device() == spec[3] and ids.get_device() == spec[3]):
            self._check(k, ids, rows)
        self.ids.append(ids)
        if self.staged is not None:
            start, self.offset = self.offset, self.offset + rows.size(0)
            self.staged[start:self.offset].copy_(rows)
        else:
            self.rows.append(rows)

    def _check(self, k: int, ids, rows) -> None:
        """Raises the ValueError that batch ``k`` earns; at the first batch, :meth:`_start`."""
        mine = self.rows_by_rank[self.rank]
        if not isinstance(rows, torch.Tensor) or rows.dim() < 1 or rows.size(0) != mine[k]:
            raise ValueError(f"rows of batch {k} must be a tensor of {mine[k]} rows (rows_by_rank), got "
                             f"{tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__}")
        if (not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1
                or ids.numel() != rows.size(0) or ids.device != rows.device):
            raise ValueError(f"ids of batch {k} must be an int64 [{rows.size(0)}] tensor on the rows' device, got "
                             f"{(ids.dtype, tuple(ids.shape), ids.device) if isinstance(ids, torch.Tensor) else ids}")
        if self.spec is None:
            self._start(rows)
        dtype, trailing = self.spec[:2]
        if rows.dtype != dtype or rows.shape[1:] != trailing or rows.device != self.device:
            raise ValueError(f"rows of batch {k} must be {dtype} [n, {list(trailing)}] on {self.device} like the "
                             f"first batch's, got {rows.dtype} {tuple(rows.shape)} on {rows.device}")

    def _start(self, rows: torch.Tensor) -> None:
        """At the first batch: this rank's spec, and a sending rank's staging buffer."""
        total = sum(self.rows_by_rank[self.rank])
        meta = _meta(rows)
        meta[0] = total  # (a first batch may have no rows)
        trailing = rows.shape[1:]
        self.device = rows.device
        self.spec = rows.dtype, trailing, meta, rows.get_device()
        if self.sends_to:
            self.staged = torch.empty((total,) + trailing, dtype=rows.dtype, device=self.comm)

    def result(self) -> Optional[torch.Tensor]:
        """The ``[num_rows, ...]`` rows in place (None on ranks other than ``dst``), once this rank added all of its
        batches."""
        if self.done:
            raise RuntimeError("BatchGather.result called twice")
        mine = self.rows_by_rank[self.rank]
        if len(self.ids) != len(mine):
            raise ValueError(f"rank {self.rank} added {len(self.ids)} of its {len(mine)} batches")
        self.done = True
        dtype, trailing = self._agree()
        own_ids = torch.cat(self.ids) if self.ids else None
        own_rows = self.staged if self.staged is not None else torch.cat(self.rows) if self.rows else None
        self.ids, self.rows, self.staged = [], [], None
        ops, received = [], []
        if own_ids is not None:
            for peer in self.sends_to:
                ops += [(dist.isend, own_ids.to(self.comm), peer), (dist.isend, own_rows.to(self.comm), peer)]
        full = side = None
        if self.receives:
            for peer in range(self.size):
                rows = sum(self.rows_by_rank[peer])
                if peer != self.rank and rows:
                    ids_buf = torch.empty(rows, dtype=torch.int64, device=self.comm)
                    rows_buf = torch.empty([rows] + trailing, dtype=dtype, device=self.comm)
                    ops += [(dist.irecv, ids_buf, peer), (dist.irecv, rows_buf, peer)]
                    received.append((ids_buf, rows_buf))
            device = self.device if self.device is not None else self.comm
            full = torch.empty([self.num_rows] + trailing, dtype=dtype, device=device)
            if own_ids is not None and full.is_cuda and received:
                # this rank's rows go in place on a side stream while the transfers run
                current, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    full.index_copy_(0, own_ids.to(device), own_rows.to(device))
            elif own_ids is not None:
                full.index_copy_(0, own_ids.to(device), own_rows.to(device))
        _exchange(ops, self.comm)
        if full is None:
            return None
        if side is not None:
            current.wait_stream(side)  # (before this rank's later work: the side stream's tensors are free after)
        for ids, rows in received:
            full.index_copy_(0, ids.to(full.device), rows.to(full.device))
        return full

    def _agree(self) -> tuple:
        """``(dtype, trailing shape)`` of the rows, agreed by the ranks (that every rank passed the same
        ``rows_by_rank`` and ``dst`` too): one all-gather of each rank's first batch's spec."""
        if self.spec is not None:
            meta = self.spec[2]
        else:
            meta = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
            meta[0] = 0
        check = zlib.crc32(repr((self.rows_by_rank, self.dst)).encode()) & 0x7FFFFFFF
        meta = torch.cat([meta, torch.tensor([check], dtype=torch.int64)])
        every = _all_metas(meta, self.size, self.comm) if self.size > 1 else meta.view(1, -1)
        if any(int(c) != int(every[0, -1]) for c in every[:, -1]):
            raise ValueError("BatchGather: the ranks passed different rows_by_rank or dst")
        if all(int(m[0]) == 0 for m in every):
            raise ValueError("BatchGather: no rank has a batch with rows")
        _, dtype, trailing = _piece_spec(every[:, :-1])
        return dtype, trailing
