r"""Training steps replayed from CUDA graphs: a step's host work paid once per batch shape.

A training step on a GPU cluster batch of a few tens of thousands of nodes is bound by
the host: a QAT step dispatches ~250 operators (fake quantizers, observers, the float
aggregation, autograd, Adam), each costing the Python interpreter and the dispatcher
more host time than its kernels take on the device.  :class:`CapturedTrainStep`
captures the whole step (``zero_grad``, forward, loss, backward and, for an optimizer
made with ``capturable=True``, its update) into a CUDA graph the first time a batch shape
comes back, and from then on replays it: the batch is copied into the graph's input
buffers and the step is one graph launch.

What a step does, per call ``step(*inputs, target=...)``:

1. the first ``warmup`` calls for a shape (the shapes, dtypes and devices of every input
   and target, ``model.training`` and grad mode) run eagerly: they are ordinary steps,
   and they create what a capture cannot (Adam's state, lazily built buffers, the range
   observers' first batch);
2. the next call captures the step for that shape: the inputs are cloned into buffers of
   the graph's own, and the capture runs no kernel;
3. that call and every later one of the shape copy the batch into the buffers and replay.

Every graph writes the very tensors the eager step does (parameters, their ``.grad``,
buffers, optimizer state), in place: the stored ranges of :mod:`pyg_quant.qat`'s observers
move in place while a step of this class runs (:func:`~pyg_quant.quantization.observers.ranges_in_place`).
Before a replay the step checks that those tensors are still the captured ones; a
``.grad`` set to None by the caller (``optimizer.zero_grad()``) is given back, and any
other change (``load_state_dict``, ``.to()``, a replaced buffer) drops every graph, so
the next calls warm up and capture again.  The ``edge_index`` inputs of pyg_quant's layers
are range-checked on every batch before it is copied in (once per tensor: resident batches
are read once), as the eager layers do.  Graphs of all shapes share one memory pool (they
replay one at a time, on the current stream); each keeps its own copy of the inputs (the
buffers it reads), so ``max_graphs`` bounds that memory; the loss returned is a copy.

Requirements: the inputs and targets are strided CUDA tensors (or hashable constants
such as None), the step reads no data-dependent size on the host (a host sync cannot be
captured; a step that tries fails to capture and runs eagerly from then on, with one
warning), and batch shapes repeat (fixed cluster batches, as in ``benchmarks/e2e.py``).
Several processes: a model wrapped by :func:`pyg_quant.distributed.ddp` with ``capturable=True`` (DDP built on a
side stream, where its gradient accumulators run) is captured with its collectives, the gradient all-reduce and the
observers' range all-reduce (:mod:`pyg_quant.distributed.ranges`), inside each graph.  NCCL requires the ranks to
capture the same steps and to replay together the graphs of one joint capture, so every step the ranks exchange
their batch shapes over a small gloo group (made when the step is, on every rank: construct the step on all
ranks): a graph is kept per combination of every rank's shape, and a rank that cannot capture makes all of them run
eagerly.  Batches that come back in the same pairs (a fixed order) reuse their graphs; a reshuffled order pairs
other shapes each epoch and warms up again.  DDP records runtime statistics in its first ten steps, so the first
capture comes after eleven eager steps.  A DDP built otherwise on a GPU raises a TypeError, a DDP over a process
group that is neither the default group nor a single rank a ValueError, and so does a model that is not
DDP-wrapped while its observers sync their ranges over several processes (use :func:`local_ranges` or DDP).
On the CPU, and for anything else, the step runs eagerly: the same arithmetic, nothing
captured.  Stochastic rounding from torch's global generator, or from a quantizer's own
seeded generator (registered with each graph), draws fresh noise at every replay.
"""
import contextlib
import warnings
from collections import OrderedDict
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from .distributed.data_parallel import capture_stream
from .distributed.group import world_size
from .distributed.ranges import syncing
from .graph import cache as graph_cache
from .quantization.fake_quantize import RANGE_BUFFERS, FakeQuantize
from .quantization.observers import ranges_in_place

