from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.nn.inits import reset
from torch_geometric.typing import SparseTensor
from torch_geometric.utils import is_torch_sparse_tensor

from .._utils import check_finite
from ..bit_tensor import BitTensor
from ..graph.bit_adjacency import BitAdjacency
from ..graph.cache import cached_graph
from ..graph.input_formats import to_edge_set
from ..graph.quant_graph import QuantGraph
from ..quantization.bits import UNSET, check_optional_bits, resolve_bits
from ..quantization.fixed import quantize_fixed
from ..quantization.quantize import dequantize, fake_quantize, fits, quantize
from ._common import (check_aggr, check_node_dim, check_out_dim, node_matrix, quant_options_repr,
                      requantize_output)
from ._eval_path import gin_eval
from .call_plan import kept
from .calibration import StaticRange
from .explain import explain_edge_mask
from .quant_linear import QuantLinear, bit_kernels_apply, run_fused_mlp


def quantize_linears(module: Callable, **quant_kwargs) -> Callable:
    """``module`` with every ``torch.nn.Linear`` / PyG ``Linear`` in it swapped, in place, for a
    :class:`QuantLinear` that shares its parameters (state dict keys are unchanged)."""
    if isinstance(module, (torch.nn.Linear, Linear)) and not isinstance(module, QuantLinear):
        return QuantLinear.from_linear(module, **quant_kwargs)
    if isinstance(module, torch.nn.Module):
        for name, child in module.named_children():
            swapped = quantize_linears(child, **quant_kwargs)
            if swapped is not child:
                setattr(module, name, swapped)
    return module


def _plus_one(t: Tensor) -> Tensor:
    return 1 + t


