r"""QATLinear: a :class:`~pyg_quant.nn.QuantLinear` whose quantizers are :class:`FakeQuantize` modules.

.. math::
    \mathbf{y} = \tilde{\mathbf{x}}\,\tilde{\mathbf{W}}^{\top} + \mathbf{b}, \qquad
    \tilde{\mathbf{x}} = \mathrm{fq}_{in}(\mathbf{x}), \quad \tilde{\mathbf{W}} = \mathrm{fq}_{w}(\mathbf{W}),

with ``W`` ``[out, in]`` the fp32 master weight (never replaced by its codes),
``fq_w`` ranging per output channel and ``fq_in`` per node (dynamic) or per
tensor (static): the granularities for which ``x̃ W̃ᵀ`` is one exact bit-plane
GEMM (:func:`pyg_quant.bitmm`).

* ``train()``: fake quantization in float32, stochastic rounding if the
  quantizers are stochastic, straight-through gradients clipped to the range.
* ``eval()`` with no gradient asked for: the same nearest-rounded codes on the
  bit kernels, ``bitmm(fq_in.quantize(x), fq_w.quantize(W)ᵀ) + b``.
* ``eval()`` with autograd on: the fake path, with the product of the
  dequantized operands ``lo + s·q`` (unrounded, :meth:`FakeQuantize.forward_exact`)
  in float64 and rounded once: the exact value of ``bitmm``'s, whose float32
  epilogue stays within a few float32 roundings of its terms (``csrc/epilogue.h``).

An input that is quantized already, a :class:`~pyg_quant.BitTensor` of at most
``fq_in.bits`` bits with a granularity of ``fq_in``'s (per node or per tensor for
the dynamic per-node quantizer, per tensor for a static one), is taken as
:math:`\tilde{\mathbf{x}}` itself, in every mode: the bit GEMM reads its codes as
they are in evaluation (no dequantize / requantize round trip), and training
computes with its values ``to_val(x)`` without rounding them again (no
stochastic noise either: that rounding has happened where the codes were
made).  A static ``fq_in`` still observes those values in training, so its
range is learned for float inputs too.  Re-quantizing such an input could
only add error (a row that does not span all its codes is stretched onto a
new grid) and costs a pack of the whole input per call.  For the default
dynamic ``fq_in``, ``to_bit(x, fq_in.bits, dim=1)`` holds exactly the codes
``fq_in`` makes of ``x``, so the layer gives the same output from it as from
``x``, bit for bit.  Any other BitTensor is read as the floats it holds and
quantized by ``fq_in``.

Works under ``torch.no_grad()`` and ``torch.inference_mode()`` alike; the
packed weight is cached only for weights with a version counter (an
inference tensor has none, so its codes are packed at every call).
"""
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from .._utils import is_compiling
from ..bit_tensor import BitTensor, to_val
from ..bitmm import bitmm
from ..nn.quant_linear import QuantLinear, bit_kernels_apply, fused_codes, warn_weight_not_cached
from ..quantization.quantize import exact_values, ranges_finite
from ..quantization.fake_quantize import FakeQuantize
from ..quantization.observers import check_finite
from .qconfig import QConfig


def tensor_version(t: Tensor) -> Optional[int]:
    """``t._version``, or None for an inference tensor (it keeps no version counter)."""
    try:
        return t._version
    except RuntimeError:
        return None


def quantized_already(x: BitTensor, fq: Optional[FakeQuantize], dims) -> bool:
    r"""Whether ``x`` is an operand ``fq`` would make (or a coarser one): at most ``fq.bits`` bits, ranges over ``dims``.

    ``dims`` are the granularities that are ``fq``'s own or special cases of it (one range
    for the tensor is one range per node, or per channel, with every range equal).
    """
    return fq is not None and x.bits <= fq.bits and x.dim in dims


def observe_only(fq: FakeQuantize, x: Tensor) -> None:
    """Let a static ``fq`` record ``x``'s range in training, as ``fq(x)`` does; ``x``'s values are not changed.

    The observer has to see the inputs it will quantize at evaluation time, even when a training
    input arrives quantized already (the layer uses it as it is): :meth:`FakeQuantize.observe`, the
    recording part of ``fq(x)`` (observer and range bookkeeping) without its fake quantization.
    """
    if fq.training and not fq.frozen and not fq.dynamic:
        fq.observe(x.detach())


def _check_qconfig(qconfig) -> QConfig:
    if qconfig is None:
        return QConfig()
    if not isinstance(qconfig, QConfig):
        raise TypeError(f"qconfig must be a pyg_quant.qat.QConfig, got {type(qconfig).__name__}")
    return qconfig


