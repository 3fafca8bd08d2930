r"""The evaluation of a converted QAT layer on a :class:`~pyg_quant.BitAdjacency` in a few ops.

:class:`~pyg_quant.qat.QATGCNConv` without autograd on a ``BitAdjacency`` (what ``QuantClusterLoader`` batches and
the README's tour hand it) computes, with the layer's frozen quantizers,

.. math::
    \mathrm{out} = D^{-1/2} \big(\hat{A} \cdot Q_{agg}(D^{-1/2} \cdot Q_{in}(X) W_q)\big) + b,

the same steps as its general forward's bit path: the weight codes of ``lin.weight_quant``, ``X`` quantized per
node over its own range (``input_observer="dynamic"``; a :class:`~pyg_quant.BitTensor` the layer takes as quantized
already, e.g. ``QuantClusterLoader(feature_dim=1)``'s features, is multiplied as it is, on the CPU:
:func:`pyg_quant.ops.quant_mlp_quantized`), ``Q_agg`` per channel over the frozen stored range of
``agg_quant`` (or each channel's own, ``agg_observer="dynamic"``; a per-tensor range is every channel's).  Here they
run as one op, :func:`pyg_quant.ops.qat_gcn_conv_eval` (composed in C++, ``csrc/conv_eval.h``): the fused MLP kernel
(its row scale the ``D^{-1/2}`` multiply) that also gives the columns' extrema, the quantizer reading its ranges as
column keys, the aggregation, and the two float32 steps after it.  :class:`~pyg_quant.qat.QATGINConv` likewise
(:func:`gin_eval`, :func:`pyg_quant.ops.qat_gin_conv_eval`): ``h_Θ(A·Q_agg(X) + (1 + ε)·X)``, the self term on the
float features after the aggregation's rounding and ``h_Θ``'s QAT linear layers one fused MLP call with their biases
and ReLUs.  The results are the general path's bit for bit: the same kernels in the same order, one dispatch a layer
instead of ten to thirty ops, because a layer's host time is what bounds an eager forward on a GPU.

Non-finite inputs: a NaN or inf makes the range it is reduced into non-finite (a node's, so its row of
``D^{-1/2} X W``; a channel's), and a channel that holds one quantizes over a NaN range instead of the stored one, so
NaN reaches every output it touches, as in the float layers.  No host synchronization is needed for that on a GPU;
on the CPU the layers raise a ValueError as their general path does.

Everything else (training, autograd, other observers such as ``"dynamic_mse"``, calibrated ranges, GCN inputs that
are the input quantizer's own codes on a GPU, hooks on the layer's quantizers or linear layers, an explainer's mask,
``torch.compile``, other adjacency formats) takes the general forward: the functions return None.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from .. import ops
from .._utils import check_finite, is_compiling, no_hooks
from ..bit_tensor import BitTensor, to_val
from ..graph.bit_adjacency import BitAdjacency
from ..graph.spmm import adjacency_args, gathered_codes
from ..nn.calibration import STATIC_RANGE
from ..nn.call_plan import CallPlan, held_plan, new_plan, tensor_slot
from ..nn.explain import explaining
from ..nn.mlp_chain import chain_view, linear_relu_pairs
from ..nn.qgcn_conv import bit_adjacency_deg_inv_sqrt
from ..nn.quant_linear import bit_kernels_apply, chain_args, runs_fused
from ..ops.reference import ordered_keys
from .linear import QATLinear

# (The checks below read modules, flags and observers from the modules' own dicts: they run at every layer call,
# and nn.Module's attribute lookup is most of their cost.)

def _fused_linear(lin, width: int) -> bool:
    """Whether the QAT linear layer ``lin`` on ``width`` input columns is one fused-kernel product: quantizing, input
    ranges per node over its own min/max, frozen weight codes, the kernel's widths, and no hooks to run."""
    modules = lin._modules
    fq_in, fq_w = modules.get("input_quant"), modules.get("weight_quant")
    return (fq_in is not None and fq_w is not None and fq_in._fake and fq_w._fake and not fq_w._observe
            and fq_in.own_range(1) and fq_in.bits == lin.act_bits and fq_w.bits == lin.weight_bits
            and runs_fused(lin, None, width) and no_hooks(lin, fq_in, fq_w))


def _aggregation_keys(fq, cols: int):
    """How ``fq`` quantizes the aggregation's ``cols`` channels here: ``(True, None)`` over each channel's own range,
    ``(True, keys)`` over its frozen stored range as column keys (a per-tensor range repeated; kept on ``fq`` while
    the range's tensors stay the same), ``(False, None)`` where the short path does not apply."""
    if fq is None or not fq._fake or not no_hooks(fq):
        return False, None
    if fq.own_range(0):
        return True, None
    if fq._modules["observer"].dynamic or fq.dim not in (None, 0):
        return False, None

    def make():
        lo, hi = fq.range()  # the range in use (narrow ones collapsed), as qparams takes it
        lo, hi = lo.to(torch.float32).reshape(-1).expand(cols), hi.to(torch.float32).reshape(-1).expand(cols)
        return torch.cat([ordered_keys(hi), ordered_keys(lo) ^ 0xFFFFFFFF])

    keys = fq.kept_while_frozen(("col_keys", cols), make)
    return keys is not None, keys


