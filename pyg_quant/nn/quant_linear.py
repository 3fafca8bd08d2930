r"""QuantLinear: :class:`torch_geometric.nn.Linear` with its GEMM on bit planes."""
import warnings
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.nn.dense.linear import Linear

from .. import ops
from .._utils import check_finite, is_compiling, no_hooks
from ..bit_tensor import BitTensor
from ..bitmm import bitmm_float
from ..quantization.bits import UNSET, resolve_bits
from ..quantization.fixed import FixedRanges
from ..quantization.quantize import dequantize, fake_quantize, fits, quantize, values_finite
from ._common import quant_options_repr
from .explain import explaining
from .mlp_chain import ChainView, chain_view, linear_relu_pairs


def warn_weight_not_cached(module: torch.nn.Module) -> None:
    """Once per module: its weight is an inference tensor, so its codes are made again at every call.

    An inference tensor keeps no version counter, so an in-place edit of it could not be told from a cache hit;
    the codes are therefore never cached for one.  A model created, loaded or moved under
    ``torch.inference_mode`` holds such weights, and each call then quantizes every weight again, which adds
    several kernels to every layer call (see benchmarks/RESULTS.md, End to end).
    """
    if module.__dict__.get("_warned_weight_not_cached"):
        return
    module.__dict__["_warned_weight_not_cached"] = True
    warnings.warn(f"{type(module).__name__}: the weight is an inference tensor (the model was created, loaded or "
                  "moved under torch.inference_mode), so its codes cannot be cached and are quantized again at "
                  "every call; create, load and move the model outside inference_mode (call it inside) to quantize "
                  "its weights once", UserWarning, stacklevel=3)


def bit_kernels_apply(module: torch.nn.Module, *tensors) -> bool:
    r"""Whether ``module`` runs its bit kernels now: in ``eval()``, when no gradient is asked for.

    The kernels have no backward; with autograd on (``eval()`` without
    ``torch.no_grad()``) the float path computes the same values, up to a few
    float32 roundings, and keeps the gradients.  Nor do they run while a PyG explainer's
    edge mask is set on ``module`` (see :mod:`pyg_quant.nn.explain`).
    """
    if module.training or explaining(module):  # the bit kernels take no edge mask: the float path does
        return False
    if torch.is_grad_enabled():
        return not any(isinstance(t, Tensor) and t.requires_grad for t in tensors)
    return True


# ops.quant_mlp (the fused chain of bit layers) runs layers up to this many channels wide and chains of up to this
# many layers whose weight codes fit in a block's shared memory: the limits of its CUDA kernel
# (csrc/cuda/quant_mlp_cuda.h).  Longer chains run as several calls (exactly the same: each call's output is the
# float32 input the next layer would read).  The CPU kernel has no width limit: a wider layer (Cora's 1,433 input
# features) runs fused there, which gives the same bits as the unfused path the GPU takes.
QUANT_MLP_MAX_WIDTH = 256
QUANT_MLP_MAX_LAYERS = 8
# Shared memory the layers of one call may take: below every sm_80+ GPU's per-block limit (99 KB on sm_86/89)
# with the kernel's row buffers; one layer of 256 x 256 takes 69 KB.
_QUANT_MLP_LAYER_BYTES = 88 * 1024


