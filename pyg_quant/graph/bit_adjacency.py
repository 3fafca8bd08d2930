r"""The bit adjacency in its two forms: :class:`BitAdjacency`, what the kernels read, and :class:`CompactAdjacency`,
its tile plan with one byte per edge, the form a loader batch travels in.

Each builds the other (:meth:`BitAdjacency.from_edge_index` plans, then expands the plan;
:meth:`CompactAdjacency.expand` writes a BitAdjacency), so the two live in one module.  The tile format is described
once, in :mod:`pyg_quant.layout`; which form a plan decodes to is :mod:`pyg_quant.graph.adjacency_form`'s rule, and
the product ``A·X`` is :mod:`pyg_quant.graph.spmm`'s.  Rows are message *targets* and columns *sources* (PyG's
``source_to_target`` flow: ``edge_index[0]`` is the source ``j``, ``edge_index[1]`` the target ``i``).

A BitAdjacency tile spends 4,096 bits on a 16 × 256 block whatever it holds; on METIS cluster batches tiles are
~2% full, ~45 bits per edge.  A CompactAdjacency keeps the same matrix as the *plan* of those tiles plus, for every
entry in a tile, the one byte that says its column inside the tile::

    tile_key   int32[T]        window · col_tiles + col_tile of each tile, sorted
    row_count  uint8[T, 16]    entries in each of the tile's 16 rows (int16 if one holds 256)
    entry_col  uint8[E_t]      column inside the tile of each tile entry, row-major order
    entry_val  uint8[E_t]      its multiplicity (absent when every tile entry is 1)
    res_row, res_col  int32    the CSR residual as coordinates, row-major
    res_val    int32           residual multiplicities (absent when all are 1)
    diag       uint8[R]        the self-loop term (absent without self loops)

about 8–10 bits per edge on cluster batches.  :meth:`CompactAdjacency.expand` writes the tiles on whatever device
the plan is on (the ``expand_tiles`` op: one pass on the CPU, three kernels on the GPU, a torch reference elsewhere;
every size is known on the host, so no synchronisation), and returns exactly the BitAdjacency that
:meth:`BitAdjacency.from_edge_index` builds, field for field.  Row-major entry order is the order of the sorted keys
the plan is made from, so planning (the ``tile_plan`` op) needs no sort beyond the one that made the keys distinct.

The same plan also decodes into a tile-free BitAdjacency, every entry in its CSR (``expand(tiles=False)``, the
``expand_csr`` op: a count and one merge pass per row on the CPU, two row kernels and a cumsum on the GPU, again with
no host synchronisation), exactly what ``from_edge_index`` builds with ``min_tile_nnz`` above 4096; ``"auto"`` picks
that form when the plan's tiles would be less than :data:`~pyg_quant.graph.adjacency_form.MIN_TILE_FILL` full,
where ``bit_spmm``'s CSR gather beats the tiles.  The wire form is the same either way (~10 bits per edge instead of
the 64 of an int32 CSR with values).  A loader batch's plan, its integers narrowed as they travel, is expanded
straight from the batch's buffer by one op (:meth:`CompactAdjacency.expand_wire`, the ``expand_wire`` op).
"""
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np
import torch

from .. import ops
from .._utils import INT32_MAX
from ..layout import TILE_COLS, TILE_ROWS
from .adjacency_form import DEFAULT_MIN_TILE_NNZ, check_adjacency_form, tiles_wanted
from .float_csr import RebuiltOnCopy

MAX_ADJ_PLANES = 8  # bit planes per entry that the bit_spmm kernels accept


