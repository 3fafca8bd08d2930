r"""Gathering tensors whose first dimension differs from rank to rank.

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
    """Runs the point-to-point ``(isend or irecv, tensor, peer)`` ops and waits for them (see :func:`_post_ops`)."""
    for request in _post_ops(ops, comm):
        request.wait()


def _post_ops(ops, comm: torch.device) -> list:
    """Posts the point-to-point ``(isend or irecv, tensor, peer)`` ops and returns their requests: on NCCL as one
    group (its sends wait for the matching receives, which could otherwise queue behind them), elsewhere one by
    one."""
    if not ops:
        return []
    if comm.type == "cuda":
        return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer) for op, tensor, peer in ops])
    return [op(tensor, peer) for op, tensor, peer in ops]


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, size: int) -> None:
    """Every rank's ``tensor`` into ``out`` (``size`` of them along a new first dimension): NCCL gathers into one
    tensor; other backends into a list of views of it."""
    if out.is_cuda:
        dist.all_gather_into_tensor(out, tensor)
    else:
        dist.all_gather(list(out.unbind(0)), tensor)


class BatchGather:
    r"""Batch outputs made on every rank, gathered into one ``[num_rows, ...]`` tensor in row order while the later
    batches run.

    Every rank makes the same object (the same ``rows_by_rank``) and passes its own batches in order to
    :meth:`add` (each batch's row ids and rows); :meth:`result` sends what is left, waits for the transfers
    and puts every row in place.  Every rank knows every rank's batch sizes, so the receiving ranks make
    buffers of the right size as soon as the first batch gave the rows' trailing shape and dtype.  Then:

    * ranks on one host whose GPUs reach each other (CUDA peer access; the devices told apart by UUID) copy
      each batch's rows straight into the receivers' buffers (CUDA IPC, mapped into the sender's own device: one
      DMA a batch on the sender's stream, no kernel of the receiver and no rendezvous while the batches run),
      the row ids once at the end, and meet in one all-reduce that orders those copies before the receivers
      read them;
    * otherwise a rank that sends copies each batch's rows after the previous ones into one buffer, and each
      ``batches_per_send`` batches go to the receiving ranks as one point-to-point send (on NCCL's own stream,
      after the batches' kernels), the row ids once at the end: group ``j`` of every rank holds its own batches
      ``j·m ... j·m + m - 1`` (``m = batches_per_send``) and the receives of the other ranks' batches of the same
      numbers, which keeps the ranks' sends and receives in matching order.

    Args:
        rows_by_rank (sequence of sequences of int): ``rows_by_rank[r][k]``: the rows of rank ``r``'s batch ``k``.
        num_rows (int): rows of the result; the batches' rows together must be as many.
        dst (int, optional): the rank that gets the result (the others get None); default None: every rank.
        device (optional): where the result goes on a rank that adds no batch (default: the device collectives
            run on); otherwise it is on the batches' rows' device.
        batches_per_send (int): batches a group of point-to-point sends holds (default 4).
        peer_copies (bool): copy into the receivers' buffers where the GPUs allow it (default True); False: the
            point-to-point sends always.

    The row ids of all ranks' batches together must name each of ``[0, num_rows)`` once: they are not checked
    (a check would wait for the device), and a row no batch names holds whatever its memory held.  The first
    :meth:`add` (or :meth:`result` on a rank without batches) agrees on the rows' trailing shape and dtype with
    one small all-gather: where they differ every rank raises the same ValueError.  Every rank must add its
    batches and call :meth:`result`.
    """

    def __init__(self, rows_by_rank: Sequence[Sequence[int]], num_rows: int, *, dst: Optional[int] = None,
                 device: Union[str, torch.device, None] = None, batches_per_send: int = 4,
                 peer_copies: bool = True):
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
        if isinstance(batches_per_send, bool) or not isinstance(batches_per_send, int) or batches_per_send < 1:
            raise ValueError(f"batches_per_send must be a positive int, got {batches_per_send!r}")
        if not isinstance(peer_copies, bool):
            raise TypeError(f"peer_copies must be a bool, got {type(peer_copies).__name__}")
        self.rank, self.size, self.dst, self.per_send = rank, size, dst, batches_per_send
        self.rows_by_rank = [list(rows) for rows in rows_by_rank]
        self.num_rows = num_rows
        self.device = torch.device(device) if device is not None else None
        self.comm = collective_device()
        self.peer_copies = peer_copies and size > 1 and self.comm.type == "cuda"
        self.receives = dst is None or dst == rank
        self.ids, self.rows = [], []  # this rank's batches, kept until their transfers are done
        self.sends_to = [r for r in range(size) if r != rank and (dst is None or r == dst)]
        self.staged = None  # this rank's rows, batch after batch (a sender without peer copies)
        self.spec = None  # (dtype, trailing shape), agreed by the ranks
        self.buffers = {}  # peer -> (ids, rows) of all its batches: views of ``received``
        self.received = None  # (ids, rows) of every other rank's batches, on a receiving rank
        self.remote = {}  # receiving peer -> (ids, rows) views of its buffers for this rank's batches (peer copies)
        self.requests, self.groups_posted, self.offset = [], 0, 0
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
        if not isinstance(rows, torch.Tensor) or rows.dim() < 1 or rows.size(0) != mine[k]:
            raise ValueError(f"rows of batch {k} must be a tensor of {mine[k]} rows (rows_by_rank), got "
                             f"{tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__}")
        if (not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1
                or ids.numel() != rows.size(0) or ids.device != rows.device):
            raise ValueError(f"ids of batch {k} must be an int64 [{rows.size(0)}] tensor on the rows' device, got "
                             f"{(ids.dtype, tuple(ids.shape), ids.device) if isinstance(ids, torch.Tensor) else ids}")
        if self.spec is None:
            self.device = rows.device
            self._agree(rows)
        dtype, trailing = self.spec
        if rows.dtype != dtype or list(rows.shape[1:]) != trailing or rows.device != self.device:
            raise ValueError(f"rows of batch {k} must be {dtype} [n, {trailing}] on {self.device} like the first "
                             f"batch's, got {rows.dtype} {tuple(rows.shape)} on {rows.device}")
        self.ids.append(ids)
        start, self.offset = self.offset, self.offset + rows.size(0)
        if self.staged is not None:
            self.staged[start:self.offset].copy_(rows)
        else:
            self.rows.append(rows)
            for _, remote_rows in self.remote.values():
                remote_rows[start:self.offset].copy_(rows, non_blocking=True)
        if not self.peer_copies and (k + 1) % self.per_send == 0:
            self._post(k // self.per_send)

    def result(self) -> Optional[torch.Tensor]:
        """The ``[num_rows, ...]`` rows in place (None on ranks other than ``dst``), once this rank added all of its
        batches."""
        if self.done:
            raise RuntimeError("BatchGather.result called twice")
        mine = self.rows_by_rank[self.rank]
        if len(self.ids) != len(mine):
            raise ValueError(f"rank {self.rank} added {len(self.ids)} of its {len(mine)} batches")
        if self.spec is None:
            self._agree(None)
        own_ids = torch.cat(self.ids) if self.ids else None
        if self.peer_copies:
            if own_ids is not None:
                for remote_ids, _ in self.remote.values():
                    remote_ids.copy_(own_ids, non_blocking=True)
            # Every rank's copies are queued on its stream before this all-reduce, and the receivers' reads after it.
            dist.all_reduce(torch.zeros(1, device=self.comm))
            if self.remote:
                torch.cuda.current_stream(self.comm).synchronize()  # the copies done before their mappings close
            self.remote = {}
        else:
            groups = max(-(-len(rows) // self.per_send) for rows in self.rows_by_rank)
            for group in range(self.groups_posted, groups):
                self._post(group)
            # then the row ids, in one transfer a pair of ranks
            ops = [(dist.isend, own_ids.to(self.comm), peer) for peer in self.sends_to if own_ids is not None]
            ops += [(dist.irecv, ids, peer) for peer, (ids, _) in self.buffers.items()]
            self.requests += _post_ops(ops, self.comm)
            for request in self.requests:
                request.wait()
        self.done = True
        own_rows = self.staged if self.staged is not None else torch.cat(self.rows) if self.rows else None
        self.ids, self.rows, self.staged = [], [], None
        if not self.receives:
            return None
        dtype, trailing = self.spec
        device = self.device if self.device is not None else self.comm
        full = torch.empty([self.num_rows] + trailing, dtype=dtype, device=device)
        if own_ids is not None:
            full.index_copy_(0, own_ids.to(device), own_rows.to(device))
        for ids, rows in self.buffers.values():
            full.index_copy_(0, ids.to(device), rows.to(device))
        self.buffers, self.received = {}, None
        return full

    def _agree(self, rows: Optional[torch.Tensor]) -> None:
        """Agrees on the rows' dtype and trailing shape (and that every rank passed the same ``rows_by_rank``),
        makes the receive buffers and, with peer copies, maps the receivers' buffers here."""
        meta = _meta(rows) if rows is not None else torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
        if rows is None:
            meta[0] = 0
        check = zlib.crc32(repr((self.rows_by_rank, self.dst, self.per_send, self.peer_copies)).encode())
        meta = torch.cat([meta, torch.tensor([check & 0x7FFFFFFF], dtype=torch.int64)])
        if self.size > 1:
            every = torch.empty((self.size,) + tuple(meta.shape), dtype=torch.int64, device=self.comm)
            _all_gather(every, meta.to(self.comm), self.size)
            every = every.cpu()
        else:
            every = meta.view(1, -1)
        if any(int(check) != int(every[0, -1]) for check in every[:, -1]):
            raise ValueError("BatchGather: the ranks passed different rows_by_rank, dst, batches_per_send or "
                             "peer_copies")
        metas = every[:, :-1]
        filled = [m for m in metas if int(m[0]) > 0]
        if not filled:
            raise ValueError("BatchGather: no rank has a batch with rows")
        if any(not torch.equal(m[1:], filled[0][1:]) for m in filled):
            raise ValueError("BatchGather: the ranks' rows differ in trailing shape or dtype: "
                             f"{[(_DTYPES[int(m[1])], [int(d) for d in m[2:] if d >= 0]) for m in filled]}")
        self.spec = dtype, trailing = _DTYPES[int(filled[0][1])], [int(d) for d in filled[0][2:] if d >= 0]
        totals = [sum(rows) for rows in self.rows_by_rank]
        others = sum(totals) - totals[self.rank]
        if self.receives and others:  # on the collectives' device (what NCCL sends to and peers map)
            self.received = all_ids, all_rows = (torch.empty(others, dtype=torch.int64, device=self.comm),
                                                 torch.empty([others] + trailing, dtype=dtype, device=self.comm))
            start = 0
            for peer in range(self.size):
                if peer != self.rank and totals[peer]:
                    self.buffers[peer] = (all_ids[start:start + totals[peer]], all_rows[start:start + totals[peer]])
                    start += totals[peer]
        if self.peer_copies:  # (every rank: the same setting, checked above)
            self.peer_copies = _map_receivers(self, totals)
        if not self.peer_copies and self.sends_to and rows is not None:
            self.staged = torch.empty([totals[self.rank]] + trailing, dtype=dtype, device=self.comm)

    def _post(self, group: int) -> None:
        """Posts group ``group`` (and any before it not yet posted): this rank's rows of that group's batches to the
        receiving ranks, the other ranks' rows of the same batch numbers into the receive buffers."""
        while self.groups_posted <= group:
            j = self.groups_posted
            first, last = j * self.per_send, (j + 1) * self.per_send
            ops = []
            mine = self.rows_by_rank[self.rank]
            start, end = sum(mine[:first]), sum(mine[:last])
            if end > start:
                for peer in self.sends_to:
                    ops.append((dist.isend, self.staged[start:end], peer))
            for peer, (_, rows) in self.buffers.items():
                counts = self.rows_by_rank[peer]
                start, end = sum(counts[:first]), sum(counts[:last])
                if end > start:
                    ops.append((dist.irecv, rows[start:end], peer))
            self.requests += _post_ops(ops, self.comm)
            self.groups_posted += 1


# (world size, rank) -> whether every rank's GPU can copy into every other's through CUDA IPC
_PEER_ACCESS = {}


def _gpus_reach_each_other() -> bool:
    """Whether the ranks share one host and each rank's GPU is visible to every other rank (the same device, by
    UUID, at the same index) with peer access: what copying into another rank's memory needs.  Asked once per
    process group (one all-gather of small objects)."""
    rank, size = world()
    key = (id(dist.group.WORLD), size, rank)
    if key not in _PEER_ACCESS:
        import socket

        current = torch.cuda.current_device()
        count = torch.cuda.device_count()
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
        reach = [i == current or torch.cuda.can_device_access_peer(current, i) for i in range(count)]
        mine = (socket.gethostname(), current, uuids, reach)
        every = [None] * size
        dist.all_gather_object(every, mine)
        host = every[0][0]
        _PEER_ACCESS[key] = all(
            other_host == host and all(
                device < len(uuids_of) and uuids_of[device] == every[peer][2][device] and reach_of[device]
                for peer, (_, device, _, _) in enumerate(every))
            for other_host, _, uuids_of, reach_of in every)
    return _PEER_ACCESS[key]


def _map_receivers(gather: BatchGather, totals: List[int]) -> bool:
    """Maps each receiving rank's buffers for this rank's rows into this process (CUDA IPC handles exchanged with
    one all-gather); returns whether every rank could (else none copies: the point-to-point sends run)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if not _gpus_reach_each_other():
        return False
    handles = None
    if gather.received is not None:
        handles = tuple(reduce_tensor(t)[1] for t in gather.received)
    every = [None] * gather.size
    dist.all_gather_object(every, handles)
    ok = True
    try:
        mine = totals[gather.rank]
        for peer, peer_handles in enumerate(every):
            if peer == gather.rank or peer_handles is None or not mine:
                continue
            # this rank's rows sit in the peer's buffers after the rows of the ranks before it (but the peer)
            start = sum(totals[r] for r in range(gather.rank) if r != peer)
            # Mapped into this rank's own device (the handle's device index replaced by this one): a copy into it is
            # then one DMA on this device's stream over the peer link, and nothing runs in a context of the peer's
            # device here (work from two processes on one GPU is time-sliced between their contexts).
            ids, rows = (rebuild_cuda_tensor(*handle[:6], gather.comm.index, *handle[7:]) for handle in peer_handles)
            gather.remote[peer] = (ids[start:start + mine], rows[start:start + mine])
    except Exception:  # noqa: BLE001 - any failure to map falls back, on every rank, to the sends
        gather.remote, ok = {}, False
    flags = torch.tensor([int(ok)], device=gather.comm)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if not bool(flags.item()):
        gather.remote = {}
        return False
    return True