def fused_codes(w: BitTensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""A layer's packed weight ``Wᵀ`` (column layout, ``[in, out]``) as :func:`pyg_quant.ops.quant_mlp` takes it:
    ``(codes uint8 [out, in], lo float32 [out], scale float32 [out], code sums int64 [out])``; its planes are ``W``'s
    ``[out, in]`` row layout."""
    codes = ops.unpack_codes(w.planes, w.cols, w.rows, False)
    return codes, w.lo.contiguous(), w.scale.contiguous(), w.code_sums().contiguous()


def _layer_bytes(in_channels: int, out_channels: int) -> int:
    """Shared memory of one layer in the CUDA kernel: weight codes (rows padded to 16 codes, starting on a 16-byte
    boundary), lo, scale, bias and the epilogue's column term (float32) of each output channel."""
    return -(-in_channels // 16) * 16 * out_channels + 16 * out_channels + 16


class QuantLinear(Linear):
    r"""A linear layer :math:`\mathbf{x}^{\prime} = \mathbf{x}\mathbf{W}^{\top} + \mathbf{b}`
    whose operands are quantized: :math:`\mathbf{x}` per row to ``act_bits``
    (one range per sample) and :math:`\mathbf{W}` per output channel to
    ``weight_bits``, the only granularities for which
    :math:`\tilde{\mathbf{x}}\tilde{\mathbf{W}}^{\top}` factors exactly into
    bit-plane GEMMs (:func:`pyg_quant.bitmm`).

    * ``train()``: fake quantization (quantize, dequantize) in float32 with
      straight-through gradients, stochastic rounding if ``stochastic``.
    * ``eval()`` under ``torch.no_grad()``: deterministic rounding and the
      bit-plane GEMM (C++ on the CPU, 1-bit tensor cores on CUDA); the result
      equals the float64 product of the dequantized operands up to a few float32
      roundings of its terms (``csrc/epilogue.h``).  With autograd on, ``eval()`` takes the float path with the same
      codes instead, so that gradients are never dropped.
    * ``weight_bits=None`` / ``act_bits=None`` keep that operand in float (the
      product then runs in float on the dequantized other one); both None is
      exactly :class:`torch_geometric.nn.Linear`.

    The weights stay float32 masters; lazy ``in_channels=-1``, initializers and
    state dicts behave as in :class:`torch_geometric.nn.Linear` (same keys).

    Args:
        in_channels (int): input features, or ``-1`` (lazy).
        out_channels (int): output features.
        bias (bool): learn an additive bias.
        weight_initializer, bias_initializer (str, optional): as in PyG's Linear.
        bits (int, optional): 1..8 for weights and inputs alike.
        weight_bits, act_bits (int, optional): separate widths (instead of ``bits``).
        stochastic (bool): stochastic rounding in training.

    Shapes:
        - **input:** :math:`(*, F_{in})` float, or a 2-D :class:`BitTensor`
        - **output:** :math:`(*, F_{out})` float
    """

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True,
                 weight_initializer: Optional[str] = None, bias_initializer: Optional[str] = None, *,
                 bits: Optional[int] = None, weight_bits=UNSET, act_bits=UNSET, stochastic: bool = False):
        super().__init__(in_channels, out_channels, bias, weight_initializer, bias_initializer)
        self.weight_bits, self.act_bits = resolve_bits(bits, weight_bits, act_bits)
        self.stochastic = bool(stochastic)

    @torch.no_grad()
    def initialize_parameters(self, module, input):
        x = input[0]
        if isinstance(x, BitTensor):  # lazy shapes need only the feature count
            input = (torch.empty(0, x.cols, device=x.device),) + tuple(input[1:])
        super().initialize_parameters(module, input)

    @classmethod
    def from_linear(cls, linear: Union[torch.nn.Linear, Linear], **quant_kwargs) -> "QuantLinear":
        """A QuantLinear sharing ``linear``'s parameters (the same Parameter objects)."""
        if isinstance(linear, Linear):
            in_channels, out_channels = linear.in_channels, linear.out_channels
            initializers = (linear.weight_initializer, linear.bias_initializer)
        else:
            in_channels, out_channels = linear.in_features, linear.out_features
            initializers = (None, None)
        module = cls(in_channels, out_channels, linear.bias is not None, *initializers, **quant_kwargs)
        module.weight = linear.weight
        if linear.bias is not None:
            module.bias = linear.bias
        if hasattr(module, "_hook") and not isinstance(linear.weight, torch.nn.parameter.UninitializedParameter):
            module._hook.remove()
            delattr(module, "_hook")
            module.in_channels = linear.weight.size(-1)
        return module

    def quantized_weight(self) -> BitTensor:
        r""":math:`\mathbf{W}^{\top}` as a column-layout :class:`BitTensor` ``[in, out]``, one range per output channel.

        ``W`` is ``[out, in]``, so its per-row row-layout planes are exactly the
        per-column column-layout planes of ``Wᵀ``: no transpose is made.
        """
        return self._cached_weight("_weight_codes", self._pack_weight)

    def fused_weight(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        r"""The codes of :meth:`quantized_weight` as :func:`pyg_quant.ops.quant_mlp` takes them: ``(codes uint8
        [out, in], lo float32 [out], scale float32 [out], code sums int64 [out])``, cached alongside it."""
        return self._cached_weight("_fused_weight", self._unpack_weight)

    def _cached_weight(self, name: str, build):
        weight = self.weight
        if is_compiling():  # traced graphs quantize in-graph (no cache to guard on)
            return build(weight)
        # The codes are reused until the weight changes: every in-place update (an
        # optimizer step, load_state_dict) bumps the tensor's version counter.  An inference
        # tensor (made under torch.inference_mode) keeps none: its codes are packed every call.
        try:
            version = weight._version
        except RuntimeError:
            warn_weight_not_cached(self)
            return build(weight)
        key = (weight.data_ptr(), version, weight.device, self.weight_bits)
        cached = getattr(self, name, None)
        if cached is not None and cached[0] == key:
            return cached[1]
        value = build(weight)
        setattr(self, name, (key, value))
        return value

    def _unpack_weight(self, weight: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        # fused_codes(self.quantized_weight()) in one op (a traced graph runs it at every call)
        return ops.mlp_weight_codes([weight.detach()], [self.weight_bits])[0]

    def _fusable(self) -> bool:
        """Whether the bit path of a float input may run as one ``ops.quant_mlp`` layer (same result)."""
        weight, bias = self.weight, self.bias
        return (not isinstance(weight, torch.nn.parameter.UninitializedParameter) and weight.dim() == 2
                and (max(weight.shape) <= QUANT_MLP_MAX_WIDTH or weight.device.type == "cpu")
                and (bias is None or bias.dtype == torch.float32))

    def _pack_weight(self, weight: Tensor) -> BitTensor:
        w = quantize(weight, self.weight_bits, 1, "row")
        return BitTensor(w.planes, (w.cols, w.rows), w.bits, "col", w.lo, w.scale, 0)

    def _bit_linear(self, x: BitTensor) -> Tensor:
        bias = self.bias
        if bias is None or bias.dtype == torch.float32:
            return bitmm_float(x, self.quantized_weight(), bias.detach() if bias is not None else None)
        return bitmm_float(x, self.quantized_weight()) + bias

    def forward(self, x: Union[Tensor, BitTensor]) -> Tensor:
        """Args:
            x (Tensor or BitTensor): input features.
        """
        weight_bits, act_bits = self.weight_bits, self.act_bits
        if isinstance(x, BitTensor):
            if x.cols != self.weight.size(-1):
                raise ValueError(f"x has {x.cols} features but the layer expects {self.weight.size(-1)}")
            # Codes of this layer's width, one range per row or per tensor: they are the
            # quantized input as they stand; anything else is read as the floats it holds.
            already_quantized = fits(x, act_bits, (None, 1))
            if already_quantized and weight_bits is not None and bit_kernels_apply(self, self.weight, self.bias):
                return self._bit_linear(x)
            if (not already_quantized and weight_bits is not None and act_bits is not None and self._fusable()
                    and _reads_codes(self, x)):
                return _quant_mlp(x, (self,), (False,))  # what the fused kernel gives on dequantize(x)
            x = dequantize(x)
            if already_quantized:
                act_bits = None
        if weight_bits is None and act_bits is None:
            return F.linear(x, self.weight, self.bias)
        if x.is_sparse:
            x = x.to_dense()  # bit planes are dense
        if x.size(-1) != self.weight.size(-1):
            raise ValueError(f"x has {x.size(-1)} features but the layer expects {self.weight.size(-1)}")
        if act_bits is not None:
            check_finite(x, "x")
        lead, x2 = x.shape[:-1], x.reshape(-1, x.size(-1))
        if weight_bits is not None and act_bits is not None and bit_kernels_apply(self, x, self.weight, self.bias):
            if self._fusable():  # quantize + bit GEMM + epilogue in one kernel, the same result
                out = _quant_mlp(x2, (self,), (False,))
            else:
                out = self._bit_linear(quantize(x2, act_bits, 1, "row"))
        else:
            stochastic = self.stochastic and self.training
            weight, bias = self.weight, self.bias
            if (act_bits is not None and weight_bits is not None and weight.dtype == torch.float32
                    and (bias is None or bias.dtype == torch.float32)):
                # both operands fake-quantized per row in one op, QAT's default linear layer (QATLinear) too
                out = ops.qat_linear(x2, weight, bias, act_bits, stochastic, None, weight_bits, stochastic, None)
            else:
                xq = fake_quantize(x2, act_bits, 1, stochastic) if act_bits is not None else x2
                wq = fake_quantize(weight, weight_bits, 1, stochastic) if weight_bits is not None else weight
                out = F.linear(xq.to(wq.dtype), wq, bias)
        return out.reshape(lead + (out.size(-1),)).to(x.dtype)

    def __repr__(self) -> str:
        quant = quant_options_repr(self.weight_bits, self.act_bits, None)
        return (f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, "
                f"bias={self.bias is not None}{', ' + quant if quant else ''})")


def _reads_codes(lin: "QuantLinear", x: BitTensor) -> bool:
    """Whether ``lin``'s fused kernel may read ``x``'s codes itself (``ops.quant_mlp_planes``) instead of
    ``dequantize(x)``: float32 ranges, no gradient to keep (the layer's bit kernels run now), and finite values
    (see :func:`values_finite`)."""
    lo, scale = x.lo, x.scale
    return (lo.dtype == scale.dtype == torch.float32 and bit_kernels_apply(lin, lo, scale, lin.weight, lin.bias)
            and values_finite(x))


def call_end(linears, start: int) -> int:
    """Where the ``ops.quant_mlp`` call that starts at ``linears[start]`` ends: consecutive layers grouped greedily
    up to the kernel's layer count and shared memory."""
    end, used = start, 0
    while end < len(linears) and end - start < QUANT_MLP_MAX_LAYERS:
        need = _layer_bytes(linears[end].weight.size(1), linears[end].weight.size(0))
        if end > start and used + need > _QUANT_MLP_LAYER_BYTES:
            break
        used += need
        end += 1
    return end


def chain_args(group, relus) -> tuple:
    """The weight arguments of one ``ops.quant_mlp`` call through the layers of ``group`` (``relus``: a ReLU after
    each): weight codes, lo, scale and code sums, biases, bit widths, ReLUs."""
    if is_compiling() and all(type(lin).fused_weight is QuantLinear.fused_weight for lin in group):
        # a traced graph keeps no codes between calls: the chain's in one op
        weights = ops.mlp_weight_codes([lin.weight.detach() for lin in group], [lin.weight_bits for lin in group])
    else:
        weights = [lin.fused_weight() for lin in group]
    return tuple([w[i] for w in weights] for i in range(4)) + (
        [None if lin.bias is None else lin.bias.detach() for lin in group], [int(lin.act_bits) for lin in group],
        [int(lin.weight_bits) for lin in group], [bool(r) for r in relus])


def _quant_mlp(x2: Union[Tensor, BitTensor], linears, relus, row_scale: Optional[Tensor] = None,
               col_keys: bool = False, out_codes: Optional["FixedRanges"] = None):
    """``ops.quant_mlp`` of a 2-D input through ``linears`` (each followed by ReLU where ``relus`` says), in as
    few calls as the kernel's limits allow (consecutive layers grouped greedily); ``row_scale`` (float32 ``[rows]``)
    multiplies the output rows in the last call, which with ``col_keys`` also gives the output's column keys:
    ``(out, keys)``.  A :class:`BitTensor` input is read as ``dequantize(x2)``, by the first call itself
    (``ops.quant_mlp_planes``).  With ``out_codes`` (fixed per-column ranges), the last call quantizes the output
    with them (``ops.quant_mlp_row_codes``) and the result is that column-layout :class:`BitTensor`, held as its row
    codes (its planes are made if something asks for them)."""
    h = x2 if isinstance(x2, BitTensor) else x2.detach().to(torch.float32).contiguous()
    start = 0
    while start < len(linears):
        end = call_end(linears, start)
        last = end == len(linears)
        chain = chain_args(linears[start:end], relus[start:end]) + (row_scale if last else None,)
        # The call's output: float32 (with col_keys, last), or fixed-range row codes (last, with out_codes).
        row_codes = last and out_codes is not None
        output = (out_codes.lo, out_codes.inv_scale, out_codes.bits) if row_codes else (col_keys and last,)
        if isinstance(h, BitTensor):
            planes = (h.planes, h.rows, h.cols, h.layout == "col", h.lo.detach(), h.scale.detach(),
                      -1 if h.dim is None else h.dim)
            h = (ops.quant_mlp_planes_row_codes if row_codes else ops.quant_mlp_planes)(*planes, *chain, *output)
        else:
            h = (ops.quant_mlp_row_codes if row_codes else ops.quant_mlp)(h, *chain, *output)
        start = end
    if out_codes is not None:
        return out_codes.from_row_codes(h, x2.rows if isinstance(x2, BitTensor) else x2.size(0))
    return h


def _match_mlp(children) -> Optional[Tuple[Tuple[QuantLinear, ...], Tuple[bool, ...]]]:
    return linear_relu_pairs(children, lambda m: type(m) is QuantLinear and m.weight_bits is not None
                             and m.act_bits is not None)


def fused_mlp_plan(module, view: Optional[ChainView] = None
                   ) -> Optional[Tuple[Tuple[QuantLinear, ...], Tuple[bool, ...]]]:
    r"""``(linears, relus)`` when ``module`` applies :class:`QuantLinear` layers (both bit widths set), each
    optionally followed by a ``torch.nn.ReLU`` (a ``torch.nn.Sequential`` of them, or PyG's ``MLP`` without
    normalization in ``eval()``: :func:`~pyg_quant.nn.mlp_chain.chain_view`, or ``view``), which
    :func:`pyg_quant.ops.quant_mlp` runs in one call; None otherwise.  Cached per module (keyed by its chain and the
    bit widths); what can change between calls (modes, dtypes, shapes, hooks) is checked by :func:`run_fused_mlp`.
    """
    view = chain_view(module) if view is None else view
    if view is None:
        return None
    children = view.steps
    if is_compiling():
        return _match_mlp(children)
    key = tuple((id(c), getattr(c, "weight_bits", None), getattr(c, "act_bits", None)) for c in children)
    cached = module.__dict__.get("_pyg_quant_mlp_plan")
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _match_mlp(children)  # holds its children, so their ids stay theirs while it is cached
    module.__dict__["_pyg_quant_mlp_plan"] = (key, plan)
    return plan


def runs_fused(lin: "QuantLinear", x: Optional[Tensor], width: int) -> bool:
    """Whether ``lin`` takes a fused ``quant_mlp`` layer on ``x`` (``width`` columns; None: an input without a
    gradient) now: eval without a gradient asked for, float32 weight, the kernel's widths."""
    weight = lin.weight
    return (lin._fusable() and weight.dtype == torch.float32 and weight.size(1) == width
            and bit_kernels_apply(lin, x, weight, lin.bias))


def run_row_scaled_linear(lin, x, row_scale: Tensor, col_keys: bool = False,
                          out_codes: Optional[FixedRanges] = None):
    r"""``lin(x) * row_scale[:, None]`` as one :func:`pyg_quant.ops.quant_mlp` call (the multiply is the kernel's
    last step, the same float32 product) when ``lin`` is a :class:`QuantLinear` that would run its fused bit kernel
    on the 2-D float32 ``x`` now (as :func:`run_fused_mlp` asks; a :class:`BitTensor` that the layer reads as the
    floats it holds counts as those floats) and ``row_scale`` is float32 ``[N]`` or ``[N, 1]``; None otherwise (call
    ``lin``, then scale).  GCN's ``D^{-1/2} X W`` is this.  With ``col_keys``, ``(out, keys)``: the same kernel
    also gives the column keys of ``out`` (its ``col_keys``), for ``quantize(out, bits, 0, "col", col_keys=keys)``.
    With ``out_codes`` (fixed per-column ranges), the result is ``quantize_fixed(out, out_codes)``, made by the same
    kernel as it stores the rows.
    """
    def run(x_in):
        if out_codes is not None:
            return _quant_mlp(x_in, (lin,), (False,), row_scale.reshape(-1), False, out_codes)
        return _quant_mlp(x_in, (lin,), (False,), row_scale.reshape(-1), col_keys)

    if (not isinstance(lin, QuantLinear) or lin.weight_bits is None or lin.act_bits is None or not no_hooks(lin)
            or row_scale.dtype != torch.float32 or not isinstance(x, (Tensor, BitTensor))):
        return None
    if isinstance(x, BitTensor):
        if fits(x, lin.act_bits, (None, 1)) or not runs_fused(lin, None, x.cols):
            return None  # codes the layer multiplies as they are, or a layer that does not fuse now
        if row_scale.numel() == x.rows and _reads_codes(lin, x):
            return run(x)
        x = dequantize(x)  # what the layer reads
    if (x.dtype != torch.float32 or x.is_sparse or x.dim() != 2 or row_scale.numel() != x.size(0)
            or not runs_fused(lin, x, x.size(1))):
        return None
    check_finite(x, "x", always=out_codes is not None)
    return run(x)


def run_fused_mlp(module, x, col_keys: bool = False, out_codes: Optional[FixedRanges] = None):
    r"""``module(x)`` as one :func:`pyg_quant.ops.quant_mlp` call when :func:`fused_mlp_plan` matches and every
    layer would run its bit kernels on ``x`` now (``eval()``, no gradient asked for), with float32 weights and
    biases, widths up to ``QUANT_MLP_MAX_WIDTH`` (any on the CPU) and no forward hooks; None otherwise (call ``module``).  The
    result equals the layer-by-layer one bit for bit (for a float32 ``x``, which each layer reads as it is).  With
    ``col_keys``, ``(out, keys)``: the last call also gives the column keys of ``out`` (of its rows, ``[-1, out]``),
    for ``quantize(out, bits, 0, "col", col_keys=keys)``.  With ``out_codes`` (fixed per-column ranges; a 2-D
    ``x``), the result is ``quantize_fixed(module(x), out_codes)``, made by the last call as it stores the rows.
    """
    view = chain_view(module)
    plan = None if view is None else fused_mlp_plan(module, view)
    if (plan is None or not isinstance(x, Tensor) or x.dtype != torch.float32 or x.is_sparse or x.dim() < 1
            or (out_codes is not None and x.dim() != 2)):
        return None
    linears, relus = plan
    if not no_hooks(*view.modules):
        return None
    width = x.size(-1)
    for lin in linears:
        if not runs_fused(lin, x, width):
            return None
        width = lin.weight.size(0)
    check_finite(x, "x", always=out_codes is not None)
    if out_codes is not None:
        return _quant_mlp(x, linears, relus, None, False, out_codes)
    result = _quant_mlp(x.reshape(-1, x.size(-1)), linears, relus, None, col_keys)
    out, keys = result if col_keys else (result, None)
    out = out.reshape(x.shape[:-1] + (out.size(-1),))
    return (out, keys) if col_keys else out

