r"""QATGCNConv / QATGINConv: :class:`~pyg_quant.QGCNConv` / :class:`~pyg_quant.QGINConv` with FakeQuantize modules.

The layers of :mod:`pyg_quant.nn` quantize every tensor over its own min/max at
each call.  Their QAT subclasses here route the same three quantization points
through :class:`~pyg_quant.qat.FakeQuantize` modules instead (see
:class:`~pyg_quant.qat.QConfig`), so ranges can be observed (EMA, percentile),
clipped with a zeroed straight-through gradient, frozen by
:func:`~pyg_quant.qat.convert`, and rounded stochastically from a seeded
generator:

* GCN: ``H = fq_in(X)·fq_w(Θ)`` (:class:`QATLinear`), ``H' = D^{-1/2} H``,
  ``out = D^{-1/2} Â fq_agg(H') + b``;
* GIN: ``out = h_Θ(A·fq_agg(X) + (1 + ε) X)`` with every Linear of ``h_Θ`` a
  :class:`QATLinear`.

Evaluation without autograd runs the bit kernels (``bitmm``, the layers'
bit-tile aggregation) on the quantizers' nearest-rounded codes; with autograd,
the fake path computes its products and sums in float64 from the same codes'
unrounded values ``lo + s·q`` (:meth:`FakeQuantize.forward_exact`) and rounds
once: the exact value of what the kernels compute, whose float32 epilogues stay
within a few float32 roundings of their terms (``csrc/epilogue.h``).  A value
that lies on a code boundary can take the neighbouring code in a later layer.  The graph
handling (adjacency formats, self-loops, degrees, edge-weight codes, caching)
is the parent layers', unchanged.
Node features are ``[N, F]`` (no leading batch dimensions); ``out_bits`` is
not used (the next QAT layer quantizes with its own quantizers).

Node features that are quantized already are used as they are, as
:class:`QATLinear` does with its input: a :class:`~pyg_quant.BitTensor` that fits
``lin``'s input quantizer goes to QATGCNConv's ``lin`` untouched, and one of at
most ``act_bits`` bits with ranges per channel (or per tensor) is QATGINConv's
aggregation operand itself (its codes on the bit tiles in evaluation, its
values unrounded in training, where the static ``agg_quant`` still observes
them).  Other BitTensors are read as the floats they hold.

:func:`pyg_quant.nn.calibrate` (on a prepared or a converted model) records what
``agg_quant`` quantizes, ``D^{-1/2} H`` and GIN's source features, per channel
(per tensor with ``agg_granularity="tensor"``) into the layer's ``static_range``;
then, in ``eval()``, those min/max ranges replace ``agg_quant``'s (values outside
clamp), until :func:`pyg_quant.nn.clear_calibration`.  Training ignores them.
"""
from typing import Optional, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.nn.dense.linear import Linear as PyGLinear

from ..bit_tensor import BitTensor, to_val
from ..graph.quant_graph import QuantGraph
from ..nn.explain import explain_edge_mask
from ..nn.qgcn_conv import QGCNConv
from ..nn.qgin_conv import QGINConv
from ..nn.quant_linear import bit_kernels_apply
from ..quantization.fixed import FixedRanges, fake_quantize_fixed, quantize_fixed
from ..quantization.quantize import exact_values
from .degree_quant import protect_mask
from .eval_path import gcn_eval, gin_eval
from .linear import QATLinear, _check_qconfig, observe_only, quantized_already
from ..quantization.observers import check_finite
from .qconfig import QConfig


def _float_features(x, name: str) -> Optional[Tensor]:
    if x is None:
        return None
    if isinstance(x, BitTensor):
        return to_val(x)  # the values it holds (quantized again only where it does not fit)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor or a BitTensor, got {type(x).__name__}")
    if x.is_sparse:
        x = x.to_dense()
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D node features [num_nodes, channels] in a QAT layer, "
                         f"got shape {tuple(x.shape)}")
    return x


