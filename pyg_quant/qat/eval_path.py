r"""A QAT GCN layer's evaluation on a :class:`~pyg_quant.BitAdjacency` in four ops: what a converted model runs.

:class:`~pyg_quant.qat.QATGCNConv` without autograd on a ``BitAdjacency`` (what ``QuantClusterLoader`` batches and
the README's tour hand it) computes, with the layer's frozen quantizers,

.. math::
    \mathrm{out} = D^{-1/2} \big(\hat{A} \cdot Q_{agg}(D^{-1/2} \cdot Q_{in}(X) W_q)\big) + b,

the same steps as its general forward's bit path: the weight codes of ``lin.weight_quant``, ``X`` quantized per
node over its own range (``input_observer="dynamic"``), ``Q_agg`` per channel over the frozen stored range of
``agg_quant`` (or each channel's own, ``agg_observer="dynamic"``; a per-tensor range is every channel's).  Here they
run as one fused MLP kernel (:func:`pyg_quant.ops.quant_mlp`, its row scale the ``D^{-1/2}`` multiply) that also
gives the columns' extrema, the quantizer reading its ranges as column keys (:func:`pyg_quant.ops.quantize_pack_ranges`),
the aggregation (:func:`pyg_quant.bit_spmm`) and the two float32 steps after it, instead of some thirty ops a layer;
the results are the general path's bit for bit.

Non-finite inputs: a NaN or inf in ``X`` makes its row's range, and so its row of ``D^{-1/2} X W``, non-finite; the
column keys show which channels hold one, and those channels quantize over their own (non-finite) range instead of
the stored one, so NaN reaches every output it touches, as in the float layers.  No host synchronization is needed
for that on a GPU; on the CPU the layer raises a ValueError as its general path does.

Everything else (training, autograd, other observers such as ``"dynamic_mse"``, calibrated ranges, inputs that
are the input quantizer's own codes, hooks on the layer's quantizers or linear layer, an explainer's mask,
``torch.compile``, other adjacency formats) takes the general forward: :func:`gcn_eval` returns None.
"""
from typing import Optional

import torch
from torch import Tensor

from .. import ops
from .._utils import check_finite, is_compiling
from ..bit_tensor import BitTensor, to_val
from ..graph.bit_adjacency import BitAdjacency
from ..graph.spmm import bit_spmm
from ..nn.calibration import STATIC_RANGE
from ..nn.qgcn_conv import bit_adjacency_deg_inv_sqrt
from ..nn.quant_linear import bit_kernels_apply, chain_args, runs_fused
from ..ops.reference import ordered_keys
from .observers import DynamicObserver

# The smallest column key of a non-finite value: +inf's key in a max slot, -inf's complement in a min slot (NaNs key
# beyond them; see csrc/ordered_key.h).
_NON_FINITE_KEY = 0xFF800000


def _own_range(fq, dim) -> bool:
    """Whether ``fq`` quantizes each tensor over its own min/max reduced over ``dim`` (a plain dynamic observer)."""
    return type(fq.observer) is DynamicObserver and fq.dim == dim


def _unhooked(*modules) -> bool:
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return False
    return not any(m is not None and (m._forward_hooks or m._forward_pre_hooks) for m in modules)


def _stored_keys(conv, fq, cols: int) -> Optional[Tensor]:
    """The column keys of ``fq``'s frozen stored range for ``cols`` channels (a per-tensor range repeated), kept on
    ``conv`` while the range's tensors stay the same; None where the range may move."""
    state = fq._frozen_state()
    if state is None:
        return None
    kept = conv.__dict__.get("_eval_agg_keys")
    if (kept is not None and kept[0][1:] == state[1:] and kept[1].numel() == 2 * cols
            and all(a is b for a, b in zip(kept[0][0], state[0]))):
        return kept[1]
    lo, hi = fq.range()  # the range in use (narrow ones collapsed), as qparams takes it
    lo, hi = lo.to(torch.float32).reshape(-1).expand(cols), hi.to(torch.float32).reshape(-1).expand(cols)
    keys = torch.cat([ordered_keys(hi), ordered_keys(lo) ^ 0xFFFFFFFF])
    conv.__dict__["_eval_agg_keys"] = (state, keys)
    return keys


