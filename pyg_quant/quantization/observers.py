r"""Range observers: where the clipping range ``[lo, hi]`` of a quantizer comes from.

An observer watches 2-D tensors ``x`` (``[rows, cols]``) and keeps a range per
*granularity*, with :func:`pyg_quant.to_bit`'s convention for ``dim`` (the
dimension reduced over):

* ``dim=None``: one range for the tensor, shape ``(1,)``;
* ``dim=0``: one range per column (per channel of node features), ``(cols,)``;
* ``dim=1``: one range per row (per node, or per output channel of a weight ``[out, in]``), ``(rows,)``.

Kinds (the names :func:`make_observer` accepts):

* ``"dynamic"`` — no state: the range of every tensor is its own min/max, in
  training and in evaluation alike (what ``to_bit`` does).  Per-node ranges,
  whose rows change from graph to graph, must be dynamic;
* ``"dynamic_mse"`` — no state either: every tensor's own *MSE-optimal* clipping
  range for the bit width (:func:`~pyg_quant.quantization.ranges.mse_ranges`), in training and in
  evaluation alike.  Per node it spends 2-bit codes on the bulk of a noisy row
  instead of its two extremes; per channel it follows the tensor at hand, so a
  range is never carried from the graphs it was trained on to a differently
  distributed one (Cluster-GCN: trained on METIS batches, whose cut edges lower
  the degrees and so raise ``D^{-1/2}``-scaled features, evaluated on the full
  graph);
* ``"minmax"`` — the running extremes of everything seen,
  :math:`lo = \min_t \min x_t`, :math:`hi = \max_t \max x_t`;
* ``"ema"`` — exponential moving averages of the batch extremes,
  :math:`lo \leftarrow lo + m\,(\min x_t - lo)` (the first batch initialises);
* ``"percentile"`` — the same moving average of the batch's ``1 − q`` and ``q``
  quantiles (Degree-Quant's robust ranges): a fraction ``1 − q`` of outliers on
  each side is clipped, buying resolution for the rest at low bit widths;
* ``"mse"`` — the same moving average of the batch's *MSE-optimal* clipping
  range for the quantizer's bit width: among the ranges ``[c + a(lo − c),
  c + a(hi − c)]`` (``c`` the point of the batch's ``[lo, hi]`` nearest 0, ``a``
  on a geometric grid from 1 down to 0.086), the one whose round-to-nearest codes
  give the least squared error, per range.  At 8 bits that is (nearly) the
  min/max; at 1–2 bits it clips the tails of a heavy-tailed activation hard,
  which min/max ranges spend most of their few levels on.

* ``"learned"`` — a range trained with the model (LSQ+, Bhalgat et al. 2020, after
  Esser et al.'s LSQ): per range a learnable ``lo`` and ``log`` step, initialised to
  the first tensor's MSE-optimal range and then moved by the task loss through
  the rounding residual (:class:`LearnedObserver`).  For weights, whose count per
  range is fixed (``groups`` ranges).

A static observer (every kind but the dynamic ones and ``"learned"``) stores its range in the
buffers ``min_val`` / ``max_val`` (empty until the first observation), so ranges
travel with the state dict and freeze when the observer stops observing; a
``"learned"`` range is two :class:`~torch.nn.Parameter` s (``range_lo``,
``log_step``), frozen the same way.
"""
import contextvars
from typing import ContextManager, Optional, Tuple

import torch

from .. import ops
from .._utils import check_finite as _check_finite, context_value, is_compiling, no_hooks
from ..distributed import ranges as _ranks
from ..layout import check_bits
from .affine import MIN_RANGE_WIDTH
from .quantize import check_matrix
from .ranges import (MSE_GRID, masked_mse_ranges, masked_tensor_range, mse_ranges, tensor_quantiles,
                                   tensor_range)

OBSERVERS = ("dynamic", "minmax", "ema", "percentile", "mse", "dynamic_mse", "learned")


def check_dim(dim) -> Optional[int]:
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, int) or dim not in (0, 1):
        raise ValueError(f"dim must be None, 0 or 1, got {dim!r}")
    return dim


def check_finite(x: torch.Tensor, name: str = "x") -> None:
    """Raise a ValueError if ``x`` holds NaN or inf (the codes of such a tensor would be garbage).

    :func:`pyg_quant._utils.check_finite` (a sum first, every element only when the
    sum is not finite), with ``name`` defaulting to ``"x"``, on every device: an observer keeps what it
    records, so a NaN let through would spoil its ranges for every later batch.
    """
    _check_finite(x, name, always=True)


