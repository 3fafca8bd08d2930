r"""pyg_quant.qat: observers, FakeQuantize (stochastic rounding, STE), QAT layers, prepare/convert, training.

Oracles:

* **Codes.** In evaluation a dynamic FakeQuantize must reproduce ``pq.to_val(pq.to_bit(x, bits, dim))``
  bit for bit (the same float32 steps), and ``to_val(fq.quantize(x))`` its own output.
* **Stochastic rounding.** With ``v = (x − lo)/s`` and ``f = v − ⌊v⌋``, one draw of ``x̃`` is
  ``lo + s⌊v⌋ + s·B`` with ``B ~ Bernoulli(f)``: mean ``x``, variance ``s²f(1 − f)``.  The mean of
  ``n`` independent draws is tested per element against ``Z·sqrt(s²f(1−f)/n)`` with ``Z = 6``
  (two-sided tail 2e-9 per element, under 1e-5 for the whole tensor; the draws are seeded, so a
  pass is reproducible), plus a float32 allowance; the variance is checked too, which rules
  out round-to-nearest (variance 0) passing by accident.
* **Round trip.** ``convert(model)`` under ``no_grad`` runs the bit kernels; the QAT model in
  ``eval()`` with autograd on runs the float fake-quant path.  Both use the same codes, and the
  float path multiplies and sums their unrounded values ``lo + s·q`` in float64 and rounds once,
  as the kernels' epilogues do, so every layer hands the next quantizer the same float32 values
  (summing to_val's float32 roundings instead gave a few ulps of difference, enough to move a value
  on a code boundary to the neighbouring code a layer later, depending on which vector kernels
  torch picked).  An aggregation of such values is exact in float64 on both sides, so it is
  compared bit for bit; a whole model is compared to ``|Δ| ≤ 1e-5·(|out| + max|out|·1e-2)``, the
  float32 rounding of products whose two float64 evaluations may straddle a rounding boundary,
  orders of magnitude below one quantization step.
"""
import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.nn import Linear, ReLU, Sequential
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv, GINConv

import pyg_quant as pq
from pyg_quant import qat
from pyg_quant.quantization.ranges import tensor_quantiles

from conftest import DEVICES, EPILOGUE_BOUND, assert_fp32_close, deq64, gen, mag64, skip_unless_compiled


def randn(rows, cols, seed, spread=1.0):
    return torch.randn(rows, cols, generator=gen(seed)) * spread


# --- observers --------------------------------------------------------------------------------
def test_minmax_observer_keeps_running_extremes():
    obs = qat.MinMaxObserver(dim=0)
    a, b = randn(10, 3, 0), randn(10, 3, 1) * 3
    obs(a)
    obs(b)
    assert torch.equal(obs.min_val, torch.minimum(a.amin(0), b.amin(0)))
    assert torch.equal(obs.max_val, torch.maximum(a.amax(0), b.amax(0)))


