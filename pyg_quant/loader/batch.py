r"""QuantBatch: a batch as one ``uint8`` buffer in a compact wire format.

A batch holds an adjacency, low-bit features, labels, masks and node ids: a
dozen small tensors.  Copied one by one, each is its own host-to-device transfer
(and its own pinned staging copy).  Here they are laid out once, at 64-byte
aligned offsets, in a single buffer, each in its *wire* form::

    buffer: uint8[nbytes]
    ┌───────────────────────────┬──────────────┬──────────┬────┬───────┬─────┐
    │adj: tile plan + 1 B/edge  │x.planes      │x.lo,scale│ y  │ masks │n_id │
    └───────────────────────────┴──────────────┴──────────┴────┴───────┴─────┘

* a :class:`~pyg_quant.graph.bit_adjacency.CompactAdjacency` travels as its plan
  (one byte per edge instead of a 512-byte bit tile per 16 × 256 block) and
  becomes a :class:`~pyg_quant.BitAdjacency` where the batch is, on first access:
  with its tiles, or without (every entry in the CSR, which ``bit_spmm`` gathers
  faster than nearly empty tiles), as the batch's ``adjacency`` option says
  (``"auto"``: without when the tiles would be less than
  :data:`~pyg_quant.graph.adjacency_form.MIN_TILE_FILL` full; default :data:`~pyg_quant.graph.adjacency_form.DEFAULT_ADJACENCY`, ``"auto"``),
  in one op that reads its parts in place, narrowed as they travel (:meth:`CompactAdjacency.expand_wire`);
* a :class:`~pyg_quant.BitTensor` travels without the padding of its outer
  dimension (re-added on access), unless that padding is at most 1/16 of it
  (then the decoded planes are views of the buffer); one held as its codes
  (``feature_dim=1``, :meth:`~pyg_quant.BitTensor.from_codes`) travels as
  those bytes;
* an integer tensor travels in the narrowest integer type that holds its values
  (``y`` with 47 classes as ``int8``, node ids as ``int32``) and is widened back
  to its dtype on access;
* a :class:`~pyg_quant.BitAdjacency` and any other tensor travel as they are.

:meth:`QuantBatch.pin_memory` pins that one buffer (one copy; none when the
loader allocated it pinned), and :meth:`QuantBatch.to` moves it with one
``non_blocking`` copy; the decoding then runs on the device, as a few kernels
queued on the current stream, without synchronising with the host.  A batch
copied on one stream and read on another (``prefetch(..., side_stream=True)``)
is handed over with :meth:`QuantBatch.record_stream`.
"""
import math
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..bit_tensor import BitTensor
from ..graph.adjacency_form import check_adjacency_form
from ..graph.bit_adjacency import BitAdjacency, CompactAdjacency
from ..graph.cache import remember_index_bounds

ALIGN = 64  # bytes: a cache line, and a multiple of every element size

_Spec = Tuple[str, torch.dtype, Tuple[int, ...], int]  # name, wire dtype, shape, byte offset

_ADJ_SCALARS = ("num_rows", "num_cols", "nnz", "max_row_sum")
_BIT_TENSORS = ("planes", "lo", "scale")
_NARROW_INTS = (torch.int8, torch.int16, torch.int32)
_WIDE_INTS = (torch.int16, torch.int32, torch.int64)


