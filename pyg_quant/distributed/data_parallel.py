r"""``DistributedDataParallel`` for QAT models: buffers synced once, at the start, not before every forward.

``DistributedDataParallel`` broadcasts every buffer from rank 0 before each forward (``broadcast_buffers=True``, its
default): a copy per buffer and step, and a QAT model has many small ones (a 3-layer GIN after ``qat.prepare``: 63,
the quantizers' ranges, flags and scales).  pyg_quant keeps those equal on every rank by itself: static observers
all-reduce each batch's range (:mod:`.ranges`), weights' ranges follow the weights DDP keeps equal, learned ranges
are parameters.  :func:`ddp` therefore syncs the buffers from rank 0 once, when it wraps the model, and never again.

Its gradients are views of DDP's communication buckets (``gradient_as_bucket_view=True`` unless given): a QAT
model's many small parameters otherwise cost a copy each, into its bucket and back, at every step.

``capturable=True`` builds the wrapper on a side stream of the model's GPU, for
:class:`~pyg_quant.CapturedTrainStep`: DDP keeps every parameter's gradient accumulator from its construction on, and
autograd runs an accumulator on the stream that was current when it was made; on the default stream no CUDA graph
can take it (nor the gradient all-reduce its hook issues), on a side stream the captured step's graph takes the whole
backward.  Eager steps pay an event between the streams per parameter, so it is off by default.

Not for models whose other buffers must follow rank 0 at every step (BatchNorm's running statistics: use
``torch.nn.SyncBatchNorm``, or plain DDP), nor under :func:`~pyg_quant.distributed.local_ranges` (where rank 0's
broadcast decides the ranks' ranges).
"""
import contextlib
import inspect
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters

# The side stream each capturable wrapper was built on (see the module docstring).
_CAPTURE_STREAMS: "weakref.WeakKeyDictionary[DistributedDataParallel, torch.cuda.Stream]" = weakref.WeakKeyDictionary()


def ddp(module: torch.nn.Module, *, capturable: bool = False, **kwargs) -> DistributedDataParallel:
    """``DistributedDataParallel(module, **kwargs)`` that syncs ``module``'s buffers from rank 0 (of ``process_group``
    where given) when it wraps it and not before each forward, its gradients views of the buckets unless
    ``gradient_as_bucket_view=False``; every other argument is DDP's.  ``capturable``: built on a side stream, so that
    :class:`~pyg_quant.CapturedTrainStep` can capture its steps (see the module docstring; a module on the CPU is
    wrapped as it is: its steps run eagerly)."""
    for name in ("broadcast_buffers", "forward_sync_buffers"):
        if name in kwargs:
            raise TypeError(f"ddp() sets {name} itself (buffers synced once); use DistributedDataParallel to choose")
    if not isinstance(capturable, bool):
        raise TypeError(f"capturable must be a bool, got {type(capturable).__name__}")
    kwargs.setdefault("gradient_as_bucket_view", True)
    device = next((p.device for p in module.parameters() if p.is_cuda), None) if capturable else None
    stream = torch.cuda.Stream(device) if device is not None else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        wrapped = _wrap(module, kwargs)
    if stream is not None:
        torch.cuda.current_stream(device).wait_stream(stream)
        _CAPTURE_STREAMS[wrapped] = stream
    return wrapped


def capture_stream(model: torch.nn.Module) -> Optional["torch.cuda.Stream"]:
    """The side stream :func:`ddp` built ``model`` on with ``capturable=True``; None for any other module."""
    return _CAPTURE_STREAMS.get(model)


def _wrap(module: torch.nn.Module, kwargs: dict) -> DistributedDataParallel:
    if _FORWARD_SYNC:  # torch >= 2.13: synced at init only
        return DistributedDataParallel(module, forward_sync_buffers=False, **kwargs)
    wrapped = DistributedDataParallel(module, broadcast_buffers=False, **kwargs)  # (syncs no buffer at all)
    group = kwargs.get("process_group")
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=src, group=group)
    return wrapped
