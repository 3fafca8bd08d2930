r"""The eval forward of QGINConv / QGCNConv on a :class:`BitAdjacency`, as one registered op a layer.

In ``eval()`` without autograd, a layer called on a ``BitAdjacency`` (what ``QuantClusterLoader`` batches hold)
computes, with ``Q`` the quantizer and ``M`` its fused MLP kernel (:func:`pyg_quant.ops.quant_mlp`):

* ``QGINConv`` on codes of its width (ranges per column or per tensor):
  ``nn((A + (1 + eps)·I)·X)`` = ``M(bit_spmm(A, X, self_weight=1 + eps))``, then ``Q`` when ``out_bits`` is set;
  on float features (a model with ``F.relu`` between its layers): ``M(bit_spmm(A, Q(X)) + (1 + eps)·X)``, the self
  term on the float features, then ``Q`` when ``out_bits`` is set;
* ``QGCNConv`` on float features or codes it reads as floats:
  ``D^-1/2 Â D^-1/2 X W + b`` = ``bit_spmm(Â, Q(M(X, W, row_scale=D^-1/2)), row_scale=D^-1/2, bias=b)``.

Each sequence is one op, :func:`pyg_quant.ops.gin_conv_eval` / :func:`pyg_quant.ops.gcn_conv_eval` (composed in C++,
``csrc/conv_eval.h``; GIN on float features: :func:`pyg_quant.ops.qat_gin_conv_eval` with ranges of its own),
because a layer's host time is what bounds an eager forward on a GPU, whose kernels take tens of microseconds.  The
general ``forward`` reaches the same kernels with the same arguments through format conversions and checks.  Here
what depends only on the layer's parameters (the MLP chain's arguments) is kept per layer, keyed by the parameters'
storage and version counters, and everything else is read off the inputs directly.  A float layer (``bits=None``,
such as the last layer ``qat.convert`` leaves in float) on a ``BitAdjacency`` runs one CSR product on the
adjacency's float matrix, kept on it (GCN's ``D^-1/2 Â D^-1/2`` folded into one matrix): float32 results within a
few rounding steps of the general path's, which adds the same terms in another order.

The quantized results are the general path's bit for bit (tests/test_eval_path.py); wherever a call differs from
these cases (training, autograd, hooks, calibration or calibrated ranges, PyG's caches, an explainer's mask,
other formats or widths) the functions return None and the general path runs.  ``torch.compile`` traces the same
op (its fake kernel is in :mod:`pyg_quant.ops`); a traced graph keeps nothing between calls, so it makes the chain's
weight arguments itself (:func:`pyg_quant.ops.mlp_weight_codes`, one op a layer).

Non-finite inputs are not checked here on the GPU (a check is a host synchronization); they propagate, as in the
float layers: a NaN or inf in a row or column makes its range NaN, and the values it reaches NaN (see
:func:`pyg_quant._utils.check_finite`).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import ops
from .._utils import check_finite, is_compiling, no_hooks
from ..bit_tensor import BitTensor
from ..graph.bit_adjacency import BitAdjacency
from ..graph.input_formats import bit_adjacency_csr, bit_adjacency_entries, residual_csr
from ..graph.float_csr import csr_matrix
from ..graph.spmm import adjacency_args, gather_operands
from ..quantization.quantize import quantize, values_finite
from ._common import requantize_output
from .calibration import STATIC_RANGE
from .explain import explaining
from .call_plan import held_plan, kept, new_plan, tensor_slot
from .mlp_chain import chain_view, module_view
from .quant_linear import QuantLinear, call_end, chain_args, fused_mlp_plan, runs_fused


def _mlp_chain(conv, container, width: int) -> Optional[tuple]:
    """The weight arguments of the one ``ops`` call through ``container`` (QuantLinear and ReLU layers in a chain,
    :func:`~pyg_quant.nn.mlp_chain.chain_view`, or one QuantLinear) on ``width`` input columns, kept on ``conv`` (a
    :class:`~pyg_quant.nn.call_plan.CallPlan`) while the modules, parameters and bit widths they were made from stay
    the same; None where the chain does not fuse into one call or a forward hook would run (the general path then
    runs)."""
    compiling = is_compiling()  # a traced graph keeps no plan: it quantizes the weights in the graph
    plan = held_plan(conv, "_eval_plan")
    if plan is not None and plan.args[0] is container and plan.args[1] == width:
        return plan.args[2]
    if isinstance(container, QuantLinear):
        view, linears, relus = module_view(container), (container,), (False,)
    else:
        view = chain_view(container)
        fused = None if view is None else fused_mlp_plan(container, view)
        if fused is None:
            return None
        linears, relus = fused
    if not no_hooks(*view.modules):
        return None
    if not _fuses(linears, width, compiling) or call_end(linears, 0) != len(linears):
        return None  # (several calls: the general path splits the chain)
    chain = chain_args(linears, relus)
    if compiling:
        return chain
    objects = list(view.entries)
    objects += [(lin._parameters, name, lin._parameters.get(name)) for lin in linears for name in ("weight", "bias")]
    values = list(view.values) + [(lin.__dict__, key, lin.__dict__.get(key)) for lin in linears
                                  for key in ("training", "weight_bits", "act_bits")]
    tensors = [lin._parameters.get(name) for lin in linears for name in ("weight", "bias")]
    conv.__dict__["_eval_plan"] = new_plan(objects, values, view.sizes, tensors, view.modules,
                                           (container, width, chain))
    return chain


def _self_weight(eps: Tensor) -> Tensor:
    return (1 + eps.detach()).reshape(1)


def _detached(t: Tensor) -> Tensor:
    return t.detach()


def _fuses(linears, width: int, compiling: bool) -> bool:
    """Whether the chain of ``linears`` runs fused on ``width`` input columns now (:func:`runs_fused`), with
    parameters that are not inference tensors (which keep no version counter to tell an edit by) where the chain's
    arguments are kept (not ``compiling``)."""
    for lin in linears:
        weight, bias = lin.weight, lin.bias
        if not runs_fused(lin, None, width):
            return False
        if not compiling and (weight.is_inference() or (bias is not None and bias.is_inference())):
            return False
        width = weight.size(0)
    return True


def _eval_call(conv, adj) -> bool:
    """What every short path needs: eval without autograd, a BitAdjacency, nothing that changes the path."""
    return (type(adj) is BitAdjacency and not conv.training and not torch.is_grad_enabled()
            and conv._buffers.get(STATIC_RANGE) is None and conv.__dict__.get("_calibration") is None
            and not explaining(conv))


def _applies(conv, adj) -> bool:
    """The conditions both quantized layers share: :func:`_eval_call` with both operands quantized."""
    return conv.act_bits is not None and conv.weight_bits is not None and _eval_call(conv, adj)


def _output(result, rows: int, bits: Optional[int], dim: Optional[int]):
    """The layer's result from a ``*_conv_eval`` op's ``[out, planes, lo, scale, code_sums, row_codes]`` (``[out]``
    for a float output)."""
    if bits is None:
        return result[0]
    if dim is None:  # ranges per tensor: the general quantizer (the op quantizes per column or per row)
        return quantize(result[0], bits, None, "row")
    return BitTensor.from_quantized(result[1:], (rows, result[0].size(1)), bits, dim)


def _float_layer_applies(conv, x, adj) -> bool:
    """Whether a float layer (no quantized operand, no requantized output) runs the float short path on ``adj``:
    :func:`_eval_call` outside ``torch.compile`` (its matrices are kept on the adjacency), float32 node features on
    the adjacency's device."""
    return (conv.act_bits is None and conv.weight_bits is None and conv.out_bits is None and _eval_call(conv, adj)
            and not is_compiling() and type(x) is Tensor and x.dtype == torch.float32 and x.dim() == 2
            and not x.is_sparse and x.size(0) == adj.num_cols and adj.num_rows == adj.num_cols and x.device == adj.device)