def _narrowed(tensor: torch.Tensor, extremes: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """``tensor`` in the narrowest signed integer type holding its values (itself if none is narrower);
    ``extremes``: its lowest and highest value where the caller has read them."""
    if tensor.dtype not in _WIDE_INTS or tensor.numel() == 0:
        return tensor
    low, high = extremes if extremes is not None else (int(tensor.min()), int(tensor.max()))
    for dtype in _NARROW_INTS:
        info = torch.iinfo(dtype)
        if dtype.itemsize >= tensor.element_size():
            return tensor
        if info.min <= low and high <= info.max:
            return tensor.to(dtype)
    return tensor


def _widened(view: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return view if dtype is None else view.to(dtype)


def _bounded(tensor: torch.Tensor, bounds: Optional[tuple]) -> torch.Tensor:
    """``tensor``, its index bounds (read when the batch was packed) remembered for the graphs built from it."""
    if bounds is not None:
        remember_index_bounds(tensor, bounds)
    return tensor


def _outer_rows(value: BitTensor) -> int:
    return value.rows if value.layout == "row" else value.cols


def _index_pair(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` may be an ``edge_index``: integer ``[2, E]``, not empty."""
    return (tensor.dim() == 2 and tensor.size(0) == 2 and tensor.numel() > 0
            and not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool)


def _flatten(fields: Dict[str, object]) -> Tuple[Dict[str, torch.Tensor], Dict[str, object]]:
    """Splits fields into the wire tensors that go into the buffer and a picklable description of the rest."""
    tensors: Dict[str, torch.Tensor] = {}
    meta: Dict[str, object] = {"objects": {}, "values": {}, "dtypes": {}, "order": list(fields), "index_bounds": {}}

    def add_narrowed(key: str, tensor: torch.Tensor, extremes=None) -> None:  # the dtype to widen back to: in meta
        tensors[key] = _narrowed(tensor, extremes)
        if tensors[key].dtype != tensor.dtype:
            meta["dtypes"][key] = tensor.dtype

    for name, value in fields.items():
        if isinstance(value, CompactAdjacency):
            for attr, tensor in value.tensors().items():  # the decode widens them to what the expansion takes
                tensors[f"{name}.{attr}"] = _narrowed(tensor)
            meta["objects"][name] = ("CompactAdjacency", value.scalars())
        elif isinstance(value, BitAdjacency):
            for attr in BitAdjacency._TENSORS:
                if getattr(value, attr) is not None:
                    tensors[f"{name}.{attr}"] = getattr(value, attr)
            meta["objects"][name] = ("BitAdjacency", {attr: getattr(value, attr) for attr in _ADJ_SCALARS})
        elif isinstance(value, BitTensor) and value.byte_codes is not None and not value.has_planes:
            # codes kept as bytes (a QAT layer's CPU product reads them so): they travel as they are
            tensors[f"{name}.codes"] = value.byte_codes
            tensors[f"{name}.lo"], tensors[f"{name}.scale"] = value.lo, value.scale
            meta["objects"][name] = ("BitTensor", {"shape": value.shape, "bits": value.bits, "layout": value.layout,
                                                   "dim": value.dim})
        elif isinstance(value, BitTensor):
            planes, outer = value.planes, _outer_rows(value)
            # A padding of at most 1/16 of the planes travels with them, so that the decode reads them in place
            # (Cora's 1,433 features padded to 1,472); a larger one is left out and re-added on decode.
            tensors[f"{name}.planes"] = planes if (planes.size(1) - outer) * 16 <= outer else planes[:, :outer]
            tensors[f"{name}.lo"], tensors[f"{name}.scale"] = value.lo, value.scale
            meta["objects"][name] = ("BitTensor", {"shape": value.shape, "bits": value.bits,
                                                   "layout": value.layout, "dim": value.dim,
                                                   "outer_pad": value.planes.size(1)})
        elif isinstance(value, torch.Tensor):
            extremes = None
            if _index_pair(value):  # read here, where the batch is packed: its decoded copy skips the range check
                lows, highs = (t.tolist() for t in torch.aminmax(value, dim=1))
                meta["index_bounds"][name] = (min(lows), *highs)
                extremes = (min(lows), max(highs))
            add_narrowed(name, value, extremes)
        else:
            meta["values"][name] = value
    return tensors, meta


def _view(buffer: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...], offset: int) -> torch.Tensor:
    size = math.prod(shape) * dtype.itemsize
    return buffer[offset:offset + size].view(dtype).view(shape)


class _Views:
    """A batch's fields as views of its buffer: the buffer viewed once per dtype, each field a window of that view
    (one op a field where :func:`_view` takes three: a loader's loop is bound by its host's time)."""

    __slots__ = ("buffer", "typed")

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.typed = buffer, {}

    def __call__(self, dtype: torch.dtype, shape: Tuple[int, ...], offset: int) -> torch.Tensor:
        itemsize = dtype.itemsize
        typed = self.typed.get(dtype)
        if typed is None:
            buffer = self.buffer
            whole = buffer.numel() - buffer.numel() % itemsize
            aligned = buffer.storage_offset() % itemsize == 0
            typed = self.typed[dtype] = buffer[:whole].view(dtype) if aligned else False
        numel = math.prod(shape)
        if typed is False or offset % itemsize or offset + numel * itemsize > typed.numel() * itemsize:
            return _view(self.buffer, dtype, shape, offset)
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return typed.as_strided(shape, strides[::-1], typed.storage_offset() + offset // itemsize)


class _Decode:
    """A field still in wire form: ``decode()`` builds it (once; the batch caches the result)."""

    __slots__ = ("decode", "kind")

    def __init__(self, decode: Callable[[], object], kind: str):
        self.decode, self.kind = decode, kind


def _tensors_in(value) -> List[torch.Tensor]:
    """``value`` if a tensor, else the tensors among its attributes (one level: a BitAdjacency's, a BitTensor's)."""
    if isinstance(value, torch.Tensor):
        return [value]
    names = [name for cls in type(value).__mro__ for name in getattr(cls, "__slots__", ())]
    names += list(getattr(value, "__dict__", {}))
    return [t for t in (getattr(value, name, None) for name in names) if isinstance(t, torch.Tensor)]


def _padded_bit_tensor(parts: Dict[str, torch.Tensor], scalars: Dict[str, object]) -> BitTensor:
    if "codes" in parts:
        return BitTensor.from_codes(parts["codes"], scalars["bits"], parts["lo"], parts["scale"], scalars["dim"],
                                    scalars["layout"])
    scalars = dict(scalars)
    planes = parts["planes"]
    pad = scalars.pop("outer_pad") - planes.size(1)
    if pad:  # one op over the planes; an outer dimension that needs no padding is read in place, as float x is
        planes = torch.nn.functional.pad(planes, (0, 0, 0, pad))
    return BitTensor(planes, lo=parts["lo"], scale=parts["scale"], **scalars)


class QuantBatch:
    r"""A mini-batch whose tensors all travel in one contiguous ``uint8`` buffer.

    Fields are read as attributes (``batch.adj``, ``batch.x``, ``batch.y``,
    ``batch.train_mask``, ``batch.n_id``, ...) or by name (``batch["y"]``); a
    field in wire form (see the module docstring) is decoded on the batch's
    device the first time it is read, and kept.  :meth:`wire_tensors` gives the
    buffer's views as they travel.  Built by
    :class:`pyg_quant.loader.QuantClusterLoader`; see there for the fields.

    Attributes:
        num_nodes (int): nodes in the batch.
        nbytes (int): bytes of the buffer, i.e. of one transfer.
        deg (Tensor): float32 ``[num_nodes]``, the weighted in-degree of every
            node in ``adj``, self-loop term included (``adj.degree()``: what GCN
            normalises by); derived on the batch's device from ``adj.row_sums``
            and ``adj.diag``, so it costs nothing to transfer.
    """

    def __init__(self, buffer: torch.Tensor, specs: Tuple[_Spec, ...], meta: Dict[str, object]):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(f"buffer must be a 1-D uint8 tensor, got {buffer.dtype}{list(buffer.shape)}")
        self.__dict__.update(_buffer=buffer, _specs=specs, _meta=meta, _added={}, _deg=None)
        self.__dict__["_fields"] = self._materialize()

    @classmethod
    def from_fields(cls, fields: Dict[str, object], pin_memory: bool = False,
                    adjacency: Optional[str] = None) -> "QuantBatch":
        r"""Copies the tensors of ``fields`` (Tensors, CompactAdjacency, BitAdjacency, BitTensor; other
        values are kept as they are) in wire form into one new buffer, pinned when ``pin_memory``.

        ``adjacency`` is the form a CompactAdjacency field decodes to: ``"tiles"`` (its planned
        tiles), ``"csr"`` (no tiles, every entry in the CSR) or ``"auto"`` (``"csr"`` when the tiles
        would be less than :data:`~pyg_quant.graph.adjacency_form.MIN_TILE_FILL` full); None (the default)
        is :data:`~pyg_quant.graph.adjacency_form.DEFAULT_ADJACENCY`.  The wire form is the same for all three."""
        adjacency = check_adjacency_form(adjacency)
        tensors, meta = _flatten(fields)
        meta["adjacency"] = adjacency
        specs: List[_Spec] = []
        offset = 0
        for name, tensor in tensors.items():
            offset = -(-offset // ALIGN) * ALIGN
            specs.append((name, tensor.dtype, tuple(tensor.shape), offset))
            offset += tensor.numel() * tensor.element_size()
        buffer = torch.empty(max(offset, 1), dtype=torch.uint8, pin_memory=pin_memory)
        end = 0
        view = _Views(buffer)
        for (name, dtype, shape, start), tensor in zip(specs, tensors.values()):
            buffer[end:start].zero_()  # alignment gaps hold zeros: equal batches have equal buffers
            view(dtype, shape, start).copy_(tensor)
            end = start + tensor.numel() * tensor.element_size()
        buffer[end:].zero_()
        return cls(buffer, tuple(specs), meta)

    def wire_tensors(self) -> Dict[str, torch.Tensor]:
        """The buffer's views, by name (``"adj.entry_col"``, ``"x.planes"``, ``"y"``, ...), as they travel."""
        view = _Views(self._buffer)
        return {name: view(dtype, shape, offset) for name, dtype, shape, offset in self._specs}

    def _materialize(self) -> Dict[str, object]:
        # Every field is made from its views of the buffer when first read: a batch copied to a device and handed
        # over (prefetch) pays for the fields it uses, each view a few host ops.
        buffer, meta = self._buffer, self._meta
        view = _Views(buffer)
        by_key, by_field = {}, {}  # a plain field's spec; an object field's parts' specs
        for key, dtype, shape, offset in self._specs:
            by_key[key] = (dtype, shape, offset)
            field, _, attr = key.partition(".")
            by_field.setdefault(field, {})[attr] = (dtype, shape, offset)
        fields: Dict[str, object] = {}
        for name in meta["order"]:
            if name in meta["objects"]:
                kind, scalars = meta["objects"][name]
                specs = by_field.get(name, {})

                def parts(specs=specs):
                    return {attr: view(*spec) for attr, spec in specs.items()}
                if kind == "BitAdjacency":
                    fields[name] = _Decode(lambda parts=parts, scalars=scalars: BitAdjacency(
                        **{attr: parts().get(attr) for attr in BitAdjacency._TENSORS}, **scalars), "BitAdjacency")
                elif kind == "CompactAdjacency":  # its narrowed parts widened and expanded in one op
                    fields[name] = _Decode(lambda specs=specs, scalars=scalars: CompactAdjacency.expand_wire(
                        buffer, specs, scalars, self.adjacency), "BitAdjacency")
                else:
                    fields[name] = _Decode(lambda parts=parts, scalars=scalars: _padded_bit_tensor(parts(), scalars),
                                           "BitTensor")
            elif name in by_key:
                wide = meta["dtypes"].get(name)
                bounds = meta.get("index_bounds", {}).get(name)  # (batches pickled before kept none)
                fields[name] = _Decode(lambda spec=by_key[name], wide=wide, bounds=bounds: _bounded(
                    _widened(view(*spec), wide), bounds), "Tensor")
            else:
                fields[name] = meta["values"][name]
        return fields

    def _field(self, name: str):
        value = self._fields[name]
        if isinstance(value, _Decode):
            value = self._fields[name] = value.decode()
        return value

    # --- field access -----------------------------------------------------------------
    def __getattr__(self, name: str):
        # Only called when normal lookup fails, i.e. for fields.
        fields = self.__dict__.get("_fields")
        if fields is not None and name in fields:
            return self._field(name)
        raise AttributeError(f"'{type(self).__name__}' has no field {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_"):
            raise AttributeError(f"cannot set private attribute {name!r} of a QuantBatch")
        # Fields added after the fact are not in the buffer; .to() moves them one by one.
        self._fields[name] = value
        self._added[name] = value

    def __getitem__(self, name: str):
        return self._field(name)

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def keys(self) -> List[str]:
        return list(self._fields)

    def items(self) -> Iterator[Tuple[str, object]]:
        return ((name, self._field(name)) for name in list(self._fields))

    @property
    def nbytes(self) -> int:
        return self._buffer.numel()

    @property
    def adjacency(self) -> str:
        """The form a wire adjacency decodes to: ``"auto"``, ``"tiles"`` or ``"csr"`` (see :meth:`from_fields`)."""
        return self._meta.get("adjacency", "tiles")  # batches pickled before the option decoded to tiles

    @property
    def buffer(self) -> torch.Tensor:
        """The ``uint8`` buffer every field is a view of."""
        return self._buffer

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    @property
    def deg(self) -> torch.Tensor:
        if self._deg is None:
            self.__dict__["_deg"] = self._field("adj").degree()
        return self._deg

    def is_pinned(self) -> bool:
        return self._buffer.is_pinned()

    def record_stream(self, stream) -> "QuantBatch":
        r"""Marks the batch's device memory as used by ``stream`` (``Tensor.record_stream`` on the buffer, on the
        fields decoded so far and on those added after the fact); returns ``self``.

        For a batch copied on one stream and read on another: the caching allocator then hands the memory out
        again only once the work queued on ``stream`` before the batch is freed is done.  A no-op on the CPU.
        """
        values = [self._buffer, self._deg, *self._added.values(),
                  *(value for value in self._fields.values() if not isinstance(value, _Decode))]
        for value in values:
            for tensor in _tensors_in(value):
                if tensor.is_cuda:
                    tensor.record_stream(stream)
        return self

    # --- moving ---------------------------------------------------------------------------
    def _rebuilt(self, buffer: torch.Tensor, move) -> "QuantBatch":
        out = QuantBatch(buffer, self._specs, self._meta)
        for name, value in self._added.items():
            setattr(out, name, move(value))
        return out

    def to(self, device=None, non_blocking: Optional[bool] = None) -> "QuantBatch":
        r"""The batch on ``device``: one copy of the buffer, then views of the copy.

        ``non_blocking`` defaults to True when the buffer is pinned and goes to an
        accelerator (an asynchronous copy on the current stream; kernels queued
        after it on that stream see the data), and to False otherwise: a
        non-blocking copy *to* the host would let the CPU read it before it lands.
        Returns ``self`` when the batch is already on ``device``.
        """
        device = torch.device(device) if device is not None else self.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        here = self.device
        if device == here:
            return self
        if non_blocking is None:
            non_blocking = here.type == "cpu" and device.type != "cpu" and self._buffer.is_pinned()

        def move(value):
            return value.to(device, non_blocking=non_blocking) if hasattr(value, "to") else value

        return self._rebuilt(self._buffer.to(device, non_blocking=non_blocking), move)

    def cuda(self, device=None, non_blocking: Optional[bool] = None) -> "QuantBatch":
        if device is None:
            device = torch.device("cuda")
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        return self.to(device, non_blocking=non_blocking)

    def cpu(self) -> "QuantBatch":
        return self.to("cpu")

    def pin_memory(self) -> "QuantBatch":
        """The batch with its buffer in page-locked memory (one copy; ``self`` if already pinned).

        Called by ``DataLoader(pin_memory=True)``."""
        if self._buffer.is_pinned():
            return self

        def move(value):
            return value.pin_memory() if hasattr(value, "pin_memory") else value

        return self._rebuilt(self._buffer.pin_memory(), move)

    # --- pickling: only the buffer travels (one shared-memory block between DataLoader workers)
    def __getstate__(self):
        return {"buffer": self._buffer, "specs": self._specs, "meta": self._meta, "added": self._added}

    def __setstate__(self, state):
        self.__init__(state["buffer"], state["specs"], state["meta"])
        for name, value in state["added"].items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        def describe(value):
            if isinstance(value, _Decode):
                return f"{value.kind}(wire)"
            if isinstance(value, torch.Tensor):
                return f"{list(value.shape)}"
            if isinstance(value, (BitAdjacency, BitTensor)):
                return f"{type(value).__name__}{list(value.shape)}"
            return repr(value)

        fields = ", ".join(f"{name}={describe(value)}" for name, value in self._fields.items())
        return f"QuantBatch({fields}, nbytes={self.nbytes}, device={self.device})"