class QGINConv(StaticRange, MessagePassing):
    r"""A drop-in quantized :class:`torch_geometric.nn.conv.GINConv`, computed on bit planes.

    .. math::
        \mathbf{X}^{\prime} = h_{\mathbf{\Theta}} \left( \mathbf{A}\tilde{\mathbf{X}}
        + (1 + \epsilon) \cdot \mathbf{X} \right)

    :math:`\tilde{\mathbf{X}}` is :math:`\mathbf{X}` (the source features)
    quantized per channel (column) to ``act_bits``, the ranges over which
    :math:`\mathbf{A}\cdot` factors exactly; :math:`\mathbf{A}\tilde{\mathbf{X}}`
    runs on the bit tiles of the 1-bit adjacency (multi-bit where edges repeat)
    and equals the float64 product of the dequantized operands up to a few float32
    roundings of its terms (``csrc/epilogue.h``).  The self term :math:`(1 + \epsilon)\mathbf{X}` is an elementwise
    add and stays in float.  Every ``torch.nn.Linear`` and PyG ``Linear`` in
    ``nn`` is swapped (in place, sharing its parameters, so state dicts keep
    their keys) for a :class:`~pyg_quant.nn.QuantLinear`, which quantizes its
    input per row to ``act_bits`` and its weight per output channel to
    ``weight_bits`` and multiplies on bit planes; other modules of ``nn``
    (activations, normalizations) run in float, and a plain callable ``nn`` is
    called as it is.

    Modes: in ``train()`` the quantizers run as fake quantization with
    straight-through gradients to the weights, inputs and ``eps``, stochastic
    rounding if ``stochastic``.  In ``eval()`` rounding is to nearest and,
    under ``torch.no_grad()`` (or inference mode), the bit kernels run; with
    autograd on, ``eval()`` computes the same values through the float path.
    ``bits=None`` is PyG's float :class:`GINConv` (``nn`` is left untouched).

    Adjacency formats (one bit layout, one kernel): ``edge_index``, a
    ``torch.sparse`` COO/CSR/CSC ``adj_t`` (its values weight the sum, as in
    PyG's ``spmm``; they are quantized to ``adj_bits`` codes), a
    ``SparseTensor`` (its values are ignored, as in PyG) or a
    :class:`pyg_quant.BitAdjacency` (its diagonal term, if any, is part of
    :math:`\mathbf{A}`).  Node features may be :class:`pyg_quant.BitTensor` s:
    ``act_bits`` codes with ranges per channel or per tensor are aggregated as
    they are, anything else is read as the floats it holds.  The layers called
    on the same, unchanged ``edge_index`` tensor read it once and share its graph
    (the packed bit tiles too).

    Computed correctly but not quantized: sparse node features are densified;
    node features with leading batch dimensions are aggregated as one
    ``[N, (*)·F]`` matrix; sparse values with ``adj_bits=None`` make the
    aggregation run in float on the quantized features.  Not supported:
    aggregations other than ``"add"``, ``flow="target_to_source"`` with a
    sparse or bit adjacency (as in PyG), TorchScript; ``decomposed_layers`` and
    PyG's propagate hooks are ignored.  PyG's explainer edge masks are applied
    as ``propagate`` applies them, on the float path (see
    :mod:`pyg_quant.nn.explain`): while one is set the layer does not run its
    bit kernels, and it needs an ``edge_index`` input.

    Args:
        nn (torch.nn.Module): the network :math:`h_{\mathbf{\Theta}}`, mapping
            ``[-1, in_channels]`` to ``[-1, out_channels]``.
        eps (float): (initial) :math:`\epsilon`. (default: ``0.``)
        train_eps (bool): make :math:`\epsilon` trainable. (default: ``False``)
        bits, weight_bits, act_bits, adj_bits, stochastic: as in
            :class:`~pyg_quant.nn.QGCNConv`.
        out_bits (int, optional): in ``eval()`` with the bit kernels, return the
            result requantized as a :class:`BitTensor` of this width.
        out_dim (int, optional): its ranges: ``0`` per channel (what a next
            QGINConv aggregates as it is; default), ``1`` per node (what a
            QGCNConv uses), ``None`` per tensor.  Per-channel ranges can be
            calibrated once and fixed (:func:`pyg_quant.nn.calibrate`, the
            ``static_range`` buffer): then the fused MLP kernel writes the
            codes itself.
        **kwargs (optional): :class:`torch_geometric.nn.conv.MessagePassing`
            arguments (``flow``, ``node_dim``).

    Shapes:
        - **input:** node features :math:`(|\mathcal{V}|, F_{in})` or
          :math:`((|\mathcal{V_s}|, F_{s}), (|\mathcal{V_t}|, F_{t}))` if
          bipartite (``x_t`` may be ``None``), edge indices
          :math:`(2, |\mathcal{E}|)` or a sparse / bit adjacency
        - **output:** node features :math:`(|\mathcal{V}|, F_{out})` or
          :math:`(|\mathcal{V}_t|, F_{out})` if bipartite
    """

    def __init__(self, nn: Callable, eps: float = 0., train_eps: bool = False, *, bits: Optional[int] = None,
                 weight_bits=UNSET, act_bits=UNSET, adj_bits: Optional[int] = 8, stochastic: bool = False,
                 out_bits: Optional[int] = None, out_dim: Optional[int] = 0, **kwargs):
        check_aggr(kwargs, self.__class__.__name__)
        super().__init__(**kwargs)
        self.weight_bits, self.act_bits = resolve_bits(bits, weight_bits, act_bits)
        self.adj_bits = check_optional_bits(adj_bits, "adj_bits")
        self.stochastic = bool(stochastic)
        self.out_bits = check_optional_bits(out_bits, "out_bits")
        self.out_dim = check_out_dim(out_dim)
        if self.weight_bits is not None or self.act_bits is not None:
            nn = quantize_linears(nn, weight_bits=self.weight_bits, act_bits=self.act_bits,
                                  stochastic=self.stochastic)
        self.nn = nn
        self._init_static_range()
        self.initial_eps = eps
        if train_eps:
            self.eps = torch.nn.Parameter(torch.empty(1))
        else:
            self.register_buffer("eps", torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self):
        super().reset_parameters()
        reset(self.nn)
        self.eps.data.fill_(self.initial_eps)
        self.clear_static_range()  # ranges of other weights

    def _static_bits(self) -> Optional[int]:
        return self.out_bits if self.out_dim == 0 else None

    def _node_counts(self, x_src, x_dst, edge_index, size) -> Tuple[int, int]:
        num_src = x_src.rows if isinstance(x_src, BitTensor) else x_src.size(-2)
        num_dst = None if x_dst is None else (x_dst.rows if isinstance(x_dst, BitTensor) else x_dst.size(-2))
        if size is not None:
            if len(size) != 2:
                raise ValueError(f"size must be (num_src, num_dst), got {size!r}")
            if size[0] is not None and int(size[0]) != num_src:
                raise ValueError(f"size[0]={size[0]} but x has {num_src} source nodes")
            if size[1] is not None:
                if num_dst is not None and int(size[1]) != num_dst:
                    raise ValueError(f"size[1]={size[1]} but x has {num_dst} target nodes")
                num_dst = int(size[1])
        if num_dst is None:  # (x_src, None) without a size: the adjacency says, as in PyG
            if isinstance(edge_index, BitAdjacency):
                num_dst = edge_index.num_rows
            elif isinstance(edge_index, SparseTensor):
                num_dst = edge_index.sparse_size(0)
            elif isinstance(edge_index, Tensor) and is_torch_sparse_tensor(edge_index):
                num_dst = edge_index.size(0)
            elif isinstance(edge_index, Tensor) and edge_index.dim() == 2 and edge_index.size(0) == 2:
                targets = edge_index[1] if self.flow == "source_to_target" else edge_index[0]
                num_dst = int(targets.max()) + 1 if targets.numel() else 0
            else:
                num_dst = num_src
        return num_src, num_dst

    def _graph(self, edge_index, num_src: int, num_dst: int) -> QuantGraph:
        """``A`` of ``edge_index``, shared with the other layers called on the same tensor
        (see :mod:`pyg_quant.graph.cache`)."""
        adj_bits = self.adj_bits if self.act_bits is not None else None

        def build(adj) -> QuantGraph:
            edges = to_edge_set(adj, None, num_src, num_dst, self.flow, sparse_tensor_values=False)
            return QuantGraph(edges, None, adj_bits)

        # Only an edge_index is cached: edges without weights, whose graph adj_bits plays no part in.
        return cached_graph(edge_index, ("gin", num_src, num_dst, self.flow), build)

    def forward(self, x: Union[Tensor, BitTensor, Tuple], edge_index, size: Optional[Tuple[int, int]] = None):
        """Args:
            x (Tensor, BitTensor or pair): node features, or ``(x_src, x_dst)`` (``x_dst`` may be None).
            edge_index: edge indices, a sparse adjacency ``adj_t`` or a :class:`BitAdjacency`.
            size ((int, int), optional): ``(num_src, num_dst)``.
        """
        fast = gin_eval(self, x, edge_index, size)
        if fast is not None:
            return fast
        if isinstance(x, (Tensor, BitTensor)):
            x = (x, x)
        if not isinstance(x, (tuple, list)) or len(x) != 2:
            raise TypeError(f"x must be a Tensor, a BitTensor or a pair (x_src, x_dst), got {type(x).__name__}")
        x_src, x_dst = x
        for name, t in (("x_src", x_src), ("x_dst", x_dst)):
            if isinstance(t, Tensor):
                check_node_dim(self.node_dim, t, self.__class__.__name__)
            elif t is not None and not isinstance(t, BitTensor):
                raise TypeError(f"{name} must be a Tensor or a BitTensor, got {type(t).__name__}")
        if x_src is None:
            raise ValueError("x_src (the source node features) is required")
        num_src, num_dst = self._node_counts(x_src, x_dst, edge_index, size)
        act_bits = self.act_bits
        graph = self._graph(edge_index, num_src, num_dst)
        bit_kernels = bit_kernels_apply(self, x_src, x_dst, self.eps)

        # x_src as the aggregation's operand: codes that fit are used as they are.
        already_quantized = isinstance(x_src, BitTensor) and fits(x_src, act_bits, (None, 0))
        if act_bits is not None and graph.can_run_bits and bit_kernels:
            if already_quantized and x_dst is x_src and x_src.dim in (None, 0):
                # (A + (1+eps)·I)·X on the same codes: the self term runs in the kernel's epilogue
                fused = graph.aggregate_bits_fused(x_src, self_weight=self._one_plus_eps().detach().reshape(()))
                if fused is not None:
                    return self._nn_output(fused, bit_kernels)
                out = graph.aggregate_bits(x_src)
            elif already_quantized:
                out = graph.aggregate_bits(x_src)
            else:
                source = dequantize(x_src) if isinstance(x_src, BitTensor) else x_src
                source = source.to_dense() if source.is_sparse else source
                check_finite(source, "x")
                matrix, restore = node_matrix(source)
                out = restore(graph.aggregate_bits(quantize(matrix, act_bits, 0, "col")))
        else:
            source = dequantize(x_src) if isinstance(x_src, BitTensor) else x_src
            source = source.to_dense() if source.is_sparse else source
            if act_bits is not None and not already_quantized:
                check_finite(source, "x")
                matrix, restore = node_matrix(source)
                source = restore(fake_quantize(matrix, act_bits, 0, self.stochastic and self.training))
            out = graph.aggregate_float(source, explain_edge_mask(self, edge_index, graph))

        if x_dst is not None:
            target = dequantize(x_dst) if isinstance(x_dst, BitTensor) else x_dst
            target = target.to_dense() if target.is_sparse else target
            out = torch.addcmul(out, self._one_plus_eps(), target)  # one pass, the float32 steps of the one-op path
        return self._nn_output(out, bit_kernels)

    def _one_plus_eps(self) -> Tensor:
        """``1 + eps``, made once while ``eps`` is a constant buffer (one op fewer a call, every step); a trained
        ``eps`` (or an inference tensor, which has no version counter) gets it made at every call."""
        eps = self.eps
        if eps.requires_grad:
            return 1 + eps
        return kept(self, "_one_plus_eps_cache", eps, _plus_one)

    def _nn_output(self, x, bit_kernels: bool):
        """``self.nn(x)``, requantized when ``out_bits`` says.  With the bit kernels, a Sequential of QuantLinear
        (+ ReLU) layers runs as one fused ``quant_mlp`` call (the same result, see
        :func:`~pyg_quant.nn.quant_linear.run_fused_mlp`); on CUDA, when its result is requantized per channel, the
        kernel also hands the quantizer the result's column extrema (``col_keys``), which spares it a pass over the
        result (the same codes).  On the CPU that pass is cheap and the plain path stays."""
        fixed = self._fixed_ranges() if bit_kernels else None
        if fixed is not None:
            # Calibrated ranges: on CUDA the fused kernel stores the codes (the same codes; on the CPU, where the
            # quantizer's pass is cheap, the row codes it would also make are not needed)
            codes = run_fused_mlp(self.nn, x, out_codes=fixed) if isinstance(x, Tensor) and x.is_cuda else None
            if codes is not None:
                return codes
            out = self.nn(x)
            if out.dim() != 2:
                raise ValueError(f"out_bits needs 2-D node features, got a result of shape {tuple(out.shape)}")
            return quantize_fixed(out, fixed)
        if bit_kernels:
            want_keys = (self.out_bits is not None and self.out_dim == 0 and isinstance(x, Tensor) and x.is_cuda
                         and x.dim() == 2)
            fused = run_fused_mlp(self.nn, x, col_keys=True) if want_keys else run_fused_mlp(self.nn, x)
            if fused is not None:
                out, keys = fused if want_keys else (fused, None)
                self._observe(out)
                return requantize_output(out, self.out_bits, self.out_dim, bit_kernels, keys)
        out = self.nn(x)
        self._observe(out)
        return requantize_output(out, self.out_bits, self.out_dim, bit_kernels)

    def __repr__(self) -> str:
        options = quant_options_repr(self.weight_bits, self.act_bits, self.out_bits)
        return f"{self.__class__.__name__}(nn={self.nn}{', ' + options if options else ''})"