_CONSTANTS = (bool, int, float, str, type(None))
_SYNC_WARNING = "synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s message
_DEBUG_MODE_NOTICE = "Synchronization debug mode is a prototype"  # what setting the mode says
# DDP times its first ten iterations with CUDA events it synchronizes on, which no capture may meet.
_DDP_EAGER_STEPS = 11
_HASH_MASK = (1 << 62) - 1


class _NotCapturable(RuntimeError):
    """Why a step cannot be captured; the step then runs eagerly from that call on."""


class _Captured:
    """One shape's graph: its input buffers, its loss, the index checks to run before a replay."""

    __slots__ = ("graph", "static", "loss", "index_checks", "optimizer_inside")

    def __init__(self, graph, static, loss, index_checks, optimizer_inside):
        self.graph, self.static, self.loss = graph, static, loss
        self.index_checks, self.optimizer_inside = index_checks, optimizer_inside


class _Agreement:
    """What the ranks tell each other before a step (a gloo all-reduce of one small CPU tensor), so that they take it
    the same way: each rank's batch-shape hash (0: it runs eagerly) and whether it must drop its graphs."""

    def __init__(self, peers: int):
        self.group = dist.new_group(backend="gloo")  # a collective: every rank makes its step together
        self.rank = dist.get_rank()
        self.table = torch.zeros(peers, 2, dtype=torch.int64)

    def exchange(self, mine: int, flag: bool) -> Tuple[Tuple[int, ...], bool]:
        """Every rank's ``mine``, in rank order, and whether any rank raised ``flag``."""
        table = self.table
        table.zero_()
        table[self.rank, 0], table[self.rank, 1] = mine, int(flag)
        dist.all_reduce(table, group=self.group)
        values = table.tolist()
        return tuple(v[0] for v in values), any(v[1] for v in values)