def test_ema_observer_formula():
    obs = qat.EMAMinMaxObserver(dim=None, momentum=0.25)
    a, b = randn(20, 4, 2), randn(20, 4, 3) + 2
    obs(a)
    assert torch.equal(obs.min_val, a.min().view(1))  # the first batch initialises
    obs(b)
    expected_lo = a.min() + 0.25 * (b.min() - a.min())
    expected_hi = a.max() + 0.25 * (b.max() - a.max())
    assert torch.allclose(obs.min_val, expected_lo.view(1), rtol=0, atol=1e-6)
    assert torch.allclose(obs.max_val, expected_hi.view(1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_percentile_observer_order_statistics(dim):
    x = randn(200, 7, 4)
    lo, hi = tensor_quantiles(x, dim, 0.95)
    flat = x.reshape(1, -1) if dim is None else (x.t() if dim == 0 else x)  # rows: the reduced vectors
    n = flat.size(1)
    k = math.ceil(0.95 * n)
    ordered = flat.sort(dim=1).values
    assert torch.equal(hi, ordered[:, k - 1])
    assert torch.equal(lo, ordered[:, n - k])
    # q = 1 is the min/max
    lo1, hi1 = tensor_quantiles(x, dim, 1.0)
    assert torch.equal(lo1, ordered[:, 0]) and torch.equal(hi1, ordered[:, -1])


def test_percentile_observer_clips_outliers():
    x = randn(1000, 1, 5)
    x[0, 0] = 1000.0  # one outlier
    obs = qat.PercentileObserver(dim=None, percentile=0.99, momentum=1.0)
    obs(x)
    assert obs.max_val.item() < 10


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_mse_ranges_minimise_the_quantization_error(bits):
    """Never worse than min/max (a = 1 is a candidate); for N(0, 1) data, the known optimal uniform ranges."""
    from pyg_quant.quantization.ranges import mse_ranges

    def error(x, lo, hi):
        fq = qat.FakeQuantize(bits, "minmax", dim=0, stochastic=False)
        fq.observer.min_val, fq.observer.max_val = lo.clone(), hi.clone()
        return float((fq.eval()(x) - x).square().sum())

    heavy = randn(4000, 4, bits) ** 3  # heavy tails: min/max wastes levels on a few values
    lo, hi = mse_ranges(heavy, 0, bits)
    assert error(heavy, lo, hi) <= error(heavy, heavy.amin(0), heavy.amax(0))
    if bits <= 4:
        assert error(heavy, lo, hi) < 0.7 * error(heavy, heavy.amin(0), heavy.amax(0))
    gauss = randn(40000, 2, 10 + bits)
    lo, hi = mse_ranges(gauss, 0, bits)
    # Lloyd-Max-like optimal uniform half-ranges for N(0, 1): 1 bit ±0.80, 2 bits ±1.49, 4 bits ±2.51;
    # the grid steps by 20%, so allow that much.
    expected = {1: 0.80, 2: 1.49, 4: 2.51}
    if bits in expected:
        half = (hi - lo) / 2
        assert ((half / expected[bits] - 1).abs() < 0.2).all(), half
    else:  # 8 bits: the min/max
        assert torch.equal(lo, gauss.amin(0)) and torch.equal(hi, gauss.amax(0))
    # nonnegative data keep lo = 0 (zeros stay exact); per tensor and per row work too
    relu = heavy.clamp(min=0)
    assert (mse_ranges(relu, 0, bits)[0] == 0).all()
    assert mse_ranges(heavy, None, bits)[0].shape == (1,) and mse_ranges(heavy, 1, bits)[0].shape == (4000,)


def test_mse_observer_takes_the_quantizer_bits_and_averages():
    fq = qat.FakeQuantize(2, "mse", dim=0, momentum=0.5)
    assert isinstance(fq.observer, qat.MSEObserver) and fq.observer.bits == 2
    from pyg_quant.quantization.ranges import mse_ranges

    a, b = randn(500, 3, 0), randn(500, 3, 1) * 2
    fq(a)
    fq(b)
    (lo_a, hi_a), (lo_b, hi_b) = mse_ranges(a, 0, 2), mse_ranges(b, 0, 2)
    assert torch.allclose(fq.observer.min_val, lo_a + 0.5 * (lo_b - lo_a))
    assert torch.allclose(fq.observer.max_val, hi_a + 0.5 * (hi_b - hi_a))
    with pytest.raises(ValueError, match="bits"):
        qat.MSEObserver(0, bits=9)


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_dynamic_mse_observer_is_each_tensors_mse_range(dim):
    from pyg_quant.quantization.ranges import mse_ranges
    fq = qat.FakeQuantize(2, "dynamic_mse", dim=dim, stochastic=False)
    assert isinstance(fq.observer, qat.DynamicMSEObserver) and fq.dynamic and fq.observer.bits == 2
    x = randn(64, 48, 21)
    fq.train()(x)
    assert not fq.observer.initialized and fq.lo.numel() == 0  # nothing stored, nothing to freeze
    for t in (x, 0.25 * x + 1.0):  # a differently distributed tensor gets a range of its own
        lo, hi = fq.range(t)
        want_lo, want_hi = mse_ranges(t, dim, 2)
        assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi)
        assert torch.equal(pq.to_val(fq.quantize(t)), fq.eval()(t))  # bit-kernel codes == fake path
    with pytest.raises(ValueError, match="pass x"):
        fq.range()


def test_dynamic_mse_beats_min_max_on_noisy_rows_at_2_bits():
    """Per node, 2-bit min/max ranges of Gaussian rows spend two of four levels on the extremes."""
    x = randn(500, 64, 22)
    errors = {}
    for kind in ("dynamic", "dynamic_mse"):
        fq = qat.FakeQuantize(2, kind, dim=1, stochastic=False).eval()
        errors[kind] = float((fq(x) - x).square().mean())
    assert errors["dynamic_mse"] < 0.75 * errors["dynamic"], errors


def test_dynamic_mse_keeps_straight_through_gradients():
    x = randn(20, 30, 23).requires_grad_()
    fq = qat.FakeQuantize(2, "dynamic_mse", dim=1)
    lo, hi = fq.range(x.detach())
    assert ((x.detach() < lo.view(-1, 1)) | (x.detach() > hi.view(-1, 1))).any()  # some values are clipped
    fq(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_qconfig_dynamic_mse_granularities():
    config = qat.QConfig(weight_bits=2, act_bits=2, **qat.CLUSTER_GCN_OBSERVERS)
    fq_in, fq_w, fq_agg = config.input_quantizer(), config.weight_quantizer(None, 16), config.agg_quantizer()
    assert fq_in.dim == 1 and fq_in.dynamic and fq_in.keep_zeros  # per node, dropout zeros kept
    assert isinstance(fq_in.observer, qat.DynamicMSEObserver) and isinstance(fq_agg.observer, qat.DynamicMSEObserver)
    assert fq_w.dim == 1 and isinstance(fq_w.observer, qat.LearnedObserver) and fq_w.observer.range_lo.numel() == 16
    assert fq_agg.dim is None  # one range for all channels
    assert qat.QConfig(agg_observer="dynamic_mse").agg_quantizer().dim == 0  # per channel by default
    assert qat.QConfig(input_observer="mse").input_quantizer().dim is None  # static: per tensor
    assert set(qat.DYNAMIC_OBSERVERS) <= set(qat.OBSERVERS)


@pytest.mark.parametrize("kwargs", [dict(input_observer="learned"), dict(agg_observer="learned"),
                                    dict(keep_zeros=True, input_observer="mse"), dict(agg_granularity="node"),
                                    dict(keep_zeros=1)])
def test_qconfig_rejects_unsupported_settings(kwargs):
    with pytest.raises((ValueError, TypeError)):
        qat.QConfig(**kwargs)


def test_learned_observer_needs_its_number_of_ranges():
    with pytest.raises(ValueError, match="groups"):
        qat.FakeQuantize(2, "learned", dim=1)
    with pytest.raises(ValueError, match="per row"):
        qat.FakeQuantize(2, "learned", dim=0, groups=3)
    fq = qat.FakeQuantize(2, "learned", dim=1, groups=4)
    with pytest.raises(ValueError, match="4 ranges"):
        fq(randn(5, 3, 0))
    assert qat.FakeQuantize(2, "learned").observer.range_lo.numel() == 1  # per tensor


# --- learned ranges (LSQ+) ----------------------------------------------------------------------
def test_learned_range_starts_at_the_mse_range_and_rounds_to_nearest():
    from pyg_quant.quantization.ranges import mse_ranges
    w = randn(8, 40, 31)
    fq = qat.FakeQuantize(2, "learned", dim=1, groups=8, stochastic=True, seed=0)
    assert not fq.dynamic and not fq.observer.initialized
    assert torch.equal(fq.range(w)[0], mse_ranges(w, 1, 2)[0])  # before training: the tensor's own MSE range
    out = fq.train()(w)
    lo, hi = fq.range()
    want_lo, want_hi = mse_ranges(w, 1, 2)
    assert torch.equal(lo, want_lo) and torch.allclose(hi, want_hi, rtol=1e-6, atol=0)
    assert torch.equal(out, fq.eval()(w))  # nearest in training although stochastic=True
    assert torch.equal(pq.to_val(fq.quantize(w)), out)  # bit-kernel codes == fake path
    assert torch.equal(fq.scale, (hi - lo) / 3)


def test_learned_range_gradients_are_lsq_plus():
    """∂x̃/∂s = q − v inside the range and q outside, ∂x̃/∂lo = 1 outside only, ∂x̃/∂x = 1 inside only."""
    x = randn(6, 50, 32).requires_grad_()
    upstream = randn(6, 50, 33)
    fq = qat.FakeQuantize(2, "learned", dim=1, groups=6)
    fq(x.detach())  # initialise
    with torch.no_grad():  # a range that clips some values on both sides
        fq.observer.log_step.sub_(0.3)
    out = fq(x)
    (out * upstream).sum().backward()
    lo = fq.observer.range_lo.detach().view(-1, 1)
    s = fq.observer.log_step.detach().exp().view(-1, 1)
    v = (x.detach() - lo) / s
    q = torch.round((out.detach() - lo) / s)
    inside = (v >= 0) & (v <= 3)
    assert (~inside).any(dim=1).all() and inside.any()
    assert torch.equal(x.grad, upstream * inside)
    assert torch.allclose(fq.observer.range_lo.grad, (upstream * ~inside).sum(1))
    want_step = (upstream * torch.where(inside, q - v, q)).sum(1) * s.view(-1)
    assert torch.allclose(fq.observer.log_step.grad, want_step, rtol=1e-5, atol=1e-5)


def test_learned_range_descends_the_quantization_error():
    """Gradient steps on the range alone, from a range 3x too wide, cut the 2-bit error to near the MSE range's."""
    x = randn(4, 200, 34)
    fq = qat.FakeQuantize(2, "learned", dim=1, groups=4)
    with torch.no_grad():
        fq(x)
        mse_error = float((fq(x) - x).square().mean())
        fq.observer.log_step.add_(math.log(3.0))
        start = float((fq(x) - x).square().mean())
    optimizer = torch.optim.Adam(fq.parameters(), lr=0.02)
    for _ in range(150):
        optimizer.zero_grad()
        (fq(x) - x).square().mean().backward()
        optimizer.step()
    with torch.no_grad():
        end = float((fq(x) - x).square().mean())
    assert start > 2 * mse_error and end < 1.1 * mse_error, (start, end, mse_error)


def test_learned_range_freezes_and_recodes_after_a_step():
    w = randn(5, 12, 35)
    fq = qat.FakeQuantize(2, "learned", dim=1, groups=5)
    fq(w)
    codes = fq.quantize(w)
    assert fq.quantize(w) is codes  # cached while nothing moved
    with torch.no_grad():  # an optimizer's in-place step on the range
        fq.observer.log_step.add_(0.5)
    moved = fq.quantize(w)
    assert moved is not codes and not torch.equal(moved.scale, codes.scale)
    fq.disable_observer()
    assert torch.equal(fq.scale, moved.scale)  # the buffers hold the range in use
    fq(w.clone().requires_grad_()).sum().backward()  # frozen: no gradient reaches the range
    assert fq.observer.range_lo.grad is None and fq.observer.log_step.grad is None
    fresh = qat.FakeQuantize(2, "learned", dim=1, groups=5)
    fresh.load_state_dict(fq.state_dict())
    assert fresh.observer.initialized and fresh.frozen
    assert torch.equal(fresh.eval()(w), fq.eval()(w))


def test_frozen_learned_range_rounds_to_nearest_in_training():
    """A learned range rounds to nearest in training whether it is trained or frozen (stochastic=True or not):
    frozen, the training forward must be the evaluation forward, not a stochastic draw."""
    w = randn(6, 40, 39)
    fq = qat.FakeQuantize(2, "learned", dim=1, groups=6, stochastic=True, seed=0)
    fq.train()(w)  # initialise
    fq.disable_observer()
    first, second = fq(w.clone().requires_grad_()), fq(w)
    want = fq.eval()(w)
    assert torch.equal(first.detach(), want) and torch.equal(second, want)


def count_ops(fn) -> dict:
    """The ATen / pyg_quant operators ``fn()`` dispatches, by name."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Counting() as counting:
        fn()
    return counting.ops


@pytest.mark.parametrize("kind", ["mse", "learned"])
def test_training_steps_leave_the_range_buffers_to_their_readers(kind):
    """lo / scale copy the range in use, which nothing in the forward reads: a training step does not write them
    (no clone / full_like / div), yet every way of reading them (attribute, state_dict, freezing) sees the range
    in use, after an optimizer's in-place step on a learned range too."""
    x = randn(16, 5, 40)
    fq = qat.FakeQuantize(4, kind, dim=1 if kind == "learned" else 0, groups=16 if kind == "learned" else None)
    fq.train()(x)
    ops = count_ops(lambda: fq(x))
    assert not {"aten.clone.default", "aten.full_like.default", "aten.div.Tensor"} & set(ops), ops
    if kind == "learned":
        with torch.no_grad():
            fq.observer.log_step.add_(0.25)  # what an optimizer does, unseen by the quantizer
    else:
        fq(x * 3.0)  # the range moves
    lo, hi = fq.range()
    scale = (hi - lo) / torch.full_like(hi, 15.0)
    assert torch.equal(fq.lo, lo) and torch.equal(fq.scale, scale)
    if kind != "learned":
        fq(x * 5.0)
    state = fq.state_dict()
    lo, hi = fq.range()
    assert torch.equal(state["lo"], lo) and torch.equal(state["scale"], (hi - lo) / torch.full_like(hi, 15.0))
    fresh = qat.FakeQuantize(4, kind, dim=fq.dim, groups=16 if kind == "learned" else None)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.scale, state["scale"]) and torch.equal(fresh.eval()(x), fq.eval()(x))


@pytest.mark.parametrize("settings", [{}, qat.CLUSTER_GCN_OBSERVERS])
@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_qat_training_step_makes_no_host_sync(kind, settings):
    """After the first step (which builds and checks the graph), a QAT training step reads nothing back from the
    device: no .item() / bool() (aten._local_scalar_dense) and no op whose output size depends on the data."""
    data = planted_graph(nodes=120, seed=41)
    torch.manual_seed(0)
    model = qat.prepare({"gcn": lambda: GCN(16, 8, 4), "gin": lambda: GIN(16, 8, 4)}[kind](), bits=4,
                        skip_last=False, **settings).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def forward_backward():
        optimizer.zero_grad()
        F.cross_entropy(model(data.x, data.edge_index), data.y).backward()

    forward_backward()
    optimizer.step()
    ops = count_ops(forward_backward)
    syncing = {op: n for op, n in ops.items()
               if op.startswith(("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique"))}
    assert sum(ops.values()) > 20 and not syncing, syncing


def test_gin_one_plus_eps_follows_a_changed_eps():
    """QATGINConv keeps 1 + eps between calls while eps is a constant buffer; an eps changed in place (a loaded
    state) must be seen at the next call."""
    torch.manual_seed(0)
    conv = qat.prepare(GINConv(Sequential(Linear(8, 8), ReLU(), Linear(8, 4)), eps=0.0), bits=8,
                       skip_last=False, stochastic=False).eval()
    x, edge_index = randn(10, 8, 42), torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]])
    with torch.no_grad():
        conv(x, edge_index)
        conv.eps.fill_(0.5)
        moved = conv(x, edge_index)
    fresh = copy.deepcopy(conv)
    fresh.__dict__.pop("_one_plus_eps_cache", None)
    with torch.no_grad():
        assert torch.equal(moved, fresh(x, edge_index))
        conv.eps.fill_(0.0)
        assert not torch.equal(moved, conv(x, edge_index))


