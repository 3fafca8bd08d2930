r"""A small cache of the graphs that layers build from one ``edge_index`` tensor.

Every layer of a model is called on the same ``edge_index`` tensor, and a full-batch
training loop calls the model on that tensor step after step.  Reading the edges (their
range check costs a host synchronisation) and building the layer's
:class:`~pyg_quant.graph.quant_graph.QuantGraph` (self-loop terms, GCN's degrees, and, filled
in on first use, the QAT aggregation's CSR matrices or the packed bit tiles) gives the
same result at every one of those calls, so :func:`cached_graph` builds it once and
hands out the same object afterwards.  Callers therefore treat a graph as read-only
after it is built: what is filled in later must be a pure function of the graph
(``QuantGraph._packed``, the CSR matrices per dtype).

An entry is keyed on

* the tensor's identity, held by a weak reference: the cache never keeps the user's
  tensor alive, and an entry (with its device memory) goes when its tensor does.  The
  graph is built from ``edge_index.detach()``, an alias that shares the storage but not
  the tensor object, so nothing built refers back to the user's tensor;
* ``edge_index._version``: in-place edits (``edge_index[0, 0] = 3``) bump it;
* ``data_ptr()``, shape, strides, dtype and device: what ``edge_index.data = ...`` or
  ``set_()`` can swap in without bumping the version;
* ``options``: everything else the graph depends on (the layer kind, node counts,
  ``flow``, self-loops, ``adj_bits``, normalization), given by the caller.  Since the
  node counts are part of the key, the range check that ran when the entry was built
  holds for every hit.

Only graphs without autograd history may be cached: callers pass an ``edge_index``
without ``edge_weight`` (integer indices carry no gradient), and a graph holding a
tensor that requires grad is never stored.  Nothing is cached while ``torch.compile``
traces (the traced graph cannot guard on this Python-side state, and it packs its tiles
inside one op anyway), in inference mode (inference tensors keep no version counter,
and a graph built there could not be saved for a later backward), or while a CUDA graph
is being captured (what is built there lives in the capture's private memory pool).  At
most :data:`MAX_ENTRIES` graphs are kept, the least recently used going first, so device
memory stays bounded.  :func:`graph_cache_disabled` turns the cache off for a block.

A capture by :class:`~pyg_quant.CapturedTrainStep` opens a :func:`capture_scope`: inside
it the layers share one graph per tensor as usual (kept in the scope, dropped with it),
and the range check of an ``edge_index`` whose bounds are not remembered is deferred (a
host synchronisation cannot be captured): the step runs it on each batch it copies into
the captured buffers, before the replay.  Without a scope, an unchecked ``edge_index``
cannot be captured (:func:`deferred_index_check` raises).

The index bounds of the tensors graphs were built from (three ints each, no device memory)
are remembered for many more tensors (:data:`MAX_BOUNDS`), under the same identity and
signature rules: rebuilding the evicted graph of a tensor seen before (a training epoch over
more GPU-resident batches than :data:`MAX_ENTRIES`) skips the range check's host
synchronisation, which on a GPU stalls the launch queue until the batch's copies and the
previous step are done.
"""
import contextvars
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator, Optional, Tuple

import torch

from .._utils import is_compiling

MAX_ENTRIES = 8
MAX_BOUNDS = 4096

# (id(edge_index), options) -> (weak reference to edge_index, its signature, graph).  A dict
# operation is atomic under the GIL, so threads need no lock: a race costs one extra build.
_entries: "OrderedDict[Tuple[int, Hashable], Tuple[weakref.ref, tuple, Any]]" = OrderedDict()
_enabled = True
# id(edge_index) -> (weak reference, signature, (lowest index, highest of row 0, highest of row 1)).
_bounds: "OrderedDict[int, Tuple[weakref.ref, tuple, Tuple[int, int, int]]]" = OrderedDict()
# The user's tensor whose graph is being built (the builder sees its detached alias).
_building: contextvars.ContextVar = contextvars.ContextVar("pyg_quant_graph_building", default=None)
# Whether CapturedTrainStep is looking for host synchronisations (see watching_syncs).
_watching: contextvars.ContextVar = contextvars.ContextVar("pyg_quant_watching_syncs", default=False)
# The CaptureScope of the CUDA graph being captured by CapturedTrainStep, if any.
_scope: contextvars.ContextVar = contextvars.ContextVar("pyg_quant_capture_scope", default=None)


