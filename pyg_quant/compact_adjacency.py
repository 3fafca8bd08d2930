r"""The bit adjacency before its tiles are written: one byte per edge.

A :class:`~pyg_quant.BitAdjacency` tile spends 4,096 bits on a 16 × 256 block
whatever it holds; on METIS cluster batches tiles are ~2% full, ~45 bits per
edge.  :class:`CompactAdjacency` keeps the same matrix as the *plan* of those
tiles plus, for every entry in a tile, the one byte that says its column inside
the tile::

    tile_key   int32[T]        window · col_tiles + col_tile of each tile, sorted
    row_count  uint8[T, 16]    entries in each of the tile's 16 rows (int16 if one holds 256)
    entry_col  uint8[E_t]      column inside the tile of each tile entry, row-major order
    entry_val  uint8[E_t]      its multiplicity (absent when every tile entry is 1)
    res_row, res_col  int32    the CSR residual as coordinates, row-major
    res_val    int32           residual multiplicities (absent when all are 1)
    diag       uint8[R]        the self-loop term (absent without self loops)

about 8–10 bits per edge on cluster batches.  It is the form a loader batch
travels in; :meth:`CompactAdjacency.expand` writes the tiles on whatever device
the plan is on (the ``expand_tiles`` op: one pass on the CPU, three kernels on
the GPU, a torch reference elsewhere; every size is known on the host, so no
synchronisation), and returns exactly the :class:`BitAdjacency` that
:meth:`BitAdjacency.from_edge_index` builds, field for field.

Row-major entry order is the order of the sorted keys the plan is made from, so
planning (the ``tile_plan`` op) needs no sort beyond the one that made the keys
distinct.

The same plan also decodes into a tile-free BitAdjacency, every entry in its CSR
(``expand(tiles=False)``, the ``expand_csr`` op: a count and one merge pass per row
on the CPU, two row kernels and a cumsum on the GPU, again with no host
synchronisation), exactly what ``from_edge_index`` builds with ``min_tile_nnz``
above 4096; ``expand(tiles="auto")`` picks that form when the plan's tiles would be
less than :data:`MIN_TILE_FILL` full, where ``bit_spmm``'s CSR gather beats the tiles.
The wire form is the same either way (~10 bits per edge instead of the 64 of an
int32 CSR with values).
"""
from typing import Dict, Optional, Union

import numpy as np
import torch

from . import ops
from .layout import TILE_COLS, TILE_ROWS

MAX_ADJ_PLANES = 8  # bit planes per entry that the bit_spmm kernels accept

# ``"auto"`` decodes a plan into tiles only when its tiles are at least this full (tile entries over
# tiles · 4096).  A tile costs its 512 bytes per plane plus the 256 feature rows of codes that bit_spmm reads
# for it, whatever it holds; the CSR gather reads about one feature row per entry, so sparse tiles lose to it
# (benchmarks/csr_decode.py; see benchmarks/RESULTS.md, Layers and kernels, "Tiles or CSR").
MIN_TILE_FILL = 1 / 32

DEFAULT_MIN_TILE_NNZ = 16  # a 16 x 256 block with fewer entries goes to the CSR residual

ADJACENCY_FORMS = ("auto", "tiles", "csr")

# The form used where none is asked for (loader batches, from_edge_index, the layers' own packing): "auto", which
# on cluster batches (tiles ~2% full) means the CSR, the faster form there.
DEFAULT_ADJACENCY = "auto"


def check_adjacency_form(adjacency, name: str = "adjacency") -> str:
    """``adjacency`` checked to be one of ``"auto"``, ``"tiles"``, ``"csr"`` (the error names ``name``); None is
    :data:`DEFAULT_ADJACENCY`, read when called."""
    if adjacency is None:
        return DEFAULT_ADJACENCY
    if not isinstance(adjacency, str) or adjacency not in ADJACENCY_FORMS:
        raise ValueError(f"{name} must be one of {ADJACENCY_FORMS}, got {adjacency!r}")
    return adjacency


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


class CompactAdjacency:
    r"""A :class:`~pyg_quant.BitAdjacency` as a tile plan plus one byte per tile entry.

    Build with :meth:`from_entries`; :meth:`expand` gives the BitAdjacency.
    ``tensors()`` / ``from_tensors`` convert to and from a dict of tensors plus
    host scalars (how :class:`~pyg_quant.loader.QuantBatch` ships it).
    """

    TENSORS = ("tile_key", "row_count", "entry_col", "entry_val", "res_row", "res_col", "res_val", "diag")
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
        return self.entry_col.numel() / max(1, self.num_tiles * TILE_ROWS * TILE_COLS)

    def wants_tiles(self, adjacency: Optional[str] = "auto") -> bool:
        """Whether ``adjacency`` (``"auto"``, ``"tiles"``, ``"csr"``; None: :data:`DEFAULT_ADJACENCY`) decodes this
        plan into tiles: ``"auto"`` does when the tiles are at least :data:`MIN_TILE_FILL` full."""
        adjacency = check_adjacency_form(adjacency)
        if adjacency == "auto":
            return self.num_tiles > 0 and self.tile_fill >= MIN_TILE_FILL
        return adjacency == "tiles"

    # --- writing the tiles --------------------------------------------------------------------
    def expand(self, tiles: Union[bool, str, None] = None):
        r"""The :class:`~pyg_quant.BitAdjacency`, built where the plan is, every output size known on the host
        (no device-to-host synchronisation).

        Args:
            tiles (bool or str): ``True`` writes the planned tiles (``expand_tiles``); ``False`` puts every
                entry in the CSR (``expand_csr``: no tiles, rows sorted by column, exactly what
                :meth:`~pyg_quant.BitAdjacency.from_edge_index` builds with ``min_tile_nnz`` above 4096);
                ``"auto"`` picks ``False`` when the tiles would be less than :data:`MIN_TILE_FILL` full;
                None (the default) follows :data:`DEFAULT_ADJACENCY`.
        """
        from .adjacency import BitAdjacency  # adjacency imports this module

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
            device = self.tile_key.device
            window_ptr = torch.zeros(-(-self.num_rows // TILE_ROWS) + 1, dtype=torch.int64, device=device)
            tile_col = torch.empty(0, dtype=torch.int32, device=device)
            tile_bits = torch.empty(self.planes, 0, TILE_ROWS, TILE_COLS // 32, dtype=torch.int32, device=device)
            return BitAdjacency(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, self.num_rows,
                                self.num_cols, diag, row_sums, self.nnz, self.max_row_sum)
        window_ptr, tile_col, tile_bits, res_ptr, row_sums = ops.expand_tiles(
            self.tile_key, self.row_count, self.entry_col, self.entry_val, self.res_row, self.res_val, self.num_rows,
            self.num_cols, self.planes)
        return BitAdjacency(window_ptr, tile_col, tile_bits, res_ptr, self.res_col, self.res_val, self.num_rows,
                            self.num_cols, diag, row_sums, self.nnz, self.max_row_sum)

    def __repr__(self) -> str:
        return (f"CompactAdjacency(shape=({self.num_rows}, {self.num_cols}), nnz={self.nnz}, planes={self.planes}, "
                f"tiles={self.num_tiles}, residual={self.res_col.numel()}, nbytes={self.nbytes})")
