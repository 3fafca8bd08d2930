r"""One graph operand for a layer's aggregation ``out = Â · Y``, in float or on bit planes.

``Â = A + diag(δ)``: ``A`` holds the edges (multiplicities, or edge weights
quantized per tensor to ``adj_bits`` codes, ``w ≈ lo_w + s_w·c``), ``δ`` is the
self-loop term, kept in float32 beside the tiles as :class:`BitAdjacency` does.
Two ways to compute ``Â · Y`` give the same numbers for the same codes, up to float rounding:

* float (training, and ``bits=None``): ``Σ_e coef_e · Y[src_e]`` with
  ``coef_e = lo_w + s_w·c_e``, as a CSR product with ``A`` (its gradient one with
  ``Aᵀ``, both built once per graph), or, where a gradient must reach the raw edge
  weights (straight-through), as an ``index_add`` over the edges;
* bits (evaluation): with ``Y ≈ lo_y + s_y·Q`` scaled per column, ``M`` the
  0/1 (multiplicity) adjacency and ``C`` the adjacency of weight codes::

      Â·Y = lo_w·(lo_y·M1 + s_y·(M·Q)) + s_w·(lo_y·C1 + s_y·(C·Q)) + δ ∘ Y

  (``lo_w = 1, s_w = 0`` without weights).  ``M·Q`` and ``C·Q`` are exact integer
  products on the tiles, the rest is added in float32 (within ``csrc/epilogue.h``'s
  bound of the exact value).  The ``lo_w`` term needs the full ``M·Q`` (not only the degree ``M1``): each edge
  carries ``lo_w`` times its source's features.
"""
from typing import Optional, Tuple

import torch

from .. import ops
from .._utils import check_finite, is_compiling
from ..bit_tensor import BitTensor, to_val
from .adjacency_form import DEFAULT_MIN_TILE_NNZ, check_adjacency_form
from .edge_ops import edge_bit_spmm, edge_spmm_int
from .float_csr import RebuiltOnCopy, csr_pair, scaled_csr_pair
from .input_formats import EdgeSet, bit_adjacency_csr, bit_adjacency_scaled_csr
from .packing import pack_entries
from .spmm import bit_spmm, bit_spmm_codes, gather_operands


def _self_loop_terms(edges: EdgeSet, fill: float) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """``(keep, diag)``: which edges stay in ``A`` and the diagonal term, by ``edges.loop_rule``.

    Written with masks rather than boolean indexing so that shapes never depend
    on the data (``torch.compile`` traces it in one graph).
    """
    src, dst, num = edges.src, edges.dst, edges.num_dst
    dtype = edges.weight.dtype if edges.weight is not None else torch.float32
    diag = torch.full((num,), fill, dtype=dtype, device=dst.device)
    if edges.loop_rule == "add":
        return None, diag
    is_loop = src == dst
    if edges.loop_rule == "replace":
        return ~is_loop, diag
    if edges.weight is None and fill == 1.0:
        return ~is_loop, diag  # a kept loop weighs 1, as an added one does
    # A loop keeps its weight (1 without weights); among repeated loops the one that
    # PyG's add_remaining_self_loops keeps, by the same index_put.  Non-loop edges write
    # to a spare slot, so no shape depends on the data.
    slot = torch.where(is_loop, dst, torch.full_like(dst, num))
    has_loop = torch.zeros(num + 1, dtype=torch.bool, device=dst.device).index_put(
        (slot,), torch.ones_like(is_loop))[:num]
    weight = edges.weight if edges.weight is not None else torch.ones_like(dst, dtype=dtype)
    loop_value = torch.zeros(num + 1, dtype=dtype, device=dst.device).index_put((slot,), weight)[:num]
    return ~is_loop, torch.where(has_loop, loop_value, diag)


