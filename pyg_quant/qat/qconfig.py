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
``agg``         the aggregated features  per channel (``dim=0``)
                ``[N, F]``
==============  =======================  ==========================================

Per-node ranges cannot be observed once and frozen (the nodes change from graph
to graph), so they are always dynamic; per-channel and per-tensor ranges may be
static (``"minmax"``, ``"ema"``, ``"percentile"``, ``"mse"``, frozen by
:func:`pyg_quant.qat.convert`) or dynamic too.

Cluster-GCN (training on METIS batches, evaluating on the full graph) at 2 bits:
``QConfig(..., input_observer="dynamic_mse", weight_observer="dynamic_mse",
agg_observer="dynamic_mse")`` (:data:`CLUSTER_GCN_OBSERVERS`).  A static
aggregation range learnt on batches is too wide for the full graph, whose
higher degrees shrink the ``D^{-1/2}``-scaled features; per-node min/max input
ranges spend two of four levels on each noisy row's extremes.  On the planted
graph of ``benchmarks/accuracy.py`` the defaults lost 10.4 / 8.9 pt at 2 bits
(stochastic / nearest), the ``"dynamic_mse"`` observers 5.2 / 4.9 (``benchmarks/RESULTS.md``).
On Cora they are no better than the defaults and cost ~2x training time, so they are opt-in.
"""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from ..bit_tensor import _check_bits
from .fake_quantize import FakeQuantize, _check_seed
from .observers import OBSERVERS

#: Observer kinds without stored ranges (every tensor quantized over a range of its own).
DYNAMIC_OBSERVERS = ("dynamic", "dynamic_mse")

#: The observers for Cluster-GCN-style training (see the module docstring): ``QConfig(**CLUSTER_GCN_OBSERVERS)``
#: or ``prepare(model, bits, **CLUSTER_GCN_OBSERVERS)``.
CLUSTER_GCN_OBSERVERS = {"input_observer": "dynamic_mse", "weight_observer": "dynamic_mse",
                         "agg_observer": "dynamic_mse"}


@dataclass(frozen=True)
class QConfig:
    r"""Quantizer settings shared by the QAT layers of one model.

    Args:
        weight_bits, act_bits (int, optional): 1..8, or None to keep that kind of tensor in float.
        stochastic (bool): stochastic rounding in training (TANGO); evaluation rounds to nearest.
        weight_observer (str): observer of the weights (per output channel).  ``"dynamic"``
            (default) is the current fp32 master weight's own range, ``"dynamic_mse"`` its
            MSE-optimal clipping range.
        input_observer (str): observer of Linear inputs: ``"dynamic"`` (per node min/max, default),
            ``"dynamic_mse"`` (per node, MSE-optimal clipping) or a static observer (then per tensor).
        agg_observer (str): observer of the aggregated features (per channel).  ``"mse"``
            (default): a moving average of the MSE-optimal clipping range for ``act_bits``;
            on Cora at 2 bits it keeps a 2-layer GCN within ~0.5 pt of fp32 where EMA
            min/max ranges lose ~8 pt (``benchmarks/accuracy.py``).  ``"dynamic_mse"``: the
            MSE-optimal range of each tensor itself, nothing stored (for inference graphs
            distributed unlike the training batches, e.g. Cluster-GCN).
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
    momentum: float = 0.1
    percentile: float = 0.999
    seed: Optional[int] = None
    degree_quant: Optional[Tuple[float, float]] = None

    def __post_init__(self):
        for name in ("weight_bits", "act_bits"):
            if getattr(self, name) is not None:
                _check_bits(getattr(self, name), name)
        if not isinstance(self.stochastic, bool):
            raise TypeError(f"stochastic must be a bool, got {type(self.stochastic).__name__}")
        for name in ("weight_observer", "input_observer", "agg_observer"):
            if getattr(self, name) not in OBSERVERS:
                raise ValueError(f"{name} must be one of {OBSERVERS}, got {getattr(self, name)!r}")
        _check_seed(self.seed)
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

    def weight_quantizer(self, counter: Optional[list] = None) -> Optional[FakeQuantize]:
        if self.weight_bits is None:
            return None
        return FakeQuantize(self.weight_bits, self.weight_observer, 1, self.stochastic, self._seed(counter),
                            self.momentum, self.percentile)

    def input_quantizer(self, counter: Optional[list] = None) -> Optional[FakeQuantize]:
        if self.act_bits is None:
            return None
        dim = 1 if self.input_observer in DYNAMIC_OBSERVERS else None
        return FakeQuantize(self.act_bits, self.input_observer, dim, self.stochastic, self._seed(counter),
                            self.momentum, self.percentile)

    def agg_quantizer(self, counter: Optional[list] = None) -> Optional[FakeQuantize]:
        if self.act_bits is None:
            return None
        return FakeQuantize(self.act_bits, self.agg_observer, 0, self.stochastic, self._seed(counter),
                            self.momentum, self.percentile)
