r"""FakeQuantize: quantize-dequantize in float with a straight-through gradient, plus the bit-plane twin.

For a range ``[lo, hi]`` (from an observer, see :mod:`.observers`) and ``b`` bits:

.. math::
    s = \frac{hi - lo}{2^b - 1}, \qquad
    q = \mathrm{clamp}\big(\lfloor (x - lo)\cdot s^{-1} + u \rfloor,\ 0,\ 2^b - 1\big), \qquad
    \tilde{x} = lo + s\,q,

in float32 step by step exactly as :func:`pyg_quant.to_bit` (tensor-by-tensor
division for ``s``, ``s^{-1} = 0`` where ``s = 0``), so the codes of the fake
path and of the bit kernels agree bit for bit.  ``u = 1/2`` rounds to nearest
(evaluation); ``u ~ U[0, 1)`` is stochastic rounding (training, when
``stochastic``): with ``v = (x − lo)/s`` inside ``[0, 2^b − 1]``,
``P(q = ⌊v⌋ + 1) = v − ⌊v⌋``, hence ``E[q] = v`` and ``E[x̃] = x`` (unbiased;
``Var[x̃] = s²·f(1 − f)`` with ``f = v − ⌊v⌋``).

Gradient (straight-through estimator, zeroed where the value was clipped):

.. math::
    \frac{\partial \tilde{x}}{\partial x} = \mathbb{1}[lo \le x \le hi].

A ``"learned"`` range (:class:`~pyg_quant.quantization.observers.LearnedObserver`, LSQ+) also gets
gradients: with ``v = (x − lo)/s`` and ``q`` the code,

.. math::
    \frac{\partial \tilde{x}}{\partial s} = \begin{cases} q - v & 0 \le v \le 2^b - 1 \\ q & \text{else}
    \end{cases}, \qquad
    \frac{\partial \tilde{x}}{\partial lo} = \mathbb{1}[v < 0 \lor v > 2^b - 1],

and is always rounded to nearest, in training too: the step's gradient is the rounding
residual ``q − v``, which stochastic rounding makes zero in expectation (it would learn
from the clipped values alone), and a weight so rounded is in training the very weight
inference uses.

``keep_zeros`` (training only): the exact zeros of ``x`` stay zero and are left out of
the ranges, i.e. ``x̃ = Dropout(Q(x))`` rather than ``Q(Dropout(x))`` for a dropout
before the quantizer, whose zeros inference never sees.

The noise ``u`` comes from the module's own ``torch.Generator`` seeded with
``seed`` (one per device, so the same seed gives the same codes), or from torch's global
generator when ``seed`` is None (then ``torch.manual_seed`` fixes it): on the CPU it is
``torch.rand``'s, on CUDA the fused kernels draw it themselves from the generator's
Philox state (one launch fewer; a CUDA graph replay draws afresh).  In a job of
several processes (``torch.distributed`` initialized) rank ``r``'s generator is seeded
with :func:`pyg_quant.distributed.rank_seed` ``(seed, r)``: ``seed`` itself on rank 0,
a seed of its own on every other rank, so the ranks draw different noise, reproducibly
for a given seed and world size (:func:`pyg_quant.distributed.seed_everything` does the
same for torch's global generator).
"""
import weakref
from typing import Dict, Optional, Tuple, Union

import torch

from .. import ops
from .._utils import is_compiling
from ..bit_tensor import BitTensor
from ..distributed import group as _group, ranges as _ranks
from ..layout import check_bits
from .affine import RANGE_VIEW, affine_params, affine_scale, collapse_narrow_range
from .quantize import check_matrix, exact_values
from .observers import OBSERVERS, DynamicObserver, Observer, check_dim, learned_step, make_observer

#: The buffers that hold a copy of the range in use, written when read (see ``FakeQuantize._store_range``).
RANGE_BUFFERS = ("lo", "scale")


def check_seed(seed) -> Optional[int]:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be None or a non-negative int, got {seed!r}")
    return seed


