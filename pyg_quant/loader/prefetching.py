r"""Batches handed over on the GPU, each copied one batch ahead of the caller.

:func:`prefetch` is what ``QuantClusterLoader(..., device="cuda")`` iterates with; it takes any iterable of host
batches with ``to(device, non_blocking=True)`` (:class:`~pyg_quant.loader.QuantBatch`, a PyG ``Data``, a tensor).
Batch ``i + 1``'s copy is queued before batch ``i`` is handed over, from pinned memory, so the host never waits for a
copy.  By default the copies go on the caller's stream, where each runs between two batches' kernels (a caller that
has moved to another stream by the hand-over gets the batch there, that stream waiting for the copy)::

    caller's stream:  copy 0 ─ copy 1 ─ batch 0's decode + model ─ copy 2 ─ batch 1 ─ ...

With ``side_stream=True`` they go on a stream of their own and run beside the previous batch's kernels::

    side stream:     copy 0 ─ev0─ copy 1 ─ev1───────────── copy 2 ─ev2──────── ...
    compute stream:  wait ev0, batch 0's decode + model ── wait ev1, batch 1 ── ...

At hand-over the caller's stream then waits for the batch's own copy event (not for the whole side stream, which
already holds the next copy) and the batch is ``record_stream``-ed on it: the caching allocator gives its memory to a
later copy only once the work queued there before the batch was freed is done.  That bookkeeping (a stream switch,
an event, a cross-stream allocation) costs the host ~0.1 ms a batch, more than the overlap saves wherever the loop
is bound by its host, as the eager layers' loop is on the GPUs measured (``benchmarks/RESULTS.md``, User paths);
the side stream pays where the device is the bound (large batches, a slow model).  The pinned host blocks (PyTorch's
caching host allocator) are reused only once the copies that read them are done.
"""
from typing import Callable, Iterable, Iterator, Optional, TypeVar, Union

import torch

_T = TypeVar("_T")
_U = TypeVar("_U")


def check_device(device, name: str = "device") -> Optional[torch.device]:
    """``device`` as a ``torch.device`` (None stays None), checked to be usable here; errors name ``name``."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"{name} must be a str, int or torch.device (e.g. 'cuda'), got {type(device).__name__}")
    if isinstance(device, int) and device < 0:
        raise ValueError(f"{name} must be a non-negative CUDA device index, got {device}")
    try:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name} must name a device, e.g. 'cuda', 'cuda:1' or 'cpu', got {device!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={str(device)!r}, but CUDA is not available here (pass None or 'cpu')")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={str(device)!r}, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def one_ahead(items: Iterable[_T], issue: Callable[[_T], _U], handover: Callable[[_U], object]) -> Iterator:
    r"""Yields ``handover(issue(item))`` for every item, ``issue`` running one item ahead: item ``i + 1`` is
    issued before item ``i`` is handed over."""
    items = iter(items)
    try:
        pending = issue(next(items))
    except StopIteration:
        return
    for item in items:
        current, pending = pending, issue(item)
        yield handover(current)
        del current  # from here the caller's reference alone keeps the batch alive
    yield handover(pending)


class _CudaCopies:
    """One iteration's side stream: ``issue`` queues a batch's copy on it, ``handover`` gives it to the caller."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def issue(self, batch):
        # Allocated and filled on the side stream: the memory is that stream's until record_stream below.
        with torch.cuda.stream(self.stream):
            moved = batch.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return moved, copied

    def handover(self, issued):
        moved, copied = issued
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copied)  # the caller's kernels (the decode first) start once this copy has landed
        moved.record_stream(stream)
        return moved


def _copy_here(batch, device: torch.device):
    """``batch`` copied on the current stream, with that stream."""
    return batch.to(device, non_blocking=True), torch.cuda.current_stream(device)


def _handover_here(issued):
    """The copied batch for the caller's current stream: where the caller has moved to another stream since the copy
    was queued, that stream waits for the copy's and the batch is recorded on it."""
    moved, stream = issued
    current = torch.cuda.current_stream(stream.device)
    if current != stream:
        current.wait_stream(stream)
        moved.record_stream(current)
    return moved


def prefetch(batches: Iterable, device: Union[str, int, torch.device], side_stream: bool = False) -> Iterator:
    r"""Iterates ``batches`` (on the CPU) handing each over on ``device``.

    On a CUDA device each batch's copy is queued one batch ahead, without waiting: on the caller's stream, or with
    ``side_stream=True`` on a stream of its own, beside the previous batch's kernels (see the module docstring for
    when that pays); ``"cuda"`` is the current device when the iteration starts.  The batches should be in pinned
    memory (``QuantClusterLoader``'s ``pin_memory=True``), or the host waits for each copy.  On the CPU the batches
    come as they are; on any other device each is moved with ``batch.to(device)`` when handed over.

    Args:
        batches (Iterable): objects with ``to(device, non_blocking=...)`` and ``record_stream(stream)`` (for
            ``side_stream``, or a caller that changes streams between batches): :class:`~pyg_quant.loader.QuantBatch`,
            PyG's ``Data``, tensors.
        device (str, int or torch.device): where to hand them over.
        side_stream (bool): copy on a side stream (CUDA only).
    """
    device = check_device(device)
    if device is None:
        raise TypeError("device must be a str, int or torch.device (e.g. 'cuda'), got None")
    if not isinstance(side_stream, bool):
        raise TypeError(f"side_stream must be a bool, got {type(side_stream).__name__}")
    if device.type == "cpu":
        return iter(batches)
    if device.type != "cuda":
        return (batch.to(device) for batch in batches)
    if device.index is None:  # as batch.to("cuda") reads it
        device = torch.device("cuda", torch.cuda.current_device())
    if not side_stream:
        return one_ahead(batches, lambda batch: _copy_here(batch, device), _handover_here)
    copies = _CudaCopies(device)
    return one_ahead(batches, copies.issue, copies.handover)