class CaptureScope:
    """What one captured step shares and defers: its graphs, and the index checks to run before each replay.

    ``index_checks`` holds ``(data_ptr, shape, check)``: ``check(tensor)`` raises the layer's ValueError for a
    tensor whose indices do not fit; ``data_ptr`` / ``shape`` identify the captured buffer it was deferred for.
    """

    def __init__(self):
        self.graphs = {}
        self.index_checks = []


@contextmanager
def capture_scope() -> Iterator[CaptureScope]:
    """Opens a :class:`CaptureScope` for the block (a capture of one step)."""
    scope = CaptureScope()
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def deferred_index_check(edge_index: torch.Tensor, check: Callable[[torch.Tensor], None]) -> bool:
    """While a CUDA graph is captured, defer ``check(edge_index)`` (True) unless its bounds are remembered (False).

    Outside a capture it returns False: the caller checks now.  Inside one without a
    :func:`capture_scope` it raises, since the check's host synchronisation cannot be captured.
    """
    if not _capturing(edge_index) or _remembered_bounds(edge_index) is not None:
        return False
    scope = _scope.get()
    if scope is None:
        raise RuntimeError("the node indices of an edge_index seen for the first time cannot be checked while a CUDA "
                           "graph is captured (the check reads them on the host): run the step once before capturing "
                           "it, or capture it with pyg_quant.CapturedTrainStep, which checks every batch it replays")
    scope.index_checks.append((edge_index.data_ptr(), tuple(edge_index.shape), check))
    return True


@contextmanager
def watching_syncs() -> Iterator[None]:
    """A block that looks for host synchronisations (``torch.cuda.set_sync_debug_mode``): the index checks
    (:func:`host_read`) pause the debug mode, since a captured step defers them."""
    token = _watching.set(True)
    try:
        yield
    finally:
        _watching.reset(token)


@contextmanager
def host_read() -> Iterator[None]:
    """Around an intended host read (an index check) inside :func:`watching_syncs`: not reported as a sync."""
    if not _watching.get():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextmanager
def _building_from(edge_index: torch.Tensor) -> Iterator[None]:
    """The graph built in this block is the user's ``edge_index``'s (its bounds are remembered under it)."""
    token = _building.set(edge_index)
    try:
        yield
    finally:
        _building.reset(token)


def run_index_check(check: Callable[[torch.Tensor], None], edge_index: torch.Tensor) -> None:
    """``check(edge_index)`` for the user's own tensor, so that its bounds are remembered (one sync per tensor)."""
    with _building_from(edge_index):
        check(edge_index)


@contextmanager
def graph_cache_disabled() -> Iterator[None]:
    """Every layer builds its graph afresh inside this block (e.g. to compare against the cache)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def clear_graph_cache() -> None:
    """Drops every cached graph and every remembered index bound."""
    _entries.clear()
    _bounds.clear()


def cached_graph_count() -> int:
    """How many graphs are cached now."""
    return len(_entries)


def _signature(edge_index: torch.Tensor) -> Optional[tuple]:
    """What identifies ``edge_index``'s current values besides the tensor object, or None if it cannot be tracked."""
    try:
        version = edge_index._version
    except RuntimeError:  # an inference tensor keeps no version counter: in-place edits could not be seen
        return None
    return (version, edge_index.data_ptr(), tuple(edge_index.shape), edge_index.stride(), edge_index.dtype,
            edge_index.device)


def _cacheable(edge_index) -> bool:
    return (_enabled and isinstance(edge_index, torch.Tensor) and edge_index.layout == torch.strided
            and not edge_index.is_floating_point() and not is_compiling()
            and not torch.is_inference_mode_enabled())


def _capturing(edge_index: torch.Tensor) -> bool:
    return edge_index.is_cuda and torch.cuda.is_current_stream_capturing()