class _LearnedFakeQuantizeFunction(torch.autograd.Function):
    """Forward: ``pyg_quant::fake_quantize`` over ``[lo, lo + L·exp(log_step)]``, rounded to nearest.  Backward: the
    straight-through gradient to ``x`` (zero outside the range) and LSQ+'s gradients to ``lo`` and ``log_step``
    (see the module docstring), summed over each range's values."""

    @staticmethod
    def forward(ctx, x, lo, log_step, bits, dim):
        levels = float(2**bits - 1)
        step = learned_step(log_step, bits)
        lo32 = lo.to(torch.float32)  # grad mode is off in forward: no detach needed
        hi = lo32 + step * levels
        out, inside = ops.fake_quantize(x, lo32, hi, bits, -1 if dim is None else dim, None, True, False, None)
        ctx.save_for_backward(x, lo32, step, out, inside)
        ctx.levels, ctx.dim = levels, dim
        return out

    @staticmethod
    def backward(ctx, grad):
        x, lo, step, out, inside = ctx.saved_tensors
        view = RANGE_VIEW[ctx.dim]
        lo_v, step_v = lo.view(view), step.view(view)
        v = (x - lo_v) / step_v
        q = torch.round((out - lo_v) / step_v).clamp_(0, ctx.levels)
        reduce = (0, 1) if ctx.dim is None else ctx.dim
        grad_x = grad * inside
        grad_lo = grad.masked_fill(inside, 0.0).sum(reduce)
        grad_step = (grad * torch.where(inside, q - v, q)).sum(reduce)
        if ctx.dim is None:  # a per-tensor sum is 0-d, the range (1,); a per-row sum has the range's shape already
            grad_lo, grad_step = grad_lo.view(lo.shape), grad_step.view(step.shape)
        return grad_x, grad_lo, grad_step * step, None, None