def _gin_float(conv, x: Tensor, adj: BitAdjacency) -> Optional[Tensor]:
    """A float QGINConv on a BitAdjacency without a diagonal term: ``nn(A·x + (1 + eps)·x)``, the product on the
    adjacency's float CSR matrix (built once per adjacency)."""
    if adj.diag is not None or conv.eps.dtype != torch.float32:
        return None
    out = torch.addcmul(ops.csr_product(x, bit_adjacency_csr(adj, torch.float32)), conv._one_plus_eps(), x)
    return conv.nn(out)


def gcn_normalized_csr(adj: BitAdjacency, deg_inv_sqrt) -> Tuple[Tensor, Optional[Tensor]]:
    r""":math:`D^{-1/2} \hat{A} D^{-1/2}` of a BitAdjacency that holds its self loops as ``(M, d)``: ``M`` a float32 CSR
    matrix of its stored entries, each scaled by ``D^-1/2`` of both ends, and ``d`` its scaled diagonal term as an
    ``[N, 1]`` column (None: folded into ``M``), built once per adjacency: a float GCN layer's aggregation is
    ``M·h + d∘h``, as PyG's ``gcn_norm`` weights give it.  Without tiles ``M`` is the residual's CSR as it is (no
    decoding, no sort, no host synchronization); with tiles the entries are decoded and the diagonal folded in."""
    def make() -> Tuple[Tensor, Optional[Tensor]]:
        dinv = deg_inv_sqrt(adj)
        if adj.num_tiles == 0:
            # gcn_norm's dinv[row] · w · dinv[col] in float32 (w = 1 without counts)
            values = dinv[adj.residual_rows()]
            if adj.res_val is not None:
                values = values * adj.res_val
            values = values * dinv[adj.res_col.long()]
            diag = (dinv * adj.diag * dinv).view(-1, 1)
            return residual_csr(adj, values, torch.float32), diag
        src, dst, count = bit_adjacency_entries(adj)
        loops = torch.arange(adj.num_rows, device=adj.device)
        rows, cols = torch.cat([dst, loops]), torch.cat([src, loops])
        weight = torch.cat([count.float(), adj.diag])
        values = dinv[rows] * weight * dinv[cols]
        return csr_matrix(rows, cols, values, adj.num_rows, adj.num_cols, torch.float32), None

    return adj.derived("gcn_normalized_csr", make)