class QATLinear(QuantLinear):
    r"""Quantization-aware :class:`torch_geometric.nn.Linear` (see the module docstring).

    Args:
        in_channels (int): input features, or ``-1`` (lazy).
        out_channels (int): output features.
        bias (bool): learn an additive bias.
        weight_initializer, bias_initializer (str, optional): as in PyG's Linear.
        qconfig (QConfig, optional): the quantizers (default ``QConfig()``: 8 bits, stochastic).

    Submodules ``weight_quant`` and ``input_quant`` (:class:`FakeQuantize`, or None where
    ``qconfig`` keeps that operand in float).  State dict keys of the weight and bias are those
    of PyG's Linear.

    Shapes:
        - **input:** :math:`(*, F_{in})`, or a 2-D :class:`BitTensor`: used as the quantized
          input as it is when it fits ``input_quant`` (see the module docstring), else read as
          the floats it holds
        - **protect** (optional): bool ``[N]`` for 2-D inputs, rows left unquantized in training
        - **output:** :math:`(*, F_{out})` float32
    """

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True,
                 weight_initializer: Optional[str] = None, bias_initializer: Optional[str] = None, *,
                 qconfig: Optional[QConfig] = None, _counter: Optional[list] = None):
        qconfig = _check_qconfig(qconfig)
        super().__init__(in_channels, out_channels, bias, weight_initializer, bias_initializer,
                         weight_bits=qconfig.weight_bits, act_bits=qconfig.act_bits, stochastic=qconfig.stochastic)
        self.qconfig = qconfig
        self.weight_quant = qconfig.weight_quantizer(_counter, out_channels)
        self.input_quant = qconfig.input_quantizer(_counter)
        self._packed = None  # (weight version key, BitTensor) while the weight quantizer is frozen

    @classmethod
    def from_linear(cls, linear: Union[torch.nn.Linear, "QuantLinear"], qconfig: Optional[QConfig] = None,
                    _counter: Optional[list] = None) -> "QATLinear":
        """A QATLinear sharing ``linear``'s weight and bias (the same Parameter objects)."""
        if not isinstance(linear, torch.nn.Module) or not hasattr(linear, "weight"):
            raise TypeError(f"linear must be a torch.nn.Linear or PyG Linear, got {type(linear).__name__}")
        return super().from_linear(linear, qconfig=qconfig, _counter=_counter)

    def packed_weight(self) -> BitTensor:
        r""":math:`\tilde{\mathbf{W}}^{\top}` ``[in, out]`` as a column-layout :class:`BitTensor`.

        ``W`` ``[out, in]`` packed per row in row layout *is* ``Wᵀ`` per column in column
        layout: no transpose is made.  Cached while the quantizer is frozen and the weight
        unchanged (after :func:`~pyg_quant.qat.convert`, the codes are packed once).
        """
        fq, weight = self._modules["weight_quant"], self._parameters["weight"]
        if is_compiling():  # traced: the codes are made in the graph (a data-pointer key cannot be traced)
            return self._pack_weight(fq)
        version = tensor_version(weight)  # None: an inference tensor, whose in-place edits are not tracked
        frozen = not fq._observe
        if version is None and frozen:
            warn_weight_not_cached(self)
        key = (weight.data_ptr(), version, weight.device)
        if self._packed is not None and self._packed[0] == key and frozen and version is not None:
            return self._packed[1]
        packed = self._pack_weight(fq)
        self._packed = (key, packed) if fq.frozen and version is not None else None
        return packed

    def _pack_weight(self, fq: FakeQuantize) -> BitTensor:
        w = fq.quantize(self.weight, "row")
        return BitTensor(w.planes, (w.cols, w.rows), w.bits, "col", w.lo, w.scale, None if w.dim is None else 0)

    def quantized_weight(self) -> BitTensor:
        """:meth:`packed_weight`: the weight quantizer's codes are what the bit kernels multiply."""
        return self.packed_weight()

    def fused_weight(self):
        r"""The codes of :meth:`packed_weight` as :func:`pyg_quant.ops.quant_mlp` takes them (see
        :meth:`QuantLinear.fused_weight <pyg_quant.nn.QuantLinear.fused_weight>`), kept with them."""
        packed = self.packed_weight()
        kept = self.__dict__.get("_fused")
        if kept is not None and kept[0] is packed:
            return kept[1]
        fused = fused_codes(packed)
        self.__dict__["_fused"] = (packed, fused)
        return fused

    def takes_as_quantized(self, x) -> bool:
        """Whether ``x`` is used as this layer's quantized input as it is (see the module docstring)."""
        fq = self.input_quant
        if not isinstance(x, BitTensor) or fq is None:
            return False
        return quantized_already(x, fq, (None, 1) if fq.dynamic else (None,))

    def forward(self, x: Union[Tensor, BitTensor], protect: Optional[Tensor] = None) -> Tensor:
        """Args:
            x (Tensor or BitTensor): input features.
            protect (Tensor, optional): bool ``[N]``, nodes kept in float in training (Degree-Quant).
        """
        if self.training and type(x) is Tensor and x.dim() == 2 and not x.is_sparse:
            return self._forward_training(x, protect)
        if isinstance(x, BitTensor):
            if x.cols != self.weight.size(-1):
                raise ValueError(f"x has {x.cols} features but the layer expects {self.weight.size(-1)}")
            if self.takes_as_quantized(x):
                return self._forward_quantized(x)
            x = to_val(x)  # read as floats, quantized below with this layer's own quantizers
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a Tensor or a BitTensor, got {type(x).__name__}")
        if x.is_sparse:
            x = x.to_dense()
        if x.size(-1) != self.weight.size(-1):
            raise ValueError(f"x has {x.size(-1)} features but the layer expects {self.weight.size(-1)}")
        fq_w, fq_in = self.weight_quant, self.input_quant
        if fq_w is None and fq_in is None:
            return F.linear(x, self.weight, self.bias)
        if protect is not None and x.dim() != 2:
            raise ValueError(f"protect needs 2-D node features, got x of shape {tuple(x.shape)}")
        # A 2-D input is passed on as the same object, so that its codes can be reused (FakeQuantize.quantize).
        lead, x2 = x.shape[:-1], (x if x.dim() == 2 else x.reshape(-1, x.size(-1)))
        bit_path = (fq_w is not None and fq_in is not None and fq_w.quantizes and fq_in.quantizes
                    and bit_kernels_apply(self, x2, self.weight, self.bias))
        # NaN/inf would give silent garbage codes in evaluation (here, or in a static range downstream); in training
        # they reach the loss.  On the CPU, dynamic ranges on the bit path are checked below, on the ranges (which
        # NaN and inf reach) instead of every element.
        by_ranges = bit_path and fq_in.dynamic and x2.device.type == "cpu"
        if fq_in is not None and not self.training and not by_ranges:
            check_finite(x2, "x")
        if bit_path:
            codes = fq_in.quantize(x2, "row")
            if by_ranges and not self.training and not ranges_finite(codes):
                check_finite(x2, "x")  # a NaN or inf made its row's range non-finite: find which, and raise
            out = bitmm(codes, self.packed_weight())
            if self.bias is not None:
                out = out + self.bias
        else:
            if fq_in is None:
                xq = x2.to(torch.float32)
            else:
                xq = fq_in(x2, protect) if self.training else fq_in.forward_exact(x2)[1]
            out = self._float_product(xq)
        return out if x.dim() == 2 else out.reshape(lead + (out.size(-1),))

    def _forward_training(self, x: Tensor, protect: Optional[Tensor]) -> Tensor:
        """``fq_in(x) · fq_w(W)ᵀ + b`` for 2-D float node features in training (the general forward's float path,
        its modules and parameters read from their dicts: a training step runs it for every linear layer)."""
        params, modules = self._parameters, self._modules
        weight = params["weight"]
        if x.size(1) != weight.size(-1):
            raise ValueError(f"x has {x.size(1)} features but the layer expects {weight.size(-1)}")
        # (.get: a quantizer left out by the QConfig is a plain None attribute, not a submodule)
        fq_in, fq_w = modules.get("input_quant"), modules.get("weight_quant")
        if fq_in is None and fq_w is None:
            return F.linear(x, weight, params["bias"])
        if protect is None and fq_in is not None and fq_w is not None and x.is_floating_point() and x.numel() > 0:
            x_args, w_args = fq_in.own_rows_training(x.device), fq_w.own_rows_training(weight.device)
            if x_args is not None and w_args is not None:  # the default QConfig's quantizers: one op
                return ops.qat_linear(x, weight, params["bias"], *x_args, *w_args)
        return self._float_product(x.to(torch.float32) if fq_in is None else fq_in(x, protect))

    def _float_product(self, xq: Tensor) -> Tensor:
        """``xq · W̃ᵀ + b`` without the bit kernels: fake-quantized W in training (one ``addmm``), and in evaluation
        bitmm's value (the float64 product of the unrounded dequantized operands, ``xq`` given so by the caller,
        rounded once, then ``+ b``)."""
        fq_w, weight, bias = self._modules.get("weight_quant"), self._parameters["weight"], self._parameters["bias"]
        if fq_w is None:
            wq = weight.to(torch.float32)
        else:
            wq = fq_w(weight) if self.training else fq_w.forward_exact(weight)[1]
        if self.training:
            return F.linear(xq, wq, bias)
        out = F.linear(xq.double(), wq.double()).to(torch.float32)
        return out if bias is None else out + bias

    def _forward_quantized(self, x: BitTensor) -> Tensor:
        r""":math:`\tilde{\mathbf{x}}\,\tilde{\mathbf{W}}^{\top} + \mathbf{b}` with :math:`\tilde{\mathbf{x}}` = ``x`` as it is."""
        fq_w = self.weight_quant
        if fq_w is not None and fq_w.quantizes and bit_kernels_apply(self, self.weight, self.bias):
            out = bitmm(x, self.packed_weight())  # x's own codes: nothing is repacked but a layout change
            return out if self.bias is None else out + self.bias
        if self.training:
            xq = to_val(x)
            observe_only(self.input_quant, xq)
        else:
            xq = exact_values(x)  # what bitmm's epilogue multiplies, not its float32 rounding
        return self._float_product(xq)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, bias={self.bias is not None}, "
                f"weight_bits={self.qconfig.weight_bits}, act_bits={self.qconfig.act_bits}, "
                f"stochastic={self.qconfig.stochastic})")
