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
* ``eval()`` with autograd on: the fake path, with the product in float64 and
  rounded once (what ``bitmm`` does), so both eval paths agree to float32
  rounding.
"""
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..bit_tensor import BitTensor, to_val
from ..bitmm import bitmm
from ..nn.quant_linear import QuantLinear, bit_kernels_apply
from .observers import check_finite
from .qconfig import QConfig


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
        - **input:** :math:`(*, F_{in})`; a :class:`BitTensor` is read as the floats it holds
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
        self.weight_quant = qconfig.weight_quantizer(_counter)
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
        fq = self.weight_quant
        key = (self.weight.data_ptr(), self.weight._version, self.weight.device)
        if self._packed is not None and self._packed[0] == key and fq.frozen:
            return self._packed[1]
        w = fq.quantize(self.weight, "row")
        packed = BitTensor(w.planes, (w.cols, w.rows), w.bits, "col", w.lo, w.scale,
                           None if w.dim is None else 0)
        self._packed = (key, packed) if fq.frozen else None
        return packed

    def forward(self, x: Union[Tensor, BitTensor], protect: Optional[Tensor] = None) -> Tensor:
        """Args:
            x (Tensor or BitTensor): input features.
            protect (Tensor, optional): bool ``[N]``, nodes kept in float in training (Degree-Quant).
        """
        if isinstance(x, BitTensor):
            x = to_val(x)  # re-quantized below with this layer's own quantizers
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
        if fq_in is not None and not self.training:
            # NaN/inf would give silent garbage codes in evaluation; in training they reach the loss.
            check_finite(x2, "x")
        if fq_w is not None and fq_in is not None and bit_kernels_apply(self, x2, self.weight, self.bias):
            out = bitmm(fq_in.quantize(x2, "row"), self.packed_weight())
        else:
            xq = fq_in(x2, protect) if fq_in is not None else x2.to(torch.float32)
            wq = fq_w(self.weight) if fq_w is not None else self.weight.to(torch.float32)
            if self.training:
                out = F.linear(xq, wq)
            else:  # bitmm's semantics: the float64 product of the dequantized operands, rounded once
                out = F.linear(xq.double(), wq.double()).to(torch.float32)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(lead + (out.size(-1),))

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, bias={self.bias is not None}, "
                f"weight_bits={self.qconfig.weight_bits}, act_bits={self.qconfig.act_bits}, "
                f"stochastic={self.qconfig.stochastic})")