# --- keep_zeros -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dynamic", "dynamic_mse"])
@pytest.mark.parametrize("dim", [None, 1])
def test_keep_zeros_quantizes_the_kept_values_only(kind, dim):
    """Q(Dropout(x)) with keep_zeros is Dropout(Q'(x)), Q' ranging over the kept entries."""
    from pyg_quant import ops
    from pyg_quant.quantization.ranges import mse_ranges, tensor_range
    x = randn(12, 64, 36) + 0.3
    keep = torch.rand(12, 64, generator=gen(37)) >= 0.5
    dropped = x * keep * 2.0
    fq = qat.FakeQuantize(2, kind, dim=dim, stochastic=False, keep_zeros=True)
    out = fq.train()(dropped)
    assert torch.equal(out[~keep], torch.zeros(int((~keep).sum())))
    rows = range(12) if dim == 1 else [None]
    for r in rows:
        sel = keep[r] if r is not None else keep
        kept = (dropped[r][sel] if r is not None else dropped[sel]).view(1, -1)
        lo, hi = mse_ranges(kept, 1, 2) if kind == "dynamic_mse" else tensor_range(kept, 1)
        want = ops.fake_quantize(kept, lo, hi, 2, 1, None, False, False, None)[0].view(-1)  # codes over [lo, hi]
        got = out[r][sel] if r is not None else out[sel]
        assert torch.equal(got, want)
    plain = qat.FakeQuantize(2, kind, dim=dim, stochastic=False)
    assert torch.equal(fq.eval()(dropped), plain.eval()(dropped))  # evaluation quantizes zeros as any value
    assert not torch.equal(plain.train()(dropped)[~keep], out[~keep])


