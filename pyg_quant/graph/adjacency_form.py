r"""Which form a :class:`~pyg_quant.BitAdjacency` takes: bit tiles plus a CSR residual, or the CSR alone.

A 16 × 256 bit tile pays off only where neighbours have nearby ids; on sparse blocks the CSR gather of ``bit_spmm``
is faster.  This module owns that rule and its thresholds, read wherever an adjacency is packed or decoded
(:meth:`BitAdjacency.from_edge_index <pyg_quant.BitAdjacency.from_edge_index>`, :meth:`CompactAdjacency.expand
<pyg_quant.graph.bit_adjacency.CompactAdjacency.expand>`, the loader's batches, the layers' own packing): the
``adjacency="auto" | "tiles" | "csr"`` argument, :data:`DEFAULT_ADJACENCY` where none is given, :data:`MIN_TILE_FILL`
for ``"auto"``, and :data:`DEFAULT_MIN_TILE_NNZ`, below which a block's entries go to the CSR residual.  The
constants are read when called, so setting them on this module changes every later decision.
"""
from typing import Optional

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


def tiles_wanted(adjacency: Optional[str], num_tiles: int, tile_fill: float) -> bool:
    """Whether ``adjacency`` (``"auto"``, ``"tiles"``, ``"csr"``; None: :data:`DEFAULT_ADJACENCY`) decodes a plan of
    ``num_tiles`` tiles, ``tile_fill`` full, into tiles: ``"auto"`` does when they are at least :data:`MIN_TILE_FILL`
    full."""
    adjacency = check_adjacency_form(adjacency)
    if adjacency == "auto":
        return num_tiles > 0 and tile_fill >= MIN_TILE_FILL
    return adjacency == "tiles"