def _aggregate_float(graph: QuantGraph, y: Tensor, training: bool, edge_mask: Optional[Tensor] = None, *,
                     self_values: Optional[Tensor] = None) -> Tensor:
    r"""``Â · y`` in float32 (:meth:`QuantGraph.aggregate_float`: one CSR product, gradient ``Aᵀ·dY``).

    The CSR product reads each source row once per edge and writes each target row once,
    instead of materialising an ``[edges, F]`` message matrix (5-7x faster for Cora's
    1433 input channels); its gradient to ``y`` is the product with the prebuilt ``Aᵀ``.
    In evaluation the sum runs in float64 and is rounded once, as the bit kernels do, and
    for their float32 result: ``y`` the unrounded dequantized values
    (:meth:`~pyg_quant.qat.FakeQuantize.forward_exact`), ``self_values`` their float32
    roundings (``to_val``'s), which the kernels' self-loop term multiplies.
    ``edge_mask``: an explainer's factor per edge (see :mod:`pyg_quant.nn.explain`).
    """
    if not training:
        y = y.double()
        self_values = None if self_values is None else self_values.double()
    elif y.dtype not in (torch.float32, torch.float64):
        y = y.float()  # the result is float32 either way, and CSR products take no half types on the CPU
    return graph.aggregate_float(y, edge_mask, self_values=self_values).to(torch.float32)


class _QATConvMixin:
    """Degree-Quant masks, the quantizer switches and the calibration shared by the two convolutions."""

    def _static_bits(self) -> Optional[int]:
        # A QAT layer calibrates what agg_quant quantizes (see _agg_ranges), not its parent's tensor.
        fq = self.agg_quant
        return fq.bits if fq is not None else None

    def _agg_ranges(self, y: Union[Tensor, BitTensor]) -> Optional[FixedRanges]:
        """Records the aggregation operand ``y`` (2-D, what ``agg_quant`` quantizes) while
        :func:`pyg_quant.nn.calibrate` runs, and returns the calibrated ranges that replace
        ``agg_quant``'s now (``eval()``, calibrated, not calibrating), else None.

        Ranges per tensor (``agg_granularity="tensor"``) are calibrated as such: every channel gets the extrema
        of the whole tensor, so the codes keep the granularity the layer was trained with.  A BitTensor ``y`` (codes
        aggregated as they are) is recorded by its values, and no ranges replace its own.
        """
        fq = self.agg_quant
        if fq is None or not fq.quantizes:
            return None
        if self.__dict__.get("_calibration") is not None:
            values = to_val(y) if isinstance(y, BitTensor) else y.detach()
            if fq.dim is None and values.numel():  # two rows whose column extrema are the tensor's extrema
                values = torch.stack((values.min().expand(values.size(1)), values.max().expand(values.size(1))))
            self._observe(values)
        return None if isinstance(y, BitTensor) else self._fixed_ranges()

    @staticmethod
    def _aggregate_fixed(graph: QuantGraph, y: Tensor, fixed: FixedRanges, bit_kernels: bool,
                         edge_mask: Optional[Tensor]) -> Tensor:
        """``Â · y`` with ``y`` quantized to the calibrated ranges: on the bit kernels when they run, else
        fake-quantized (the same codes) and summed in float64 as in evaluation."""
        if bit_kernels and graph.can_run_bits:
            return graph.aggregate_bits(quantize_fixed(y, fixed))
        return _aggregate_float(graph, fake_quantize_fixed(y, fixed), False, edge_mask)

    def _protect(self, graph: QuantGraph, num_nodes: int) -> Optional[Tensor]:
        p_range = self.qconfig.degree_quant
        if p_range is None or not self.training or graph.num_src != graph.num_dst:
            return None
        noise = self.agg_quant.noise if self.agg_quant is not None else (
            lambda shape, device: torch.rand(shape, device=device))
        return protect_mask(graph.degree()[:num_nodes], p_range, noise)


