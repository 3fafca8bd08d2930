from typing import Optional, Union

import torch
from torch import Tensor
from torch.nn import Parameter
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.inits import zeros
from torch_geometric.typing import SparseTensor

from .. import ops
from .._utils import is_compiling
from ..bit_tensor import BitTensor
from ..graph.bit_adjacency import BitAdjacency
from ..graph.cache import cached_graph
from ..graph.input_formats import to_edge_set
from ..graph.quant_graph import QuantGraph
from ..ops.reference import inv_sqrt_degree
from ..quantization.bits import UNSET, check_optional_bits, resolve_bits
from ..quantization.fixed import fake_quantize_fixed, quantize_fixed
from ..quantization.quantize import fake_quantize, quantize
from ._common import (check_aggr, check_node_dim, check_out_dim, node_matrix, quant_options_repr,
                      requantize_output)
from ._eval_path import gcn_eval
from .calibration import StaticRange
from .explain import explain_edge_mask
from .quant_linear import QuantLinear, bit_kernels_apply, run_row_scaled_linear


def _cache_attribute(edge_index) -> str:
    """PyG's cache attribute for an adjacency: ``_cached_edge_index`` for tensors (``torch.sparse`` too), else
    ``_cached_adj_t`` (a ``SparseTensor``; a ``BitAdjacency``, which PyG does not know, counts as one)."""
    return "_cached_adj_t" if isinstance(edge_index, (SparseTensor, BitAdjacency)) else "_cached_edge_index"


def bit_adjacency_deg_inv_sqrt(adj: BitAdjacency) -> Tensor:
    r""":func:`inv_sqrt_degree` of a :class:`BitAdjacency` that is the whole :math:`\hat{A}` (its self-loops
    included), made once per adjacency: every layer called on it shares it (its degrees: ``adj.degree()``, what
    ``QuantGraph.degree`` gives).  One :func:`pyg_quant.ops.degree_inv_sqrt` call, each row's sum its one "edge"
    (the same floats as the torch composition, which runs while ``torch.compile`` traces)."""
    return adj.derived("gcn_deg_inv_sqrt", lambda: row_sums_inv_sqrt(adj))


def row_sums_inv_sqrt(adj: BitAdjacency) -> Tensor:
    """:func:`inv_sqrt_degree` of ``adj.degree()``, made anew (see :func:`bit_adjacency_deg_inv_sqrt`)."""
    if is_compiling():
        return inv_sqrt_degree(adj.degree())
    rows = torch.arange(adj.num_rows, device=adj.device)
    return ops.degree_inv_sqrt(rows, None, adj.row_sums, adj.diag, adj.num_rows)[1]


