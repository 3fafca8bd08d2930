r"""The one bit layout of pyg_quant, used by the CPU and the CUDA kernels alike.

A tensor quantized to ``bits`` bits is stored as ``bits`` *bit planes* (QGTC's
3D-stacked bit compression).  Plane ``p`` holds bit ``p`` of every code
``q ∈ [0, 2**bits - 1]``, so ``q = Σ_p 2**p · plane_p``.  The planes of one
tensor live in a single contiguous ``int32`` tensor::

    planes : int32[bits, outer_pad, words]

Each plane is a matrix of 32-bit words.  The bits run along the **packed
dimension** (the dimension a GEMM reduces over); the other logical dimension is
the **outer dimension**.  Bit ``k`` (least significant first) of word ``w``
holds element ``32·w + k`` of the packed dimension.  Two consecutive words read
as one little-endian 64-bit word keep that order, which is how the CPU kernels
read them (``popcount`` over ``uint64``); the tensor-core kernels read the
same words as ``.b1`` fragments.

``layout="row"`` (the A operand of ``A @ B``)::

    logical x: rows × cols           planes[p, r, w]  (outer = rows)
    ┌───────────────────────┐        ┌────────────┬────────────┬──┐
    │ r: x[r,0] ... x[r,C-1]│  ───►  │ w0: cols   │ w1: cols   │..│  bit k of w
    └───────────────────────┘        │   0..31    │  32..63    │  │  = bit p of
                                     └────────────┴────────────┴──┘  q[r, 32w+k]

``layout="col"`` (the B operand; features ``X`` in ``A·X``): the same picture
for ``xᵀ``, i.e. ``planes[p, c, w]`` bit ``k`` is bit ``p`` of ``q[32·w + k, c]``
(outer = cols, the bits run down a column).

Padding: the packed dimension is padded with zero codes to a multiple of
``PACK_ALIGN_BITS`` = 256 bits (the ``k256`` step of the b1 ``mma``/``wgmma``
instructions), the outer dimension to a multiple of ``OUTER_ALIGN`` = 64 (the
``m64`` of ``wgmma``, a multiple of the ``m16``/``n8`` of ``mma.sync``).  Padded
codes are zero, so they add nothing to any popcount; the logical shape is kept
beside the planes.

Affine scales: ``x ≈ lo + scale · q``.  ``lo`` and ``scale`` are float32,
shaped ``(1,)`` (``dim=None``: one range for the tensor), ``(cols,)``
(``dim=0``: ranges reduced over rows, one per column) or ``(rows,)`` (``dim=1``:
one per row), following torch's reduction convention.  Codes are computed as
``v = (x - lo) * inv_scale`` with ``inv_scale = 1 / scale`` (0 where
``scale == 0``), all in float32 without fused multiply-add, then
``q = clamp(floor(v + u), 0, 2**bits - 1)`` with ``u = 0.5`` (round to nearest)
or ``u ~ U[0, 1)`` (stochastic rounding).  Every backend follows exactly these
float32 steps so that codes agree bit for bit.

Block-sparse bit adjacency (:class:`pyg_quant.BitAdjacency`): the adjacency is
cut into row windows of ``TILE_ROWS`` = 16 rows and column tiles of
``TILE_COLS`` = 256 columns (one ``m16 × k256`` b1 fragment).  Only non-empty
tiles are stored, sorted by (window, column tile)::

    window_ptr : int64[num_windows + 1]   tiles of window i: window_ptr[i]:window_ptr[i+1]
    tile_col   : int32[num_tiles]         column-tile index of each tile
    tile_bits  : int32[bits, num_tiles, 16, 8]

``tile_bits[p, t, r, w]`` bit ``k`` is bit ``p`` of the entry at row
``16·window + r`` and column ``256·tile_col[t] + 32·w + k``, i.e. each tile row is
a row-layout bit vector.  A tile row lines up word for word with words
``8·tile_col[t] : 8·tile_col[t] + 8`` of a ``layout="col"`` feature tensor, so the
aggregation ``A·X`` reads features in place, with no repacking.  The CSR residual
(entries of blocks too sparse for a tile) is gathered row by row instead, from
the *row codes* below.

Row codes (the gather form of node features, derived from the planes and cached
on the :class:`~pyg_quant.BitTensor`, like its code sums; a BitTensor made by a
kernel that writes only them, :meth:`~pyg_quant.BitTensor.from_row_codes`, makes
its planes from them when asked, ``ops.planes_from_row_codes``)::

    row_codes : uint8[nodes_pad, row_code_bytes(cols, bits)]

hold node ``r``'s codes one after the other in containers of
``container_bits(bits)`` ∈ {1, 2, 4, 8} bits, LSB first: the code of column
``c`` is bits ``(c·w) % 8 ..`` of byte ``(c·w) // 8`` (``w`` the container).
Rows are padded with zero codes to a multiple of 16 bytes, so that a gathering
thread reads its slice with one aligned vector load; ``nodes_pad`` is the
planes' padded node count.  At 4 bits a 64-feature row is 32 bytes, one memory
sector, where ``uint8`` codes took 64 and an fp32 row 256.  (``csrc/layout.h``
holds this module's constants and rules for the kernels, ``csrc/row_codes.h`` the row
codes' access.)
"""

PACK_ALIGN_BITS = 256
PACK_ALIGN_WORDS = PACK_ALIGN_BITS // 32
OUTER_ALIGN = 64
TILE_ROWS = 16
TILE_COLS = 256
TILE_WORDS = TILE_COLS // 32
MAX_BITS = 8
LAYOUTS = ("row", "col")
#: The narrowest range ``[lo, hi]`` a quantizer keeps (narrower ones collapse to ``hi = lo``): ``2**MAX_BITS - 1``
#: normal float32 steps (``2**-126`` each), so that the inverse scale ``(2**bits - 1) / (hi - lo)`` stays finite.
MIN_RANGE_WIDTH = (2**MAX_BITS - 1) * 2.0**-126


def check_bits(bits, name: str = "bits") -> int:
    """``bits`` if it is an int in 1..``MAX_BITS`` (a code width this layout holds), else a TypeError or ValueError
    naming the argument ``name``."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{name} must be an int in 1..{MAX_BITS}, got {type(bits).__name__}")
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"{name} must be in 1..{MAX_BITS}, got {bits}")
    return bits


def check_layout(layout) -> str:
    """``layout`` if it is one of :data:`LAYOUTS`, else a ValueError naming the argument."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def packed_words(length: int) -> int:
    """Number of 32-bit words that hold ``length`` packed elements, padded."""
    return round_up(max(length, 1), PACK_ALIGN_BITS) // 32


def padded_outer(length: int) -> int:
    return round_up(max(length, 1), OUTER_ALIGN)


def container_bits(bits: int) -> int:
    """Bits of a row-code container: the power of two (1, 2, 4 or 8) that holds a ``bits``-bit code."""
    return 1 if bits <= 1 else 2 if bits <= 2 else 4 if bits <= 4 else 8


def row_code_bytes(cols: int, bits: int) -> int:
    """Bytes of one node's packed row codes: ``cols`` containers, padded to 16 bytes."""
    return round_up(max(cols, 1) * container_bits(bits), 128) // 8
