r"""QConfig: which quantizer every tensor of a QAT layer gets.

A QAT layer quantizes three kinds of tensors, each with the granularity the
bit kernels need to factor their products exactly (:func:`pyg_quant.bitmm`:
``A`` per tensor or per row, ``B`` per tensor or per column;
:func:`pyg_quant.bit_spmm`: features per column or per tensor):

==============  =======================  ==========================================
role            tensor                   ranges
==============  =======================  ==========================================
``weight``      ``W`` ``[out, in]``      per output channel (``dim=1``)
``input``       a Linear's input ``X``   per node (``dim=1``) when ``input_observer``
                ``[N, in]``              is dynamic (``"dynamic"``, ``"dynamic_mse"``), else per
                                         tensor (static)
``agg``         the aggregated features  per channel (``dim=0``), or per tensor with
                ``[N, F]``               ``agg_granularity="tensor"``
==============  =======================  ==========================================

Per-node ranges cannot be observed once and frozen (the nodes change from graph
to graph), so they are always dynamic; per-channel and per-tensor ranges may be
static (``"minmax"``, ``"ema"``, ``"percentile"``, ``"mse"``, frozen by
:func:`pyg_quant.qat.convert`) or dynamic too.  Weights may also have ranges
trained with them (``"learned"``, LSQ+), frozen by ``convert`` as well.

Cluster-GCN (training on METIS batches, evaluating on the full graph) at 2 bits:
:data:`CLUSTER_GCN_OBSERVERS`, i.e. ``QConfig(..., input_observer="dynamic_mse",
keep_zeros=True, weight_observer="learned", agg_observer="dynamic_mse",
agg_granularity="tensor")``.  Measured on the planted graph of
``benchmarks/accuracy.py`` (2 bits, stochastic / nearest rounding, 10 seeds, drop
vs fp32 87.28; ``benchmarks/RESULTS.md``):

* ``prepare``'s defaults: −10.4 / −8.9 pt.  A static aggregation range learnt on
  batches is too wide for the full graph, whose higher degrees shrink the
  ``D^{-1/2}``-scaled features; per-node min/max input ranges spend two of four
  levels on each noisy row's extremes.
* ``"dynamic_mse"`` for all three points, per node / per output channel / per
  channel (the previous setting): −5.54 / −5.22.
* aggregated features per tensor instead of per channel: −4.86 / −4.95.  One range
  for all channels keeps their relative scales, so the weights decide which
  channels get the resolution.
* ... plus learned weight ranges (``"learned"``, LSQ+, nearest rounding of the
  weights in training): −4.84 / −4.99.
* ... plus ``keep_zeros`` on the Linear input: −4.86 / −4.34.  The model's input
  dropout zeroes half of each training row; quantized, those zeros became a
  row-wide offset (nearest) or noise (stochastic) that inference never sees, and
  they pulled each row's range.
* ~2 pt of the loss is the input's at 2 bits alone and cannot be recovered (4
  levels keep ~88% of the Fisher information of a weak shift in Gaussian noise).

On Cora the defaults are as good and cheaper, so these settings are opt-in.
"""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from ..quantization.bits import check_optional_bits
from ..quantization.fake_quantize import FakeQuantize, check_seed
from ..quantization.observers import OBSERVERS

#: Observer kinds without stored ranges (every tensor quantized over a range of its own).
DYNAMIC_OBSERVERS = ("dynamic", "dynamic_mse")

#: The quantizer settings for Cluster-GCN-style training (see the module docstring):
#: ``QConfig(**CLUSTER_GCN_OBSERVERS)`` or ``prepare(model, bits, **CLUSTER_GCN_OBSERVERS)``.
CLUSTER_GCN_OBSERVERS = {"input_observer": "dynamic_mse", "keep_zeros": True, "weight_observer": "learned",
                         "agg_observer": "dynamic_mse", "agg_granularity": "tensor"}

#: The granularities of the aggregated features' ranges the bit kernels take (``QConfig.agg_granularity``).
AGG_GRANULARITIES = ("channel", "tensor")


