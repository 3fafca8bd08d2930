r"""Static (calibrated) activation ranges for inference.

By default a layer quantizes the features it aggregates per channel with ranges
taken from those features at every call (*dynamic* ranges): on the GPU that is
a reduction over the tensor and a second pass that writes its codes.  As in
static post-training quantization, the ranges can instead be fixed in advance:

.. code-block:: python

    model.eval()
    with torch.no_grad(), pyg_quant.nn.calibrate(model):
        for batch in calibration_batches:       # a few representative batches
            model(batch.x, batch.edge_index)
    # from here on, in eval(), the layers quantize with the ranges seen above

Inside ``calibrate`` the layers run as before (dynamic ranges) and record each
channel's minimum and maximum over every call, with a per-channel ``"minmax"``
observer (:class:`~pyg_quant.quantization.observers.MinMaxObserver`, the one QAT
uses; each process records its own calls); on leaving it, each layer freezes
the observer's range as its ``static_range`` buffer (float32 ``[2, channels]``: minima, then
maxima; saved in the state dict).  Then, in ``eval()``, the layer quantizes
with them: the bit kernels' GPU path computes the codes as its fused MLP kernel
stores its output (:func:`pyg_quant.ops.quant_mlp_row_codes`), with no pass of its
own; values outside a range take the range's end codes.  Training
(``train()``) ignores them.  Ranges calibrated on a tensor quantize that tensor
exactly as its own dynamic ranges do (the same float32 steps).

Which tensor a layer calibrates: :class:`~pyg_quant.nn.QGINConv` the output it
requantizes per channel (``out_bits`` with ``out_dim=0``);
:class:`~pyg_quant.nn.QGCNConv` the features it aggregates,
:math:`\mathbf{D}^{-1/2}\mathbf{X}\mathbf{W}`, quantized per channel to
``act_bits``; their QAT versions (:func:`pyg_quant.qat.prepare`, also once
converted) what their ``agg_quant`` quantizes, whose ranges the calibrated ones
then replace (see :mod:`pyg_quant.qat.conv`).  Other layers and settings have
nothing to calibrate and are left as they are.
"""
import warnings
from contextlib import contextmanager
from typing import Iterator, List, Optional

import torch
from torch import Tensor

from ..distributed.ranges import local_ranges
from ..quantization.fixed import FixedRanges
from ..quantization.observers import MinMaxObserver

STATIC_RANGE = "static_range"