def distinct_entries(keys: torch.Tensor):
    """Sorted distinct ``keys`` and how often each occurs (numpy's vectorised sort on the CPU:
    ~4x faster than ``torch.unique`` there)."""
    if keys.device.type != "cpu" or keys.numel() == 0:
        return torch.unique(keys, return_counts=True)
    ordered = np.sort(keys.numpy())
    first = np.empty(ordered.size, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    counts = np.diff(np.append(starts, ordered.size))
    return torch.from_numpy(ordered[starts]), torch.from_numpy(counts)


def check_edge_index_form(edge_index, name: str = "edge_index") -> torch.Tensor:
    """``edge_index`` checked to be an int64 or int32 tensor of shape ``[2, num_edges]`` (errors name ``name``)."""
    if not isinstance(edge_index, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(edge_index).__name__}")
    if edge_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 or int32, got {edge_index.dtype}")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"{name} must have shape [2, num_edges], got {tuple(edge_index.shape)}")
    return edge_index


def _check_edge_index(edge_index, num_src: int, num_dst: int) -> torch.Tensor:
    edge_index = check_edge_index_form(edge_index).long()
    if edge_index.numel() > 0:
        if int(edge_index.min()) < 0:
            raise ValueError("edge_index holds negative node indices")
        if int(edge_index[0].max()) >= num_src or int(edge_index[1].max()) >= num_dst:
            raise ValueError(f"edge_index holds node indices out of range for num_nodes="
                             f"{num_src if num_src == num_dst else (num_src, num_dst)}")
    return edge_index


def _tile_fill(entries: int, num_tiles: int) -> float:
    """Tile entries over the capacity of ``num_tiles`` tiles (0 without tiles)."""
    return entries / max(1, num_tiles * TILE_ROWS * TILE_COLS)


class BitAdjacency:
    r"""A graph's adjacency as block-sparse bit tiles of 16 rows × 256 columns plus a CSR residual.

    ``A[i, j]`` is the number of edges ``j → i`` (duplicates add up, as in PyG's
    sum aggregation; more than one edge between two nodes makes ``bits > 1``
    bit planes).  An optional diagonal term ``diag`` (from ``self_loops``) is kept
    apart from the tiles, so ``A + diag·I`` multiplies exactly.  All-zero tiles are
    not stored and never read (QGTC's zero-tile jumping, at the format level).
    Blocks holding fewer than ``min_tile_nnz`` entries are not worth a tile (a
    tile costs 512 bytes per plane whatever it holds): their entries go to a CSR
    residual (``res_ptr``, ``res_col``, ``res_val``) that the same kernels add in.

    Build with :meth:`from_edge_index`.  Attributes: ``window_ptr``, ``tile_col``,
    ``tile_bits`` (see :mod:`pyg_quant.layout`), ``res_ptr`` (int64
    ``[num_rows + 1]``), ``res_col`` (int32), ``res_val`` (int32 multiplicities, or
    None when ``bits == 1``), ``num_rows`` (targets),
    ``num_cols`` (sources), ``bits``, ``diag`` (float32 ``[num_rows]`` or None),
    ``row_sums`` (int64 ``[num_rows]``: Σ_j A_ij, the diagonal term excluded),
    ``nnz`` (distinct non-zero entries) and ``max_row_sum``.
    """

    _TENSORS = ("window_ptr", "tile_col", "tile_bits", "res_ptr", "res_col", "res_val", "diag", "row_sums")
    __slots__ = _TENSORS + ("num_rows", "num_cols", "nnz", "max_row_sum", "row_sum_bits", "_derived", "_captured")

    def __init__(self, window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val: Optional[torch.Tensor],
                 num_rows: int, num_cols: int, diag: Optional[torch.Tensor], row_sums: torch.Tensor,
                 nnz: int, max_row_sum: int):
        self.window_ptr, self.tile_col, self.tile_bits = window_ptr, tile_col, tile_bits
        self.res_ptr, self.res_col, self.res_val = res_ptr, res_col, res_val
        self.num_rows, self.num_cols = int(num_rows), int(num_cols)
        self.diag, self.row_sums = diag, row_sums
        self.nnz, self.max_row_sum = int(nnz), int(max_row_sum)
        self.row_sum_bits = self.max_row_sum.bit_length()
        self._derived = None
        # Made while a CUDA graph is captured (decoded inside the graph): its tensors live in the capture's pool.
        self._captured = (row_sums.is_cuda and not torch.compiler.is_compiling()
                          and torch.cuda.is_current_stream_capturing())

    def wide_sums(self, x_bits: int) -> bool:
        """Whether ``Σ_j A_ij · q_j`` of ``x_bits``-bit codes can exceed int32 (the kernels then sum in int64).

        While ``torch.compile`` traces, the bound is ``2**row_sum_bits - 1`` (at least ``max_row_sum``), so that
        batches whose largest row sums differ share one compiled graph; int64 sums give the same result.
        """
        bound = (1 << self.row_sum_bits) - 1 if torch.compiler.is_compiling() else self.max_row_sum
        return bound * (2**int(x_bits) - 1) > INT32_MAX

    def derived(self, name: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` (a tensor, or a tuple of tensors and Nones), kept on this adjacency for the next call with
        the same ``name``.

        For per-node vectors that every layer of a model derives from the same batch (GCN's
        ``D^{-1/2}``): computed once per adjacency instead of once per layer.  ``compute``
        must be a function of this adjacency's tensors, which are never edited in place.
        Nothing is kept while a CUDA graph is captured (the result would live in the capture's
        memory pool and hold values only once the graph has run), unless the adjacency itself was
        made in a capture (decoded inside the graph: its own tensors are the pool's already), nor
        while ``torch.compile`` traces, nor a result that requires grad; results made in inference
        mode serve inference mode only.
        """
        if torch.compiler.is_compiling():
            return compute()
        key = (name, torch.is_inference_mode_enabled())
        table = getattr(self, "_derived", None)
        if table is not None and key in table:
            return table[key]
        value = compute()
        parts = [t for t in (value if isinstance(value, tuple) else (value,)) if t is not None]
        if any(t.requires_grad for t in parts) or (any(t.is_cuda for t in parts)
                                                   and torch.cuda.is_current_stream_capturing()
                                                   and not getattr(self, "_captured", False)):
            return value
        if table is None:
            table = self._derived = RebuiltOnCopy()  # copies and pickles recompute (sparse CSR values cannot copy)
        table[key] = value
        return value

    @classmethod
    def from_edge_index(cls, edge_index: torch.Tensor,
                        num_nodes: Optional[Union[int, Tuple[int, int]]] = None,
                        self_loops: int = 0, min_tile_nnz: Optional[int] = None,
                        adjacency: Optional[str] = None) -> "BitAdjacency":
        r"""Packs ``edge_index`` (``[2, E]``, source row 0, target row 1).

        Args:
            edge_index (Tensor): int64/int32 ``[2, num_edges]``.
            num_nodes (int or (int, int), optional): node count, or
                ``(num_sources, num_targets)`` for a bipartite graph.  Defaults to
                ``edge_index.max() + 1``.
            self_loops (int): 0, 1 or 2.  With ``k > 0`` the result is ``A + k·I``
                for nodes without a self-loop and keeps a present self-loop at
                weight 1, exactly like PyG's ``add_remaining_self_loops`` with
                ``fill_value=k`` (GCN's ``A + I``, and ``A + 2I`` when ``improved``).
            min_tile_nnz (int): a 16 × 256 block with at least this many entries
                becomes a bit tile; sparser blocks go to the CSR residual.  ``1``
                stores every non-empty block as a tile; above 4096 (a block's size)
                every entry stays in the CSR, which on CUDA runs a gather kernel
                that is faster than tiles when they would be mostly empty (about
                2× on cluster batches whose tiles are 2% full).  Default 16.
            adjacency (str, optional): the form of the result: ``"tiles"`` (the
                tiles ``min_tile_nnz`` plans), ``"csr"`` (no tiles, every entry in
                the CSR, rows sorted by column: the same as ``min_tile_nnz`` above
                4096) or ``"auto"`` (``"csr"`` when the planned tiles would be less
                than :data:`~pyg_quant.graph.adjacency_form.MIN_TILE_FILL` full, else
                ``"tiles"``).  Default: :data:`~pyg_quant.graph.adjacency_form.DEFAULT_ADJACENCY`
                (``"auto"``), and ``"tiles"`` whenever ``min_tile_nnz`` is given.
        """
        if adjacency is None:
            adjacency = check_adjacency_form(None) if min_tile_nnz is None else "tiles"
        check_adjacency_form(adjacency)
        compact = cls.compact_from_edge_index(edge_index, num_nodes, self_loops,
                                              DEFAULT_MIN_TILE_NNZ if min_tile_nnz is None else min_tile_nnz)
        return compact.expand(tiles=compact.wants_tiles(adjacency))

    @staticmethod
    def compact_from_edge_index(edge_index: torch.Tensor,
                                num_nodes: Optional[Union[int, Tuple[int, int]]] = None,
                                self_loops: int = 0, min_tile_nnz: int = 16) -> "CompactAdjacency":
        r"""The :class:`~pyg_quant.graph.bit_adjacency.CompactAdjacency` of :meth:`from_edge_index`
        (same arguments): the tile plan with one byte per edge, before any tile is written.
        ``.expand()`` gives the BitAdjacency, on the device the plan is on."""
        if isinstance(min_tile_nnz, bool) or not isinstance(min_tile_nnz, int) or min_tile_nnz < 1:
            raise ValueError(f"min_tile_nnz must be a positive int, got {min_tile_nnz!r}")
        if isinstance(self_loops, bool) or self_loops not in (0, 1, 2):
            raise ValueError(f"self_loops must be 0, 1 or 2, got {self_loops!r}")
        if num_nodes is None:
            if not isinstance(edge_index, torch.Tensor) or edge_index.numel() == 0:
                raise ValueError("num_nodes is required when edge_index is empty or not a tensor")
            num_nodes = int(edge_index.max()) + 1
        if isinstance(num_nodes, (tuple, list)):
            if len(num_nodes) != 2:
                raise ValueError(f"num_nodes must be an int or (num_src, num_dst), got {num_nodes!r}")
            num_src, num_dst = (int(n) for n in num_nodes)
        else:
            num_src = num_dst = int(num_nodes)
        if num_src <= 0 or num_dst <= 0:
            raise ValueError(f"num_nodes must be positive, got {num_nodes!r}")
        edge_index = _check_edge_index(edge_index, num_src, num_dst)
        if self_loops and num_src != num_dst:
            raise ValueError("self_loops needs a square adjacency (num_src == num_dst)")
        device = edge_index.device
        src, dst = edge_index[0], edge_index[1]

        diag = None
        if self_loops:
            is_loop = src == dst
            diag = torch.full((num_dst,), float(self_loops), device=device)
            if device.type != "cpu" or bool(is_loop.any()):  # on the CPU, skip two selects in the usual case
                diag[dst[is_loop]] = 1.0
                src, dst = src[~is_loop], dst[~is_loop]

        keys, counts = distinct_entries(dst * num_src + src)
        max_count = int(counts.max()) if counts.numel() else 1
        if max_count > 255:
            raise ValueError(f"edge_index repeats an edge {max_count} times; at most 255 fit the 8-bit adjacency")
        return CompactAdjacency.from_entries(keys, counts, num_dst, num_src, min_tile_nnz, diag)

    # --- reporting --------------------------------------------------------------------
    @property
    def shape(self) -> Tuple[int, int]:
        return (self.num_rows, self.num_cols)

    @property
    def device(self) -> torch.device:
        return self.tile_bits.device

    @property
    def bits(self) -> int:
        """Bit planes per entry (1 unless some edge repeats)."""
        return self.tile_bits.size(0)

    @property
    def num_tiles(self) -> int:
        return self.tile_col.numel()

    @property
    def tile_nnz(self) -> int:
        """Non-zero entries held in bit tiles."""
        return self.nnz - self.res_nnz

    @property
    def res_nnz(self) -> int:
        """Non-zero entries held in the CSR residual."""
        return self.res_col.numel()

    @property
    def fill_ratio(self) -> float:
        """Tile entries over the capacity of the stored tiles."""
        return _tile_fill(self.tile_nnz, self.num_tiles)

    @property
    def nbytes(self) -> int:
        tensors = [getattr(self, name) for name in self._TENSORS]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def degree(self) -> torch.Tensor:
        """Weighted in-degree of every target node, the diagonal term included (float32)."""
        deg = self.row_sums.to(torch.float32)
        return deg + self.diag if self.diag is not None else deg

    def residual_rows(self) -> torch.Tensor:
        """The row of each residual entry (int64, in ``res_col``'s order), with no host synchronization."""
        rows = torch.arange(self.num_rows, device=self.device)
        return torch.repeat_interleave(rows, self.res_ptr[1:] - self.res_ptr[:-1], output_size=self.res_col.numel())

    def to_dense(self) -> torch.Tensor:
        """``A + diag·I`` as a dense float32 matrix (for checks on small graphs)."""
        dense = torch.zeros(self.num_rows, self.num_cols, device=self.device)
        window = torch.repeat_interleave(torch.arange(self.window_ptr.numel() - 1, device=self.device),
                                         self.window_ptr[1:] - self.window_ptr[:-1])
        shifts = torch.arange(32, device=self.device)
        for p in range(self.bits):
            words = self.tile_bits[p].to(torch.int64) & 0xFFFFFFFF  # [tiles, 16, 8]
            bits = ((words.unsqueeze(-1) >> shifts) & 1).flatten(-2)  # [tiles, 16, 256]
            t, r, c = bits.nonzero(as_tuple=True)
            row = window[t] * TILE_ROWS + r
            col = self.tile_col[t].long() * TILE_COLS + c
            dense.index_put_((row, col), torch.full_like(row, 2**p, dtype=torch.float32), accumulate=True)
        res_row = self.residual_rows()
        res_val = torch.ones_like(self.res_col) if self.res_val is None else self.res_val
        dense.index_put_((res_row, self.res_col.long()), res_val.float(), accumulate=True)
        if self.diag is not None:
            dense += torch.diag(self.diag)
        return dense

    def _map(self, fn) -> "BitAdjacency":
        moved = {name: None if getattr(self, name) is None else fn(getattr(self, name)) for name in self._TENSORS}
        return BitAdjacency(num_rows=self.num_rows, num_cols=self.num_cols, nnz=self.nnz,
                            max_row_sum=self.max_row_sum, **moved)

    def to(self, device=None, non_blocking: bool = False) -> "BitAdjacency":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "BitAdjacency":
        return self._map(lambda t: t.pin_memory())

    def __repr__(self) -> str:
        return (f"BitAdjacency(shape={self.shape}, nnz={self.nnz}, bits={self.bits}, tiles={self.num_tiles}, "
                f"fill={self.fill_ratio:.3f}, residual={self.res_nnz}, nbytes={self.nbytes}, "
                f"self_loops={self.diag is not None})")


class CompactAdjacency:
    r"""A :class:`~pyg_quant.BitAdjacency` as a tile plan plus one byte per tile entry.

    Build with :meth:`from_entries`; :meth:`expand` gives the BitAdjacency.
    ``tensors()`` / ``from_tensors`` convert to and from a dict of tensors plus
    host scalars (how :class:`~pyg_quant.loader.QuantBatch` ships it).
    """

    TENSORS = ops.WIRE_PARTS  # tile_key, row_count, entry_col, entry_val, res_row, res_col, res_val, diag
    SCALARS = ("num_rows", "num_cols", "planes", "nnz", "max_row_sum")
    __slots__ = TENSORS + SCALARS

    def __init__(self, **fields):
        for name in self.TENSORS:
            setattr(self, name, fields.get(name))
        for name in self.SCALARS:
            setattr(self, name, int(fields[name]))

    @classmethod
    def from_entries(cls, keys: torch.Tensor, sums: torch.Tensor, num_rows: int, num_cols: int,
                     min_tile_nnz: int = 16, diag: Optional[torch.Tensor] = None) -> "CompactAdjacency":
        r"""The plan for ``A[k // num_cols, k % num_cols] = sums`` (sorted distinct ``keys``, positive
        integer ``sums``).

        A 16 × 256 block with at least ``min_tile_nnz`` entries becomes a tile of
        ``bit_length(max sum)`` planes (at most 8); sparser blocks, and entries too
        large for 8 planes, go to the CSR residual.  ``diag``: the self-loop term,
        small non-negative integers (``[num_rows]``) or None.
        """
        largest = int(sums.max()) if sums.numel() else 1
        planes = min(MAX_ADJ_PLANES, max(1, largest.bit_length()))
        tile_key, row_count, entry_col, entry_val, res_row, res_col, res_sum, row_sums = ops.tile_plan(
            keys, sums, num_rows, num_cols, min_tile_nnz, planes)
        if row_count.numel() and int(row_count.max()) < TILE_COLS:  # a full tile row (256) needs int16
            row_count = row_count.to(torch.uint8)
        multi_bit = planes > 1 or bool((res_sum != 1).any())
        if diag is not None:
            diag_code = diag.to(torch.uint8)
            if not torch.equal(diag_code.to(diag.dtype), diag):
                raise ValueError("diag must hold integers in [0, 255] (self-loop weights)")
            diag = diag_code
        return cls(tile_key=tile_key, row_count=row_count, entry_col=entry_col,
                   entry_val=entry_val if planes > 1 else None, res_row=res_row, res_col=res_col,
                   res_val=res_sum.to(torch.int32) if multi_bit else None, diag=diag, num_rows=num_rows,
                   num_cols=num_cols, planes=planes, nnz=keys.numel(),
                   max_row_sum=int(row_sums.max()) if num_rows else 0)

    # --- shipping ---------------------------------------------------------------------------
    def tensors(self) -> Dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None}

    def scalars(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.SCALARS}

    @classmethod
    def from_tensors(cls, tensors: Dict[str, torch.Tensor], scalars: Dict[str, int]) -> "CompactAdjacency":
        return cls(**tensors, **scalars)

    @property
    def device(self) -> torch.device:
        return self.tile_key.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def num_tiles(self) -> int:
        return self.tile_key.numel()

    @property
    def tile_fill(self) -> float:
        """Tile entries over the capacity of the planned tiles (0 without tiles); known on the host."""
        return _tile_fill(self.entry_col.numel(), self.num_tiles)

    def wants_tiles(self, adjacency: Optional[str] = "auto") -> bool:
        """Whether ``adjacency`` (``"auto"``, ``"tiles"``, ``"csr"``; None: the default form) decodes this plan into
        tiles (:func:`~pyg_quant.graph.adjacency_form.tiles_wanted`)."""
        return tiles_wanted(adjacency, self.num_tiles, self.tile_fill)

    @staticmethod
    def expand_wire(buffer: torch.Tensor, parts: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int]],
                    scalars: Dict[str, int], adjacency: Optional[str] = None) -> "BitAdjacency":
        r"""The BitAdjacency of a plan shipped in the uint8 ``buffer`` (how :class:`~pyg_quant.loader.QuantBatch`
        ships one), in the form ``adjacency`` names (see :meth:`wants_tiles`), made in one op where
        ``from_tensors(...).expand(...)`` takes a dozen (:func:`pyg_quant.ops.expand_wire`): the same BitAdjacency.

        Args:
            buffer (Tensor): ``uint8[nbytes]``.
            parts (dict): ``(dtype, shape, byte offset)`` of each tensor of :meth:`tensors` as it travels: its
                integers in any narrower type that holds them.
            scalars (dict): :meth:`scalars`.
        """
        layout = ops.wire_layout(parts)
        num_tiles, entries = parts["tile_key"][1][0], parts["entry_col"][1][0]
        tiles = tiles_wanted(adjacency, num_tiles, _tile_fill(entries, num_tiles))
        num_rows, num_cols = scalars["num_rows"], scalars["num_cols"]
        window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, diag, row_sums = ops.expand_wire(
            buffer, layout, num_rows, num_cols, scalars["planes"], tiles)
        weighted = "res_val" in parts or (not tiles and "entry_val" in parts)
        return BitAdjacency(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val if weighted else None,
                            num_rows, num_cols, diag if "diag" in parts else None, row_sums, scalars["nnz"],
                            scalars["max_row_sum"])

    # --- writing the tiles --------------------------------------------------------------------
    def expand(self, tiles: Union[bool, str, None] = None):
        r"""The :class:`~pyg_quant.BitAdjacency`, built where the plan is, every output size known on the host
        (no device-to-host synchronisation).

        Args:
            tiles (bool or str): ``True`` writes the planned tiles (``expand_tiles``); ``False`` puts every
                entry in the CSR (``expand_csr``: no tiles, rows sorted by column, exactly what
                :meth:`~pyg_quant.BitAdjacency.from_edge_index` builds with ``min_tile_nnz`` above 4096);
                ``"auto"`` picks ``False`` when the tiles would be less than
                :data:`~pyg_quant.graph.adjacency_form.MIN_TILE_FILL` full; None (the default) follows
                :data:`~pyg_quant.graph.adjacency_form.DEFAULT_ADJACENCY`.
        """
        if tiles is None:
            tiles = self.wants_tiles(None)
        elif isinstance(tiles, str):
            if tiles != "auto":
                raise ValueError(f"tiles must be True, False or 'auto', got {tiles!r}")
            tiles = self.wants_tiles("auto")
        elif not isinstance(tiles, bool):
            raise TypeError(f"tiles must be True, False or 'auto', got {tiles!r}")
        diag = None if self.diag is None else self.diag.to(torch.float32)
        if not tiles:
            res_ptr, res_col, res_val, row_sums = ops.expand_csr(
                self.tile_key, self.row_count, self.entry_col, self.entry_val, self.res_row, self.res_col,
                self.res_val, self.num_rows, self.num_cols)
            return BitAdjacency(*ops.tile_free_operands(self.num_rows, self.planes, self.tile_key.device), res_ptr,
                                res_col, res_val, self.num_rows, self.num_cols, diag, row_sums, self.nnz,
                                self.max_row_sum)
        window_ptr, tile_col, tile_bits, res_ptr, row_sums = ops.expand_tiles(
            self.tile_key, self.row_count, self.entry_col, self.entry_val, self.res_row, self.res_val, self.num_rows,
            self.num_cols, self.planes)
        return BitAdjacency(window_ptr, tile_col, tile_bits, res_ptr, self.res_col, self.res_val, self.num_rows,
                            self.num_cols, diag, row_sums, self.nnz, self.max_row_sum)

    def __repr__(self) -> str:
        return (f"CompactAdjacency(shape=({self.num_rows}, {self.num_cols}), nnz={self.nnz}, planes={self.planes}, "
                f"tiles={self.num_tiles}, residual={self.res_col.numel()}, nbytes={self.nbytes})")