@dataclass(frozen=True)
class QConfig:
    r"""Quantizer settings shared by the QAT layers of one model.

    Args:
        weight_bits, act_bits (int, optional): 1..8, or None to keep that kind of tensor in float.
        stochastic (bool): stochastic rounding in training (TANGO); evaluation rounds to nearest.
        weight_observer (str): observer of the weights (per output channel).  ``"dynamic"``
            (default) is the current fp32 master weight's own range, ``"dynamic_mse"`` its
            MSE-optimal clipping range, ``"learned"`` a range trained with the weights (LSQ+,
            :class:`~pyg_quant.quantization.observers.LearnedObserver`; its weights are rounded to nearest in
            training whatever ``stochastic`` says, and the range is frozen by ``convert``).
        input_observer (str): observer of Linear inputs: ``"dynamic"`` (per node min/max, default),
            ``"dynamic_mse"`` (per node, MSE-optimal clipping) or a static observer (then per tensor).
        keep_zeros (bool): in training, the exact zeros of a Linear's input stay zero and are left
            out of its ranges (``Dropout(Q(x))`` instead of ``Q(Dropout(x))`` for a dropout on the
            input: inference sees no dropout zeros).  Needs a dynamic ``input_observer``.  In
            evaluation zeros are quantized as any value.
        agg_observer (str): observer of the aggregated features (per channel).  ``"mse"``
            (default): a moving average of the MSE-optimal clipping range for ``act_bits``;
            on Cora at 2 bits it keeps a 2-layer GCN within ~0.5 pt of fp32 where EMA
            min/max ranges lose ~8 pt (``benchmarks/accuracy.py``).  ``"dynamic_mse"``: the
            MSE-optimal range of each tensor itself, nothing stored (for inference graphs
            distributed unlike the training batches, e.g. Cluster-GCN).
        agg_granularity (str): ``"channel"`` (default: a range per channel) or ``"tensor"`` (one
            range for all channels, the weights then set the channels' relative resolution).
        momentum (float): EMA momentum of ``"ema"`` / ``"percentile"`` observers.
        percentile (float): quantile ``q`` of ``"percentile"`` observers.
        seed (int, optional): base seed of the rounding noise; quantizer ``k`` of a model gets
            ``seed + k``.  None draws from torch's global generator.
        degree_quant (tuple of float, optional): Degree-Quant's protective masking,
            ``(p_min, p_max)``: in training, each node is left unquantized with a probability
            growing linearly with its in-degree rank from ``p_min`` to ``p_max``.
    """
    weight_bits: Optional[int] = 8
    act_bits: Optional[int] = 8
    stochastic: bool = True
    weight_observer: str = "dynamic"
    input_observer: str = "dynamic"
    agg_observer: str = "mse"
    keep_zeros: bool = False
    agg_granularity: str = "channel"
    momentum: float = 0.1
    percentile: float = 0.999
    seed: Optional[int] = None
    degree_quant: Optional[Tuple[float, float]] = None

    def __post_init__(self):
        for name in ("weight_bits", "act_bits"):
            check_optional_bits(getattr(self, name), name)
        if not isinstance(self.stochastic, bool):
            raise TypeError(f"stochastic must be a bool, got {type(self.stochastic).__name__}")
        for name in ("weight_observer", "input_observer", "agg_observer"):
            if getattr(self, name) not in OBSERVERS:
                raise ValueError(f"{name} must be one of {OBSERVERS}, got {getattr(self, name)!r}")
        for name in ("input_observer", "agg_observer"):
            if getattr(self, name) == "learned":
                raise ValueError(f'{name}="learned" is not supported: learned ranges are for weights, whose '
                                 "number of ranges is known when the optimizer is built")
        if not isinstance(self.keep_zeros, bool):
            raise TypeError(f"keep_zeros must be a bool, got {type(self.keep_zeros).__name__}")
        if self.keep_zeros and self.input_observer not in DYNAMIC_OBSERVERS:
            raise ValueError(f"keep_zeros needs a dynamic input_observer {DYNAMIC_OBSERVERS}, "
                             f"got {self.input_observer!r}")
        if self.agg_granularity not in AGG_GRANULARITIES:
            raise ValueError(f"agg_granularity must be one of {AGG_GRANULARITIES}, got {self.agg_granularity!r}")
        check_seed(self.seed)
        if self.degree_quant is not None:
            dq = self.degree_quant
            if (not isinstance(dq, (tuple, list)) or len(dq) != 2
                    or not all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in dq)
                    or not 0.0 <= dq[0] <= dq[1] <= 1.0):
                raise ValueError(f"degree_quant must be None or (p_min, p_max) with 0 <= p_min <= p_max <= 1, "
                                 f"got {dq!r}")
            object.__setattr__(self, "degree_quant", (float(dq[0]), float(dq[1])))

    def replace(self, **changes) -> "QConfig":
        return replace(self, **changes)

    def _seed(self, counter: Optional[list]) -> Optional[int]:
        if self.seed is None:
            return None
        if counter is None:
            return self.seed
        counter[0] += 1
        return self.seed + counter[0] - 1

    def weight_quantizer(self, counter: Optional[list] = None,
                         out_channels: Optional[int] = None) -> Optional[FakeQuantize]:
        """The quantizer of a weight ``[out_channels, in]`` (``out_channels``: needed by ``"learned"`` ranges)."""
        if self.weight_bits is None:
            return None
        return FakeQuantize(self.weight_bits, self.weight_observer, 1, self.stochastic, self._seed(counter),
                            self.momentum, self.percentile, groups=out_channels)

    def input_quantizer(self, counter: Optional[list] = None) -> Optional[FakeQuantize]:
        if self.act_bits is None:
            return None
        dim = 1 if self.input_observer in DYNAMIC_OBSERVERS else None
        return FakeQuantize(self.act_bits, self.input_observer, dim, self.stochastic, self._seed(counter),
                            self.momentum, self.percentile, keep_zeros=self.keep_zeros)

    def agg_quantizer(self, counter: Optional[list] = None) -> Optional[FakeQuantize]:
        if self.act_bits is None:
            return None
        dim = 0 if self.agg_granularity == "channel" else None
        return FakeQuantize(self.act_bits, self.agg_observer, dim, self.stochastic, self._seed(counter),
                            self.momentum, self.percentile)