class QuantGraph:
    r"""The adjacency ``Â`` of one forward call (see the module docstring).

    Args:
        edges (EdgeSet): the graph, from :func:`~pyg_quant.graph.input_formats.to_edge_set`.
        self_loop_fill (float, optional): add self-loops of this weight by the
            format's rule (GCN); None adds none.  A :class:`BitAdjacency` that
            carries a diagonal term already is used as it is.
        adj_bits (int, optional): bits of the edge-weight codes, used by both
            paths; None keeps edge weights in float (then only the float
            aggregation can run).
        min_tile_nnz (int): tile threshold when packing (see :class:`BitAdjacency`).
        adjacency (str, optional): the packed form, ``"tiles"``, ``"auto"`` (no tiles when they
            would be less than :data:`~pyg_quant.graph.adjacency_form.MIN_TILE_FILL` full, where
            ``bit_spmm``'s CSR gather is faster) or ``"csr"``; None (default):
            :data:`~pyg_quant.graph.adjacency_form.DEFAULT_ADJACENCY`; see
            :func:`~pyg_quant.graph.packing.pack_entries`.
    """

    def __init__(self, edges: EdgeSet, self_loop_fill: Optional[float], adj_bits: Optional[int],
                 min_tile_nnz: int = DEFAULT_MIN_TILE_NNZ, adjacency: Optional[str] = None):
        self.num_src, self.num_dst = edges.num_src, edges.num_dst
        self.adj_bits = adj_bits
        self.min_tile_nnz = min_tile_nnz
        self.adjacency = check_adjacency_form(adjacency)
        self.keep: Optional[torch.Tensor] = None
        self.diag: Optional[torch.Tensor] = None
        self.prebuilt = None  # the user's BitAdjacency, used as M as it is
        self.deg_inv_sqrt: Optional[torch.Tensor] = None  # set by GCN normalization
        bit_adj = edges.bit_adj
        if bit_adj is not None and (bit_adj.diag is not None or self_loop_fill is None):
            self.prebuilt, self.diag = bit_adj, bit_adj.diag
        else:
            if bit_adj is not None:  # self-loops must be added by the rule: needs the explicit entries
                edges = edges.decoded()
            if self_loop_fill is not None:
                self.keep, self.diag = _self_loop_terms(edges, self_loop_fill)
        self.edges = edges
        self.weighted = edges.weight is not None
        self._packed: Optional[tuple] = None
        if self.weighted and adj_bits is not None:
            self._quantize_weights(adj_bits)

    # --- edge weights ------------------------------------------------------------------
    def _quantize_weights(self, bits: int) -> None:
        w = self.edges.weight.detach().to(torch.float32)
        check_finite(w, "edge_weight", always=True)  # once a graph
        if w.numel() == 0:
            lo = hi = torch.zeros((), device=w.device)
        elif self.keep is None:
            lo, hi = w.min(), w.max()
        else:  # ranges over the edges that stay in A (self-loops moved to the diagonal are not coded)
            inf = torch.full_like(w, float("inf"))
            lo, hi = torch.where(self.keep, w, inf).min(), torch.where(self.keep, w, -inf).max()
            lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo))
            hi = torch.where(torch.isfinite(hi), hi, torch.zeros_like(hi))
        scale = (hi - lo) / torch.full_like(hi, float(2**bits - 1))
        inv_scale = torch.where(scale > 0, torch.ones_like(scale) / scale, torch.zeros_like(scale))
        self.w_lo, self.w_scale = lo, scale
        self.codes = torch.floor((w - lo) * inv_scale + 0.5).clamp_(0, 2**bits - 1).to(torch.int64)

    @property
    def can_run_bits(self) -> bool:
        """Whether ``Â`` has a bit form (float edge weights need ``adj_bits``)."""
        return not self.weighted or self.adj_bits is not None

    def _float_edges(self) -> EdgeSet:
        if self.edges.src is None:
            self.edges = self.edges.decoded()
        return self.edges

    def edge_coefficients(self, dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
        """Per-edge float factor of the float aggregation (None: every edge counts once).

        Quantized weights ``lo_w + s_w·c`` are evaluated in ``dtype``: in float64 they are the unrounded
        values that the bit kernels' ``lo_w·(…) + s_w·(…)`` multiply.
        """
        edges = self._float_edges()
        coef = None
        if self.weighted:
            coef = edges.weight
            if self.adj_bits is not None:
                deq = self.w_lo.to(dtype) + self.w_scale.to(dtype) * self.codes.to(dtype)
                raw = coef.to(dtype)
                coef = deq + (raw - raw.detach())  # straight-through to the raw weight
        elif edges.count is not None:
            coef = edges.count.to(dtype)
        if self.keep is not None:
            coef = self.keep.to(dtype) if coef is None else torch.where(self.keep, coef, torch.zeros_like(coef))
        return coef

    def _csr_values(self, dtype: torch.dtype) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(values, keep)`` for :func:`~pyg_quant.graph.float_csr.csr_pair`: an unweighted graph's multiplicities
        (None: ones) and self-loop mask as they are (the op applies them), else :meth:`edge_coefficients`."""
        if self.weighted:
            return self.edge_coefficients(dtype), None
        return self._float_edges().count, self.keep

    def _row_sums(self, values: Optional[torch.Tensor]) -> torch.Tensor:
        """``Σ_j`` of ``A`` (``values=None``: of the multiplicity adjacency ``M``) per target, int64, exact."""
        edges, keep = self.edges, self.keep
        if values is None:
            values = edges.count
            if values is None:  # one for each edge that stays in A
                values = torch.ones_like(edges.dst) if keep is None else keep.to(edges.dst.dtype)
                keep = None
        if keep is not None:
            values = torch.where(keep, values, torch.zeros_like(values))
        return torch.zeros(self.num_dst, dtype=torch.int64, device=edges.dst.device).index_add_(0, edges.dst, values)

    def degree(self) -> torch.Tensor:
        r"""``Â·1`` per target, float32 (GCN's :math:`\hat{d}`).

        Without weights it is the integer row sums (exact in float32 below 2^24) plus ``δ``, one float32
        rounding (:func:`pyg_quant.ops.degree_inv_sqrt`).  With quantized weights it is evaluated from the exact integer row sums
        (``lo_w·M1 + s_w·C1 + δ`` in float64), so every format and both paths get the
        same bits; the gradient to the weights flows through the float sum.
        """
        diag = self.diag
        if self.prebuilt is not None:
            return self.prebuilt.degree()  # (its diagonal is self.diag)
        if not self.weighted:
            return self._unweighted_degrees()[0]
        if self.adj_bits is None:
            coef = self.edge_coefficients()
            deg = torch.zeros(self.num_dst, dtype=coef.dtype, device=coef.device).index_add(0, self.edges.dst, coef)
            return deg + diag if diag is not None else deg
        exact = (self.w_lo.double() * self._row_sums(None).double()
                 + self.w_scale.double() * self._row_sums(self.codes).double())
        if diag is not None:
            exact = exact + diag.detach().double()
        exact = exact.to(torch.float32)
        if not (torch.is_grad_enabled() and self.edges.weight.requires_grad):
            return exact
        coef = self.edge_coefficients()
        summed = torch.zeros(self.num_dst, device=coef.device).index_add(0, self.edges.dst, coef)
        if diag is not None:
            summed = summed + diag.to(torch.float32)
        return exact + (summed - summed.detach())

    def _unweighted_degrees(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(d, d^-1/2)`` of an unweighted edge list: :func:`pyg_quant.ops.degree_inv_sqrt` (its torch composition
        while ``torch.compile`` traces)."""
        edges = self._float_edges()
        degrees = ops.reference.degree_inv_sqrt if is_compiling() else ops.degree_inv_sqrt
        return degrees(edges.dst, self.keep, edges.count, self.diag, self.num_dst)

    def degree_inv_sqrt(self) -> torch.Tensor:
        r""":math:`\hat{d}^{-1/2}` of :meth:`degree`, 0 where a degree is 0 (the floats of
        :func:`pyg_quant.ops.reference.inv_sqrt_degree`); an unweighted edge list's in the same op as its degrees."""
        if self.prebuilt is None and not self.weighted:
            return self._unweighted_degrees()[1]
        return ops.reference.inv_sqrt_degree(self.degree())

    # --- aggregation -------------------------------------------------------------------
    def csr_pair(self, dtype: torch.dtype) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(A, Aᵀ)`` (the edges, self-loop term apart) as CSR matrices of ``dtype``, kept on the graph.

        Built once per graph and dtype, so a graph that the layers share (see
        :mod:`pyg_quant.graph.cache`) carries them across layers and steps.  None where a
        gradient must reach the edge coefficients (the edge-wise ``index_add`` carries it).
        """
        cache = self.__dict__.setdefault("_csr", RebuiltOnCopy())
        if dtype in cache:
            return cache[dtype]
        prebuilt = self.prebuilt
        if prebuilt is not None and not self.weighted and self.keep is None:
            # A user's BitAdjacency is one graph for every layer and call: its matrices are kept on it.
            pair = (bit_adjacency_csr(prebuilt, dtype), bit_adjacency_csr(prebuilt, dtype, transpose=True))
        else:
            values, keep = self._csr_values(dtype)  # decodes the edges if needed
            if values is not None and values.requires_grad:
                return None
            edges = self.edges
            pair = csr_pair(edges.dst, edges.src, values, self.num_dst, self.num_src, dtype, keep)
        cache[dtype] = pair
        return pair

    def aggregate_scaled(self, y: torch.Tensor) -> Optional[torch.Tensor]:
        r"""``D^{-1/2} Â · y`` (``deg_inv_sqrt`` scaling the rows) in one CSR product, its gradient one with the
        transpose: the matrix ``D^{-1/2}(A + diag(δ))`` built once per graph and dtype (a float sum in another
        order than :meth:`aggregate_float` and the row scaling's).  None where that does not apply (no GCN
        normalization, other than a 2-D float32 / float64 ``y``, ``torch.compile`` tracing, a gradient to the
        edge coefficients, ``δ`` or ``D^{-1/2}``): the caller takes the steps one by one."""
        dinv = self.deg_inv_sqrt
        if (dinv is None or y.dim() != 2 or y.dtype not in (torch.float32, torch.float64) or is_compiling()
                or dinv.requires_grad or (self.diag is not None and self.diag.requires_grad)):
            return None
        cache = self.__dict__.setdefault("_csr", RebuiltOnCopy())
        key = ("scaled", y.dtype)
        pair = cache.get(key)
        if pair is None:
            prebuilt = self.prebuilt
            if prebuilt is not None and not self.weighted and self.keep is None:
                pair = bit_adjacency_scaled_csr(prebuilt, dinv, y.dtype)
            else:
                values, keep = self._csr_values(y.dtype)  # (decodes the edges if needed)
                if values is not None and values.requires_grad:
                    return None
                edges = self.edges
                pair = scaled_csr_pair(edges.dst, edges.src, values, dinv, self.diag, self.num_dst, self.num_src,
                                       y.dtype, keep)
            cache[key] = pair
        return ops.csr_product(y, *pair)

    def column(self, values: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A per-node vector of this graph (``deg_inv_sqrt``, ``diag``) as an ``[N, 1]`` column of ``dtype``.

        A graph the layers share lives across layers and steps, and a GCN layer scales by ``deg_inv_sqrt``
        twice a call: the column is made once per vector and dtype (a cast and a view fewer per use), unless it
        carries a gradient (an autograd view cannot outlive its step) or ``torch.compile`` is tracing.
        """
        if values is None:
            return None
        if values.requires_grad or is_compiling():
            return values.to(dtype).view(-1, 1)
        cache = self.__dict__.setdefault("_columns", {})
        hit = cache.get((id(values), dtype))
        if hit is not None and hit[0] is values:  # the entry holds values, so its id cannot be reused
            return hit[1]
        column = values.to(dtype).view(-1, 1)
        cache[(id(values), dtype)] = (values, column)
        return column

    def aggregate_float(self, y: torch.Tensor, edge_mask: Optional[torch.Tensor] = None, *,
                        self_values: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``Â · y`` along dim -2 (any leading batch dims), autograd-friendly, in ``y``'s dtype.

        A 2-D float32 / float64 ``y`` runs one CSR product (:meth:`csr_pair`); other inputs,
        edge weights that need a gradient, and ``torch.compile`` tracing (sparse CSR tensors
        and the custom backward would break its graph) an ``index_add`` of the edge messages.
        ``edge_mask`` (``[num_edges]``, an explainer's, see :mod:`pyg_quant.nn.explain`) multiplies
        each edge's message, the self-loop term apart; it takes the ``index_add``, which carries
        its gradient.  ``self_values`` (default ``y``, same shape) are what the self-loop term ``δ`` multiplies.
        """
        use_csr = (edge_mask is None and y.dim() == 2 and y.dtype in (torch.float32, torch.float64)
                   and not is_compiling())
        pair = self.csr_pair(y.dtype) if use_csr else None
        if pair is not None:
            out = ops.csr_product(y, *pair)
        else:
            edges = self._float_edges()
            coef = self.edge_coefficients(y.dtype if y.is_floating_point() else torch.float32)
            if edge_mask is not None:
                coef = edge_mask if coef is None else coef * edge_mask
            messages = y.index_select(-2, edges.src)
            if coef is not None:
                messages = messages * coef.to(messages.dtype).view(-1, 1)
            shape = y.shape[:-2] + (self.num_dst, y.size(-1))
            out = torch.zeros(shape, dtype=messages.dtype, device=y.device).index_add(-2, edges.dst, messages)
        if self.diag is not None:
            own = y if self_values is None else self_values.to(y.dtype)
            # A slice of all rows would still cost a slice_backward (a zero fill and a copy) in every backward.
            self_features = own if own.size(-2) == self.num_dst else own[..., :self.num_dst, :]
            out = out + self.column(self.diag, y.dtype) * self_features
        return out

    def _pack(self) -> tuple:
        if self._packed is None:
            edges = self.edges
            src, dst, count = edges.src, edges.dst, edges.count
            codes = self.codes if self.weighted else None
            if self.keep is not None:
                src, dst = src[self.keep], dst[self.keep]
                count = count[self.keep] if count is not None else None
                codes = codes[self.keep] if codes is not None else None
            pack = (self.num_dst, self.num_src, self.min_tile_nnz, self.adjacency)
            mask = pack_entries(dst, src, count, *pack)
            coded = pack_entries(dst, src, codes, *pack) if self.weighted else None
            self._packed = (mask, coded)
        return self._packed

    def _code_products(self, y: BitTensor):
        """``(M·Q, C·Q or None)`` as integer tensors; ``y`` in column layout."""
        if self.prebuilt is not None:
            return self._products(self.prebuilt, y), None
        if is_compiling():
            edges = self.edges
            args = (y.planes, self.num_src, self.num_dst, y.bits, y.cols, self.min_tile_nnz, self.adjacency)
            products = edge_spmm_int(edges.src, edges.dst, self.keep, edges.count, *args)
            coded = edge_spmm_int(edges.src, edges.dst, self.keep, self.codes, *args) if self.weighted else None
            return products, coded
        mask, coded = self._pack()
        return self._products(mask, y), self._products(coded, y) if coded is not None else None

    @staticmethod
    def _products(adj, y: BitTensor) -> torch.Tensor:
        x_planes, x_codes = gather_operands(adj, y, False)
        return bit_spmm_codes(adj, x_planes, y.bits, y.cols, x_codes)

    def aggregate_bits(self, y: BitTensor) -> torch.Tensor:
        r"""``Â · to_val(y)`` on the bit tiles, ``[num_dst, y.cols]`` float32; ``y`` scaled per column or tensor.

        One kernel with its fused epilogue where it can (:meth:`aggregate_bits_fused`); quantized edge weights take
        two integer products and their affine terms in float32 torch ops, as the epilogue adds them
        (``csrc/epilogue.h``), so every format and both paths give the same bits for the same ``Â``.
        """
        if y.dim not in (None, 0):
            raise ValueError("aggregate_bits needs features scaled per column or per tensor")
        fused = self.aggregate_bits_fused(y)
        if fused is not None:
            return fused
        y = y.as_layout("col")
        mask_products, code_products = self._code_products(y)
        lo_y, scale_y = y.lo.view(1, -1), y.scale.view(1, -1)
        mask_sums = self.prebuilt.row_sums if self.prebuilt is not None else self._row_sums(None)
        out = lo_y * mask_sums.float().view(-1, 1) + scale_y * mask_products.float()
        if self.weighted:
            code_part = lo_y * self._row_sums(self.codes).float().view(-1, 1) + scale_y * code_products.float()
            out = self.w_lo * out + self.w_scale * code_part
        if self.diag is not None:
            out = out + self.diag.view(-1, 1) * to_val(y)[:self.num_dst]
        return out

    def aggregate_bits_fused(self, y: BitTensor, *, self_weight=None, row_scale: Optional[torch.Tensor] = None,
                             bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        r"""``diag(row_scale) · (Â + diag(self_weight)) · to_val(y) + bias`` in one kernel, or None.

        The integer product, the affine correction, the self terms, the row
        scaling and the bias run in :func:`pyg_quant.bit_spmm`'s fused epilogue
        (float32, ``csrc/epilogue.h``), instead of the separate
        float passes of :meth:`aggregate_bits`.  None where that epilogue cannot
        express ``Â`` (quantized edge weights need two integer products); while ``torch.compile`` traces an
        ``edge_index`` graph, the tiles are packed inside the same op
        (:func:`~pyg_quant.graph.edge_ops.edge_bit_spmm`).
        """
        if self.weighted or y.dim not in (None, 0):
            return None
        if self.prebuilt is not None:
            return bit_spmm(self.prebuilt, y, self_weight=self_weight, row_scale=row_scale, bias=bias)  # with its diag
        extra = self.diag
        if self_weight is not None:
            extra = self_weight if extra is None else extra + self_weight
        if is_compiling():  # packs inside the op: its packed sizes depend on the data
            y, edges = y.as_layout("col"), self.edges
            return edge_bit_spmm(edges.src, edges.dst, self.keep, edges.count, y.planes, y.lo, y.scale,
                                 -1 if y.dim is None else y.dim, y.bits, self.num_src, self.num_dst, y.cols,
                                 self.min_tile_nnz, self.adjacency, extra, row_scale, bias)
        return bit_spmm(self._pack()[0], y, self_weight=extra, row_scale=row_scale, bias=bias)