class QATGCNConv(_QATConvMixin, QGCNConv):
    r"""Quantization-aware :class:`~pyg_quant.QGCNConv` (see the module docstring).

    Args:
        in_channels, out_channels, improved, cached, add_self_loops, normalize, bias:
            as in :class:`torch_geometric.nn.GCNConv`.
        qconfig (QConfig, optional): the quantizers (default ``QConfig()``).
        adj_bits (int, optional): width of the edge-weight codes (as in QGCNConv).
        **kwargs: :class:`~torch_geometric.nn.conv.MessagePassing` arguments.

    Submodules: ``lin`` (:class:`QATLinear`) and ``agg_quant`` (:class:`FakeQuantize` or None).
    """

    def __init__(self, in_channels: int, out_channels: int, improved: bool = False, cached: bool = False,
                 add_self_loops: Optional[bool] = None, normalize: bool = True, bias: bool = True, *,
                 qconfig: Optional[QConfig] = None, adj_bits: Optional[int] = 8, _counter: Optional[list] = None,
                 **kwargs):
        qconfig = _check_qconfig(qconfig)
        super().__init__(in_channels, out_channels, improved, cached, add_self_loops, normalize, bias,
                         weight_bits=qconfig.weight_bits, act_bits=qconfig.act_bits, adj_bits=adj_bits,
                         stochastic=qconfig.stochastic, **kwargs)
        self.qconfig = qconfig
        self.lin = QATLinear.from_linear(self.lin, qconfig, _counter)
        self.agg_quant = qconfig.agg_quantizer(_counter)

    @classmethod
    def from_float(cls, conv: torch.nn.Module, qconfig: Optional[QConfig] = None,
                   _counter: Optional[list] = None) -> "QATGCNConv":
        """From a :class:`torch_geometric.nn.GCNConv` (or a QGCNConv), sharing its weight and bias."""
        lin = getattr(conv, "lin", None)
        if lin is None or not hasattr(conv, "normalize"):
            raise TypeError(f"conv must be a GCNConv or QGCNConv, got {type(conv).__name__}")
        module = cls(conv.in_channels, conv.out_channels, conv.improved, conv.cached, conv.add_self_loops,
                     conv.normalize, conv.bias is not None, qconfig=qconfig,
                     adj_bits=getattr(conv, "adj_bits", 8), _counter=None,
                     aggr=conv.aggr, flow=conv.flow, node_dim=conv.node_dim)
        # The fresh Linear and quantizers made by __init__ give way to ones sharing conv's
        # weight; they draw their seeds from the counter in the layer's order (lin, then agg).
        module.lin = QATLinear.from_linear(lin, module.qconfig, _counter)
        module.agg_quant = module.qconfig.agg_quantizer(_counter)
        if conv.bias is not None:
            module.bias = conv.bias
        return module

    def forward(self, x: Union[Tensor, BitTensor], edge_index, edge_weight: Optional[Tensor] = None) -> Tensor:
        """Args:
            x (Tensor or BitTensor): node features ``[N, F_in]``.
            edge_index: edge indices, a sparse adjacency ``adj_t`` or a :class:`~pyg_quant.BitAdjacency`.
            edge_weight (Tensor, optional): edge weights for ``edge_index``.
        """
        fast = gcn_eval(self, x, edge_index, edge_weight)
        if fast is not None:
            return fast
        if isinstance(x, (tuple, list)):  # PyG's error (to_hetero passes pairs on bipartite edge types)
            raise ValueError(f"'{self.__class__.__name__}' received a tuple of node features as input while this "
                             f"layer does not support bipartite message passing. Please try other layers such as "
                             f"'SAGEConv' or 'GraphConv' instead")
        if isinstance(x, BitTensor):
            num_nodes = x.rows  # lin takes it as its quantized input, or reads its values (QATLinear)
        else:
            x = _float_features(x, "x")
            num_nodes = x.size(0)
        bit_kernels = bit_kernels_apply(self, x, edge_weight, self.lin.weight, self.bias)
        graph = self._graph(x, edge_index, edge_weight)
        protect = self._protect(graph, num_nodes)

        h = self.lin(x, protect=protect)
        deg_inv_sqrt = graph.deg_inv_sqrt
        if deg_inv_sqrt is not None:
            h = h * graph.column(deg_inv_sqrt, h.dtype)
        fq = self.agg_quant
        fixed = self._agg_ranges(h)
        if fixed is not None:
            out = self._aggregate_fixed(graph, h, fixed, bit_kernels, explain_edge_mask(self, edge_index, graph))
        elif fq is not None and fq.quantizes and graph.can_run_bits and bit_kernels:
            out = graph.aggregate_bits(fq.quantize(h, "col"))
        else:
            own = None
            if fq is not None and self.training:
                h = fq(h, protect)
            elif fq is not None:
                own, h = fq.forward_exact(h, protect)
            mask = explain_edge_mask(self, edge_index, graph)
            scaled = graph.aggregate_scaled(h) if self.training and mask is None else None
            if scaled is not None:  # D^-1/2 Â h in one product (training): its row scaling is done
                out, deg_inv_sqrt = scaled.to(torch.float32), None
            else:
                out = _aggregate_float(graph, h, self.training, mask, self_values=own)
        if deg_inv_sqrt is not None:
            out = out * graph.column(deg_inv_sqrt, out.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out


def _swap_linears(module: torch.nn.Module, qconfig: QConfig, counter: Optional[list]) -> torch.nn.Module:
    """Every Linear / QuantLinear inside ``module`` replaced, in place, by a :class:`QATLinear` sharing its weights."""
    if isinstance(module, QATLinear):
        return module
    if isinstance(module, (torch.nn.Linear, PyGLinear)):  # QuantLinear is a PyG Linear
        return QATLinear.from_linear(module, qconfig, counter)
    for name, child in module.named_children():
        swapped = _swap_linears(child, qconfig, counter)
        if swapped is not child:
            setattr(module, name, swapped)
    return module


class QATGINConv(_QATConvMixin, QGINConv):
    r"""Quantization-aware :class:`~pyg_quant.QGINConv` (see the module docstring).

    Args:
        nn (torch.nn.Module): :math:`h_{\mathbf{\Theta}}`; its Linears become :class:`QATLinear` (in place).
        eps (float), train_eps (bool): as in :class:`torch_geometric.nn.GINConv`.
        qconfig (QConfig, optional): the quantizers (default ``QConfig()``).
        adj_bits (int, optional): as in QGINConv.
        **kwargs: :class:`~torch_geometric.nn.conv.MessagePassing` arguments.

    Submodule ``agg_quant`` (:class:`FakeQuantize` or None) quantizes the source features.
    """

    def __init__(self, nn: torch.nn.Module, eps: float = 0., train_eps: bool = False, *,
                 qconfig: Optional[QConfig] = None, adj_bits: Optional[int] = 8, _counter: Optional[list] = None,
                 **kwargs):
        qconfig = _check_qconfig(qconfig)
        if not isinstance(nn, torch.nn.Module):
            raise TypeError(f"nn must be a torch.nn.Module in a QAT layer, got {type(nn).__name__}")
        super().__init__(nn, eps, train_eps, weight_bits=qconfig.weight_bits, act_bits=qconfig.act_bits,
                         adj_bits=adj_bits, stochastic=qconfig.stochastic, **kwargs)
        self.qconfig = qconfig
        self.agg_quant = qconfig.agg_quantizer(_counter)
        if qconfig.weight_bits is not None or qconfig.act_bits is not None:
            self.nn = _swap_linears(self.nn, qconfig, _counter)

    @classmethod
    def from_float(cls, conv: torch.nn.Module, qconfig: Optional[QConfig] = None,
                   _counter: Optional[list] = None) -> "QATGINConv":
        """From a :class:`torch_geometric.nn.GINConv` (or a QGINConv), keeping its weights.

        ``conv.nn`` is taken over (its Linears are swapped in place, sharing their parameters).
        """
        if not isinstance(getattr(conv, "nn", None), torch.nn.Module) or not hasattr(conv, "eps"):
            raise TypeError(f"conv must be a GINConv or QGINConv with a Module nn, got {type(conv).__name__}")
        # The parent constructor re-initializes nn (PyG's reset_parameters): keep the values to restore.
        saved = {k: v.detach().clone() for k, v in conv.state_dict().items()}
        module = cls(conv.nn, float(conv.initial_eps), isinstance(conv.eps, torch.nn.Parameter), qconfig=qconfig,
                     adj_bits=getattr(conv, "adj_bits", 8), _counter=_counter,
                     aggr=conv.aggr, flow=conv.flow, node_dim=conv.node_dim)
        missing, unexpected = module.load_state_dict(saved, strict=False)
        if unexpected:
            raise RuntimeError(f"could not carry {unexpected} over to {cls.__name__}")
        return module.to(conv.eps.device)

    def forward(self, x, edge_index, size: Optional[Tuple[int, int]] = None) -> Tensor:
        """Args:
            x (Tensor, BitTensor or pair): node features ``[N, F]``, or ``(x_src, x_dst)``.
            edge_index: edge indices, a sparse adjacency ``adj_t`` or a :class:`~pyg_quant.BitAdjacency`.
            size ((int, int), optional): ``(num_src, num_dst)``.
        """
        fast = gin_eval(self, x, edge_index, size)
        if fast is not None:
            return fast
        if isinstance(x, (Tensor, BitTensor)):
            x = (x, x)
        if not isinstance(x, (tuple, list)) or len(x) != 2:
            raise TypeError(f"x must be a Tensor, a BitTensor or a pair (x_src, x_dst), got {type(x).__name__}")
        if x[0] is None:
            raise ValueError("x_src (the source node features) is required")
        fq = self.agg_quant
        # Source codes that fit agg_quant are the aggregation's operand as they are.
        codes = x[0] if isinstance(x[0], BitTensor) and quantized_already(x[0], fq, (None, 0)) else None
        x_dst = _float_features(x[1], "x_dst")
        if x[0] is x[1]:
            x_src = x_dst  # the floats of one input, made once
        else:  # codes that fit are decoded only if the float path needs their values
            x_src = _float_features(x[0], "x_src") if codes is None else None
        num_src, num_dst = self._node_counts(x[0], x_dst, edge_index, size)
        graph = self._graph(edge_index, num_src, num_dst)
        bit_kernels = bit_kernels_apply(self, x[0], x[1], self.eps)
        fixed = self._agg_ranges(x_src if codes is None else codes)
        if fq is not None and graph.can_run_bits and bit_kernels and codes is not None:
            if x[0] is x[1] and graph.diag is None:
                # (1 + eps)·to_val(x) as the aggregation's epilogue self term: the float32 steps of the addcmul below
                fused = graph.aggregate_bits_fused(codes, self_weight=self._one_plus_eps().detach().reshape(()))
                if fused is not None:
                    return self.nn(fused)
            out = graph.aggregate_bits(codes)
        else:
            x_src = x_src if x_src is not None else _float_features(x[0], "x_src")
            if fq is not None and codes is None and not self.training:  # in training NaN/inf reach the loss
                check_finite(x_src, "x")
            mask = explain_edge_mask(self, edge_index, graph)
            if codes is not None:  # values used as they are; a static range still learns from them
                observe_only(fq, x_src)
                if self.training:
                    out = _aggregate_float(graph, x_src, True, mask)
                else:  # the codes' unrounded values, as the bit kernels sum them
                    out = _aggregate_float(graph, exact_values(codes), False, mask, self_values=x_src)
            elif fixed is not None:
                out = self._aggregate_fixed(graph, x_src, fixed, bit_kernels, mask)
            elif fq is not None and fq.quantizes and graph.can_run_bits and bit_kernels:
                out = graph.aggregate_bits(fq.quantize(x_src, "col"))
            else:
                source, own = x_src, None
                if fq is not None and self.training:
                    source = fq(x_src, self._protect(graph, num_src))
                elif fq is not None:
                    own, source = fq.forward_exact(x_src)
                out = _aggregate_float(graph, source, self.training, mask, self_values=own)
        if x_dst is not None:
            out = torch.addcmul(out, self._one_plus_eps(), x_dst)  # out + (1 + eps)·x_dst in one pass
        return self.nn(out)


__all__ = ["QATGCNConv", "QATGINConv"]