def gcn_eval(conv, x, adj, edge_weight) -> Optional[Tensor]:
    """``conv(x, adj)`` for a :class:`~pyg_quant.qat.QATGCNConv` in the case above, or None."""
    if (type(adj) is not BitAdjacency or edge_weight is not None or is_compiling() or conv.cached
            or not conv.normalize or conv._cached_adj_t is not None or conv._cached_edge_index is not None
            or adj.diag is None or adj.num_rows != adj.num_cols or conv._buffers.get(STATIC_RANGE) is not None
            or conv.__dict__.get("_calibration") is not None):
        return None
    lin, fq_agg, bias = conv.lin, conv.agg_quant, conv.bias
    fq_in, fq_w = getattr(lin, "input_quant", None), getattr(lin, "weight_quant", None)
    if (fq_in is None or fq_w is None or fq_agg is None or not (fq_in.quantizes and fq_w.quantizes and fq_agg.quantizes)
            or not fq_w.frozen or not _own_range(fq_in, 1) or fq_in.bits != lin.act_bits
            or fq_w.bits != lin.weight_bits or (bias is not None and bias.dtype != torch.float32)
            or not _unhooked(lin, fq_in, fq_w, fq_agg)):
        return None
    if isinstance(x, BitTensor):
        if lin.takes_as_quantized(x) or x.lo.dtype != torch.float32 or x.scale.dtype != torch.float32:
            return None  # its own codes are the product's operand: the general path multiplies them
        rows, width = x.rows, x.cols
    elif isinstance(x, Tensor) and x.dtype == torch.float32 and x.dim() == 2 and not x.is_sparse:
        rows, width = x.size(0), x.size(1)
    else:
        return None
    if (rows != adj.num_cols or x.device != adj.device or not runs_fused(lin, None, width)
            or not bit_kernels_apply(conv, x if isinstance(x, Tensor) else None, lin.weight, bias)):
        return None
    channels = lin.weight.size(0)
    if _own_range(fq_agg, 0):
        stored = None
    elif not fq_agg.dynamic and fq_agg.dim in (None, 0):
        stored = _stored_keys(conv, fq_agg, channels)
        if stored is None:
            return None
    else:
        return None
    cuda = x.device.type == "cuda"
    dinv = bit_adjacency_deg_inv_sqrt(adj)
    chain = chain_args((lin,), (False,))
    # D^-1/2 (X W) and its column keys, from the fused kernel
    if isinstance(x, BitTensor):
        h, keys = ops.quant_mlp_planes(x.planes, x.rows, x.cols, x.layout == "col", x.lo, x.scale,
                                       -1 if x.dim is None else x.dim, *chain, dinv, True)
    else:
        h, keys = ops.quant_mlp(x.contiguous(), *chain, dinv, True)
    if stored is not None or not cuda:
        slots = keys.view(2, channels)  # max slots, then min slots
        non_finite = slots.amax(0, keepdim=True) >= _NON_FINITE_KEY  # [1, channels]
        if not cuda and bool(non_finite.any()):
            check_finite(to_val(x) if isinstance(x, BitTensor) else x, "x")  # raises where the general path does
        if stored is not None:
            keys = torch.where(non_finite, slots, stored.view(2, channels)).view(-1)
    packed = ops.quantize_pack_ranges(h, fq_agg.bits, 0, True, None, cuda, keys, not cuda)
    codes = BitTensor.from_quantized(packed, (rows, channels), fq_agg.bits, 0)
    out = bit_spmm(adj, codes)
    out.mul_(dinv.view(-1, 1))
    return out if bias is None else out.add_(bias.detach())
