r"""Batches handed over on the GPU, each copied on a side stream while the previous one computes.

:func:`prefetch` is what ``QuantClusterLoader(..., device="cuda")`` iterates with; it takes any
iterable of host batches with ``to(device, non_blocking=True)`` and ``record_stream(stream)``
(:class:`~pyg_quant.loader.QuantBatch`, a PyG ``Data``, a tensor)::

    side stream:     copy 0 ─ev0─ copy 1 ─ev1───────────── copy 2 ─ev2──────── ...
    compute stream:  wait ev0, batch 0's decode + model ── wait ev1, batch 1 ── ...

Batch ``i + 1``'s copy is queued (on the side stream, into memory of that stream's pool) before
batch ``i`` is handed over, so it runs beside batch ``i``'s kernels even when the caller's model
synchronises with the host.  At hand-over the stream current then waits for the batch's own
copy event (not for the whole side stream, which already holds the next copy) and the batch is
``record_stream``-ed on it: the caching allocator gives its memory to a later copy only once the
work queued there before the batch was freed is done.  The host buffers must be pinned for the
copies to be asynchronous; their pinned blocks (PyTorch's caching host allocator) are reused
only once the copies that read them are done.
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


def prefetch(batches: Iterable, device: Union[str, int, torch.device]) -> Iterator:
    r"""Iterates ``batches`` (on the CPU) handing each over on ``device``.

    On a CUDA device each batch is copied on a side stream one batch ahead (see the module docstring);
    ``"cuda"`` is the current device when the iteration starts.  The batches should be in pinned memory
    (``QuantClusterLoader``'s ``pin_memory=True``), or the host waits for each copy.  On the CPU the batches
    come as they are; on any other device each is moved with ``batch.to(device)`` when handed over.

    Args:
        batches (Iterable): objects with ``to(device, non_blocking=...)`` and ``record_stream(stream)``:
            :class:`~pyg_quant.loader.QuantBatch`, PyG's ``Data``, tensors.
        device (str, int or torch.device): where to hand them over.
    """
    device = check_device(device)
    if device is None:
        raise TypeError("device must be a str, int or torch.device (e.g. 'cuda'), got None")
    if device.type == "cpu":
        return iter(batches)
    if device.type != "cuda":
        return (batch.to(device) for batch in batches)
    if device.index is None:  # as batch.to("cuda") reads it
        device = torch.device("cuda", torch.cuda.current_device())
    copies = _CudaCopies(device)
    return one_ahead(batches, copies.issue, copies.handover)