class StaticRange:
    """The calibration state of a layer (a mixin of the conv layers): its ``static_range`` buffer, the min/max
    observer while :func:`calibrate` records, and the :class:`FixedRanges` made from the buffer (cached)."""

    def _init_static_range(self) -> None:
        self.register_buffer(STATIC_RANGE, None)  # not in the state dict until calibrated
        self.__dict__["_calibration"] = None

    def _static_bits(self) -> Optional[int]:
        """The width of the per-channel codes this layer can quantize with fixed ranges (None: nothing to
        calibrate; the layers override it)."""
        return None

    def _observe(self, values: Tensor) -> None:
        """Record the per-channel extrema of ``values`` (2-D, channels last) while calibrating."""
        observer = self.__dict__.get("_calibration")
        if observer is None:
            return
        if values.dim() != 2:
            raise ValueError(f"{type(self).__name__}: calibration needs 2-D node features, got shape "
                             f"{tuple(values.shape)}")
        if values.numel() == 0:
            return
        if observer.initialized and observer.min_val.numel() != values.size(1):
            raise ValueError(f"{type(self).__name__}: calibration saw {observer.min_val.numel()} channels, then "
                             f"{values.size(1)}")
        with local_ranges():
            observer(values.detach().to(torch.float32))

    def _fixed_ranges(self) -> Optional[FixedRanges]:
        """The layer's calibrated ranges when they apply now (``eval()``, not calibrating), else None."""
        static = getattr(self, STATIC_RANGE)
        if static is None or self.training or self.__dict__.get("_calibration") is not None:
            return None
        bits = self._static_bits()
        if bits is None:
            return None
        if static.is_inference():  # no version counter: an in-place load could not be told from a cache hit
            return FixedRanges.from_extrema(static[0], static[1], bits)
        key = (static.data_ptr(), static._version, static.device, bits)
        cached = self.__dict__.get("_fixed_ranges_cache")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_fixed_ranges_cache"] = (key, FixedRanges.from_extrema(static[0], static[1], bits))
        return cached[1]

    def set_static_range(self, lo: Tensor, hi: Tensor) -> None:
        """Fix the per-channel ranges ``[lo, hi]`` (what :func:`calibrate` does with the extrema it saw)."""
        lo, hi = torch.as_tensor(lo).detach(), torch.as_tensor(hi).detach()
        if lo.dim() != 1 or lo.shape != hi.shape or lo.numel() == 0:
            raise ValueError(f"lo and hi must be 1-D with one entry per channel, got shapes {tuple(lo.shape)} and "
                             f"{tuple(hi.shape)}")
        channels = self._static_channels()
        if channels is not None and lo.numel() != channels:
            raise ValueError(f"lo and hi must have one entry per channel ({channels}), got {lo.numel()}")
        if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()) or bool((hi < lo).any()):
            raise ValueError("lo and hi must be finite with lo <= hi")
        device = next(iter(self.parameters()), lo).device  # the layer's device
        with torch.inference_mode(False):  # a normal tensor even when calibrated under inference_mode
            setattr(self, STATIC_RANGE, torch.stack((lo, hi)).to(device=device, dtype=torch.float32))

    def _static_channels(self) -> Optional[int]:
        """The number of channels the ranges must have, where the layer knows it before a call."""
        return None

    def clear_static_range(self) -> None:
        """Back to dynamic ranges."""
        setattr(self, STATIC_RANGE, None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A calibrated state loads into a layer not yet calibrated: make the buffer it fills.
        # A state saved before calibration (no such key) makes the layer dynamic again: it is what was saved.
        key = prefix + STATIC_RANGE
        if getattr(self, STATIC_RANGE) is None and isinstance(state_dict.get(key), Tensor):
            with torch.inference_mode(False):  # a normal tensor (its version counts later loads) under inference_mode
                setattr(self, STATIC_RANGE, torch.empty_like(state_dict[key], dtype=torch.float32))
        elif key not in state_dict:
            self.clear_static_range()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def calibratable_layers(module: torch.nn.Module) -> List[StaticRange]:
    """The layers of ``module`` (itself included) with per-channel codes to calibrate."""
    return [m for m in module.modules() if isinstance(m, StaticRange) and m._static_bits() is not None]


@contextmanager
def calibrate(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Record activation ranges over the forward calls made inside the block, and fix them on leaving it (see the
    module docstring).  The layers run with dynamic ranges meanwhile (any earlier calibration is dropped on entry);
    a layer that saw no call is left dynamic, with a warning.  On an exception inside the block, or NaN / inf values
    seen, nothing is fixed (a ValueError for the latter)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    layers = calibratable_layers(module)
    for layer in layers:
        layer.clear_static_range()
        layer.__dict__["_calibration"] = MinMaxObserver(dim=0)  # per channel
    try:
        yield module
    finally:
        observers = [layer.__dict__["_calibration"] for layer in layers]
        for layer in layers:
            layer.__dict__["_calibration"] = None
    seen = [observer.range() if observer.initialized else None for observer in observers]
    names = {id(m): n for n, m in module.named_modules()}
    for layer, extrema in zip(layers, seen):  # checked first: an error fixes nothing
        if extrema and not bool(torch.isfinite(extrema[0]).all() & torch.isfinite(extrema[1]).all()):
            raise ValueError(f"calibrate: layer {names[id(layer)] or type(layer).__name__!r} saw NaN or inf "
                             f"values; no range was fixed")
    for layer, extrema in zip(layers, seen):
        if extrema:
            layer.set_static_range(extrema[0], extrema[1])
        else:
            warnings.warn(f"calibrate: layer {names[id(layer)] or type(layer).__name__!r} ran no forward call inside "
                          f"the block; it keeps dynamic ranges", stacklevel=3)


def clear_calibration(module: torch.nn.Module) -> None:
    """Drop the calibrated ranges of every layer of ``module``: dynamic ranges again."""
    for layer in module.modules():
        if isinstance(layer, StaticRange):
            layer.clear_static_range()