def _gcn_float(conv, x: Tensor, adj: BitAdjacency, deg_inv_sqrt) -> Optional[Tensor]:
    """A float QGCNConv on a BitAdjacency that holds its self loops: ``Â_norm · lin(x) + b`` (see
    :func:`gcn_normalized_csr`)."""
    bias = conv.bias
    if (adj.diag is None or not conv.normalize or conv.cached or conv._cached_adj_t is not None
            or conv._cached_edge_index is not None or (bias is not None and bias.dtype != torch.float32)):
        return None
    matrix, diag = gcn_normalized_csr(adj, deg_inv_sqrt)
    h = conv.lin(x)
    out = ops.csr_product(h, matrix)
    out = out if diag is None else torch.addcmul(out, diag, h)
    return out if bias is None else out.add_(bias)


def _gin_float_features(conv, x: Tensor, adj: BitAdjacency) -> Optional[object]:
    """A quantized QGINConv on float features (the layers after the first in a model with ``F.relu`` between them):
    ``nn(A·Q(x) + (1 + eps)·x)``, ``Q`` per column over ``x``'s own ranges, in one op."""
    # (the rows checked against the adjacency's tensor, not its int: a traced graph then relates sizes of its tensor
    # inputs only, which inductor can bind)
    if (x.dtype != torch.float32 or x.dim() != 2 or x.is_sparse or adj.num_rows != adj.num_cols
            or x.size(0) != adj.res_ptr.size(0) - 1 or x.device != adj.device):
        return None
    eps = tensor_slot(conv, "eps")[1]
    nn = conv._modules.get("nn")
    if eps.device != x.device or eps.dtype != torch.float32 or nn is None:
        return None
    chain = _mlp_chain(conv, nn, x.size(1))
    if chain is None:
        return None
    x = x.contiguous()
    if x.device.type != "cuda":
        check_finite(x, "x")  # the general path's check, where it costs no host synchronization
    self_term = kept(conv, "_eval_self_term", eps, _self_weight)
    out = ops.qat_gin_conv_eval(*adjacency_args(adj), adj.diag, adj.wide_sums(conv.act_bits), x, None, None, None,
                                x.size(1), 0, conv.act_bits, None, self_term, *chain)
    return requantize_output(out, conv.out_bits, conv.out_dim, True)