class FakeQuantize(torch.nn.Module):
    r"""Fake quantization of 2-D tensors in the FakeQuantize style (observer, switches, buffers).

    * ``forward(x)`` in ``train()``: the observer records ``x`` (if
      ``observer_enabled``), then ``x̃`` with stochastic rounding (if
      ``stochastic``) and the clipped straight-through gradient;
    * ``forward(x)`` in ``eval()``: ``x̃`` with round-to-nearest from the frozen
      range (the observer never moves in ``eval()``);
    * :meth:`quantize`: the same nearest-rounded codes as a :class:`BitTensor`
      for the bit kernels (``to_val(fq.quantize(x)) == fq.eval()(x)`` exactly).

    Buffers: ``lo``, ``scale`` (the range in use, ``(1,)`` / ``(cols,)`` /
    ``(rows,)``; empty for a dynamic observer, whose range is every input's
    own), ``observer_enabled`` and ``fake_quant_enabled`` (uint8 switches, as
    in ``torch.ao.quantization.FakeQuantize``).  Until a static observer has
    seen data, inputs are quantized over their own range.  ``lo`` and ``scale``
    are a copy of the observer's range that nothing in the forward reads: they
    are written when read (as ``fq.lo`` / ``fq.scale``, by ``state_dict()``,
    or when the range is frozen), not at every training step.

    Args:
        bits (int): 1..8.
        observer (str or Observer): ``"dynamic"``, ``"minmax"``, ``"ema"``,
            ``"percentile"``, ``"mse"``, ``"dynamic_mse"`` (see :mod:`.observers`; the
            ``"mse"`` kinds are given ``bits``) or an observer instance (whose ``dim`` is then used).
        dim (int, optional): the reduction dimension of the ranges: ``None``
            per tensor, ``0`` per column, ``1`` per row.
        stochastic (bool): stochastic rounding in training (evaluation always rounds to nearest).
        seed (int, optional): seed of the module's generator; None uses torch's global one.
        momentum, percentile (float): observer settings (``"ema"``, ``"percentile"``, ``"mse"``).
        groups (int, optional): the number of ranges of a ``"learned"`` observer per row (the rows of the
            weight it quantizes).
        keep_zeros (bool): in training, exact zeros stay zero and are left out of the ranges (see the
            module docstring); dynamic observers only.

    Shapes:
        - **input:** ``[rows, cols]`` floating point (returned as float32)
        - **protect** (optional): bool ``[rows]``, rows passed through unquantized
          (Degree-Quant's protective mask; training only)
    """

    def __init__(self, bits: int, observer: Union[str, Observer] = "dynamic", dim: Optional[int] = None,
                 stochastic: bool = True, seed: Optional[int] = None, momentum: float = 0.1,
                 percentile: float = 0.999, groups: Optional[int] = None, keep_zeros: bool = False):
        super().__init__()
        self.bits = check_bits(bits)
        if isinstance(observer, Observer):
            if dim is not None and observer.dim != dim:
                raise ValueError(f"dim={dim} disagrees with the observer's dim={observer.dim}")
            dim = observer.dim
        elif isinstance(observer, str):
            observer = make_observer(observer, check_dim(dim), momentum, percentile, self.bits, groups)
        else:
            raise TypeError(f"observer must be one of {OBSERVERS} or an Observer, got {type(observer).__name__}")
        if not isinstance(stochastic, bool):
            raise TypeError(f"stochastic must be a bool, got {type(stochastic).__name__}")
        if not isinstance(keep_zeros, bool):
            raise TypeError(f"keep_zeros must be a bool, got {type(keep_zeros).__name__}")
        if keep_zeros and not observer.dynamic:
            raise ValueError("keep_zeros needs a dynamic observer (\"dynamic\" or \"dynamic_mse\"), got "
                             f"{type(observer).__name__}")
        self.keep_zeros = keep_zeros
        self.observer = observer
        self.dim = observer.dim
        self.stochastic = stochastic
        self.seed = check_seed(seed)
        # Python mirrors of the two switches: reading a CUDA buffer in forward would sync the device.
        self._observe, self._fake = True, True
        self._range_moved = False  # the observer moved since lo / scale were written (see _store_range)
        self.register_buffer("lo", torch.empty(0))
        self.register_buffer("scale", torch.empty(0))
        self.register_buffer("observer_enabled", torch.ones(1, dtype=torch.uint8))
        self.register_buffer("fake_quant_enabled", torch.ones(1, dtype=torch.uint8))
        self._generators: Dict[str, torch.Generator] = {}
        self._codes = None  # the last quantize() result and what it depends on (see quantize)

    # --- switches ----------------------------------------------------------------------
    def enable_observer(self, enabled: bool = True) -> "FakeQuantize":
        """Let the range move (observe, or for a ``"learned"`` range: initialise and train), or freeze it."""
        self.observer_enabled.fill_(int(enabled))
        self._observe = bool(enabled)
        if self._range_buffers_stale():
            self._store_range()  # the frozen range, in the buffers
        return self

    def disable_observer(self) -> "FakeQuantize":
        return self.enable_observer(False)

    def enable_fake_quant(self, enabled: bool = True) -> "FakeQuantize":
        self.fake_quant_enabled.fill_(int(enabled))
        self._fake = bool(enabled)
        return self

    def disable_fake_quant(self) -> "FakeQuantize":
        return self.enable_fake_quant(False)

    @property
    def quantizes(self) -> bool:
        """Whether fake quantization is on (``disable_fake_quant`` turns it off: inputs pass through, in training
        and in evaluation alike, and the layers use no bit kernel for this point)."""
        return self._fake

    @property
    def dynamic(self) -> bool:
        return self.observer.dynamic

    @property
    def frozen(self) -> bool:
        """Whether the range can no longer move (observer off, or dynamic by design)."""
        return not self._observe

    # --- noise -------------------------------------------------------------------------
    def reset_rng(self) -> None:
        """Restart the noise sequence from ``seed`` (drops the per-device generators)."""
        self._generators = {}

    def generator(self, device: torch.device) -> Optional[torch.Generator]:
        """The module's generator on ``device`` (seeded on first use with ``seed``, or with
        :func:`~pyg_quant.distributed.rank_seed` ``(seed, rank)`` on rank ``rank > 0`` of a multi-process job),
        or None for torch's global one."""
        if self.seed is None:
            return None
        rank = _group.world()[0]
        key = str(device) if rank == 0 else f"{device}@rank{rank}"
        generator = self._generators.get(key)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(_group.rank_seed(self.seed, rank))
            self._generators[key] = generator
        return generator

    def noise(self, shape, device: torch.device) -> torch.Tensor:
        """``U[0, 1)`` float32 noise of ``shape`` on ``device``, from the module's generator."""
        return torch.rand(shape, generator=self.generator(device), device=device, dtype=torch.float32)

    # Generators are not copied or pickled (older torch cannot); a copy restarts from `seed`.
    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_generators"] = {}
        state["_codes"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._generators = {}
        self._codes = None

    # --- ranges ------------------------------------------------------------------------
    def range(self, x: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` in use for ``x`` (float32, 1-D); ranges too narrow for a finite inverse scale are
        collapsed (:func:`~pyg_quant.quantization.affine.collapse_narrow_range`)."""
        return collapse_narrow_range(*self.observer.range(x))

    def qparams(self, x: Optional[torch.Tensor] = None):
        """``(lo, hi, scale, inv_scale)`` for ``x``, float32, shaped to broadcast against ``x``.

        A frozen stored range gives the same four tensors at every call (a converted model's): they are kept
        (:meth:`kept_while_frozen`).
        """
        def make():
            lo, hi = self.range(x)
            scale, inv_scale = affine_params(lo.to(torch.float32), hi.to(torch.float32), self.bits)
            view = RANGE_VIEW[self.dim]
            return lo.view(view), hi.view(view), scale.view(view), inv_scale.view(view)

        kept = self.kept_while_frozen("qparams", make)
        return make() if kept is None else kept

    def kept_while_frozen(self, key, make):
        """``make()`` (a function of the stored range alone), kept under ``key`` and made again only when the range's
        tensors change (other objects, or edited in place); None where the range may move (:meth:`_frozen_state`)."""
        state = self._frozen_state()
        if state is None:
            return None
        table = self.__dict__.setdefault("_kept_while_frozen", {})
        kept = table.get(key)
        if kept is not None and kept[0][1:] == state[1:] and all(a is b for a, b in zip(kept[0][0], state[0])):
            return kept[1]
        value = make()
        table[key] = (state, value)
        return value

    def _frozen_state(self) -> Optional[tuple]:
        """``(range tensors, their versions and storage, bits, dim)`` of a stored range that cannot move now, which
        :meth:`qparams` depends on alone; None where it may move or its parameters must not be kept (observing,
        dynamic or not yet observed, a range that takes a gradient, inference tensors, which keep no version
        counter, tracing, a CUDA graph capture, where what is made lives in the capture's pool)."""
        observer = self._modules["observer"]  # (not self.observer: this runs at every layer call)
        if self._observe or observer.dynamic or not observer.initialized or is_compiling():
            return None
        tensors = tuple(observer.range_tensors())
        marks = []
        for t in tensors:
            if t.requires_grad or t.is_inference() or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
                return None
            marks.append((t._version, t.data_ptr()))
        return tensors, tuple(marks), self.bits, self.dim

    def _range_buffers_stale(self) -> bool:
        """Whether ``lo`` / ``scale`` may differ from the range in use: the observer moved since they were written,
        or it is a learned range that is still trained (the optimizer moves it in place, unseen here)."""
        if self.dynamic or not self.observer.initialized:
            return False
        # (.get: a module pickled before this flag existed)
        return self.__dict__.get("_range_moved", False) or (self.observer.learned and self._observe)

    def _store_range(self) -> None:
        """Write the range in use into the ``lo`` / ``scale`` buffers.

        Nothing in the forward reads them (the observer's own tensors are the range), so a training step does not
        write them (7 ops a step); they are written where they can be seen: when read as attributes
        (:meth:`__getattr__`), by ``state_dict()`` and when the range is frozen.
        """
        self._range_moved = False
        # Ordinary tensors even when read under inference mode (convert may run there): a buffer that is an
        # inference tensor keeps no version counter.
        with torch.inference_mode(False), torch.no_grad():
            lo, hi = self.range()
            # Into _buffers directly: assigning the attribute would check hasattr(self, "lo"), i.e. __getattr__.
            self._buffers["lo"] = lo.clone()
            self._buffers["scale"] = affine_scale(lo, hi, self.bits)

    def __getattr__(self, name: str):
        # nn.Module keeps buffers outside __dict__, so every read of fq.lo / fq.scale comes here.
        if name in RANGE_BUFFERS and self._range_buffers_stale():
            self._store_range()
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self._range_buffers_stale():
            self._store_range()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    # --- forward -----------------------------------------------------------------------
    def observe(self, x: torch.Tensor) -> None:
        """What :meth:`forward` records of ``x`` before it quantizes: in training, a static observer that is on
        takes ``x`` into its range; nothing else is computed (for inputs used as they are, see
        :func:`pyg_quant.qat.linear.observe_only`)."""
        check_matrix(x)
        # Modules, flags and buffers are read from the dicts: this runs a few times a layer in every training step.
        state, observer = self.__dict__, self._modules["observer"]
        if state["training"] and state["_observe"] and not observer.dynamic:  # (a dynamic observer keeps nothing)
            observer(x)
            self._recorded()

    def _recorded(self) -> None:
        """Bookkeeping after the observer recorded a batch: ``lo`` / ``scale`` are stale until read."""
        self.__dict__["_range_moved"] = True
        if self._buffers["lo"].numel() == 0 and _group.world_size() > 1:
            # lo / scale are written when read (a state_dict() on rank 0 alone, say): take their shape now, on
            # every rank at once, so that DDP's buffer broadcast never meets buffers of different sizes.
            self._store_range()

    def forward(self, x: torch.Tensor, protect: Optional[torch.Tensor] = None) -> torch.Tensor:
        state, observer = self.__dict__, self._modules["observer"]
        training, observing = state["training"], state["_observe"]
        step = None
        if training and observing and state["_fake"] and not state["keep_zeros"]:
            step = observer.fused_step(check_matrix(x))
        if step is None or step[1] != (-1 if state["dim"] is None else state["dim"]):
            self.observe(x)
            step = None
        if not state["_fake"]:
            return x
        if protect is not None and training and (protect.dtype != torch.bool or protect.shape != (x.size(0),)):
            raise ValueError(f"protect must be a bool tensor of shape ({x.size(0)},), got "
                             f"{protect.dtype}{list(protect.shape)}")
        x32 = x.to(torch.float32)
        if step is not None:
            # The observer's step, the collapse of narrow ranges and the fake quantization in one op (two where the
            # ranks sync their ranges): what the general path below computes for a static EMA / MSE range, op by op.
            random_noise = state["stochastic"]
            generator = self.generator(x32.device) if random_noise else None
            if _ranks.syncing():
                lo, hi, used_hi = observer.step_range(x32, step)
                out = ops.fake_quantize(x32, lo, used_hi, state["bits"], step[1], None, x32.requires_grad,
                                        random_noise, generator)[0]
            else:
                out, _, lo, hi = ops.ema_fake_quantize(x32, *observer.range_tensors(), *step, state["bits"],
                                                       x32.requires_grad, random_noise, generator)
            observer.record(lo, hi)
            self._recorded()
            return self._protected(out, x32, protect)
        learned = observer.learned
        if learned and training and observing:
            # The range is trained: nearest rounding, LSQ+ gradients to range_lo and log_step.
            out = _LearnedFakeQuantizeFunction.apply(x32, observer.range_lo, observer.log_step, self.bits, self.dim)
            return self._protected(out, x32, protect)
        keep = x32.detach() != 0 if state["keep_zeros"] and training else None
        if keep is not None:
            # The range of the non-zero entries (a dynamic range: every other value keeps its gradient).
            lo, hi = collapse_narrow_range(*observer.masked_range(x32, keep))
        else:
            # Static ranges may clip, and clipped values get no gradient.  A dynamic range moves with its tensor:
            # every value keeps its straight-through gradient (a "dynamic_mse" range clips, but zeroing those
            # gradients cost ~1 pt on the planted Cluster-GCN graph at 2 bits).  The observers detach x themselves.
            lo, hi = (None, None) if observer.own_extrema else self.range(x32)
        # A learned range rounds to nearest, frozen too: its weights are then the very weights inference uses.
        random_noise = state["stochastic"] and training and not learned
        generator = self.generator(x32.device) if random_noise else None
        dim = state["dim"]
        # One fused op (the noise, to_bit's float32 steps, the dequantization, the clipping mask) and one autograd
        # node, whose gradient is the clipping mask's where a static range clips.
        out = ops.fake_quantize(x32, lo, hi, self.bits, -1 if dim is None else dim, None,
                                x32.requires_grad and not observer.dynamic, random_noise, generator)[0]
        if keep is not None:
            out = torch.where(keep, out, torch.zeros_like(out))  # the zeros stay exact zeros
        return self._protected(out, x32, protect)

    def own_range(self, dim: Optional[int]) -> bool:
        """Whether each tensor is quantized over its own min/max reduced over ``dim`` (a plain ``"dynamic"``
        observer)."""
        return type(self._modules["observer"]) is DynamicObserver and self.__dict__["dim"] == dim

    def own_rows_training(self, device: torch.device) -> Optional[tuple]:
        """``(bits, random_noise, generator)`` of :meth:`forward` in training where it fake-quantizes each row over
        the row's own min/max (:meth:`own_range` per row, fake quantization on, no zeros kept), the arguments of the
        ops that compose it (``pyg_quant::qat_linear``); else None."""
        state = self.__dict__
        if not state["_fake"] or state["keep_zeros"] or not self.own_range(1):
            return None
        random_noise = state["stochastic"]
        return state["bits"], random_noise, self.generator(device) if random_noise else None

    def forward_exact(self, x: torch.Tensor, protect: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor,
                                                                                              torch.Tensor]:
        r"""``(forward(x), x̃)``: in ``eval()`` with fake quantization on, ``x̃`` holds forward's values before their
        float32 rounding, ``lo + scale·q`` in float64 for the codes of :meth:`quantize` (:func:`~pyg_quant.quantization.quantize.exact_values`),
        with forward's gradient; else ``x̃`` is ``forward(x)`` itself.

        The QAT layers' evaluation without the bit kernels multiplies and sums ``x̃`` in float64 and rounds once:
        the exact value of what the bit kernels compute from the same codes (their float32 epilogues stay within a
        few float32 roundings of its terms).
        """
        out = self(x, protect)
        if self.training or not self._fake:
            return out, out
        exact = exact_values(self.quantize(x))
        if out.requires_grad:
            exact = exact + (out - out.detach()).double()  # adds zeros: forward's straight-through gradient
        return out, exact

    def _protected(self, out: torch.Tensor, x32: torch.Tensor, protect: Optional[torch.Tensor]) -> torch.Tensor:
        """``out`` with the rows of ``protect`` (Degree-Quant's mask, training only) passed through as ``x32``."""
        if protect is None or not self.training:
            return out
        return torch.where(protect.view(-1, 1), x32, out)

    def quantize(self, x: torch.Tensor, layout: str = "row") -> BitTensor:
        """The round-to-nearest codes of ``x`` as a :class:`BitTensor` (the bit kernels' operand).

        ``to_val`` of it equals ``forward(x)`` in ``eval()`` bit for bit.  The last result is
        kept and returned again while the same tensor object comes back unchanged (same
        version counter) and the range has not moved, as a full-batch model's input does at
        every evaluation; the tensor itself is only weakly referenced.
        """
        check_matrix(x)
        # (Traced, nothing is kept: the codes are made in the graph.)
        key = None if is_compiling() else self._codes_key(x, layout)
        cached = self._codes
        if key is not None and cached is not None and cached[0]() is x and cached[1] == key \
                and all(a is b for a, b in zip(cached[2], self._range_tensors())):
            return cached[3]
        x32 = x.detach().to(torch.float32).contiguous()
        lo, _, scale, inv_scale = self.qparams(x32)
        planes = ops.quantize_pack(x32, lo.contiguous(), inv_scale.contiguous(), self.bits, layout == "col", None)
        codes = BitTensor(planes, (x32.size(0), x32.size(1)), self.bits, layout, lo.reshape(-1).contiguous(),
                          scale.reshape(-1).contiguous(), self.dim)
        # x weakly (a dead input is never matched), the range tensors strongly (so their ids stay theirs).
        self._codes = None if key is None else (weakref.ref(x), key, self._range_tensors(), codes)
        return codes

    def _range_tensors(self) -> tuple:
        return () if self.dynamic else self.observer.range_tensors()

    def _codes_key(self, x: torch.Tensor, layout: str):
        """What the codes of ``x`` depend on besides its identity and the range tensors', or None if unknown."""
        range_versions = ()
        try:
            version = x._version  # inference-mode tensors keep no version counter
            if not self.dynamic:
                obs = self.observer
                if not obs.initialized:
                    return None
                # The observer assigns fresh range tensors when it moves; in-place edits (an optimizer's step on a
                # learned range) bump their versions.
                range_versions = tuple(t._version for t in obs.range_tensors())
        except RuntimeError:  # the input or the observer's ranges are inference tensors: no caching
            return None
        return (version, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, layout, self.bits, range_versions)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name in ("lo", "scale"):  # shapes are set by the data
            saved = state_dict.get(prefix + name)
            if isinstance(saved, torch.Tensor):
                setattr(self, name, torch.empty_like(saved, device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._observe = bool(self.observer_enabled.item())
        self._fake = bool(self.fake_quant_enabled.item())

    def extra_repr(self) -> str:
        return (f"bits={self.bits}, dim={self.dim}, stochastic={self.stochastic}, seed={self.seed}, "
                f"observer_enabled={self._observe}, fake_quant_enabled={self._fake}"
                + (", keep_zeros=True" if self.keep_zeros else ""))
