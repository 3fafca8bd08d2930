r"""The quantization primitives that :mod:`pyg_quant.nn`, :mod:`pyg_quant.qat`, :mod:`pyg_quant.loader` and
:mod:`pyg_quant.captured_step` share: functions on tensors and :class:`~pyg_quant.BitTensor` s, no modules and no
state.

Every quantizer here follows :func:`pyg_quant.to_bit`'s float32 steps, so that for one input and one rounding they
all make the codes the kernels make.  Modules, each with one job, listed from the bottom up (each imports only those
above it in this list, and none of :mod:`pyg_quant.nn`, :mod:`pyg_quant.qat`, :mod:`pyg_quant.loader` or
:mod:`pyg_quant.graph`, which build on it; ``tests/test_quantization_package.py`` checks this):

* :mod:`.bits`: the bit-width arguments, ``None`` (float) or 1..8, and ``bits`` as shorthand for
  ``weight_bits = act_bits`` (``UNSET``, :func:`~.bits.resolve_bits`);
* :mod:`.affine`: what a range ``[lo, hi]`` gives for ``bits``-bit codes: its scale and inverse scale;
* :mod:`.ranges`: where a range comes from, per tensor, column or row: min/max (all entries or some),
  quantiles, MSE-optimal clipping;
* :mod:`.quantize`: quantize a tensor over its own ranges into a BitTensor, fake-quantize it (values with a
  straight-through gradient), dequantize;
* :mod:`.fixed`: the same with ranges fixed in advance (calibrated: :func:`pyg_quant.nn.calibrate`).

The stateful pieces built on these are elsewhere: the range observers and ``FakeQuantize`` in :mod:`pyg_quant.qat`,
the layers' calibration state in :mod:`pyg_quant.nn.calibration`.
"""
