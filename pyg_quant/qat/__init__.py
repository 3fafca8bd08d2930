r"""Quantization-aware training for pyg_quant's bit-plane GNN layers.

* :class:`FakeQuantize` (:mod:`pyg_quant.quantization`, re-exported here, as are the observers) with range
  observers (:mod:`pyg_quant.quantization.observers`: dynamic, min/max,
  EMA, percentile, MSE-optimal clipping, static or per tensor, or learned with the
  weights (LSQ+)): stochastic rounding in training (unbiased, seeded), nearest in
  evaluation, straight-through gradients zeroed outside the clipping range;
  ``keep_zeros`` keeps a dropout's zeros exact in training.
* :class:`QConfig`: which quantizer each tensor of a layer gets.
* :class:`QATLinear`, :class:`QATGCNConv`, :class:`QATGINConv`: the layers of
  :mod:`pyg_quant.nn` driven by those quantizers; fp32 master weights.
* :func:`prepare` (GCNConv/GINConv/Linear → QAT layers, last layer fp32 by default: a
  skipped convolution becomes ``QGCNConv`` / ``QGINConv`` with ``bits=None``, which reads a
  ``BitAdjacency`` too) and :func:`convert` (frozen ranges, bit kernels, equal outputs; also
  under ``torch.inference_mode()``).
* Inputs that are quantized already (a BitTensor that fits a layer's quantizer) are used
  as they are, not quantized again (see :mod:`.linear`).
* :func:`quantization_error` / :func:`recommend_bits`: a relative-error metric and the
  fewest bits that keep it under a threshold.

Typical use::

    model = pyg_quant.qat.prepare(float_model, bits=4)      # stochastic rounding, last layer fp32
    ... train model as usual ...                           # on a GPU, pyg_quant.CapturedTrainStep replays
                                                            # each batch shape's step from a CUDA graph
    inference = pyg_quant.qat.convert(model)
    with torch.no_grad():
        out = inference(x, edge_index)                      # bit kernels, frozen ranges
"""
from .conv import QATGCNConv, QATGINConv
from .degree_quant import protect_mask, protection_probability
from .linear import QATLinear
from .metrics import quantization_error, quantization_errors, recommend_bits
from ..quantization.fake_quantize import FakeQuantize
from ..quantization.observers import (OBSERVERS, DynamicMSEObserver, DynamicObserver, EMAMinMaxObserver,
                                      LearnedObserver, MinMaxObserver, MSEObserver, Observer, PercentileObserver,
                                      make_observer)
from .prepare import convert, fake_quantizers, prepare, quantizable_layers
from .qconfig import AGG_GRANULARITIES, CLUSTER_GCN_OBSERVERS, DYNAMIC_OBSERVERS, QConfig

__all__ = [
    "AGG_GRANULARITIES", "CLUSTER_GCN_OBSERVERS", "DYNAMIC_OBSERVERS", "OBSERVERS", "DynamicMSEObserver",
    "DynamicObserver", "EMAMinMaxObserver", "FakeQuantize", "LearnedObserver", "MinMaxObserver", "MSEObserver", "Observer",
    "PercentileObserver", "QATGCNConv", "QATGINConv", "QATLinear", "QConfig", "convert", "fake_quantizers",
    "make_observer", "prepare", "protect_mask", "protection_probability", "quantizable_layers",
    "quantization_error", "quantization_errors", "recommend_bits",
]
