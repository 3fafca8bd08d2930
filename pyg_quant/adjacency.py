r"""Block-sparse bit adjacency and the aggregation ``A·X`` on it.

The tile format is described once, in :mod:`pyg_quant.layout`.  Rows are
message *targets* and columns *sources* (PyG's ``source_to_target`` flow:
``edge_index[0]`` is the source ``j``, ``edge_index[1]`` the target ``i``), so
``bit_spmm(adj, x)[i] = Σ_{(j→i)} x[j]``.
"""
from typing import Callable, Optional, Tuple, Union

import torch

from . import ops
from .bit_tensor import BitTensor
from .bitmm import INT32_MAX
from .compact_adjacency import DEFAULT_MIN_TILE_NNZ, CompactAdjacency, check_adjacency_form, distinct_entries
from .layout import TILE_COLS, TILE_ROWS, packed_words, padded_outer


def _check_edge_index(edge_index, num_src: int, num_dst: int) -> torch.Tensor:
    if not isinstance(edge_index, torch.Tensor):
        raise TypeError(f"edge_index must be a torch.Tensor, got {type(edge_index).__name__}")
    if edge_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"edge_index must be int64 or int32, got {edge_index.dtype}")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, num_edges], got {tuple(edge_index.shape)}")
    edge_index = edge_index.long()
    if edge_index.numel() > 0:
        if int(edge_index.min()) < 0:
            raise ValueError("edge_index holds negative node indices")
        if int(edge_index[0].max()) >= num_src or int(edge_index[1].max()) >= num_dst:
            raise ValueError(f"edge_index holds node indices out of range for num_nodes="
                             f"{num_src if num_src == num_dst else (num_src, num_dst)}")
    return edge_index


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

    def derived(self, name: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()``, kept on this adjacency for the next call with the same ``name``.

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
        if value.requires_grad or (value.is_cuda and torch.cuda.is_current_stream_capturing()
                                   and not getattr(self, "_captured", False)):
            return value
        if table is None:
            table = self._derived = {}
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
                than :data:`~pyg_quant.compact_adjacency.MIN_TILE_FILL` full, else
                ``"tiles"``).  Default: :data:`~pyg_quant.compact_adjacency.DEFAULT_ADJACENCY`
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
                                self_loops: int = 0, min_tile_nnz: int = 16) -> CompactAdjacency:
        r"""The :class:`~pyg_quant.compact_adjacency.CompactAdjacency` of :meth:`from_edge_index`
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
        return self.tile_nnz / max(1, self.num_tiles * TILE_ROWS * TILE_COLS)

    @property
    def nbytes(self) -> int:
        tensors = [getattr(self, name) for name in self._TENSORS]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def degree(self) -> torch.Tensor:
        """Weighted in-degree of every target node, the diagonal term included (float32)."""
        deg = self.row_sums.to(torch.float32)
        return deg + self.diag if self.diag is not None else deg

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
        res_row = torch.repeat_interleave(torch.arange(self.num_rows, device=self.device),
                                          self.res_ptr[1:] - self.res_ptr[:-1])
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


def _float_vector(value, length: int, device: torch.device, name: str,
                  scalar: bool = False) -> Optional[torch.Tensor]:
    """None, a Python number or a 1-D tensor of ``length`` -> float32 ``[length]`` on ``device`` (or None); with
    ``scalar``, a number or a 0-dim tensor becomes ``[1]``, which the op broadcasts (no fill kernel)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if not isinstance(value, torch.Tensor):
        return torch.full((1 if scalar else length,), float(value), dtype=torch.float32, device=device)
    if value.dim() == 0:
        value = value.detach().to(device=device, dtype=torch.float32)
        return value.reshape(1) if scalar else value.expand(length).contiguous()
    if value.dim() != 1 or value.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got shape {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the operands are on {device}")
    return value.detach().to(torch.float32).contiguous()


def bit_spmm(adj: BitAdjacency, x: BitTensor, *, self_weight=None, row_scale=None, bias=None,
             relu: bool = False) -> torch.Tensor:
    r"""``(A + diag·I) · to_val(x)`` on the bit tiles, as float32 ``[num_rows, x.cols]``.

    With the optional epilogue (fused into the kernel, one pass over the output):

    .. math::
        \mathrm{out} = \mathrm{relu}\big(\mathrm{diag}(s)\,(A + \mathrm{diag}(d + w))\,X + b\big)

    where ``d`` is ``adj.diag`` (its self loops), ``w = self_weight`` (GIN's
    ``1 + eps``), ``s = row_scale`` (GCN's ``D^{-1/2}`` after aggregation) and
    ``b = bias``.

    ``x`` must be scaled per column or per tensor (``dim=0`` or ``None``) so that
    ``(A·X)_ik = lo_k·Σ_j A_ij + scale_k·(A·Q)_ik`` factors exactly; it is read
    in ``layout="col"`` (a ``"row"`` input is repacked once and cached).  The
    result equals the float64 value up to one float32 rounding.

    Args:
        adj (BitAdjacency): ``[num_rows, num_cols]``.
        x (BitTensor): ``[num_cols, F]``.
        self_weight (float or Tensor, optional): ``[num_rows]`` or a scalar; needs a square ``adj``.
        row_scale (Tensor, optional): ``[num_rows]``.
        bias (Tensor, optional): ``[F]``.
        relu (bool): clamp the result at zero.
    """
    if not isinstance(adj, BitAdjacency):
        raise TypeError(f"adj must be a BitAdjacency, got {type(adj).__name__}")
    if not isinstance(x, BitTensor):
        raise TypeError(f"x must be a BitTensor, got {type(x).__name__}")
    if x.rows != adj.num_cols:
        raise ValueError(f"x has {x.rows} rows but adj has {adj.num_cols} source nodes")
    if x.device != adj.device:
        raise ValueError(f"x is on {x.device} but adj is on {adj.device}")
    if x.dim not in (None, 0):
        raise ValueError("x must be scaled per column (dim=0) or per tensor (dim=None) for A·X to "
                         "factor exactly; got per-row ranges (dim=1)")
    if not isinstance(relu, bool):
        raise TypeError(f"relu must be a bool, got {type(relu).__name__}")
    rows, cols, device = adj.num_rows, x.cols, x.device
    self_term = _float_vector(self_weight, rows, device, "self_weight", scalar=True)
    if self_term is not None and adj.num_rows != adj.num_cols:
        raise ValueError("self_weight needs a square adjacency (num_rows == num_cols)")
    if adj.diag is not None:
        self_term = adj.diag if self_term is None else adj.diag + self_term
    row_scale = _float_vector(row_scale, rows, device, "row_scale")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a tensor, got {type(bias).__name__}")
    bias = _float_vector(bias, cols, device, "bias")
    x_col = x.as_layout("col")
    wide = adj.wide_sums(x.bits)
    lo = x.lo.expand(cols).contiguous()
    scale = x.scale.expand(cols).contiguous()
    x_planes, x_codes = gather_operands(adj, x_col, self_term is not None)
    return ops.bit_spmm_affine(adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val,
                               x_planes, lo, scale, adj.row_sums, self_term, row_scale, bias, relu, rows, cols,
                               wide, x_codes)


def gathered_codes(adj: "BitAdjacency", x_col: BitTensor, self_term: bool) -> Optional[torch.Tensor]:
    """``x_col``'s cached row codes where the CUDA kernels gather from them (a CSR residual, or a self term); the
    CPU kernels walk their own unpacked codes, so there it is None and nothing is packed."""
    if x_col.device.type != "cuda" or (adj.res_col.numel() == 0 and not self_term):
        return None
    return x_col.row_codes()


def gather_operands(adj: "BitAdjacency", x_col: BitTensor,
                    self_term: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(x_planes, x_codes)`` of a ``bit_spmm`` op on ``x_col``: its planes and :func:`gathered_codes`.  A
    BitTensor held as row codes (:meth:`BitTensor.from_row_codes`) keeps them where nothing reads its planes: on
    CUDA (compiled kernels) with an adjacency without tiles, the kernels read only the row codes and take the planes'
    shape from the ``x_planes`` argument, which is then an allocated, unread tensor of that shape."""
    if (x_col.has_planes or adj.tile_col.numel() > 0 or x_col.device.type != "cuda"
            or not ops.use_compiled("bit_spmm_int", x_col.device)):
        return x_col.planes, gathered_codes(adj, x_col, self_term)
    shape = (x_col.bits, padded_outer(x_col.cols), packed_words(x_col.rows))
    return torch.empty(shape, dtype=torch.int32, device=x_col.device), x_col.row_codes()