def test_masked_mse_ranges_with_everything_kept_is_mse_ranges():
    from pyg_quant.quantization.ranges import masked_mse_ranges, mse_ranges
    x = randn(30, 20, 38)
    for dim in (None, 0, 1):
        got = masked_mse_ranges(x, torch.ones_like(x, dtype=torch.bool), dim, 2)
        want = mse_ranges(x, dim, 2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_observe_records_as_forward_does_without_drawing_noise():
    """``FakeQuantize.observe`` (what a QAT layer does with values that arrive quantized): the observer moves as under
    ``forward`` in training, and the module's generator draws nothing, so its next rounding noise is a fresh one's."""
    x, y = randn(40, 6, 1, spread=3.0), randn(40, 6, 2)
    recorded, passed, fresh = (qat.FakeQuantize(4, "ema", dim=0, seed=5).train() for _ in range(3))
    recorded.observe(x)
    passed(x)
    for a, b in zip(recorded.observer.range_tensors(), passed.observer.range_tensors()):
        assert torch.equal(a, b)
    assert torch.equal(recorded.lo, passed.lo) and torch.equal(recorded.scale, passed.scale)
    fresh.observe(x)
    out_recorded, out_passed, out_fresh = recorded(y), passed(y), fresh(y)  # the same ranges for all three
    assert torch.equal(out_recorded, out_fresh)  # the generators' first draw: observe took none
    assert not torch.equal(out_recorded, out_passed)  # forward on x drew the first
    frozen = qat.FakeQuantize(4, "ema", dim=0).train().disable_observer()
    frozen.observe(x)
    assert not frozen.observer.initialized  # nothing recorded while the observer is off


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("observer", ["ema", "mse"])
@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("compiled", [True, False])
def test_static_range_step_in_one_op_is_the_op_by_op_step(device, observer, dim, compiled, monkeypatch):
    """A static EMA / MSE quantizer's training step as one op (``ops.ema_fake_quantize``; the observer's step alone,
    ``ops.ema_range``) gives what the observer's and the quantizer's ops give one by one: outputs, gradients (clipped
    values zeroed), stored ranges and rounding noise, bit for bit, a range narrower than MIN_RANGE_WIDTH collapsed;
    the compiled op and its reference (every op the reference) alike."""
    from pyg_quant import ops
    if not compiled:
        monkeypatch.setattr(ops, "use_compiled", lambda op, device: False)
    calls = []
    for name in ("ema_fake_quantize", "ema_range"):
        original = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    fused, stepwise = (qat.FakeQuantize(4, observer, dim=dim, seed=3).to(device).train() for _ in range(2))
    stepwise.observer.fused_step = lambda x: None  # the op-by-op path
    weights = randn(37, 9, 99).to(device)
    protect = torch.arange(37, device=device) % 5 == 0
    for k in range(5):
        x = randn(37, 9, k, spread=3.0 + 3 * k).to(device)  # wider each time: the stored range clips
        x[:, 4] = torch.tensor([0.0, 1e-37], device=device).repeat(19)[:37]  # narrower than MIN_RANGE_WIDTH
        if k == 1:  # the observer alone (an input used as it is)
            fused.observe(x)
            stepwise.observe(x)
        else:
            outs, grads = [], []
            for fq in (fused, stepwise):
                leaf = x.clone().requires_grad_()
                out = fq(leaf, protect if k == 3 else None)
                (out * weights).sum().backward()
                outs.append(out)
                grads.append(leaf.grad)
            assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
            if k > 0:
                assert not bool((grads[0] == weights).all())  # a static range clipped some values
        for a, b in zip(fused.observer.range_tensors(), stepwise.observer.range_tensors()):
            assert torch.equal(a, b)
    assert torch.equal(fused.lo, stepwise.lo) and torch.equal(fused.scale, stepwise.scale)
    assert calls == ["ema_range"] + ["ema_fake_quantize"] * 3  # (the first batch stores a range op by op)


def test_keep_zeros_needs_a_dynamic_observer():
    with pytest.raises(ValueError, match="dynamic"):
        qat.FakeQuantize(2, "ema", keep_zeros=True)


def test_observer_rejects_changing_granularity():
    obs = qat.EMAMinMaxObserver(dim=1)
    obs(randn(5, 3, 0))
    with pytest.raises(ValueError, match="dynamic"):
        obs(randn(6, 3, 1))


def test_observer_state_dict_round_trip():
    fq = qat.FakeQuantize(4, "ema", dim=0)
    fq(randn(30, 5, 0))
    fq.disable_observer()
    fresh = qat.FakeQuantize(4, "ema", dim=0)
    fresh.load_state_dict(fq.state_dict())
    assert fresh.frozen  # the switch travels with the state dict
    assert torch.equal(fresh.observer.min_val, fq.observer.min_val)
    assert torch.equal(fresh.scale, fq.scale)
    fq.eval(), fresh.eval()
    x = randn(9, 5, 1)
    assert torch.equal(fq(x), fresh(x))


@pytest.mark.parametrize("kwargs,exc", [
    (dict(kind="median"), ValueError), (dict(kind="ema", momentum=0.0), ValueError),
    (dict(kind="ema", momentum=True), ValueError), (dict(kind="percentile", percentile=0.4), ValueError),
    (dict(kind="minmax", dim=2), ValueError), (dict(kind="minmax", dim=True), ValueError)])
def test_make_observer_errors(kwargs, exc):
    kind = kwargs.pop("kind")
    with pytest.raises(exc):
        qat.make_observer(kind, **kwargs)


# --- FakeQuantize: codes ----------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dim", [None, 0, 1])
def test_eval_codes_equal_to_bit(bits, dim):
    x = randn(37, 19, bits, spread=3.0) + 0.5
    fq = qat.FakeQuantize(bits, "dynamic", dim=dim).eval()
    expected = pq.to_val(pq.to_bit(x, bits, dim))
    assert torch.equal(fq(x), expected)
    for layout in ("row", "col"):
        bt = fq.quantize(x, layout)
        assert bt.dim == dim and bt.bits == bits
        assert torch.equal(pq.to_val(bt), expected)


def test_static_range_clips():
    fq = qat.FakeQuantize(3, "minmax", dim=None)
    fq(torch.tensor([[-1.0, 1.0]]))  # range [-1, 1]
    fq.eval()
    out = fq(torch.tensor([[-5.0, -1.0, 0.3, 1.0, 7.0]]))
    step = 2.0 / 7
    assert out[0, 0] == -1.0 and out[0, -1] == 1.0  # clipped to the range
    assert abs(float(out[0, 2]) - (-1.0 + step * round(1.3 / step))) < 1e-6
    assert torch.equal(fq.lo, torch.tensor([-1.0]))
    assert torch.allclose(fq.scale, torch.tensor([step]))


def test_observer_moves_only_in_training_and_when_enabled():
    fq = qat.FakeQuantize(4, "ema", dim=None)
    fq(randn(10, 3, 0))
    lo = fq.observer.min_val.clone()
    fq.eval()
    fq(randn(10, 3, 1) * 10)
    assert torch.equal(fq.observer.min_val, lo)
    fq.train().disable_observer()
    fq(randn(10, 3, 2) * 10)
    assert torch.equal(fq.observer.min_val, lo)
    fq.enable_observer()
    fq(randn(10, 3, 3) * 10)
    assert not torch.equal(fq.observer.min_val, lo)


def test_fake_quant_switch_passes_through():
    fq = qat.FakeQuantize(2, "dynamic").disable_fake_quant()
    x = randn(4, 4, 0)
    assert fq(x) is x


# --- FakeQuantize: stochastic rounding --------------------------------------------------------
def test_stochastic_rounding_is_unbiased():
    bits, n = 2, 4000
    x = randn(16, 16, 7)
    fq = qat.FakeQuantize(bits, "minmax", dim=0, stochastic=True, seed=11)
    fq(x)
    fq.disable_observer()  # fixed range from here on
    draws = torch.stack([fq(x) for _ in range(n)]).double()
    lo, _, scale, inv_scale = fq.qparams()
    v = ((x - lo) * inv_scale).double()
    f = v - v.floor()
    var = scale.double() ** 2 * f * (1 - f)
    mean = draws.mean(0)
    allowance = 1e-6 * (x.abs().double() + scale.double())  # float32 steps of lo + s·q
    assert ((mean - x.double()).abs() <= 6 * (var / n).sqrt() + allowance).all()
    # The sample variance follows s²f(1−f): stochastic, not nearest, rounding.
    sample_var = draws.var(0)
    assert torch.allclose(sample_var, var, atol=6 * float(scale.max()) ** 2 / math.sqrt(n))
    # Every draw is one of the two neighbouring grid points.
    q = (draws - lo.double()) / scale.double()
    assert ((q - v.floor()).round().abs() <= 1).all() and ((q - v.floor()).round() >= 0).all()


def test_stochastic_rounding_is_deterministic_per_seed():
    x = randn(64, 8, 1)

    def draws(seed, count=3):
        fq = qat.FakeQuantize(2, "dynamic", dim=0, stochastic=True, seed=seed)
        return [fq(x) for _ in range(count)]

    a, b, c = draws(5), draws(5), draws(6)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], a[1])  # the sequence moves on
    fq = qat.FakeQuantize(2, "dynamic", dim=0, stochastic=True, seed=5)
    first = fq(x)
    copied = copy.deepcopy(fq)  # a copy restarts from the seed
    assert torch.equal(copied(x), first)
    restored = pickle.loads(pickle.dumps(fq))
    assert torch.equal(restored(x), first)
    fq.reset_rng()
    assert torch.equal(fq(x), first)


def test_stochastic_rounding_global_generator():
    x = randn(32, 8, 2)
    fq = qat.FakeQuantize(3, "dynamic", stochastic=True, seed=None)
    torch.manual_seed(123)
    a = fq(x)
    torch.manual_seed(123)
    assert torch.equal(fq(x), a)


def test_eval_is_nearest_even_when_stochastic():
    x = randn(20, 6, 3)
    fq = qat.FakeQuantize(2, "dynamic", dim=1, stochastic=True, seed=0).eval()
    assert torch.equal(fq(x), pq.to_val(pq.to_bit(x, 2, 1)))


# --- FakeQuantize: straight-through gradients -------------------------------------------------
@pytest.mark.parametrize("stochastic", [False, True])
def test_ste_gradient_identity_inside_zero_outside(stochastic):
    fq = qat.FakeQuantize(4, "minmax", dim=0, stochastic=stochastic, seed=0)
    fq(torch.tensor([[-1.0, 0.0], [1.0, 2.0]]))  # ranges: column 0 [-1, 1], column 1 [0, 2]
    fq.disable_observer()
    x = torch.tensor([[-1.5, 0.0], [-1.0, 0.5], [0.2, 2.0], [1.0, 2.5], [3.0, -0.1]], requires_grad=True)
    upstream = torch.arange(1.0, 11.0).view(5, 2)
    (fq(x) * upstream).sum().backward()
    inside = torch.tensor([[False, True], [True, True], [True, True], [True, False], [False, False]])
    assert torch.equal(x.grad, torch.where(inside, upstream, torch.zeros_like(upstream)))