class QGCNConv(StaticRange, MessagePassing):
    r"""A drop-in quantized :class:`torch_geometric.nn.conv.GCNConv`, computed on bit planes.

    .. math::
        \mathbf{X}^{\prime} = \mathbf{\hat{D}}^{-1/2} \mathbf{\hat{A}}
        \left( \mathbf{\hat{D}}^{-1/2} \mathbf{X} \mathbf{\Theta} \right) + \mathbf{b},

    with :math:`\mathbf{\hat{A}} = \mathbf{A} + \mathbf{I}` (:math:`\mathbf{A}
    + 2\mathbf{I}` when ``improved``) and :math:`\hat{d}_i = \sum_j
    \hat{A}_{ij}`, evaluated as four quantized steps:

    1. :math:`\mathbf{H} = \tilde{\mathbf{X}}\tilde{\mathbf{\Theta}}`:
       :math:`\mathbf{X}` quantized per node (row) to ``act_bits``,
       :math:`\mathbf{\Theta}` per output channel (column) to ``weight_bits``,
       a bit-plane GEMM (:class:`~pyg_quant.nn.QuantLinear`);
    2. :math:`\mathbf{H}^{\prime} = \mathbf{\hat{D}}^{-1/2}\mathbf{H}`, quantized
       per channel (column) to ``act_bits``.  The row scaling comes *before*
       this quantization on purpose: :math:`\mathbf{\hat{A}}\cdot` factors
       exactly over per-column ranges, and a row scaling applied to the codes
       afterwards would make :math:`\mathbf{\hat{A}}\mathbf{\hat{D}}^{-1/2}`
       non-binary and break that factorisation;
    3. :math:`\mathbf{\hat{A}}\tilde{\mathbf{H}}^{\prime}` on the bit tiles of
       the 1-bit :math:`\mathbf{A}` (multi-bit where edges repeat), the
       self-loop term :math:`\hat{A}_{ii}` added in float
       (:func:`pyg_quant.bit_spmm`'s ``diag``);
    4. the row scaling :math:`\mathbf{\hat{D}}^{-1/2}` and the bias in float.

    Steps 1 and 3 equal the float64 products of their dequantized operands up
    to a few float32 roundings of their terms (``csrc/epilogue.h``), so the layer is :class:`GCNConv` applied to
    the quantized :math:`\tilde{\mathbf{X}}`, :math:`\tilde{\mathbf{\Theta}}`
    and :math:`\tilde{\mathbf{H}}^{\prime}`.  Edge weights (``edge_weight`` or
    the values of a sparse adjacency) are quantized per tensor to ``adj_bits``
    codes, :math:`w \approx lo_w + s_w c`, and aggregated as
    :math:`lo_w \mathbf{A}_{01} + s_w \mathbf{C}` with the code adjacency
    :math:`\mathbf{C}` on the same tiles; the degrees are those of the
    quantized weights.

    Modes: in ``train()`` the same quantizers run as fake quantization
    (quantize, dequantize) in float32 with straight-through gradients to the
    weights, inputs and edge weights, stochastic rounding if ``stochastic``.
    In ``eval()`` rounding is to nearest and, under ``torch.no_grad()`` (or
    inference mode), the bit kernels run (C++ popcount on the CPU, 1-bit
    tensor cores on CUDA); with autograd on, ``eval()`` computes the same
    values through the float path so gradients stay available.  ``bits=None``
    is PyG's float :class:`GCNConv` (same parameters, same state dict keys).

    Adjacency formats, all brought to one bit layout before one kernel:
    ``edge_index`` with ``edge_weight``, a ``torch.sparse`` COO/CSR/CSC
    ``adj_t`` (its values are the edge weights), a ``SparseTensor`` (with
    torch_sparse), or a :class:`pyg_quant.BitAdjacency`.  Self-loops follow
    PyG's rule for each format: ``edge_index`` keeps a present loop's weight
    and adds ``fill`` where none is (``add_remaining_self_loops``); a
    torch.sparse ``adj_t`` adds ``fill`` on top of a present loop; a
    ``SparseTensor`` sets every diagonal entry to ``fill``; and, as in PyG
    2.6–2.8, an *unweighted* ``edge_index`` gets loops of weight 1 even when
    ``improved`` (``gcn_norm`` adds the loops before it fills the weights with
    ones; pass ``edge_weight`` for :math:`\mathbf{A} + 2\mathbf{I}`).  On
    graphs without self-loops, with weights given when ``improved``, all
    formats agree.  A ``BitAdjacency`` carrying a diagonal term
    (``self_loops=1|2``) is used as it is (build it with ``self_loops=2`` for
    ``improved``); one without is decoded and given self-loops by the
    ``edge_index`` rule, which costs a repack (use ``cached=True``).

    Node features may be a :class:`pyg_quant.BitTensor` (e.g. the ``out_bits``
    output of a previous layer): with ``act_bits`` bits and ranges per node or
    per tensor it is used as it is, otherwise it is read as the floats it
    holds.

    Computed correctly but not quantized: sparse node features are densified;
    node features with leading batch dimensions (``[*, N, F]``, PyG's static
    graphs) are aggregated as one ``[N, (*)·F]`` matrix; float edge weights
    with ``adj_bits=None`` make the aggregation run in float on the quantized
    features.  Not supported: aggregations other than ``"add"``,
    ``flow="target_to_source"`` with a sparse or bit adjacency (as in PyG),
    TorchScript; ``decomposed_layers`` and PyG's propagate hooks are ignored
    (there is no ``propagate`` call).  PyG's explainer edge masks are applied
    as ``propagate`` applies them, on the float path (see
    :mod:`pyg_quant.nn.explain`): while one is set the layer does not run its
    bit kernels, and it needs an ``edge_index`` input.

    Args:
        in_channels (int): Size of each input sample, or ``-1`` (lazy).
        out_channels (int): Size of each output sample.
        improved (bool): :math:`\mathbf{A} + 2\mathbf{I}`. (default: ``False``)
        cached (bool): cache the normalized adjacency (in eval, the packed bit
            tiles too) on the first call and reuse it; transductive use only.
            As in PyG, the graph of a tensor input (``edge_index`` or
            ``torch.sparse``) is kept as ``_cached_edge_index``, that of a
            ``SparseTensor`` (or a ``BitAdjacency``) as ``_cached_adj_t``, and
            setting either to ``None`` drops it.  Without it, an ``edge_index``
            passed without ``edge_weight`` is still read once: the layers called
            on the same, unchanged tensor share its graph. (default: ``False``)
        add_self_loops (bool, optional): add self-loops; defaults to ``normalize``.
        normalize (bool): symmetric normalization. (default: ``True``)
        bias (bool): learn an additive bias. (default: ``True``)
        bits (int, optional): 1..8, shorthand for ``weight_bits = act_bits = bits``;
            ``None`` is the float layer.
        weight_bits, act_bits (int, optional): separate widths for
            :math:`\mathbf{\Theta}` and for the features (inputs and
            :math:`\mathbf{H}^{\prime}`).  The ranges of
            :math:`\mathbf{H}^{\prime}` can be calibrated once and fixed
            (:func:`pyg_quant.nn.calibrate`, the ``static_range`` buffer):
            then, in ``eval()``, the fused kernel of step 1 writes its codes.
        adj_bits (int, optional): width of the edge-weight codes. (default: ``8``)
        stochastic (bool): stochastic rounding in training. (default: ``False``)
        out_bits (int, optional): in ``eval()`` with the bit kernels, return the
            result requantized as a :class:`BitTensor` of this width (so a stack
            of layers stays in bit planes); training returns floats, which the
            next layer quantizes the same way.
        out_dim (int, optional): ranges of the ``out_bits`` result: ``1`` per
            node (what a next QGCNConv uses; default), ``0`` per channel (what a
            QGINConv uses), ``None`` per tensor.
        **kwargs (optional): :class:`torch_geometric.nn.conv.MessagePassing`
            arguments (``flow``, ``node_dim``).

    Shapes:
        - **input:** node features :math:`(|\mathcal{V}|, F_{in})` (or
          :math:`(*, |\mathcal{V}|, F_{in})`), edge indices
          :math:`(2, |\mathcal{E}|)` or a sparse / bit adjacency
          :math:`(|\mathcal{V}|, |\mathcal{V}|)`, edge weights
          :math:`(|\mathcal{E}|)` *(optional)*
        - **output:** node features :math:`(|\mathcal{V}|, F_{out})`, or a
          :class:`BitTensor` with ``out_bits``
    """
    # PyG's cache attributes (None: nothing cached), holding the QuantGraph of each input kind
    _cached_edge_index: Optional[QuantGraph]
    _cached_adj_t: Optional[QuantGraph]

    def __init__(self, in_channels: int, out_channels: int, improved: bool = False, cached: bool = False,
                 add_self_loops: Optional[bool] = None, normalize: bool = True, bias: bool = True, *,
                 bits: Optional[int] = None, weight_bits=UNSET, act_bits=UNSET, adj_bits: Optional[int] = 8,
                 stochastic: bool = False, out_bits: Optional[int] = None, out_dim: Optional[int] = 1, **kwargs):
        check_aggr(kwargs, self.__class__.__name__)
        super().__init__(**kwargs)

        if add_self_loops is None:
            add_self_loops = normalize
        if add_self_loops and not normalize:
            raise ValueError(f"'{self.__class__.__name__}' does not support adding self-loops to the graph "
                             f"when no on-the-fly normalization is applied")

        self.in_channels = in_channels
        self.out_channels = out_channels
        self.improved = improved
        self.cached = cached
        self.add_self_loops = add_self_loops
        self.normalize = normalize
        self.weight_bits, self.act_bits = resolve_bits(bits, weight_bits, act_bits)
        self.adj_bits = check_optional_bits(adj_bits, "adj_bits")
        self.stochastic = bool(stochastic)
        self.out_bits = check_optional_bits(out_bits, "out_bits")
        self.out_dim = check_out_dim(out_dim)

        self._cached_edge_index = None
        self._cached_adj_t = None
        self._init_static_range()

        self.lin = QuantLinear(in_channels, out_channels, bias=False, weight_initializer="glorot",
                               weight_bits=self.weight_bits, act_bits=self.act_bits, stochastic=self.stochastic)

        if bias:
            self.bias = Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)

        self.reset_parameters()

    def reset_parameters(self):
        super().reset_parameters()
        self.lin.reset_parameters()
        zeros(self.bias)
        self._cached_edge_index = None
        self._cached_adj_t = None
        self.clear_static_range()  # ranges of other weights

    def _static_bits(self) -> Optional[int]:
        return self.act_bits

    def _static_channels(self) -> Optional[int]:
        return self.out_channels

    @property
    def _cached_graph(self) -> Optional[QuantGraph]:
        """The cached graph of either input kind (see ``cached``)."""
        return self._cached_edge_index if self._cached_edge_index is not None else self._cached_adj_t

    def _graph(self, x, edge_index, edge_weight: Optional[Tensor]) -> QuantGraph:
        cache = _cache_attribute(edge_index)
        cached = getattr(self, cache)
        if cached is not None:
            return cached
        num_nodes = x.rows if isinstance(x, BitTensor) else x.size(-2)
        # Edge weights are coded only where the features are: with act_bits=None
        # the aggregation is a float one and keeps them exact.
        adj_bits = self.adj_bits if self.act_bits is not None else None
        if edge_weight is None:
            # No autograd history, so the layers called on this edge_index share one graph (see
            # graph/cache.py).  Edges without weights have no codes: adj_bits plays no part in it.
            options = ("gcn", num_nodes, self.flow, self.add_self_loops, self.improved, self.normalize)
            graph = cached_graph(edge_index, options, lambda adj: self._build_graph(adj, None, num_nodes, adj_bits))
        else:
            graph = self._build_graph(edge_index, edge_weight, num_nodes, adj_bits)
        if self.cached and self.normalize:  # PyG caches nothing without normalization: later graphs are used
            setattr(self, cache, graph)
        return graph

    def _build_graph(self, edge_index, edge_weight: Optional[Tensor], num_nodes: int,
                     adj_bits: Optional[int]) -> QuantGraph:
        edges = to_edge_set(edge_index, edge_weight, num_nodes, num_nodes, self.flow)
        fill = None
        if self.add_self_loops:
            # PyG's gcn_norm adds the remaining loops to an unweighted edge_index before it
            # fills the weights with ones, so there `improved` gives loops of weight 1.
            unweighted_edge_index = edges.bit_adj is None and edges.loop_rule == "remaining" and edges.weight is None
            fill = 2.0 if self.improved and not unweighted_edge_index else 1.0
        graph = QuantGraph(edges, fill, adj_bits)
        if self.normalize:
            # A BitAdjacency that carries its self-loops is the whole Â: every layer of the model called on it gets
            # the same D^-1/2, made once (the graph cache does not see BitAdjacency inputs).
            prebuilt = graph.prebuilt
            graph.deg_inv_sqrt = (bit_adjacency_deg_inv_sqrt(prebuilt) if prebuilt is not None
                                  else graph.degree_inv_sqrt())
        return graph

    def forward(self, x: Union[Tensor, BitTensor], edge_index, edge_weight: Optional[Tensor] = None):
        """Args:
            x (Tensor or BitTensor): node features.
            edge_index: edge indices, a sparse adjacency ``adj_t`` or a :class:`BitAdjacency`.
            edge_weight (Tensor, optional): edge weights for ``edge_index``.
        """
        fast = gcn_eval(self, x, edge_index, edge_weight, bit_adjacency_deg_inv_sqrt)
        if fast is not None:
            return fast
        if isinstance(x, (tuple, list)):
            raise ValueError(f"'{self.__class__.__name__}' received a tuple of node features as input while this "
                             f"layer does not support bipartite message passing. Please try other layers such as "
                             f"'SAGEConv' or 'GraphConv' instead")
        if isinstance(x, Tensor):
            check_node_dim(self.node_dim, x, self.__class__.__name__)
        elif not isinstance(x, BitTensor):
            raise TypeError(f"x must be a Tensor or a BitTensor, got {type(x).__name__}")
        bit_kernels = bit_kernels_apply(self, x, edge_weight, self.lin.weight, self.bias)
        graph = self._graph(x, edge_index, edge_weight)

        deg_inv_sqrt = graph.deg_inv_sqrt
        act_bits = self.act_bits
        quantized = act_bits is not None and graph.can_run_bits and bit_kernels  # h is quantized per channel below
        fixed = self._fixed_ranges()  # calibrated ranges of h (eval only)
        h = h_keys = codes = None
        if deg_inv_sqrt is not None and bit_kernels:  # D^-1/2 (X W): the fused kernel's last float32 multiply
            row_scale = graph.column(deg_inv_sqrt, torch.float32)
            if quantized and fixed is not None and x.device.type == "cuda":
                # h's codes straight from the kernel that computes h (None: the layer runs unfused below)
                codes = run_row_scaled_linear(self.lin, x, row_scale, out_codes=fixed)
            elif quantized and fixed is None and x.device.type == "cuda":
                # The kernel also hands the quantizer h's column extrema (col_keys), which spares it a pass over h
                # (the same codes); on the CPU that pass is cheap and the plain path stays.
                scaled = run_row_scaled_linear(self.lin, x, row_scale, col_keys=True)
                h, h_keys = (None, None) if scaled is None else scaled
            else:
                h = run_row_scaled_linear(self.lin, x, row_scale)
        if h is None and codes is None:
            h = self.lin(x)
            if deg_inv_sqrt is not None:
                h = h * graph.column(deg_inv_sqrt, h.dtype)
        if quantized:
            restore, two_d = (lambda out: out), True
            if codes is None:
                matrix, restore = node_matrix(h)  # h itself where the kernel ran (2-D float32): what h_keys describe
                two_d = h.dim() == 2
                self._observe(matrix)
                codes = quantize_fixed(matrix, fixed) if fixed is not None else quantize(matrix, act_bits, 0, "col",
                                                                                          h_keys)
            bias = self.bias.detach() if self.bias is not None else None
            fused = (graph.aggregate_bits_fused(codes, row_scale=deg_inv_sqrt, bias=bias)
                     if two_d and (bias is None or bias.dtype == torch.float32) else None)
            if fused is not None:  # normalization and bias ran in the kernel's epilogue
                return self._finish(fused, x, bit_kernels)
            # the fused epilogue's last steps in torch, in its order: every format gives the same bits
            out = restore(graph.aggregate_bits(codes))
            if deg_inv_sqrt is not None:
                out = out * deg_inv_sqrt.view(-1, 1)
            if bias is not None:
                out = out + bias
            return self._finish(out, x, bit_kernels)

        if act_bits is not None:
            matrix, restore = node_matrix(h)
            self._observe(matrix)
            h = restore(fake_quantize_fixed(matrix, fixed) if fixed is not None
                        else fake_quantize(matrix, act_bits, 0, self.stochastic and self.training))
        mask = explain_edge_mask(self, edge_index, graph)
        out = graph.aggregate_scaled(h) if self.training and mask is None else None  # D^-1/2 Â h in one product
        if out is None:
            out = graph.aggregate_float(h, mask)
            if deg_inv_sqrt is not None:
                out = out * graph.column(deg_inv_sqrt, out.dtype)
        if self.bias is not None:
            out = out + self.bias
        return self._finish(out, x, bit_kernels)

    def _finish(self, out: Tensor, x, bit_kernels: bool):
        if isinstance(x, Tensor) and x.is_floating_point():
            out = out.to(x.dtype)
        return requantize_output(out, self.out_bits, self.out_dim, bit_kernels)

    def __repr__(self) -> str:
        options = quant_options_repr(self.weight_bits, self.act_bits, self.out_bits)
        return f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}{', ' + options if options else ''})"