def gin_eval(conv, x, adj, size) -> Optional[object]:
    """``conv(x, adj)`` for a :class:`~pyg_quant.nn.QGINConv` in the case above, or None."""
    if conv.act_bits is None and conv.weight_bits is None:
        return _gin_float(conv, x, adj) if size is None and _float_layer_applies(conv, x, adj) else None
    if size is None and type(x) is Tensor and _applies(conv, adj):
        return _gin_float_features(conv, x, adj)
    if (size is not None or type(x) is not BitTensor or not _applies(conv, adj) or x.bits != conv.act_bits
            or x.dim not in (None, 0) or x.layout != "col" or x.rows != adj.num_cols or adj.num_rows != adj.num_cols
            or x.lo.dtype != torch.float32 or x.scale.dtype != torch.float32):
        return None
    device, eps = x.device, tensor_slot(conv, "eps")[1]
    if device != adj.device or eps.device != device or eps.dtype != torch.float32:
        return None
    nn = conv._modules.get("nn")
    if nn is None:
        return None
    chain = _mlp_chain(conv, nn, x.cols)
    if chain is None:
        return None
    self_term = kept(conv, "_eval_self_term", eps, _self_weight)  # GIN's 1 + eps, float32 [1]
    if adj.diag is not None:
        self_term = adj.diag + self_term
    cols = x.cols
    lo, scale = x.lo, x.scale
    if lo.numel() != cols:  # ranges per tensor: one a column
        lo, scale = lo.expand(cols).contiguous(), scale.expand(cols).contiguous()
    x_planes, x_codes = gather_operands(adj, x, True)
    bits, dim = conv.out_bits, conv.out_dim
    op_bits = 0 if bits is None or dim is None else bits
    result = ops.gin_conv_eval(*adjacency_args(adj), adj.wide_sums(x.bits), x_planes, x_codes, lo, scale, self_term,
                               *chain, op_bits, 0 if dim is None else dim)
    if device.type != "cuda":
        check_finite(result[0], "x")  # no host synchronization on the CPU
    return _output(result, adj.num_rows, bits, dim)


def gcn_eval(conv, x, adj, edge_weight, deg_inv_sqrt) -> Optional[object]:
    """``conv(x, adj)`` for a :class:`~pyg_quant.nn.QGCNConv` in the case above, or None.  ``deg_inv_sqrt(adj)``:
    the layer's ``D^-1/2`` of a BitAdjacency that holds its self loops."""
    if conv.act_bits is None and conv.weight_bits is None:
        return (_gcn_float(conv, x, adj, deg_inv_sqrt) if edge_weight is None and _float_layer_applies(conv, x, adj)
                else None)
    if (edge_weight is not None or not _applies(conv, adj) or conv.cached or not conv.normalize
            or conv._cached_adj_t is not None or conv._cached_edge_index is not None
            or adj.diag is None or adj.num_rows != adj.num_cols):
        return None
    lin = conv._modules.get("lin")  # (read from the dicts: Module.__getattr__ is most of a check's cost)
    if type(lin) is not QuantLinear:
        return None
    bias = tensor_slot(conv, "bias")[1]
    if bias is not None and bias.dtype != torch.float32:
        return None
    if type(x) is BitTensor:
        # codes the linear layer reads as the floats they hold (its own width's per-row codes take the general path)
        if (x.dim != 0 or x.layout != "col" or x.lo.dtype != torch.float32 or x.scale.dtype != torch.float32
                or x.bits == lin.act_bits and x.dim in (None, 1)):
            return None
        width, rows = x.cols, x.rows
    elif isinstance(x, Tensor) and x.dtype == torch.float32 and x.dim() == 2 and not x.is_sparse:
        width, rows = x.size(1), x.size(0)
    else:
        return None
    if rows != adj.num_cols or x.device != adj.device:
        return None
    cuda = x.device.type == "cuda"
    if type(x) is BitTensor and not cuda and not values_finite(x):
        return None  # the general path dequantizes and raises
    chain = _mlp_chain(conv, lin, width)
    if chain is None:
        return None
    dinv = deg_inv_sqrt(adj)
    if type(x) is BitTensor:
        x_args = (x.planes, x.lo, x.scale, x.rows)
    else:
        if not cuda:
            check_finite(x, "x")  # no host synchronization on the CPU
        x_args = (x.contiguous(), None, None, x.size(0))
    bits, dim = conv.out_bits, conv.out_dim
    if bias is not None:
        bias = kept(conv, "_eval_bias", bias, _detached)
    result = ops.gcn_conv_eval(*adjacency_args(adj), adj.diag, dinv, bias,
                               conv.act_bits, adj.wide_sums(conv.act_bits), *x_args, *chain,
                               0 if bits is None or dim is None else bits, 0 if dim is None else dim)
    return _output(result, adj.num_rows, bits, dim)