def _syncs_ranges(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a quantizer whose observer all-reduces its ranges over the ranks (a static one)."""
    return any(isinstance(m, FakeQuantize) and not (m.observer.dynamic or m.observer.learned) for m in model.modules())


class CapturedTrainStep:
    r"""A training step (``zero_grad``, forward, loss, backward, optimizer step), captured in a CUDA graph per
    batch shape and replayed (see the module docstring).

    .. code-block:: python

        step = pyg_quant.CapturedTrainStep(model, optimizer, torch.nn.functional.cross_entropy)
        for epoch in range(epochs):
            for x, edge_index, y in batches:          # the same shapes every epoch
                loss = step(x, edge_index, target=y)  # model(x, edge_index); loss_fn(out, y); backward; step

    Args:
        model (torch.nn.Module): called as ``model(*inputs)``.
        optimizer (torch.optim.Optimizer): stepped after every backward.  Made with
            ``capturable=True`` (Adam, AdamW, ...), its update is part of the graph;
            otherwise it runs eagerly after each replay.
        loss_fn (callable): ``loss_fn(output, *targets)``, a scalar tensor.
        warmup (int): eager steps per shape before it is captured (at least 1).
        max_graphs (int): graphs kept, the least recently used dropped first.

    Shapes:
        - **inputs:** anything ``model`` takes, as strided tensors or hashable constants
        - **target:** a tensor or a tuple of tensors, passed to ``loss_fn`` after the output
        - **output:** the step's loss, a 0-d tensor without gradient
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., Tensor], *,
                 warmup: int = 1, max_graphs: int = 128):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        for name, value in (("warmup", warmup), ("max_graphs", max_graphs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.warmup, self.max_graphs = warmup, max_graphs
        self._stream: Optional[torch.cuda.Stream] = None  # eager CUDA steps and captures run on it
        self._peers, self._agreement, self._min_eager = 1, None, 0
        if isinstance(model, DistributedDataParallel):
            self._stream = capture_stream(model)
            if self._stream is None and any(p.is_cuda for p in model.parameters()):
                raise TypeError("model is a DistributedDataParallel built on the default stream, where its gradient "
                                "accumulators run and no CUDA graph can capture them: wrap the module with "
                                "pyg_quant.distributed.ddp(module, capturable=True)")
            self._peers = dist.get_world_size(model.process_group)
            if self._peers > 1 and self._peers != world_size():
                raise ValueError(f"model's process group has {self._peers} of the {world_size()} ranks: a captured "
                                 "step agrees with the default group's ranks or with none (a group of one)")
            if self._peers > 1:
                self._agreement = _Agreement(self._peers)
            if hasattr(model, "_set_ddp_runtime_logging_sample_rate"):
                model._set_ddp_runtime_logging_sample_rate(2**31 - 1)  # no sampled timing after the first steps
            self._min_eager = _DDP_EAGER_STEPS
        self._syncs_ranges = _syncs_ranges(model)
        self._eager_steps = 0
        self._graphs: "OrderedDict[Hashable, _Captured]" = OrderedDict()
        self._seen: "OrderedDict[Hashable, int]" = OrderedDict()  # eager steps taken per shape
        self._pool = None
        self._state = None  # where the tensors every graph reads and writes live (see _state_key)
        self._watched: list = []
        self._grad_params: List[torch.nn.Parameter] = []
        self._grads: List[Tuple[torch.nn.Parameter, Tensor]] = []
        self.disabled_reason: Optional[str] = None

    # --- public ------------------------------------------------------------------------
    @property
    def num_graphs(self) -> int:
        """How many shapes have a captured graph now."""
        return len(self._graphs)

    def reset(self) -> None:
        """Drops every graph: the next calls warm up and capture again."""
        self._graphs.clear()
        self._seen.clear()
        # The .grad tensors stay (_restore_grads): the next captures write the ones the eager steps used.
        self._pool, self._state, self._watched, self._grad_params = None, None, [], []

    def __call__(self, *inputs, target) -> Tensor:
        targets = tuple(target) if isinstance(target, (tuple, list)) else (target,)
        for i, t in enumerate(targets):
            if not isinstance(t, Tensor):
                raise TypeError(f"target[{i}] must be a Tensor, got {type(t).__name__}")
        if self._peers < world_size() and self._syncs_ranges and syncing():
            raise ValueError(f"the model's quantizers all-reduce their ranges over {world_size()} processes, which a "
                             "step of this process alone cannot capture: wrap the model with "
                             "pyg_quant.distributed.ddp(module, capturable=True), or train inside "
                             "pyg_quant.distributed.local_ranges()")
        values = inputs + targets
        key = self._key(values, len(inputs))
        self._restore_grads()
        if self._agreement is not None:
            key = self._agree(key)
        if key is None or self.disabled_reason is not None:
            return self._eager(inputs, targets)
        entry = self._graphs.get(key)
        if entry is not None and self._agreement is None and not self._state_unchanged():
            self.reset()
            entry = None
        if entry is None:
            seen = self._seen.get(key, 0)
            if seen < self.warmup or self._eager_steps < self._min_eager:
                self._seen[key] = seen + 1
                self._seen.move_to_end(key)
                while len(self._seen) > 4 * self.max_graphs:
                    self._seen.popitem(last=False)
                if seen + 1 < self.warmup or self._eager_steps + 1 < self._min_eager:
                    return self._eager(inputs, targets)
                # The last eager step before the capture also looks for host synchronisations: a capture that
                # meets one fails and leaves torch's random generators mid-capture.
                loss, syncs = self._eager_watching_syncs(inputs, targets)
                if syncs:
                    self._disable(f"it synchronizes with the host: {syncs}")
                return loss
            failure = None
            try:
                entry = self._capture(key, values, len(inputs))
            except _NotCapturable as error:
                failure = str(error)
            if self._agreement is not None and not all(self._agreement.exchange(int(entry is not None), False)[0]):
                self._graphs.pop(key, None)  # another rank could not capture: no graph replays without its peers
                entry = None
            if entry is None:
                if failure is not None:
                    self._disable(failure)
                return self._eager(inputs, targets)
        self._graphs.move_to_end(key)
        for position, check in entry.index_checks:
            graph_cache.run_index_check(check, values[position])
        for buffer, value in zip(entry.static, values):
            if isinstance(buffer, Tensor) and buffer is not value:
                buffer.copy_(value)
        entry.graph.replay()
        if not entry.optimizer_inside:
            self.optimizer.step()
        return entry.loss.clone()

    def _agree(self, key: Optional[Hashable]) -> Optional[Hashable]:
        """The step's key on every rank: this rank's key with every rank's shape hash, or None where some rank runs
        eagerly; every rank drops its graphs where one of them must (their tensors changed)."""
        mine = 0 if key is None or self.disabled_reason is not None else (hash(key) & _HASH_MASK) | 1
        hashes, reset = self._agreement.exchange(mine, self._state is not None and not self._state_unchanged())
        if reset:
            self.reset()
        return None if 0 in hashes else (key, hashes)

    # --- steps -------------------------------------------------------------------------
    def _run(self, inputs, targets) -> Tensor:
        self.optimizer.zero_grad(set_to_none=False)  # the .grad tensors stay the ones the graphs write
        loss = self.loss_fn(self.model(*inputs), *targets)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
        loss.backward()
        return loss

    def _eager(self, inputs, targets) -> Tensor:
        """A plain step.  On CUDA (until capturing is given up) it runs on the stream the captures use: autograd's
        gradient accumulators, made in the first step, then belong to the capture's stream."""
        device = next((v.device for v in inputs + targets if isinstance(v, Tensor) and v.is_cuda), None)
        if device is None or self.disabled_reason is not None:
            return self._eager_here(inputs, targets)
        current, side = torch.cuda.current_stream(device), self._side_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            loss = self._eager_here(inputs, targets)
        current.wait_stream(side)
        loss.record_stream(current)
        return loss

    def _eager_here(self, inputs, targets) -> Tensor:
        self._eager_steps += 1
        with ranges_in_place():
            loss = self._run(inputs, targets)
        self.optimizer.step()
        self._grads = [(p, p.grad) for p in self._parameters() if p.grad is not None]
        return loss.detach()

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _eager_watching_syncs(self, inputs, targets) -> Tuple[Tensor, str]:
        """An eager step under ``torch.cuda.set_sync_debug_mode("warn")``: its loss, and the first host
        synchronisation it made (empty if none; the layers' own ``edge_index`` check, deferred in a capture,
        does not count).  Other warnings are passed on."""
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught, graph_cache.watching_syncs():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = self._eager(inputs, targets)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        syncs = [w for w in caught if _SYNC_WARNING in str(w.message)]
        for w in caught:
            if w not in syncs and _DEBUG_MODE_NOTICE not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        where = f"{len(syncs)} synchronizing operation(s), the first from {syncs[0].filename}:{syncs[0].lineno}" \
            if syncs else ""
        return loss, where

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        warnings.warn(f"CapturedTrainStep: the step cannot be captured ({reason}); it runs eagerly from now on",
                      RuntimeWarning, stacklevel=3)

    def _capture(self, key, values, num_inputs: int) -> _Captured:
        device = next(v.device for v in values if isinstance(v, Tensor))
        if self._state is not None and not self._state_unchanged():
            self.reset()
        watched, params = self._watch_list(), self._parameters()
        state = self._state_key(watched, params)
        static = [v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, Tensor) else v for v in values]
        graph = torch.cuda.CUDAGraph()
        self._register_generators(graph, device)
        optimizer_inside = all(group.get("capturable", False) for group in self.optimizer.param_groups)
        try:
            with graph_cache.capture_scope() as scope, ranges_in_place():
                with torch.cuda.graph(graph, pool=self._pool, stream=self._side_stream(device)):
                    loss = self._run(static[:num_inputs], static[num_inputs:])
                    if optimizer_inside:
                        self.optimizer.step()
        except RuntimeError as error:
            _end_generator_captures(device, self._generators(device))
            raise _NotCapturable(str(error).split("\n")[0]) from error
        after = self._watch_list()
        if (self._state_key(watched, params) != state or len(after) != len(watched)
                or any(a[0] is not b[0] or a[1] != b[1] for a, b in zip(after, watched))):
            raise _NotCapturable("the step replaced a parameter, gradient, buffer or optimizer state tensor")
        index_checks = []
        for data_ptr, shape, check in scope.index_checks:
            position = next((i for i, v in enumerate(static) if isinstance(v, Tensor) and v.data_ptr() == data_ptr
                             and tuple(v.shape) == shape), None)
            if position is None:
                raise _NotCapturable("an edge_index made inside the model cannot be range-checked before a replay")
            index_checks.append((position, check))
        if self._pool is None:
            self._pool = graph.pool()
        self._state, self._watched, self._grad_params = state, watched, params
        self._grads = [(p, p.grad) for p in params if p.grad is not None]
        entry = self._graphs[key] = _Captured(graph, static, loss.detach(), index_checks, optimizer_inside)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry

    # --- what the graphs depend on -----------------------------------------------------
    def _key(self, values: Sequence, num_inputs: int) -> Optional[Hashable]:
        """The shape signature of a call, or None where it runs eagerly (not all on CUDA, or capture unavailable)."""
        parts, cuda = [], False
        for i, v in enumerate(values):
            name = f"inputs[{i}]" if i < num_inputs else f"target[{i - num_inputs}]"
            if isinstance(v, Tensor):
                if v.layout != torch.strided:
                    raise TypeError(f"{name} must be a strided (dense) tensor, got layout {v.layout}")
                cuda = cuda or v.is_cuda
                parts.append((tuple(v.shape), v.dtype, v.device, v.requires_grad))
            elif isinstance(v, _CONSTANTS):
                parts.append((type(v), v))
            else:
                raise TypeError(f"{name} must be a Tensor or a constant (None, bool, int, float, str), got "
                                f"{type(v).__name__}")
        if not cuda or not all(not isinstance(v, Tensor) or v.is_cuda for v in values):
            return None
        return (tuple(parts), num_inputs, self.model.training, torch.is_grad_enabled())

    def _parameters(self) -> List[torch.nn.Parameter]:
        params = {id(p): p for p in self.model.parameters()}
        for group in self.optimizer.param_groups:
            params.update((id(p), p) for p in group["params"])
        return list(params.values())

    def _watch_list(self) -> list:
        """``(dict, key)`` of every tensor a graph reads or writes besides its inputs: the modules' parameters and
        buffers, and the optimizer's state (a list, because walking it is much cheaper than walking the modules)."""
        watched = []
        for module in self.model.modules():
            skip = RANGE_BUFFERS if isinstance(module, FakeQuantize) else ()  # written when read, never in a step
            watched.extend((module._parameters, name) for name, v in module._parameters.items() if v is not None)
            watched.extend((module._buffers, name) for name, v in module._buffers.items()
                           if v is not None and name not in skip)
        for state in self.optimizer.state.values():
            watched.extend((state, name) for name, v in state.items() if isinstance(v, Tensor))
        return watched

    def _state_key(self, watched: list, params: List[torch.nn.Parameter]) -> tuple:
        """Where every watched tensor and gradient lives (a replaced tensor, or one moved by ``.data =``, differs)."""
        return (id(self.optimizer.state), len(self.optimizer.state),
                tuple(table[name].data_ptr() for table, name in watched),
                tuple(0 if p.grad is None else p.grad.data_ptr() for p in params))

    def _state_unchanged(self) -> bool:
        """Whether the tensors the graphs read and write are still the captured ones."""
        return self._state_key(self._watched, self._grad_params) == self._state

    def _restore_grads(self) -> None:
        """Gives back the captured ``.grad`` tensors that the caller's ``optimizer.zero_grad()`` set to None (every
        step zeroes them first, so their stale values are never read)."""
        for p, grad in self._grads:
            if p.grad is None:
                p.grad = grad

    def _generators(self, device: torch.device) -> List[torch.Generator]:
        """The quantizers' own seeded generators (torch's default one is registered with every capture anyway)."""
        return [module.generator(device) for module in self.model.modules()
                if isinstance(module, FakeQuantize) and module.stochastic and module.seed is not None]

    def _register_generators(self, graph, device: torch.device) -> None:
        for generator in self._generators(device):
            if not hasattr(graph, "register_generator_state"):
                raise _NotCapturable("a quantizer's own seeded generator needs torch >= 2.5 to be captured")
            graph.register_generator_state(generator)


def _end_generator_captures(device: torch.device, generators: List[torch.Generator]) -> None:
    """After a failed capture: a trivial capture that succeeds, so the random generators it registers leave their
    capture state (a failed ``capture_end`` skips that, and every later random op would raise)."""
    with contextlib.suppress(RuntimeError):  # nothing more can be done here; the caller reports the first failure
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        for generator in generators:
            if hasattr(graph, "register_generator_state"):
                graph.register_generator_state(generator)
        with torch.cuda.graph(graph):
            torch.rand(1, device=device)
        del graph
