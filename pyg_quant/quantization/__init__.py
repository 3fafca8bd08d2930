r"""Quantization that :mod:`pyg_quant.nn`, :mod:`pyg_quant.qat`, :mod:`pyg_quant.loader` and
:mod:`pyg_quant.captured_step` share: the primitives (functions on tensors and :class:`~pyg_quant.BitTensor` s) and
the quantizers built on them (range observers, :class:`FakeQuantize`).

Every quantizer here follows :func:`pyg_quant.to_bit`'s float32 steps, so that for one input and one rounding they
all make the codes the kernels make.  Modules, each with one job, listed from the bottom up (each imports only those
above it in this list, the ranks of :mod:`pyg_quant.distributed.group` / :mod:`~pyg_quant.distributed.ranges`, and
none of :mod:`pyg_quant.nn`, :mod:`pyg_quant.qat`, :mod:`pyg_quant.loader` or :mod:`pyg_quant.graph`, which build on
it; ``tests/test_quantization_package.py`` checks this):

* :mod:`.bits`: the bit-width arguments, ``None`` (float) or 1..8, and ``bits`` as shorthand for
  ``weight_bits = act_bits`` (``UNSET``, :func:`~.bits.resolve_bits`);
* :mod:`.affine`: what a range ``[lo, hi]`` gives for ``bits``-bit codes: its scale and inverse scale;
* :mod:`.ranges`: where a range comes from, per tensor, column or row: min/max (all entries or some),
  quantiles, MSE-optimal clipping;
* :mod:`.quantize`: quantize a tensor over its own ranges into a BitTensor, fake-quantize it (values with a
  straight-through gradient), dequantize;
* :mod:`.fixed`: the same with ranges fixed in advance (calibrated: :func:`pyg_quant.nn.calibrate`);
* :mod:`.observers`: where a quantizer's range comes from, as state: dynamic (each tensor's own), min/max, EMA,
  percentile, MSE-optimal, learned (LSQ+); a static observer's batch ranges reduced over the ranks of a
  multi-process job;
* :mod:`.fake_quantize`: :class:`~.fake_quantize.FakeQuantize`, an observer and a bit width as one module (fake
  quantization in training, seeded stochastic rounding, the codes for the kernels once frozen).

One mechanism serves every layer: the layers' training quantizers run the ops a dynamic ``FakeQuantize`` runs
(:func:`.quantize.fake_quantize`, :func:`pyg_quant.ops.qat_linear`), :func:`pyg_quant.nn.calibrate` records with
a ``"minmax"`` observer and freezes its range into the layer's ``static_range``, and :mod:`pyg_quant.qat` configures
``FakeQuantize`` modules for each tensor (:class:`~pyg_quant.qat.QConfig`).
"""