def _raise_if_not_finite(out: Tensor, x) -> None:
    """On the CPU, the general path's ValueError where ``x`` holds NaN or inf (which makes ``out`` non-finite)."""
    if not math.isfinite(out.sum().item()):
        check_finite(to_val(x) if isinstance(x, BitTensor) else x, "x")


def _float_matrix(x) -> bool:
    return isinstance(x, Tensor) and x.dtype == torch.float32 and x.dim() == 2 and not x.is_sparse


def _new_plan(conv, linears, fq, args: tuple) -> Optional[CallPlan]:
    """The plan of ``conv`` (its QAT ``linears``, aggregation quantizer ``fq``) for ``args``."""
    objects, values, sizes, tensors, hooked = [], [], [], [], [fq]
    modules = conv._modules
    for name in ("nn", "lin", "agg_quant"):
        if name in modules:
            objects.append((modules, name, modules[name]))
    view = chain_view(modules.get("nn"))
    if view is not None:  # (GIN's nn)
        hooked += list(view.modules)
        sizes += list(view.sizes)
        objects += list(view.entries)
        values += list(view.values)
    for name in ("eps", "bias"):
        table, tensor = tensor_slot(conv, name) if hasattr(conv, name) else (None, None)
        if table is not None:
            objects.append((table, name, tensor))
            tensors.append(tensor)
    observer = fq._modules["observer"]
    objects.append((fq._modules, "observer", observer))
    values += [(fq.__dict__, key, fq.__dict__.get(key)) for key in ("_fake", "_observe", "bits", "dim")]
    if not fq.own_range(0):
        tensors += list(observer.range_tensors())
    for lin in linears:
        lin_modules, params = lin._modules, lin._parameters
        fq_in, fq_w = lin_modules["input_quant"], lin_modules["weight_quant"]
        hooked += [lin, fq_in, fq_w]
        objects += [(params, "weight", params["weight"]), (params, "bias", params.get("bias")),
                    (lin_modules, "input_quant", fq_in), (lin_modules, "weight_quant", fq_w),
                    (fq_in._modules, "observer", fq_in._modules["observer"]),
                    (fq_w._modules, "observer", fq_w._modules["observer"])]
        values += [(lin.__dict__, key, lin.__dict__.get(key))
                   for key in ("training", "_explain", "act_bits", "weight_bits")]
        values += [(q.__dict__, key, q.__dict__.get(key)) for q in (fq_in, fq_w)
                   for key in ("_fake", "_observe", "bits", "dim")]
        tensors += [params["weight"], params.get("bias")]
    return new_plan(objects, values, sizes, tensors, hooked, args)


def _kept_plan(conv, name: str) -> Optional[CallPlan]:
    """The plan kept on ``conv`` under ``name`` if it still holds, in eager calls without a gradient."""
    return None if torch.is_grad_enabled() else held_plan(conv, name)


def _keep_plan(conv, name: str, linears, fq, args: tuple) -> None:
    if not torch.is_grad_enabled():
        conv.__dict__[name] = _new_plan(conv, linears, fq, args)


def gcn_eval(conv, x, adj, edge_weight) -> Optional[Tensor]:
    """``conv(x, adj)`` for a :class:`~pyg_quant.qat.QATGCNConv` in the case above, or None."""
    if (type(adj) is not BitAdjacency or edge_weight is not None or is_compiling() or conv.cached
            or not conv.normalize or conv._cached_adj_t is not None or conv._cached_edge_index is not None
            or adj.diag is None or adj.num_rows != adj.num_cols or conv._buffers.get(STATIC_RANGE) is not None
            or conv.__dict__.get("_calibration") is not None):
        return None
    lin, bias = conv._modules["lin"], tensor_slot(conv, "bias")[1]
    if (bias is not None and bias.dtype != torch.float32) or not isinstance(lin, QATLinear):
        return None
    quantized = False
    if isinstance(x, BitTensor):
        quantized = lin.takes_as_quantized(x)
        if (quantized and x.device.type != "cpu") or x.lo.dtype != torch.float32 or x.scale.dtype != torch.float32:
            return None  # codes multiplied as they are are compiled for the CPU; elsewhere the general path does it
        rows, width = x.rows, x.cols
    elif _float_matrix(x):
        rows, width = x.size(0), x.size(1)
    else:
        return None
    if rows != adj.num_cols or x.device != adj.device:
        return None
    fq = conv._modules.get("agg_quant")
    plan = _kept_plan(conv, "_qat_eval_plan")
    if plan is not None and plan.args[0] == width:
        if conv.training or explaining(conv):
            return None
        _, stored, bias, chain = plan.args
    else:
        applies, stored = _aggregation_keys(fq, lin._parameters["weight"].size(0))
        if (not applies or not _fused_linear(lin, width)
                or not bit_kernels_apply(conv, x if isinstance(x, Tensor) else None, lin.weight, bias)):
            return None
        bias = None if bias is None else bias.detach()
        chain = chain_args((lin,), (False,))
        _keep_plan(conv, "_qat_eval_plan", (lin,), fq, (width, stored, bias, chain))
    cuda = x.device.type == "cuda"
    dinv = bit_adjacency_deg_inv_sqrt(adj)
    if isinstance(x, BitTensor):
        x = x.as_layout("row") if quantized else x  # the operand's codes are read a row at a time
        # (codes held as bytes are the product's rows themselves: no planes packed to be unpacked)
        held = x.byte_codes if quantized and x.layout == "row" else None
        x_args = (x.planes if held is None else held, x.lo, x.scale, x.rows, x.cols, x.layout == "col",
                  -1 if x.dim is None else x.dim)
    else:
        x_args = (x.contiguous(), None, None, rows, width, True, 0)
    bits = fq.bits
    out = ops.qat_gcn_conv_eval(*adjacency_args(adj), adj.diag, dinv, bias, bits, adj.wide_sums(bits), stored,
                                *x_args, *chain, x_quantized=quantized)
    if not cuda:
        _raise_if_not_finite(out, x)
    return out