def test_ste_dynamic_range_passes_every_gradient():
    x = randn(10, 4, 5).requires_grad_()
    qat.FakeQuantize(2, "dynamic", dim=1)(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_protect_rows_pass_through_in_training_only():
    x = randn(6, 3, 6)
    protect = torch.tensor([True, False, False, True, False, False])
    fq = qat.FakeQuantize(1, "dynamic", dim=0, stochastic=False)
    out = fq(x, protect)
    assert torch.equal(out[protect], x[protect])
    assert torch.equal(out[~protect], fq(x)[~protect])
    fq.eval()
    assert torch.equal(fq(x, protect), fq(x))
    with pytest.raises(ValueError, match="protect"):
        fq.train()(x, protect[:3])


def test_quantize_reuses_codes_only_for_the_same_unchanged_input():
    x = randn(40, 12, 9)
    fq = qat.FakeQuantize(4, "ema", dim=0)
    fq(x)
    fq.eval()
    first = fq.quantize(x, "col")
    assert fq.quantize(x, "col") is first  # same object, same version, same range: reused
    with torch.no_grad():
        x[3, 2] += 5.0  # in place: the version counter moves
    changed = fq.quantize(x, "col")
    assert changed is not first and torch.equal(pq.to_val(changed), fq(x))
    fq.train()(x * 3)  # the observer moves the range
    fq.eval()
    moved = fq.quantize(x, "col")
    assert moved is not changed and torch.equal(pq.to_val(moved), fq(x))
    assert fq.quantize(x, "row") is not moved  # another layout
    again = fq.quantize(x, "col")
    assert fq.quantize(x.clone(), "col") is not again  # equal values, another tensor: recomputed
    with torch.inference_mode():  # no version counter: never cached, still right
        frozen = x.clone()
        assert torch.equal(pq.to_val(fq.quantize(frozen, "col")), fq(frozen))


def test_quantize_cache_does_not_keep_inputs_alive():
    import gc
    import weakref

    fq = qat.FakeQuantize(2, "dynamic", dim=1).eval()
    x = randn(8, 8, 1)
    fq.quantize(x)
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("kwargs,exc", [
    (dict(bits=0), ValueError), (dict(bits=9), ValueError), (dict(bits=2.0), TypeError),
    (dict(bits=4, observer="nope"), ValueError), (dict(bits=4, observer=3), TypeError),
    (dict(bits=4, dim=-1), ValueError), (dict(bits=4, seed=-1), ValueError),
    (dict(bits=4, stochastic=1), TypeError),
    (dict(bits=4, observer=qat.MinMaxObserver(dim=0), dim=1), ValueError)])
def test_fake_quantize_argument_errors(kwargs, exc):
    with pytest.raises(exc):
        qat.FakeQuantize(**kwargs)


@pytest.mark.parametrize("x,exc", [(torch.ones(3), ValueError), (torch.ones(2, 2, 2), ValueError),
                                   (torch.ones(2, 2, dtype=torch.int64), TypeError), ([[1.0]], TypeError),
                                   (torch.ones(0, 3), ValueError)])
def test_fake_quantize_input_errors(x, exc):
    with pytest.raises(exc):
        qat.FakeQuantize(4)(x)


# --- QATLinear --------------------------------------------------------------------------------
def test_qat_linear_paths_agree_and_train():
    torch.manual_seed(0)
    float_lin = Linear(24, 10)
    lin = qat.QATLinear.from_linear(float_lin, qat.QConfig(weight_bits=4, act_bits=3, seed=1))
    assert lin.weight is float_lin.weight  # fp32 master weights, shared
    x = randn(50, 24, 1)
    lin.train()
    lin(x).square().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    lin.eval()
    float_path = lin(x)  # autograd on: fake path, float64 product
    with torch.no_grad():
        bits_path = lin(x)  # bitmm on the same codes
    assert not float_path.requires_grad or float_path.grad_fn is not None
    # both equal the exact product of the same codes' values: the fake path rounds it once (float64 product), the
    # bit kernel's float32 epilogue stays within its bound of the terms it adds
    xb, wb = pq.to_bit(x, 3, 1), pq.to_bit(lin.weight.detach(), 4, 1)
    bias = lin.bias.detach().double()
    exact = deq64(xb) @ deq64(wb).t() + bias
    terms = mag64(xb) @ mag64(wb).t() + bias.abs()
    assert_fp32_close(bits_path, exact, EPILOGUE_BOUND * terms, scale=terms)
    assert_fp32_close(float_path.detach(), exact, 2 * 2.0**-24 * terms, scale=terms)


@pytest.mark.parametrize("device", DEVICES)
def test_qat_linear_op_double_backward_equals_the_quantizers(monkeypatch, device):
    """A double backward (create_graph=True) through ``pyg_quant::qat_linear`` reaches x and W as it does through the
    quantizers' composition (straight-through fake quantizations, then linear): a gradient penalty's gradients
    agree, first-order gradients bit for bit."""
    skip_unless_compiled()
    x = randn(40, 24, 11).to(device)
    weights = torch.rand(40, 10, generator=gen(12)).to(device)
    results = []
    for path in ("op", "general"):
        protect = torch.zeros(40, dtype=torch.bool, device=device) if path == "general" else None
        torch.manual_seed(0)
        lin = qat.QATLinear(24, 10, qconfig=qat.QConfig(weight_bits=3, act_bits=4, stochastic=False)).to(device)
        x_grad = x.clone().requires_grad_()
        out = lin.train()(x_grad, protect=protect)
        gx, gw = torch.autograd.grad((out * weights).sum() + (out ** 2).sum(), (x_grad, lin.weight), create_graph=True)
        penalty = (gx ** 2).sum() + (gw ** 2).sum()
        results.append((gx.detach(), gw.detach()) + torch.autograd.grad(penalty, (x_grad, lin.weight)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    for a, b in zip(results[0][2:], results[1][2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert results[0][2].abs().sum() > 0 and results[0][3].abs().sum() > 0  # the penalty reaches x and W


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_qat_linear_training_op_equals_the_quantizers(monkeypatch, device, stochastic):
    """Training with the default quantizers runs ``pyg_quant::qat_linear`` (one op); its output and gradients equal
    the quantizers' own composition (the general path, taken here through an all-False Degree-Quant mask) bit for
    bit, the noise drawn in the same order, and the torch reference's (the extension's kernels off) where it draws the
    same noise (torch.rand's: on the CPU, or rounding to nearest; the CUDA kernels draw theirs in the kernel)."""
    skip_unless_compiled()
    x = randn(40, 24, 3).to(device)
    weights = torch.rand(40, 10, generator=gen(5)).to(device)  # a loss whose gradient is not all ones
    results = []
    for path in ("op", "general", "reference"):
        protect = torch.zeros(40, dtype=torch.bool, device=device) if path == "general" else None
        if path == "reference":
            for op in ("qat_linear", "fake_quantize"):
                monkeypatch.setitem(pq._extension._KERNELS, (op, torch.device(device).type), False)
        torch.manual_seed(0)
        lin = qat.QATLinear(24, 10, qconfig=qat.QConfig(weight_bits=3, act_bits=4, stochastic=stochastic,
                                                        seed=7)).to(device).train()
        x_grad = x.clone().requires_grad_()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = lin(x_grad, protect=protect)
        ran_op = any(e.name == "pyg_quant::qat_linear" for e in prof.events())
        assert ran_op == (path == "op")
        (out * weights).sum().backward()
        results.append((out.detach(), x_grad.grad, lin.weight.grad, lin.bias.grad))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    if device == "cpu" or not stochastic:
        assert all(torch.equal(a, b) for a, b in zip(results[0], results[2]))
    monkeypatch.undo()
    torch.library.opcheck(torch.ops.pyg_quant.qat_linear.default,
                          (x.clone().requires_grad_(), lin.weight.detach().clone().requires_grad_(), lin.bias.detach(),
                           4, False, None, 3, False, None),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_master_weights_stay_fp32_while_training():
    """The optimizer updates fp32 masters; only the forward pass sees their codes."""
    torch.manual_seed(0)
    lin = qat.QATLinear(16, 6, qconfig=qat.QConfig(weight_bits=1, act_bits=2, seed=0))
    optimizer = torch.optim.SGD(lin.parameters(), lr=0.05)
    x = randn(64, 16, 2)
    for _ in range(5):
        optimizer.zero_grad()
        lin(x).square().mean().backward()
        optimizer.step()
    assert lin.weight.dtype == torch.float32
    assert all(row.unique().numel() > 2 for row in lin.weight.detach())  # not snapped to a 1-bit grid
    codes = lin.weight_quant.eval()(lin.weight.detach())
    assert all(row.unique().numel() <= 2 for row in codes)  # what the forward pass uses


def test_qat_linear_float_operands_and_errors():
    lin = qat.QATLinear(8, 4, qconfig=qat.QConfig(weight_bits=2, act_bits=None))
    assert lin.input_quant is None and lin.weight_quant is not None
    x = randn(5, 8, 0)
    lin.eval()
    expected = F.linear(x.double(), pq.to_val(pq.to_bit(lin.weight.detach(), 2, 1)).double()).float() + lin.bias
    with torch.no_grad():
        assert torch.allclose(lin(x), expected, atol=1e-6)
        assert lin(torch.randn(2, 3, 8, generator=gen(1))).shape == (2, 3, 4)  # leading dims
    with pytest.raises(ValueError, match="features"):
        lin(randn(5, 7, 0))
    with pytest.raises(TypeError, match="qconfig"):
        qat.QATLinear(8, 4, qconfig="8bit")
    # training with one operand in float: the other fake-quantized, the float one as it is
    lin.train()
    wq = pq.to_val(pq.to_bit(lin.weight.detach(), 2, 1))  # nearest rounding: what stochastic=False trains with
    lin_nearest = qat.QATLinear(8, 4, qconfig=qat.QConfig(weight_bits=2, act_bits=None, stochastic=False)).train()
    lin_nearest.load_state_dict(lin.state_dict(), strict=False)
    torch.testing.assert_close(lin_nearest(x), F.linear(x, wq, lin.bias), rtol=0, atol=0)
    act_only = qat.QATLinear(8, 4, qconfig=qat.QConfig(weight_bits=None, act_bits=3, stochastic=False)).train()
    xq = pq.to_val(pq.to_bit(x, 3, 1))
    torch.testing.assert_close(act_only(x), F.linear(xq, act_only.weight, act_only.bias), rtol=0, atol=0)


# --- float aggregation -----------------------------------------------------------------------
@pytest.mark.parametrize("weighted", [False, True])
def test_sparse_float_aggregation_matches_edge_wise(weighted):
    """The QAT layers' float aggregation (one sparse product) gives QuantGraph.aggregate_float's values."""
    from pyg_quant.graph.input_formats import to_edge_set
    from pyg_quant.graph.quant_graph import QuantGraph
    from pyg_quant.qat.conv import _aggregate_float

    g, n = gen(3), 30
    edge_index = torch.randint(n, (2, 120), generator=g)
    # repeated edges and a repeated self-loop (GCN's loop rule keeps one loop's weight)
    edge_index = torch.cat([edge_index, edge_index[:, :10], torch.tensor([[4, 4], [4, 4]])], 1)
    weight = torch.rand(edge_index.size(1), generator=g) + 0.5 if weighted else None
    graph = QuantGraph(to_edge_set(edge_index, weight, n, n, "source_to_target"), 1.0, 8)
    y = randn(n, 5, 4).requires_grad_()
    for training in (True, False):
        ours = _aggregate_float(graph, y, training)
        edge_wise = graph.aggregate_float(y if training else y.double()).to(torch.float32)
        assert torch.allclose(ours, edge_wise, rtol=1e-6, atol=1e-6)
    upstream = randn(n, 5, 5)
    (ours_grad,) = torch.autograd.grad((_aggregate_float(graph, y, True) * upstream).sum(), y)
    (edge_grad,) = torch.autograd.grad((graph.aggregate_float(y) * upstream).sum(), y)
    assert torch.allclose(ours_grad, edge_grad, rtol=1e-6, atol=1e-6)
    if weighted:  # weights that ask for a gradient get one (edge-wise path)
        trainable = weight.clone().requires_grad_()
        graph = QuantGraph(to_edge_set(edge_index, trainable, n, n, "source_to_target"), 1.0, 8)
        _aggregate_float(graph, y, True).sum().backward()
        assert trainable.grad is not None and trainable.grad.abs().sum() > 0


# --- models -----------------------------------------------------------------------------------
class GCN(torch.nn.Module):
    def __init__(self, channels, hidden, classes):
        super().__init__()
        self.conv1 = GCNConv(channels, hidden, cached=True)
        self.conv2 = GCNConv(hidden, classes, cached=True)

    def forward(self, x, edge_index):
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


class GIN(torch.nn.Module):
    def __init__(self, channels, hidden, classes):
        super().__init__()
        self.conv1 = GINConv(Sequential(Linear(channels, hidden), ReLU(), Linear(hidden, hidden)), train_eps=True)
        self.conv2 = GINConv(Sequential(Linear(hidden, hidden), ReLU(), Linear(hidden, hidden)))
        self.head = Linear(hidden, classes)

    def forward(self, x, edge_index):
        x = F.relu(self.conv1(x, edge_index))
        return self.head(F.relu(self.conv2(x, edge_index)))


def planted_graph(nodes=600, classes=4, features=16, community=50, degree=8, p_out=0.1, snr=0.3, seed=0):
    """Communities of ``community`` nodes (label = community mod ``classes``), a share ``p_out`` of the
    edges random; features = ``snr``·(±1 class signature) + N(0, 1): weak alone, strong once averaged
    over neighbours."""
    g = gen(seed)
    pairs = nodes * degree // 2
    src = torch.randint(nodes, (pairs,), generator=g)
    inside = (src // community) * community + torch.randint(community, (pairs,), generator=g)
    dst = torch.where(torch.rand(pairs, generator=g) < p_out, torch.randint(nodes, (pairs,), generator=g),
                      inside.clamp(max=nodes - 1))
    keep = src != dst
    edge_index = torch.cat([torch.stack([src[keep], dst[keep]]), torch.stack([dst[keep], src[keep]])], 1)
    y = (torch.arange(nodes) // community) % classes
    signature = torch.randint(0, 2, (classes, features), generator=g).float() * 2 - 1
    x = snr * signature[y] + torch.randn(nodes, features, generator=g)
    split = torch.rand(nodes, generator=g)
    return Data(x=x, edge_index=edge_index, y=y, train_mask=split < 0.2, test_mask=split >= 0.2)


def train(model, data, epochs, lr=0.01):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=5e-4)
    for _ in range(epochs):
        model.train()
        optimizer.zero_grad()
        out = model(data.x, data.edge_index)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        optimizer.step()
    return model


@torch.no_grad()
def test_accuracy(model, data):
    model.eval()
    pred = model(data.x, data.edge_index).argmax(-1)
    return float((pred[data.test_mask] == data.y[data.test_mask]).float().mean())


test_accuracy.__test__ = False  # a helper, not a test


# --- prepare ----------------------------------------------------------------------------------
def test_prepare_swaps_layers_and_keeps_weights():
    torch.manual_seed(0)
    model = GIN(16, 8, 3)
    prepared = qat.prepare(model, bits=4)
    assert isinstance(prepared.conv1, qat.QATGINConv) and isinstance(prepared.conv1, pq.QGINConv)
    assert isinstance(prepared.conv2, qat.QATGINConv)
    assert type(prepared.head) is Linear  # skip_last: the classifier stays fp32
    assert all(isinstance(m, qat.QATLinear) for m in (prepared.conv1.nn[0], prepared.conv1.nn[2]))
    assert isinstance(prepared.conv1.eps, torch.nn.Parameter) and not isinstance(prepared.conv2.eps,
                                                                                  torch.nn.Parameter)
    state, new_state = model.state_dict(), prepared.state_dict()
    for key, value in state.items():
        assert torch.equal(new_state[key], value), key
    assert type(model.conv1) is GINConv  # not inplace: the float model is untouched
    everything = qat.prepare(model, bits=2, skip_last=False)
    assert isinstance(everything.head, qat.QATLinear)
    some = qat.prepare(model, weight_bits=4, act_bits=None, skip=["conv2"])
    # a skipped GINConv is kept fp32 as QGINConv(bits=None) (it reads a BitAdjacency), on the same weights
    assert type(some.conv2) is pq.QGINConv and some.conv2.act_bits is None and some.conv1.agg_quant is None
    assert type(some.conv2.nn[0]) is Linear
    gcn = qat.prepare(GCN(16, 8, 3), bits=8, skip_last=False)
    assert isinstance(gcn.conv2, qat.QATGCNConv) and isinstance(gcn.conv2, pq.QGCNConv)
    assert [name for name, _ in qat.quantizable_layers(gcn)] == ["conv1", "conv2"]


def test_prepare_warns_when_nothing_is_quantized():
    with pytest.warns(UserWarning, match="every layer in float"):
        single = qat.prepare(GCNConv(8, 4), bits=4)  # skip_last: the only layer stays fp32
    assert type(single) is pq.QGCNConv and single.weight_bits is None and single.act_bits is None
    assert isinstance(qat.prepare(GCNConv(8, 4), bits=4, skip_last=False), qat.QATGCNConv)


def test_prepare_seeds_quantizers_in_order():
    prepared = qat.prepare(GCN(16, 8, 3), bits=4, skip_last=False, seed=100)
    seeds = [fq.seed for _, fq in qat.fake_quantizers(prepared)]
    assert seeds == list(range(100, 106))


@pytest.mark.parametrize("kwargs,exc", [
    (dict(), ValueError), (dict(bits=4, weight_bits=2), ValueError), (dict(bits=9), ValueError),
    (dict(bits=4, skip=["nope"]), ValueError), (dict(bits=4, skip_last=1), TypeError),
    (dict(bits=4, agg_observer="mean"), ValueError), (dict(bits=4, qconfig=qat.QConfig()), ValueError),
    (dict(qconfig="x"), TypeError), (dict(bits=4, degree_quant=(0.5, 0.1)), ValueError)])
def test_prepare_errors(kwargs, exc):
    with pytest.raises(exc):
        qat.prepare(GCN(8, 4, 2), **kwargs)


@pytest.mark.parametrize("observer", ["dynamic", "dynamic_mse"])
@pytest.mark.parametrize("self_loops", [False, True])
def test_eval_float_aggregation_gives_the_bit_kernels_result(observer, self_loops):
    """In evaluation the float aggregation sums the codes' unrounded values ``lo + s·q`` in float64 (and the self-loop
    term multiplies to_val's float32 values, as the kernels' does) and rounds once: the exact value of what the bit
    kernels sum, whose float32 epilogue stays within its bound of the terms it adds.  Summing to_val's float32 values
    instead differs from it in many entries (the values whose roundings do not cancel)."""
    from pyg_quant.graph.input_formats import to_edge_set
    from pyg_quant.graph.quant_graph import QuantGraph
    from pyg_quant.qat.conv import _aggregate_float

    g, n = gen(11), 200
    edge_index = torch.randint(n, (2, 2000), generator=g)
    graph = QuantGraph(to_edge_set(edge_index, None, n, n, "source_to_target"), 1.0 if self_loops else None, 8)
    assert (graph.diag is not None) == self_loops
    fq = qat.FakeQuantize(2, observer, dim=0).eval()
    y = randn(n, 24, 12, spread=3.0).requires_grad_()
    rounded, exact = fq.forward_exact(y)
    assert torch.equal(rounded, fq(y)) and exact.dtype == torch.float64
    assert not torch.equal(exact, rounded.double()) and torch.allclose(exact, rounded.double(), rtol=1e-6, atol=0)
    codes = fq.quantize(y, "col")
    ours = _aggregate_float(graph, exact, False, self_values=rounded)
    # the magnitudes of the terms, summed over the same edges (the self-loop term's too)
    terms = _aggregate_float(graph, mag64(codes), False, self_values=rounded.detach().abs()).double()
    bits = graph.aggregate_bits(codes)
    assert_fp32_close(bits, ours.detach(), (EPILOGUE_BOUND + 2.0**-24) * terms, scale=terms)
    assert int((_aggregate_float(graph, rounded, False) != ours).sum()) > 100  # what the float path summed before
    (grad,) = torch.autograd.grad(ours.sum(), y)  # forward's straight-through gradient
    assert torch.equal(grad, torch.autograd.grad(_aggregate_float(graph, fq(y), False).sum(), y)[0])


def test_prepare_rejects_non_modules():
    with pytest.raises(TypeError, match="model"):
        qat.prepare("gcn", bits=4)
    with pytest.raises(ValueError, match="FakeQuantize"):
        qat.convert(GCN(8, 4, 2))


# --- convert ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gcn", "gin"])
@pytest.mark.parametrize("bits", [2, 8])
def test_convert_round_trip(kind, bits):
    data = planted_graph(nodes=300, seed=1)
    torch.manual_seed(0)
    model = GCN(16, 16, 4) if kind == "gcn" else GIN(16, 16, 4)
    prepared = train(qat.prepare(model, bits=bits, skip_last=False, seed=3), data, epochs=5)
    prepared.eval()
    float_path = prepared(data.x, data.edge_index)  # autograd on: the fake-quant path
    assert float_path.requires_grad
    with torch.no_grad():
        qat_eval = prepared(data.x, data.edge_index)  # the bit kernels
    inference = qat.convert(prepared)
    assert not inference.training and not any(p.requires_grad for p in inference.parameters())
    assert all(fq.frozen for _, fq in qat.fake_quantizers(inference))
    with torch.no_grad():
        converted = inference(data.x, data.edge_index)
    assert torch.equal(converted, qat_eval)
    converted_again = inference(data.x, data.edge_index)  # grad mode on, but nothing asks for one
    assert torch.equal(converted_again, converted)
    scale = float(converted.abs().max())
    diff = (float_path.detach() - converted).abs()
    assert (diff <= 1e-5 * (converted.abs() + 1e-2 * scale)).all(), float(diff.max())
    # Frozen: training mode on the converted model moves no range.
    before = {k: v.clone() for k, v in inference.state_dict().items()}
    inference.train()(data.x, data.edge_index)
    after = inference.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_convert_round_trip_with_dynamic_mse_observers(kind):
    data = planted_graph(nodes=300, seed=4)
    torch.manual_seed(0)
    model = GCN(16, 16, 4) if kind == "gcn" else GIN(16, 16, 4)
    prepared = train(qat.prepare(model, bits=2, skip_last=False, seed=5, **qat.CLUSTER_GCN_OBSERVERS), data, 5)
    prepared.eval()
    float_path = prepared(data.x, data.edge_index)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dynamic quantizers need no observed data
        inference = qat.convert(prepared)
    with torch.no_grad():
        converted = inference(data.x, data.edge_index)
        assert torch.equal(converted, prepared(data.x, data.edge_index))
    diff = (float_path.detach() - converted).abs()
    # The float path rounds each layer's exact value once, the kernels' float32 epilogue stays within its bound of
    # it; at 2 bits with MSE-chosen ranges many values lie on code boundaries, where that difference can move one to
    # the next code: the two paths agree entry by entry up to such steps, and norm-wise.
    stepped = diff > 1e-5 * converted.abs() + 1e-6 * float(converted.abs().max())
    assert int(stepped.sum()) <= diff.numel() // 100, int(stepped.sum())
    assert float(diff.norm()) <= 0.01 * float(converted.norm()), float(diff.norm() / converted.norm())
    quantizers = dict(qat.fake_quantizers(inference))
    # Activation ranges stay per input after convert; the learned weight ranges are frozen.
    assert all(fq.dynamic for name, fq in quantizers.items() if not name.endswith("weight_quant"))
    assert all(fq.observer.learned and fq.frozen for name, fq in quantizers.items() if name.endswith("weight_quant"))


def test_convert_uses_bit_kernels(monkeypatch):
    data = planted_graph(nodes=200, seed=2)
    torch.manual_seed(0)
    prepared = train(qat.prepare(GCN(16, 8, 4), bits=4, skip_last=False), data, epochs=2)
    inference = qat.convert(prepared)
    calls = []
    import pyg_quant.qat.linear as qat_linear

    real = qat_linear.bitmm
    monkeypatch.setattr(qat_linear, "bitmm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        inference(data.x, data.edge_index)
    assert len(calls) == 2
    packed = inference.conv1.lin.packed_weight()
    assert inference.conv1.lin.packed_weight() is packed  # packed once


def test_converted_static_ranges_keep_their_parameters_until_edited():
    """A frozen stored range's (lo, hi, scale, inv_scale) are made once and kept; an in-place edit of the range (a
    load_state_dict) or new range tensors make them again, so the outputs follow."""
    data = planted_graph(nodes=200, seed=2)
    torch.manual_seed(0)
    prepared = train(qat.prepare(GCN(16, 8, 4), bits=4, skip_last=False, agg_observer="ema"), data, epochs=2)
    inference = qat.convert(prepared)
    fq = inference.conv1.agg_quant
    first = fq.qparams()
    assert all(a is b for a, b in zip(fq.qparams(), first))
    with torch.no_grad():
        out = inference(data.x, data.edge_index)
        state = {k: v.clone() for k, v in inference.state_dict().items()}
        fq.observer.max_val.mul_(2)  # in place: the version moves
        widened = fq.qparams()
        assert not any(a is b for a, b in zip(widened, first))
        torch.testing.assert_close(widened[1], first[1] * 2)
        assert not torch.equal(inference(data.x, data.edge_index), out)
        inference.load_state_dict(state)
        assert torch.equal(fq.qparams()[1], first[1]) and torch.equal(inference(data.x, data.edge_index), out)
        fq.observer.max_val = fq.observer.max_val * 3  # another tensor
        torch.testing.assert_close(fq.qparams()[1], first[1] * 3)
    # while observing (a prepared model in training), nothing is kept
    assert prepared.conv1.agg_quant._frozen_state() is None


def test_convert_warns_about_unobserved_ranges():
    prepared = qat.prepare(GCN(8, 4, 2), bits=4)
    with pytest.warns(UserWarning, match="observed no data"):
        qat.convert(prepared)


def test_state_dict_of_trained_qat_model_loads_into_fresh_prepare():
    data = planted_graph(nodes=200, seed=3)
    torch.manual_seed(0)
    trained = train(qat.prepare(GCN(16, 8, 4), bits=4, agg_observer="percentile"), data, epochs=3)
    fresh = qat.prepare(GCN(16, 8, 4), bits=4, agg_observer="percentile")
    fresh.load_state_dict(trained.state_dict())
    fresh.eval(), trained.eval()
    with torch.no_grad():
        assert torch.equal(fresh(data.x, data.edge_index), trained(data.x, data.edge_index))


# --- Degree-Quant -----------------------------------------------------------------------------
def test_degree_protection_probability_follows_rank():
    degree = torch.tensor([5.0, 1.0, 3.0, 9.0, 1.0])
    p = qat.protection_probability(degree, (0.0, 0.4))
    assert torch.allclose(p, torch.tensor([0.3, 0.0, 0.2, 0.4, 0.1]))
    always = qat.protect_mask(degree, (1.0, 1.0), lambda shape, device: torch.rand(shape))
    assert always.all()


def test_degree_quant_protects_nodes_in_training():
    data = planted_graph(nodes=200, seed=4)
    torch.manual_seed(0)
    prepared = qat.prepare(GCN(16, 8, 4), bits=1, skip_last=False, degree_quant=(1.0, 1.0), seed=0)
    plain = copy.deepcopy(prepared)
    object.__setattr__(plain.conv1, "qconfig", plain.conv1.qconfig.replace(degree_quant=None))
    conv, ref = prepared.conv1, plain.conv1
    for fq in (conv.lin.weight_quant, ref.lin.weight_quant):
        fq.disable_fake_quant()
    # With every node protected (p = 1) only the weights are quantized: here, nothing at all.
    out = conv(data.x, data.edge_index)
    gcn = GCNConv(16, 8, cached=False)
    gcn.load_state_dict({k: v for k, v in conv.state_dict().items() if k in gcn.state_dict()})
    assert torch.allclose(out, gcn(data.x, data.edge_index), atol=1e-5)
    assert not torch.allclose(ref(data.x, data.edge_index), out, atol=1e-3)
    ref.load_state_dict(conv.state_dict())  # the same observed ranges
    conv.eval(), ref.eval()
    with torch.no_grad():  # evaluation quantizes every node
        assert torch.equal(conv(data.x, data.edge_index), ref(data.x, data.edge_index))


# --- metrics ----------------------------------------------------------------------------------
def test_quantization_error_and_recommendation():
    x = randn(200, 32, 8)
    errors = qat.quantization_errors(x, dim=0)
    assert errors[1] > errors[2] > errors[4] > errors[8] > 0
    # Uniform rounding error: e_b ≈ s_b / sqrt(12) · sqrt(n) / ||x||.
    s8 = (x.amax(0) - x.amin(0)) / 255
    predicted = float((s8.square().sum() * 200 / 12).sqrt() / x.norm())
    assert abs(errors[8] - predicted) < 0.1 * predicted
    assert qat.recommend_bits(x, threshold=errors[4] * 1.0001, dim=0) == 4
    assert qat.recommend_bits(x, threshold=errors[8] / 2, dim=0) is None
    assert qat.quantization_error(torch.zeros(3, 3), 2) == 0.0
    with pytest.raises(ValueError, match="threshold"):
        qat.recommend_bits(x, threshold=0)
    with pytest.raises(ValueError, match="candidates"):
        qat.recommend_bits(x, candidates=(3, 16))


# --- training ---------------------------------------------------------------------------------
def test_qat_training_reaches_accuracy():
    """4-bit QAT of a GCN (every layer quantized, stochastic rounding) on a planted-class graph.

    On this graph a fp32 GCN scores about 0.99 and 4-bit QAT about 0.99 (3 seeds, 60 epochs); the
    features alone are weak (SNR 0.3), so reaching 0.9 needs the aggregation to work.
    """
    data = planted_graph()
    torch.manual_seed(0)
    model = train(qat.prepare(GCN(16, 16, 4), bits=4, skip_last=False, seed=0), data, epochs=60)
    accuracy = test_accuracy(model, data)
    assert accuracy >= 0.9, accuracy
    assert test_accuracy(qat.convert(model), data) == accuracy


@pytest.mark.parametrize("observer", ["mse", "ema"])
def test_stored_range_of_a_dead_channel_never_makes_nan(observer):
    """A channel that stays zero (a dead ReLU) makes an EMA range decay by 0.9 a step; after ~830 steps its width
    is subnormal, 1 / scale overflows to inf and (x - lo) * inf is NaN (seen in GIN QAT on an H100, channel 28 of
    an aggregation quantizer at step 827).  The stored range must collapse to zero width instead."""
    torch.manual_seed(0)
    fq = qat.FakeQuantize(4, observer, dim=0, stochastic=True, seed=3)
    fq.train()
    for step in range(1000):
        x = torch.randn(64, 3).relu()  # as after a ReLU: the low end stays exactly 0
        if step >= 5:
            x[:, 1] = 0.0
        out = fq(x)
        assert torch.isfinite(out).all(), step
    lo, hi = fq.range()
    assert float(hi[1] - lo[1]) == 0.0 and float(lo[1]) == 0.0
    assert torch.equal(out[:, 1], torch.zeros(64))


def test_narrow_loaded_or_learned_ranges_never_make_nan():
    """The same overflow through the other ways a range reaches the quantizer: a saved state, and a learned step
    (forward, LSQ+ gradients, evaluation)."""
    torch.manual_seed(1)
    x = torch.randn(64, 3).relu()
    x[:, 1] = 0.0
    fq = qat.FakeQuantize(4, "ema", dim=0, stochastic=False)
    fq.train()
    fq(torch.rand(64, 3))
    state = fq.state_dict()
    state["observer.min_val"] = torch.zeros(3)
    state["observer.max_val"] = torch.tensor([1.0, 1e-39, 1.0])
    fq.load_state_dict(state)
    fq.eval()
    out = fq(x)
    assert torch.isfinite(out).all() and torch.equal(out[:, 1], torch.zeros(64))

    learned = qat.FakeQuantize(4, "learned", dim=1, groups=64)
    learned.train()
    learned(x)
    with torch.no_grad():
        learned.observer.range_lo.zero_()
        learned.observer.log_step.fill_(-95.0)
    xg = x.clone().requires_grad_()
    out = learned(xg)
    out.sum().backward()
    for t in (out, xg.grad, learned.observer.range_lo.grad, learned.observer.log_step.grad):
        assert torch.isfinite(t).all()
    learned.eval()
    assert torch.isfinite(learned(x)).all()


@pytest.mark.parametrize("compiled", [True, False])
def test_ema_range_rejects_a_stored_range_of_another_size(compiled, monkeypatch):
    from pyg_quant import ops
    if not compiled:
        monkeypatch.setattr(ops, "use_compiled", lambda op, device: False)
    x = randn(10, 3, 0)
    with pytest.raises(ValueError, match="3 ranges but 2 are stored"):
        ops.ema_range(x, torch.zeros(2), torch.ones(2), 0.1, 0, [], 0)
    with pytest.raises(ValueError, match="dim must be"):
        ops.ema_range(x, torch.zeros(1), torch.ones(1), 0.1, 2, [], 0)
