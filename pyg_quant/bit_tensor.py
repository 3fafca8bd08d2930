"""BitTensor: affine-quantized codes stored as packed bit planes (layout: :mod:`pyg_quant.layout`)."""
from typing import Optional, Tuple

import torch

from . import ops
from .layout import check_bits, check_layout, packed_words, row_code_bytes


def check_dim(dim) -> Optional[int]:
    """The dimension ranges are reduced over, ``None``, 0 or 1 (-2 and -1 taken as 0 and 1), else a ValueError."""
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, int) or dim not in (0, 1, -1, -2):
        raise ValueError(f"dim must be None, 0 or 1 (or -2, -1), got {dim!r}")
    return dim % 2


class BitTensor:
    r"""A 2-D tensor quantized affinely, ``x ≈ lo + scale · q`` with ``q ∈ [0, 2**bits − 1]``.

    Attributes:
        planes (Tensor): ``int32[bits, outer_pad, words]`` bit planes in
            :mod:`pyg_quant.layout`'s layout.
        shape (tuple): the logical ``(rows, cols)``.
        bits (int): code width, 1..8.
        layout (str): ``"row"`` (bits run along each row; the A operand of a
            GEMM) or ``"col"`` (bits run down each column; the B operand, and
            node features for :func:`pyg_quant.bit_spmm`).
        lo, scale (Tensor): float32 ranges: shape ``(1,)`` for ``dim=None``,
            ``(cols,)`` for ``dim=0``, ``(rows,)`` for ``dim=1``.
        dim (int or None): the dimension the ranges were reduced over.

    Build one with :func:`pyg_quant.to_bit`; get floats back with :func:`pyg_quant.to_val`.
    """

    __slots__ = ("_planes", "shape", "bits", "layout", "lo", "scale", "dim", "_other_layout", "_code_sums",
                 "_row_codes", "_codes")

    def __init__(self, planes: torch.Tensor, shape: Tuple[int, int], bits: int, layout: str,
                 lo: torch.Tensor, scale: torch.Tensor, dim: Optional[int]):
        self._set_fields(planes, shape, bits, layout, lo, scale, dim)
        if planes.dtype != torch.int32 or planes.dim() != 3 or planes.size(0) != bits:
            raise ValueError(f"planes must be int32[bits={bits}, outer, words], got "
                             f"{planes.dtype}{list(planes.shape)}")

    def _set_fields(self, planes: Optional[torch.Tensor], shape, bits, layout, lo, scale, dim) -> None:
        self._planes: Optional[torch.Tensor] = planes
        self.shape = (int(shape[0]), int(shape[1]))
        self.bits = check_bits(bits)
        self.layout = check_layout(layout)
        self.lo = lo
        self.scale = scale
        self.dim = check_dim(dim)
        self._other_layout: Optional["BitTensor"] = None
        self._code_sums: Optional[torch.Tensor] = None  # packed_code_sums(planes), when the quantizer made them
        self._row_codes: Optional[torch.Tensor] = None  # pack_row_codes(planes), once asked for
        self._codes: Optional[torch.Tensor] = None  # the codes as bytes, for a BitTensor built from_codes
        expected = {None: 1, 0: self.shape[1], 1: self.shape[0]}[self.dim]
        if lo.shape != (expected,) or scale.shape != (expected,):
            raise ValueError(f"lo and scale must have shape ({expected},) for dim={self.dim}, "
                             f"got {tuple(lo.shape)} and {tuple(scale.shape)}")

    @classmethod
    def from_quantized(cls, packed: Tuple[torch.Tensor, ...], shape: Tuple[int, int], bits: int,
                       dim: int, layout: Optional[str] = None) -> "BitTensor":
        """The BitTensor ``shape`` ``(rows, cols)`` of ``ops.quantize_pack_ranges``' result ``packed`` = ``(planes,
        lo, scale, code_sums, row_codes)`` packed in ``layout`` (by default the column layout for ranges per column,
        ``dim`` 0, and the row layout per row), with the row codes or the code sums it came with (whichever is not
        empty).  The op has checked what the constructor would, so nothing is checked again: the layers' eager
        forward makes one of these a call."""
        planes, lo, scale, code_sums, row_codes = packed
        out = object.__new__(cls)
        out._planes, out.shape, out.bits, out.lo, out.scale, out.dim = (
            planes, (int(shape[0]), int(shape[1])), int(bits), lo, scale, dim)
        out.layout = layout if layout is not None else "col" if dim == 0 else "row"
        out._other_layout, out._codes = None, None
        has_codes = row_codes.numel() > 0
        out._row_codes = row_codes if has_codes else None
        out._code_sums = None if has_codes else code_sums
        return out

    @classmethod
    def from_row_codes(cls, row_codes: torch.Tensor, shape: Tuple[int, int], bits: int, lo: torch.Tensor,
                       scale: torch.Tensor, dim: Optional[int]) -> "BitTensor":
        """A column-layout BitTensor held as its packed row codes (``uint8[packed_words(rows)·32, row bytes]``, see
        :mod:`pyg_quant.layout`): what the CSR gather of :func:`pyg_quant.bit_spmm` reads.  Its planes are made from
        them the first time they are asked for (:func:`pyg_quant.ops.planes_from_row_codes`)."""
        rows, cols = int(shape[0]), int(shape[1])
        nodes, row_bytes = packed_words(rows) * 32, row_code_bytes(cols, check_bits(bits))
        if (row_codes.dtype != torch.uint8 or tuple(row_codes.shape) != (nodes, row_bytes)
                or not row_codes.is_contiguous()):
            raise ValueError(f"row_codes must be contiguous uint8[{nodes}, {row_bytes}] for {rows} x {cols} "
                             f"{bits}-bit codes, got {row_codes.dtype}{list(row_codes.shape)}")
        out = cls.__new__(cls)
        out._set_fields(None, shape, bits, "col", lo, scale, dim)
        out._row_codes = row_codes
        return out

    @classmethod
    def from_codes(cls, codes: torch.Tensor, bits: int, lo: torch.Tensor, scale: torch.Tensor, dim: Optional[int],
                   layout: str) -> "BitTensor":
        """A BitTensor held as its codes, ``uint8[rows, cols]`` below ``2**bits`` (what
        :class:`~pyg_quant.loader.QuantClusterLoader` stores), packed into planes in ``layout`` the first time they
        are asked for.  The CPU product of a QAT layer that takes the codes as they are reads the bytes themselves; a
        move to another device, or pinned memory, packs them first (the planes are the smaller transfer)."""
        if codes.dtype != torch.uint8 or codes.dim() != 2 or not codes.is_contiguous():
            raise ValueError(f"codes must be a contiguous uint8 [rows, cols] tensor, got {codes.dtype}"
                             f"{list(codes.shape)}")
        out = cls.__new__(cls)
        out._set_fields(None, tuple(codes.shape), bits, layout, lo, scale, dim)
        out._codes = codes
        return out

    @property
    def planes(self) -> torch.Tensor:
        """``int32[bits, outer_pad, words]`` (:mod:`pyg_quant.layout`); made on first use by a BitTensor built
        :meth:`from_codes` or :meth:`from_row_codes`."""
        return self._made_once("_planes", lambda: (
            ops.pack_codes(self._codes, self.bits, self.layout == "col") if self._codes is not None
            else ops.planes_from_row_codes(self._row_codes, self.rows, self.cols, self.bits)))

    def _made_once(self, name: str, make):
        """The field ``name``, made by ``make()`` when missing and kept, except while ``torch.compile`` traces: kept
        on an input, a traced graph's output would outlive its run (a CUDA graph's, under reduce-overhead, is
        overwritten by the next replay)."""
        value = getattr(self, name)
        if value is None:
            value = make()
            if not torch.compiler.is_compiling():
                setattr(self, name, value)
        return value

    @property
    def has_planes(self) -> bool:
        """Whether the planes are made (False only for a :meth:`from_codes` or :meth:`from_row_codes` tensor not yet
        asked for them)."""
        return self._planes is not None

    @property
    def byte_codes(self) -> Optional[torch.Tensor]:
        """The ``uint8[rows, cols]`` codes a :meth:`from_codes` tensor holds; None for any other."""
        return self._codes

    def _held(self) -> torch.Tensor:
        """The tensor the codes live in now: the planes, else the codes or the row codes they come from."""
        if self._planes is not None:
            return self._planes
        return self._codes if self._codes is not None else self._row_codes

    # --- shape and storage -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._held().device

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held: the planes (padding included; the codes or row codes while the planes are not made) plus the
        ranges."""
        return sum(t.numel() * t.element_size() for t in (self._held(), self.lo, self.scale))

    def codes(self) -> torch.Tensor:
        """The integer codes as ``uint8[rows, cols]`` (a :meth:`from_codes` tensor's own)."""
        if self._codes is not None:
            return self._codes
        return ops.unpack_codes(self.planes, self.rows, self.cols, self.layout == "col")

    def code_sums(self) -> torch.Tensor:
        """Sums of the codes along the packed dimension (row sums for ``"row"``, column sums for ``"col"``)."""
        outer = self.rows if self.layout == "row" else self.cols
        sums = self._code_sums if self._code_sums is not None else ops.packed_code_sums(self.planes)
        return sums[:outer]

    def row_codes(self) -> torch.Tensor:
        """The packed row codes (:mod:`pyg_quant.layout`, "Row codes"), ``uint8[nodes_pad, row bytes]``; made once."""
        return self._made_once("_row_codes", lambda: ops.pack_row_codes(self.planes, self.cols, self.layout == "col"))

    def _replace(self, **fields) -> "BitTensor":
        state = {k: getattr(self, k) for k in ("planes", "shape", "bits", "layout", "lo", "scale", "dim")}
        state.update(fields)
        return BitTensor(**state)

    def _moved(self, move) -> "BitTensor":
        if self._planes is None and self._codes is not None:  # (a move off the CPU packed them first)
            return BitTensor.from_codes(move(self._codes), self.bits, move(self.lo), move(self.scale), self.dim,
                                        self.layout)
        if self._planes is None:  # still held as row codes: they move, the planes are made where needed
            return BitTensor.from_row_codes(move(self._row_codes), self.shape, self.bits, move(self.lo),
                                            move(self.scale), self.dim)
        return self._replace(planes=move(self._planes), lo=move(self.lo), scale=move(self.scale))

    def to(self, device=None, non_blocking: bool = False) -> "BitTensor":
        if self._codes is not None and device is not None and torch.device(device) != self.device:
            self.planes  # packed where the codes are: the planes travel
        return self._moved(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "BitTensor":
        if self._codes is not None:
            self.planes  # pinned planes, which a later non-blocking copy moves
        return self._moved(lambda t: t.pin_memory())

    def as_layout(self, layout: str) -> "BitTensor":
        """The same codes packed in ``layout``; repacked once and cached."""
        if check_layout(layout) == self.layout:
            return self
        def repacked() -> "BitTensor":
            codes = self.codes().float()
            zero = codes.new_zeros(1, 1)
            return self._replace(planes=ops.quantize_pack(codes, zero, zero + 1, self.bits, layout == "col", None),
                                 layout=layout)

        return self._made_once("_other_layout", repacked)

    def __repr__(self) -> str:
        granularity = {None: "tensor", 0: "column", 1: "row"}[self.dim]
        return (f"BitTensor(shape={self.shape}, bits={self.bits}, layout={self.layout!r}, "
                f"scale_per={granularity}, device={self.device}, nbytes={self.nbytes})")


def to_val(bt: BitTensor) -> torch.Tensor:
    """Dequantizes: ``lo + scale · q`` as float32 ``[rows, cols]``."""
    if not isinstance(bt, BitTensor):
        raise TypeError(f"bt must be a BitTensor, got {type(bt).__name__}")
    # One pass over the planes (each operation rounded to float32 as in lo + scale * q), not unpack + cast + two.
    return ops.dequantize(bt.planes, bt.rows, bt.cols, bt.layout == "col", bt.lo, bt.scale,
                          -1 if bt.dim is None else bt.dim)