def _linear_steps(nn, width: int) -> Optional[list]:
    """``[(QATLinear, relu after it)]`` of GIN's ``nn`` when it applies QAT linear layers (each optionally followed by
    a ReLU: a Sequential of them, or PyG's ``MLP`` without normalization in ``eval()``,
    :func:`~pyg_quant.nn.mlp_chain.chain_view`) that run on the fused kernel now, with plain dynamic input ranges and
    frozen weight codes, and no hooks; None otherwise."""
    view = chain_view(nn)
    pairs = None if view is None else linear_relu_pairs(view.steps, lambda m: type(m) is QATLinear)
    if pairs is None or not no_hooks(*view.modules):
        return None
    for lin in pairs[0]:
        if not _fused_linear(lin, width):
            return None
        width = lin.weight.size(0)
    return list(zip(*pairs))


def gin_eval(conv, x, adj, size) -> Optional[Tensor]:
    r"""``conv(x, adj)`` for a :class:`~pyg_quant.qat.QATGINConv` without autograd on a :class:`BitAdjacency`, or
    None (the general forward runs).

    The general path's bit steps, as few ops: the source features quantized per channel (the frozen stored range,
    read as column keys, a channel holding a NaN or inf over its own; or each channel's own range), the aggregation
    (:func:`pyg_quant.bit_spmm`), ``+ (1 + eps)·x`` on the float features, then each QAT linear layer's product on
    the fused kernel without its bias, the bias and the ReLU added after the product's rounding, as the layer does.
    """
    if (type(adj) is not BitAdjacency or size is not None or is_compiling() or adj.num_rows != adj.num_cols
            or conv._buffers.get(STATIC_RANGE) is not None or conv.__dict__.get("_calibration") is not None):
        return None
    fq = conv._modules.get("agg_quant")
    if isinstance(x, BitTensor):
        if fq is None or not (x.bits <= fq.bits and x.dim in (None, 0) and x.layout == "col"):
            return None  # codes the general path reads as floats and quantizes again
        rows, width = x.rows, x.cols
    elif _float_matrix(x):
        rows, width = x.size(0), x.size(1)
    else:
        return None
    if rows != adj.num_cols or x.device != adj.device:
        return None
    plan = _kept_plan(conv, "_qat_eval_plan")
    if plan is not None and plan.args[0] == width:
        if conv.training or explaining(conv):
            return None
        _, stored, one_plus_eps, chain = plan.args
        if one_plus_eps.device != x.device:
            return None
    else:
        eps = tensor_slot(conv, "eps")[1]
        applies, stored = _aggregation_keys(fq, width)
        if (not applies or eps.device != x.device or eps.dtype != torch.float32
                or not bit_kernels_apply(conv, x if isinstance(x, Tensor) else None, eps)):
            return None
        steps = _linear_steps(conv._modules["nn"], width)
        if steps is None:
            return None
        linears, relus = zip(*steps)
        one_plus_eps, chain = conv._one_plus_eps(), chain_args(linears, relus)
        _keep_plan(conv, "_qat_eval_plan", linears, fq, (width, stored, one_plus_eps.detach(), chain))
    cuda = x.device.type == "cuda"
    if isinstance(x, BitTensor):
        code_bits = x.bits
        x_args = (x.planes, x.lo, x.scale, gathered_codes(adj, x, adj.diag is not None), x.cols,
                  -1 if x.dim is None else x.dim)
    else:
        x = x.contiguous()
        if not cuda:
            check_finite(x, "x")  # the general path's check on the CPU
        code_bits, x_args = fq.bits, (x, None, None, None, width, 0)
    return ops.qat_gin_conv_eval(*adjacency_args(adj), adj.diag, adj.wide_sums(code_bits), *x_args, fq.bits, stored,
                                 one_plus_eps, *chain)