def _holds_autograd_history(value: Any, depth: int = 0) -> bool:
    """Whether a tensor reachable from ``value`` (its attributes, a few levels deep) requires grad."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if depth == 3:
        return False
    if isinstance(value, dict):
        children = value.values()
    elif isinstance(value, (tuple, list)):
        children = value
    elif hasattr(value, "__dict__"):
        children = vars(value).values()
    else:
        return False
    return any(_holds_autograd_history(child, depth + 1) for child in children)


def _forget_when_dead(table: OrderedDict, key: Hashable) -> Callable[[weakref.ref], None]:
    """A weakref callback dropping ``table[key]`` when its tensor dies (unless a newer entry took the key)."""
    def forget(ref: weakref.ref) -> None:
        entry = table.get(key)  # the closure holds the table, also while the module is torn down
        if entry is not None and entry[0] is ref:
            table.pop(key, None)
    return forget


def _bounds_owner(edge_index: torch.Tensor) -> Optional[Tuple[torch.Tensor, tuple]]:
    """``(the tensor whose bounds edge_index's are, its signature)``: the user's tensor whose graph
    :func:`cached_graph` is building from ``edge_index`` (its alias), or ``edge_index`` itself for a graph built
    outside the cache; None where its edits cannot be told (an inference tensor) or it is not the alias."""
    source = _building.get()
    signature = _signature(edge_index)
    if signature is None or (source is not None and _signature(source) != signature):
        return None
    return (edge_index if source is None else source), signature


def _remember(owner: Tuple[torch.Tensor, tuple], bounds: Tuple[int, int, int]) -> None:
    source, signature = owner
    _bounds[id(source)] = (weakref.ref(source, _forget_when_dead(_bounds, id(source))), signature, bounds)
    _bounds.move_to_end(id(source))
    while len(_bounds) > MAX_BOUNDS:
        _bounds.popitem(last=False)


def _remembered_bounds(edge_index: torch.Tensor, owner=None) -> Optional[Tuple[int, int, int]]:
    """The bounds remembered for ``edge_index``'s owner (:func:`_bounds_owner`), or None."""
    owner = _bounds_owner(edge_index) if owner is None else owner
    if owner is None:
        return None
    source, signature = owner
    entry = _bounds.get(id(source))
    if entry is not None and entry[0]() is source and entry[1] == signature:
        _bounds.move_to_end(id(source))
        return entry[2]
    return None


def remember_index_bounds(edge_index: torch.Tensor, bounds: Tuple[int, int, int]) -> None:
    """Records ``bounds`` (the lowest index, the highest of each row) of the ``[2, E]`` tensor ``edge_index`` for
    whoever made it knowing them without reading its device (a loader batch decoding what it packed on the host):
    the graphs built from it then skip the range check's host synchronization, until it is edited."""
    signature = _signature(edge_index)
    if signature is not None and not is_compiling():
        _remember((edge_index, signature), tuple(int(b) for b in bounds))


def index_bounds(edge_index: torch.Tensor, compute: Callable[[], Tuple[int, int, int]]) -> Tuple[int, int, int]:
    """``compute()`` (the ``[2, E]`` tensor's lowest index and the highest of each row: a host sync), or the bounds
    remembered for its owner (:func:`_bounds_owner`: the user's tensor whose graph :func:`cached_graph` is building
    from ``edge_index``, or ``edge_index`` itself), which are remembered from here on."""
    owner = _bounds_owner(edge_index)
    if owner is None:
        return compute()
    bounds = _remembered_bounds(edge_index, owner)
    if bounds is None:
        bounds = compute()
        _remember(owner, bounds)
    return bounds


def cached_graph(edge_index, options: Hashable, build: Callable[[Any], Any]):
    r"""``build(edge_index)``, or the result of an earlier call on the same unchanged tensor with equal ``options``.

    Args:
        edge_index: the adjacency as the layer got it.  Only a strided integer tensor
            (an ``edge_index``) is cached; any other input is passed to ``build`` as it is.
        options (hashable): everything besides ``edge_index`` that the result depends
            on, starting with a tag for the kind of graph (see the module docstring).
        build (callable): builds the graph from the adjacency; on a miss it gets
            ``edge_index.detach()``, which reads the same storage.
    """
    if not _cacheable(edge_index):
        return build(edge_index)
    scope = _scope.get()
    if scope is not None and _capturing(edge_index):
        # One graph per tensor within the captured step; it lives in the capture's memory pool, so it goes with the
        # scope.  The entry holds the tensor, so its id is not reused while the scope lasts.
        key = (id(edge_index), options)
        entry = scope.graphs.get(key)
        if entry is None or entry[0] is not edge_index:
            with _building_from(edge_index):
                entry = scope.graphs[key] = (edge_index, build(edge_index.detach()))
        return entry[1]
    signature = _signature(edge_index)
    if signature is None:
        return build(edge_index)
    key = (id(edge_index), options)
    entry = _entries.get(key)
    if entry is not None and entry[0]() is edge_index and entry[1] == signature:
        _entries.move_to_end(key)
        return entry[2]
    with _building_from(edge_index):
        graph = build(edge_index.detach())
    if _capturing(edge_index) or _holds_autograd_history(graph):
        return graph
    _entries[key] = (weakref.ref(edge_index, _forget_when_dead(_entries, key)), signature, graph)  # replaces a stale entry
    _entries.move_to_end(key)
    while len(_entries) > MAX_ENTRIES:
        _entries.popitem(last=False)
    return graph