# Set by pyg_quant.CapturedTrainStep: stored ranges move in place, so a captured CUDA graph keeps reading and
# writing the module's own buffers (a fresh tensor made during a capture would live in the graph's memory pool).
_in_place: contextvars.ContextVar = contextvars.ContextVar("pyg_quant_observers_in_place", default=False)


def ranges_in_place() -> ContextManager[None]:
    """Observers update their stored ranges in place (copies) instead of assigning fresh tensors, in this block."""
    return context_value(_in_place, True)


@torch.no_grad()
def learned_step(log_step: torch.Tensor, bits: int) -> torch.Tensor:
    """A learned range's float32 step ``exp(log_step)`` (detached), no smaller than that of the narrowest range
    :func:`~pyg_quant.quantization.affine.collapse_narrow_range` keeps, so that ``1 / step`` stays finite in LSQ+'s
    gradients too."""
    return torch.exp(log_step.to(torch.float32)).clamp_min(MIN_RANGE_WIDTH / float(2**bits - 1))


class Observer(torch.nn.Module):
    r"""Base class: ``forward(x)`` records ``x``'s range (and returns ``x`` untouched).

    Args:
        dim (int, optional): the dimension the ranges are reduced over (see the module docstring).
    Class attribute ``dynamic``: no stored range, every tensor is quantized over a range of its own.
    """

    dynamic = False
    #: The range of every tensor is its own min/max (the fused fake-quantize kernel computes it itself).
    own_extrema = False
    #: The range is trained by the loss (:class:`LearnedObserver`), not observed.
    learned = False
    #: How a batch's range is reduced over the ranks of a multi-process job before it is recorded
    #: (:mod:`pyg_quant.distributed.ranges`): ``"extrema"`` or ``"mean"``.
    rank_reduction = "extrema"

    def __init__(self, dim: Optional[int] = None):
        super().__init__()
        self.dim = check_dim(dim)
        self.register_buffer("min_val", torch.empty(0))
        self.register_buffer("max_val", torch.empty(0))

    @property
    def initialized(self) -> bool:
        return self._buffers["min_val"].numel() > 0

    def batch_range(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return tensor_range(x, self.dim)

    def combine(self, lo: torch.Tensor, hi: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The new stored range from the stored one and a batch's, as new tensors (``lo`` and ``hi`` may be views of
        one tensor); subclasses define the rule."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_matrix(x)
        buffers = self._buffers  # (not self.min_val: this runs in every training step)
        with torch.no_grad():
            lo, hi = self.batch_range(x)
            stored = buffers["min_val"]
            initialized = stored.numel() > 0
            if initialized and lo.shape != stored.shape:
                raise ValueError(f"{type(self).__name__}(dim={self.dim}) keeps {stored.numel()} ranges but x "
                                 f"of shape {tuple(x.shape)} has {lo.numel()}; per-row ranges of varying rows "
                                 "need observer='dynamic'")
            if _ranks.syncing():  # several processes: every rank records the same range (distributed.ranges)
                if not initialized:
                    _ranks.check_same_count(lo.numel(), f"{type(self).__name__}(dim={self.dim})")
                lo, hi = _ranks.all_reduce_range_rows(lo, hi, self.rank_reduction).unbind(0)
                if not initialized:  # recorded as they are below: fresh tensors (combine makes new ones)
                    lo, hi = lo.clone(), hi.clone()
            if initialized:
                lo, hi = self.combine(lo.to(stored.device), hi.to(stored.device))
                if not is_compiling() and _in_place.get():  # (a traced region cannot read it)
                    # A captured step (pyg_quant.CapturedTrainStep) reads and writes these very tensors at every
                    # replay.
                    stored.copy_(lo)
                    buffers["max_val"].copy_(hi)
                    return x
        # Fresh tensors (reductions or the combination's arithmetic), never views of x: record keeps them as they are,
        # and a range handed out before (a BitTensor's lo) keeps its values.
        self.record(lo, hi)
        return x

    def fused_step(self, x: torch.Tensor) -> Optional[tuple]:
        """``(momentum, dim, grid, grid_bits)``, the arguments of :func:`pyg_quant.ops.ema_range` where that op is this
        observer's step on ``x`` (2-D) now (:meth:`EMAMinMaxObserver.step_range` takes it); None where
        :meth:`forward` records ``x`` (every observer but an eager :class:`EMAMinMaxObserver` / :class:`MSEObserver`
        with a range stored for ``x``'s shape)."""
        return None

    def record(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Store ``(lo, hi)``, the new range (fresh tensors), in the buffers' dict as ``Module.__setattr__`` would: they
        stay registered, with the shape of the first batch's range."""
        self._buffers["min_val"], self._buffers["max_val"] = lo, hi

    def range(self, x: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The stored ``(lo, hi)``; before any observation, ``x``'s own range (or a ValueError without ``x``)."""
        if self.initialized:
            return self.min_val, self.max_val
        if x is None:
            raise ValueError(f"{type(self).__name__} has observed nothing yet")
        return tensor_range(x, self.dim)

    def range_tensors(self) -> tuple:
        """The tensors that hold the stored range: a cache of codes is valid while they are the same objects with
        the same versions."""
        buffers = self._buffers
        return buffers["min_val"], buffers["max_val"]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The buffers' shapes are set by the data; take the saved shapes instead of rejecting them.
        for name in ("min_val", "max_val"):
            saved = state_dict.get(prefix + name)
            if isinstance(saved, torch.Tensor):
                setattr(self, name, torch.empty_like(saved, device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class DynamicObserver(Observer):
    """No state: every tensor is quantized over its own min/max (``pq.to_bit``'s ranges)."""

    dynamic = True
    own_extrema = True

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return check_matrix(x)

    def range(self, x: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if x is None:
            raise ValueError("a dynamic observer's range is that of the tensor being quantized; pass x")
        return tensor_range(x, self.dim)

    def masked_range(self, x: torch.Tensor, keep: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The range of ``x``'s entries where ``keep`` only (``FakeQuantize(keep_zeros=True)``)."""
        return masked_tensor_range(x, keep, self.dim)


class MinMaxObserver(Observer):
    """The running extremes of everything observed."""

    def combine(self, lo, hi):
        buffers = self._buffers
        return torch.minimum(buffers["min_val"], lo), torch.maximum(buffers["max_val"], hi)


def _check_momentum(momentum) -> float:
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 < momentum <= 1.0:
        raise ValueError(f"momentum must be a number in (0, 1], got {momentum!r}")
    return float(momentum)


class EMAMinMaxObserver(Observer):
    r"""Moving averages of the batch extremes: :math:`lo \leftarrow (1 − m)\,lo + m \min x`.

    Args:
        dim (int, optional): the reduction dimension.
        momentum (float): ``m`` in (0, 1]; 1 follows the last batch.
    """

    def __init__(self, dim: Optional[int] = None, momentum: float = 0.1):
        super().__init__(dim)
        self.momentum = _check_momentum(momentum)

    def fused_step(self, x: torch.Tensor) -> Optional[tuple]:
        grid = _EMA_GRIDS.get(type(self))  # (a subclass with a batch range of its own is not the op's)
        if grid is None or is_compiling() or _in_place.get() or not no_hooks(self):
            return None
        stored = self._buffers["min_val"]
        dim = self.dim
        if (stored.numel() != (1 if dim is None else x.size(1 - dim)) or stored.dtype != torch.float32
                or stored.device != x.device):
            return None  # (not observed yet, or forward's error for a new shape)
        return self.momentum, -1 if dim is None else dim, grid, self.bits if grid else 0

    def step_range(self, x: torch.Tensor, step: tuple) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lo, hi, used_hi)`` of :func:`pyg_quant.ops.ema_range` for :meth:`fused_step`'s ``step``: the stored range
        moved toward ``x``'s batch range (reduced over the ranks first where they sync, see
        :mod:`pyg_quant.distributed.ranges`), and the hi that fake quantization uses."""
        if not _ranks.syncing():
            return ops.ema_range(x, *self.range_tensors(), *step)
        # Several processes: the batch range reduced over the ranks (one all-reduce), then the op's step over the
        # min/max of those two rows, which are that range itself: the foreach steps of forward's path, fewer ops.
        momentum, dim = step[:2]
        rows = _ranks.all_reduce_range_rows(*self.batch_range(x.detach()), self.rank_reduction)
        batch = rows.t() if dim == 1 else rows if dim == 0 else rows.view(2, 1)
        return ops.ema_range(batch, *self.range_tensors(), momentum, dim, [], 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_matrix(x)
        step = self.fused_step(x)
        if step is None:
            return super().forward(x)
        self.record(*self.step_range(x, step)[:2])
        return x

    def combine(self, lo, hi):
        buffers = self._buffers
        stored = [buffers["min_val"], buffers["max_val"]]
        # stored + m·(batch − stored) for both ends at once: three launches instead of six, the same float32 steps.
        steps = torch._foreach_mul(torch._foreach_sub([lo, hi], stored), self.momentum)
        new_lo, new_hi = torch._foreach_add(stored, steps)
        return new_lo, new_hi

    def extra_repr(self) -> str:
        return f"dim={self.dim}, momentum={self.momentum}"


class PercentileObserver(EMAMinMaxObserver):
    r"""Moving averages of the batch's ``1 − q`` and ``q`` quantiles (Degree-Quant's robust ranges).

    Args:
        dim (int, optional): the reduction dimension.
        percentile (float): ``q`` in (0.5, 1]; ``1`` is the EMA min/max.
        momentum (float): as in :class:`EMAMinMaxObserver`.
    """

    def __init__(self, dim: Optional[int] = None, percentile: float = 0.999, momentum: float = 0.1):
        super().__init__(dim, momentum)
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0.5 < percentile <= 1.0:
            raise ValueError(f"percentile must be a number in (0.5, 1], got {percentile!r}")
        self.percentile = float(percentile)

    rank_reduction = "mean"  # a quantile of the union of the ranks' batches is not a function of theirs

    def batch_range(self, x):
        return tensor_quantiles(x, self.dim, self.percentile)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, percentile={self.percentile}, momentum={self.momentum}"


class MSEObserver(EMAMinMaxObserver):
    r"""Moving averages of the batch's MSE-optimal clipping range for ``bits``-bit codes
    (:func:`~pyg_quant.quantization.ranges.mse_ranges`).

    Args:
        dim (int, optional): the reduction dimension.
        bits (int): the width of the codes the range is for (set by :class:`FakeQuantize`).
        momentum (float): as in :class:`EMAMinMaxObserver`.
    """

    def __init__(self, dim: Optional[int] = None, bits: int = 8, momentum: float = 0.1):
        super().__init__(dim, momentum)
        self.bits = check_bits(bits)

    rank_reduction = "mean"  # nor is an MSE-optimal range

    def batch_range(self, x):
        return mse_ranges(x, self.dim, self.bits)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, bits={self.bits}, momentum={self.momentum}"


#: The observers whose step is :func:`pyg_quant.ops.ema_range`'s, and its batch range: ``[]`` the min/max, else
#: the MSE search's grid.
_EMA_GRIDS = {EMAMinMaxObserver: [], MSEObserver: [float(a) for a in MSE_GRID]}


class DynamicMSEObserver(DynamicObserver):
    r"""No state: every tensor is quantized over its own MSE-optimal clipping range for ``bits``
    (:func:`~pyg_quant.quantization.ranges.mse_ranges`).

    Values outside the range are clipped but, as with every dynamic range, keep their
    straight-through gradient (:class:`~pyg_quant.qat.FakeQuantize`).  Costs ``len(MSE_GRID)``
    fake quantizations of the tensor per call.

    Args:
        dim (int, optional): the reduction dimension.
        bits (int): the width of the codes the range is for (set by :class:`FakeQuantize`).
    """

    own_extrema = False

    def __init__(self, dim: Optional[int] = None, bits: int = 8):
        super().__init__(dim)
        self.bits = check_bits(bits)

    def range(self, x: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if x is None:
            raise ValueError("a dynamic observer's range is that of the tensor being quantized; pass x")
        return mse_ranges(x, self.dim, self.bits)

    def masked_range(self, x: torch.Tensor, keep: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return masked_mse_ranges(x, keep, self.dim, self.bits)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, bits={self.bits}"


class LearnedObserver(Observer):
    r"""A range trained by the loss (LSQ+): learnable ``range_lo`` and ``log_step``, one of each per range.

    With ``L = 2^bits − 1`` levels, the range is ``[lo, lo + L·s]``, ``s = exp(log_step)``
    (a log step: Adam's steps on it are relative, and ``s`` stays positive).  The first
    tensor seen in training sets both to its MSE-optimal range
    (:func:`~pyg_quant.quantization.ranges.mse_ranges`); from then on the optimizer moves them with the model's weights (the gradients are
    :class:`~pyg_quant.qat.FakeQuantize`'s: with ``v = (x − lo)/s`` and ``q`` its code,
    ``∂x̃/∂s = q − v`` inside the range and ``q`` outside, ``∂x̃/∂lo = 0`` inside and 1
    outside, ``∂x̃/∂x = 1`` inside and 0 outside).  The parameters must exist when the
    optimizer is built, so their number (``groups``) is fixed at construction: the output
    channels of a weight ``[out, in]`` per row, 1 per tensor.  Frozen (no longer
    initialised or trained) when the quantizer stops observing, as by
    :func:`~pyg_quant.qat.convert`; until it has seen a tensor, each tensor is quantized
    over its own MSE-optimal range.

    Args:
        dim (int, optional): the reduction dimension (``1`` per row, ``None`` per tensor).
        groups (int): the number of ranges (rows for ``dim=1``, 1 for ``dim=None``).
        bits (int): the width of the codes.
    """

    learned = True

    def __init__(self, dim: Optional[int] = None, groups: int = 1, bits: int = 8):
        torch.nn.Module.__init__(self)
        self.dim = check_dim(dim)
        if self.dim == 0:
            raise ValueError("a learned range is per row (dim=1) or per tensor (dim=None)")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be a positive int, got {groups!r}")
        if self.dim is None and groups != 1:
            raise ValueError(f"a per-tensor learned range has groups=1, got {groups}")
        self.bits = check_bits(bits)
        self.range_lo = torch.nn.Parameter(torch.zeros(groups))
        self.log_step = torch.nn.Parameter(torch.zeros(groups))
        self.register_buffer("observed", torch.zeros(1, dtype=torch.uint8))
        self._observed = False  # mirror of the buffer (reading a CUDA buffer would sync)

    @property
    def initialized(self) -> bool:
        return self._observed

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Initialise the range from ``x`` (its MSE-optimal range) if nothing was seen yet."""
        check_matrix(x)
        if not self._observed:
            lo, hi = mse_ranges(x, self.dim, self.bits)
            if lo.numel() != self.range_lo.numel():
                raise ValueError(f"LearnedObserver(dim={self.dim}) has {self.range_lo.numel()} ranges but x of "
                                 f"shape {tuple(x.shape)} has {lo.numel()}")
            step = (hi - lo) / float(2**self.bits - 1)
            tiny = torch.finfo(torch.float32).tiny
            self.range_lo.copy_(lo)
            self.log_step.copy_(torch.log(step.clamp_min(tiny)))
            self.observed.fill_(1)
            self._observed = True
        return x

    def range(self, x: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` of the learned range (float32, detached), or ``x``'s MSE-optimal range before any training."""
        if not self._observed:
            if x is None:
                raise ValueError("LearnedObserver has observed nothing yet")
            return mse_ranges(x, self.dim, self.bits)
        lo = self.range_lo.detach().to(torch.float32)  # a tensor of its own, not the Parameter
        return lo, lo + learned_step(self.log_step, self.bits) * float(2**self.bits - 1)

    def range_tensors(self) -> tuple:
        params = self._parameters
        return params["range_lo"], params["log_step"]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        torch.nn.Module._load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                              unexpected_keys, error_msgs)
        self._observed = bool(self.observed.item())

    def extra_repr(self) -> str:
        return f"dim={self.dim}, groups={self.range_lo.numel()}, bits={self.bits}"


def make_observer(kind: str, dim: Optional[int] = None, momentum: float = 0.1,
                  percentile: float = 0.999, bits: int = 8, groups: Optional[int] = None) -> Observer:
    """An observer by name (one of :data:`OBSERVERS`); ``bits`` is used by ``"mse"``, ``"dynamic_mse"`` and
    ``"learned"``, ``groups`` (the number of ranges) by ``"learned"`` (which requires it for ``dim=1``)."""
    if kind == "dynamic":
        return DynamicObserver(dim)
    if kind == "minmax":
        return MinMaxObserver(dim)
    if kind == "ema":
        return EMAMinMaxObserver(dim, momentum)
    if kind == "percentile":
        return PercentileObserver(dim, percentile, momentum)
    if kind == "mse":
        return MSEObserver(dim, bits, momentum)
    if kind == "dynamic_mse":
        return DynamicMSEObserver(dim, bits)
    if kind == "learned":
        if groups is None:
            if dim is not None:
                raise ValueError('observer "learned" per row needs groups (the number of rows)')
            groups = 1
        return LearnedObserver(dim, groups, bits)
    raise ValueError(f"observer must be one of {OBSERVERS}, got {kind!r}")
