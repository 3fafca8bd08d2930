"""The fused QAT ops ``fake_quantize`` and ``mse_range``: compiled CPU == pure-torch reference, GPU == CPU.

The reference (:mod:`pyg_quant.ops.reference`) writes the float32 steps out one torch op at a
time; the compiled kernels must give the same bits.  ``mse_range`` sums float64 errors in
another order on each backend, so its ranges agree except at a near-tie of two candidates
(a difference of ~1e-16 relative), which random data does not produce.
"""
import itertools

import pytest
import torch

import pyg_quant as pq
from pyg_quant import ops
from pyg_quant.ops import reference as ref
from pyg_quant.quantization.ranges import MSE_GRID

from conftest import CUDA_OK, gen, randn, requires_compiled

SHAPES = [(1, 1), (1, 300), (513, 3), (257, 65), (2000, 7), (33, 1025)]
DIMS = (-1, 0, 1)


def _data(rows, cols, seed, heavy=False):
    x = randn(rows, cols, seed, shift=0.3, spread=2.0)
    return x ** 3 if heavy else x


def _equal(a, b):
    """The same values, NaN where the other has NaN (a GPU writes the canonical NaN, the CPU keeps the input's)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


def _ranges(x, dim):
    return ref._own_range(x, dim)


@requires_compiled
@pytest.mark.parametrize("shape", SHAPES)
def test_fake_quantize_cpu_equals_reference(shape):
    rows, cols = shape
    x = _data(rows, cols, rows * 7 + cols, heavy=rows % 2 == 1)
    clean = x.clone()
    if cols > 8:  # a NaN and infinities inside the CPU's 8-wide vector loop, not only in its scalar tail
        x[0, 3], x[-1, 5], x[rows // 2, 8] = float("nan"), float("inf"), -float("inf")
    noise = torch.rand(rows, cols, generator=gen(rows + cols))
    for bits, dim, nz, given, with_mask in itertools.product((1, 2, 4, 8), DIMS, (None, noise), (False, True),
                                                             (False, True)):
        lo = hi = None
        if given:  # a finite range narrower than the data, so some values clip
            lo, hi = _ranges(clean, dim)
            lo, hi = lo + 0.2 * (hi - lo), hi - 0.2 * (hi - lo)
        out, mask = torch.ops.pyg_quant.fake_quantize(x, lo, hi, bits, dim, nz, with_mask)
        r_out, r_mask = ref.fake_quantize(x, lo, hi, bits, dim, nz, with_mask)
        assert _equal(out, r_out), (bits, dim, nz is None, given)
        assert _equal(mask, r_mask)
        if with_mask and given and dim == -1 and x.numel() > 2:
            assert 0 < int(mask.sum()) < mask.numel()  # the narrowed range clips some values


@requires_compiled
def test_fake_quantize_values_and_edge_cases():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, float("nan"), 1.0, 0.5]])
    out, _ = torch.ops.pyg_quant.fake_quantize(x, None, None, 1, 1, None, False)
    assert torch.equal(out[0], torch.tensor([0.0, 0.0, 3.0, 3.0]))  # 1 bit per row: {lo, hi}, nearest
    assert torch.equal(out[1], x[1])  # a constant row is exact (scale 0)
    assert torch.isnan(out[2]).all()  # NaN makes its row's range NaN: nothing looks valid
    lo, hi = torch.tensor([0.0]), torch.tensor([1.5])
    out, mask = torch.ops.pyg_quant.fake_quantize(x[:1], lo, hi, 2, -1, None, True)
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 1.5, 1.5]]))  # 2 and 3 clip to hi
    assert torch.equal(mask, torch.tensor([[True, True, False, False]]))


def _check_drawn_noise(device):
    """random_noise=True draws exactly torch.rand(x.shape, generator=g): seed-deterministic, and SR unbiased."""
    x = _data(300, 17, 4).to(device)
    for dim in DIMS:
        g1 = torch.Generator(device=device).manual_seed(5)
        g2 = torch.Generator(device=device).manual_seed(5)
        drawn = ops.fake_quantize(x, None, None, 2, dim, None, False, True, g1)[0]
        given = ops.fake_quantize(x, None, None, 2, dim, torch.rand(x.shape, generator=g2, device=device), False)[0]
        assert _equal(drawn, given)
        assert not _equal(drawn, ops.fake_quantize(x, None, None, 2, dim, None, False, True, g1)[0])  # moved on
    # unbiased: the mean of many stochastic roundings of a constant 0.3 on the grid {0, 1} is 0.3
    y = torch.full((2000, 8), 0.3, device=device)
    y[0, 0], y[1, 0] = 0.0, 1.0  # the per-tensor range [0, 1], 1 bit
    mean = ops.fake_quantize(y, None, None, 1, -1, None, False, True, torch.Generator(device=device).manual_seed(1))[0]
    assert abs(float(mean[2:].mean()) - 0.3) < 0.01
    with pytest.raises(ValueError, match="not both"):
        ops.fake_quantize(x, None, None, 2, 0, torch.rand(x.shape, device=device), False, True, None)


@requires_compiled
def test_fake_quantize_draws_its_noise_like_torch_rand():
    _check_drawn_noise("cpu")


@requires_compiled
@pytest.mark.parametrize("shape", SHAPES)
def test_mse_range_cpu_equals_reference(shape):
    rows, cols = shape
    for heavy, bits, dim in itertools.product((False, True), (1, 2, 4, 8), DIMS):
        x = _data(rows, cols, rows + 3 * cols + bits, heavy)
        lo, hi = torch.ops.pyg_quant.mse_range(x, dim, bits, list(MSE_GRID))
        r_lo, r_hi = ref.mse_range(x, dim, bits, MSE_GRID)
        assert _equal(lo, r_lo) and _equal(hi, r_hi), (heavy, bits, dim)


@requires_compiled
def test_mse_range_picks_the_least_error_candidate():
    """Checked against an independent float64 evaluation of every candidate."""
    x = _data(3000, 5, 11, heavy=True)
    for bits in (1, 2, 3):
        lo, hi = torch.ops.pyg_quant.mse_range(x, 0, bits, list(MSE_GRID))
        mn, mx = x.amin(0).double(), x.amax(0).double()
        center = torch.minimum(mn.clamp(min=0), mx)
        errs = []
        for a in MSE_GRID:
            c_lo, c_hi = center + a * (mn - center), center + a * (mx - center)
            s = (c_hi - c_lo) / (2**bits - 1)
            q = ((x.double() - c_lo) / s).round().clamp(0, 2**bits - 1)
            errs.append(((c_lo + s * q - x.double()) ** 2).sum(0))
        errs = torch.stack(errs)
        chosen = ((hi.double() - lo.double()) / (mx - mn)).sub(torch.tensor(MSE_GRID, dtype=torch.float64)
                                                              .view(-1, 1)).abs().argmin(0)
        # the chosen candidate's error is the smallest, up to float32 rounding of the candidate ranges
        assert (errs[chosen, torch.arange(5)] <= errs.min(0).values * (1 + 1e-4)).all()
        assert (chosen > 0).all()  # heavy tails at <= 3 bits: min/max is never the best


@requires_compiled
@pytest.mark.parametrize("call, message", [
    (lambda: torch.ops.pyg_quant.fake_quantize(torch.randn(3, 4), None, None, 9, 0, None, False), "bits"),
    (lambda: torch.ops.pyg_quant.fake_quantize(torch.randn(3, 4), None, None, 4, 2, None, False), "dim"),
    (lambda: torch.ops.pyg_quant.fake_quantize(torch.randn(3, 4).double(), None, None, 4, 0, None, False), "float32"),
    (lambda: torch.ops.pyg_quant.fake_quantize(torch.randn(3, 4), torch.zeros(3), torch.ones(3), 4, 0, None, False),
     "one value per group"),
    (lambda: torch.ops.pyg_quant.fake_quantize(torch.randn(3, 4), torch.zeros(4), None, 4, 0, None, False),
     "together"),
    (lambda: torch.ops.pyg_quant.fake_quantize(torch.randn(3, 4), None, None, 4, 0, torch.rand(4, 3), False),
     "noise"),
    (lambda: torch.ops.pyg_quant.fake_quantize(torch.randn(0, 4), None, None, 4, 0, None, False), "empty"),
    (lambda: torch.ops.pyg_quant.mse_range(torch.randn(3, 4), 0, 0, [1.0]), "bits"),
    (lambda: torch.ops.pyg_quant.mse_range(torch.randn(3, 4), 0, 2, []), "grid"),
    (lambda: torch.ops.pyg_quant.mse_range(torch.randn(3, 4), 0, 2, [1.0] * 17), "grid"),
    (lambda: torch.ops.pyg_quant.mse_range(torch.randn(3, 4), 0, 2, [1.5]), "grid"),
    (lambda: torch.ops.pyg_quant.mse_range(torch.randn(3, 4), 3, 2, [1.0]), "dim"),
])
def test_fused_op_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_fake_quantize_module_uses_the_fused_op_with_the_same_values(monkeypatch):
    """FakeQuantize's training and evaluation outputs are the reference formula's, via one op call a forward."""
    calls = []
    real = ops.fake_quantize

    def spy(*args, **kwargs):
        calls.append(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "fake_quantize", spy)
    x = _data(200, 9, 5)
    for observer, dim in (("dynamic", 1), ("ema", 0), ("mse", None), ("dynamic_mse", 0)):
        fq = pq.qat.FakeQuantize(4, observer, dim=dim, stochastic=True, seed=3)
        train_out = fq.train()(x)
        lo, hi = fq.range(x)
        noise = torch.rand(x.shape, generator=gen(3))  # the module's generator, restarted
        ref_out, _ = ref.fake_quantize(x, lo, hi, 4, -1 if dim is None else dim, noise, False)
        assert _equal(train_out, ref_out), observer
        eval_out = fq.eval()(x)
        assert _equal(eval_out, ref.fake_quantize(x, *fq.range(x), 4, -1 if dim is None else dim, None, False)[0])
    assert calls == [1, 1, 0, 0, -1, -1, 0, 0]


def _check_straight_through_gradient(device):
    """The op's own gradient: ``dL/dx = dL/dout`` inside the range and 0 outside it with ``with_mask``, passed
    through without; none to the range or the noise; and opcheck's autograd and fake-tensor checks."""
    x = _data(257, 65, 11).to(device)
    lo, hi = (t.to(device) * 0.7 for t in _ranges(x.cpu(), 0))
    weights = torch.rand(x.shape, generator=gen(4)).to(device)  # a loss whose gradient is not all ones
    for with_mask, random_noise, given in itertools.product((False, True), (False, True), (False, True)):
        x_grad = x.clone().requires_grad_()
        lo_grad, hi_grad = lo.clone().requires_grad_(), hi.clone().requires_grad_()
        args = (lo_grad, hi_grad) if given else (None, None)
        out, inside = torch.ops.pyg_quant.fake_quantize(x_grad, *args, 4, 0, None, with_mask, random_noise, None)
        assert out.requires_grad and not inside.requires_grad
        (out * weights).sum().backward()
        want = weights * inside if with_mask else weights
        assert torch.equal(x_grad.grad, want), (with_mask, random_noise, given)
        assert lo_grad.grad is None and hi_grad.grad is None
        if with_mask and given:
            assert 0 < int(inside.sum()) < inside.numel()  # both sides of the range are exercised
    noise = torch.rand(x.shape, generator=gen(5)).to(device)
    for args in ((x.clone().requires_grad_(), lo, hi, 4, 0, None, True),
                 (x.clone().requires_grad_(), None, None, 2, 1, noise, False)):
        torch.library.opcheck(torch.ops.pyg_quant.fake_quantize.default, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))


@requires_compiled
def test_fake_quantize_carries_the_straight_through_gradient():
    _check_straight_through_gradient("cpu")


@requires_compiled
def test_fake_quantize_gradient_compiles_with_inductor():
    """A training step through the op compiles with the default backend, whole, and gives eager's gradient."""
    x = _data(64, 9, 2)
    lo, hi = (t * 0.8 for t in _ranges(x, 0))

    def loss_fn(x):
        out = torch.ops.pyg_quant.fake_quantize(x, lo, hi, 4, 0, None, True, False, None)[0]
        return (out * out).sum()

    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_fn(eager_x).backward()
    torch._dynamo.reset()
    torch.compile(loss_fn, fullgraph=True)(compiled_x).backward()
    assert torch.allclose(compiled_x.grad, eager_x.grad, rtol=1e-6, atol=0)


def _ema_data(rows, cols, seed):
    """Random values with a NaN, an infinity and a constant (collapsing) group along each dim."""
    x = _data(rows, cols, seed, heavy=True)
    x[rows // 2, cols // 3] = float("nan")
    x[rows // 3, 1] = float("inf")
    x[:, cols - 1] = x[rows - 1, :] = 0.25  # a column and a row whose range is narrower than MIN_RANGE_WIDTH
    return x


def _ema_cases(x):
    stored = {}
    for dim in DIMS:
        groups = 1 if dim < 0 else x.shape[1 - dim]
        s_lo, s_hi = randn(groups, 1, 7, shift=-2.0).view(-1), randn(groups, 1, 8, shift=2.0).view(-1)
        if dim is not None and dim >= 0 and groups > 1:  # the constant group's stored range is its value
            s_lo[-1] = s_hi[-1] = x[-1, -1]
        stored[dim] = s_lo, s_hi
    return [(dim, grid, bits, stored[dim]) for dim in DIMS for grid, bits in (([], 0), (list(MSE_GRID), 4),
                                                                              ([1.0, 0.5], 2))]


@requires_compiled
@pytest.mark.parametrize("shape", [(1, 1), (37, 9), (1300, 70)])
def test_ema_range_cpu_equals_reference(shape):
    """The op's range is the reference's (the observers' batch range, then their EMA step), and its used hi is the
    collapsed one (hi = lo where narrower than MIN_RANGE_WIDTH); NaN and infinities propagate as amin / amax's."""
    from pyg_quant.quantization.affine import collapse_narrow_range
    x = _ema_data(*shape, 5) if shape[0] > 1 else randn(1, 1, 5)
    for dim, grid, bits, (s_lo, s_hi) in _ema_cases(x):
        lo, hi, used_hi = torch.ops.pyg_quant.ema_range(x, s_lo, s_hi, 0.1, dim, grid, bits)
        r_lo, r_hi, r_used = ref.ema_range(x, s_lo, s_hi, 0.1, dim, grid, bits)
        assert _equal(lo, r_lo) and _equal(hi, r_hi), (dim, grid)
        assert _equal(used_hi, collapse_narrow_range(r_lo, r_hi)[1]) and _equal(r_used, used_hi), (dim, grid)
        if shape[0] > 1 and dim is not None and dim >= 0:
            assert bool((used_hi == lo).any()) and bool(torch.isnan(lo).any())  # the constant group, the NaN


@requires_compiled
def test_ema_range_op_registration():
    x = _ema_data(300, 40, 6).nan_to_num(posinf=7.0)  # (opcheck compares outputs with NaN != NaN)
    for dim, grid, bits, stored in _ema_cases(x)[::2]:
        torch.library.opcheck(torch.ops.pyg_quant.ema_range.default, (x, *stored, 0.25, dim, grid, bits),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


# --- GPU == CPU -----------------------------------------------------------------------------



@pytest.mark.parametrize("shape", SHAPES + [(70000, 3)])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU and pyg_quant's compiled CUDA backend")
def test_fake_quantize_gpu_equals_cpu(shape):
    rows, cols = shape
    x = _data(rows, cols, rows + 5 * cols, heavy=cols % 2 == 1)
    x[rows // 2, cols // 2] = float("nan") if rows > 1000 else x[rows // 2, cols // 2]
    noise = torch.rand(rows, cols, generator=gen(rows))
    # (each row over its own range, dim 1 without lo / hi, runs a kernel of its own on the GPU: with the mask too)
    for bits, dim, nz, given, with_mask in itertools.product((1, 2, 3, 4, 8), DIMS, (None, noise), (False, True),
                                                             (False, True)):
        lo = hi = None
        if given:
            lo, hi = (t * 0.8 for t in _ranges(x.nan_to_num(), dim))
        cpu = torch.ops.pyg_quant.fake_quantize(x, lo, hi, bits, dim, nz, with_mask)
        gpu = torch.ops.pyg_quant.fake_quantize(x.cuda(), None if lo is None else lo.cuda(),
                                                None if hi is None else hi.cuda(), bits, dim,
                                                None if nz is None else nz.cuda(), with_mask)
        assert _equal(gpu[0], cpu[0]) and _equal(gpu[1], cpu[1]), (bits, dim, nz is None, given, with_mask)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU and pyg_quant's compiled CUDA backend")
def test_fake_quantize_carries_the_straight_through_gradient_on_the_gpu():
    _check_straight_through_gradient("cuda")


def _noise_at(seed, offset, index, cols):
    """The u that fake_quantize draws for element ``index`` of a ``[1, cols]`` tensor at generator state (seed, offset):
    1-bit rounding over the row's range [0, 1] gives 1 exactly where u >= 1 - v, so 24 replays of the same state
    bisect u on its 2^-24 grid."""
    low, high = 0, 2**24  # u * 2^24 lies in [low, high)
    while high - low > 1:
        mid = (low + high) // 2
        x = torch.full((1, cols), 0.5, device="cuda")
        x[0, 1], x[0, 2] = 0.0, 1.0  # the row's range (index is a multiple of 4)
        x[0, index] = 1.0 - mid / 2**24  # exact in float32: 1 - v = mid / 2^24
        g = torch.Generator(device="cuda").manual_seed(seed)
        g.set_offset(offset)
        up = ops.fake_quantize(x, None, None, 1, 1, None, False, True, g)[0][0, index] == 1.0
        low, high = (mid, high) if up else (low, mid)
    return low / 2**24


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU and pyg_quant's compiled CUDA backend")
def test_fake_quantize_draws_its_noise_on_the_gpu():
    """The CUDA kernels draw u in the kernel (Philox, no torch.rand launch): seed-deterministic, moved on by each call,
    the same for an element whichever kernel runs (own-row ranges or given ones), unbiased, and curand's Philox
    numbers (element 4k takes the first of subsequence k's four, as torch.rand's element k of a short tensor does)."""
    x = _data(300, 17, 4).cuda()
    for dim in DIMS:
        g1 = torch.Generator(device="cuda").manual_seed(5)
        g2 = torch.Generator(device="cuda").manual_seed(5)
        first = ops.fake_quantize(x, None, None, 2, dim, None, False, True, g1)[0]
        assert _equal(first, ops.fake_quantize(x, None, None, 2, dim, None, False, True, g2)[0])
        assert not _equal(first, ops.fake_quantize(x, None, None, 2, dim, None, False, True, g1)[0])  # moved on
    lo, hi = x.amin(1), x.amax(1)
    own = ops.fake_quantize(x, None, None, 3, 1, None, False, True, torch.Generator(device="cuda").manual_seed(9))[0]
    given = ops.fake_quantize(x, lo, hi, 3, 1, None, False, True, torch.Generator(device="cuda").manual_seed(9))[0]
    assert _equal(own, given)
    y = torch.full((2000, 8), 0.3, device="cuda")
    y[0, 0], y[1, 0] = 0.0, 1.0  # the per-tensor range [0, 1], 1 bit
    for dim in (-1, 0):
        mean = ops.fake_quantize(y, None, None, 1, dim, None, False, True,
                                 torch.Generator(device="cuda").manual_seed(1))[0][2:].mean()
        assert abs(float(mean) - 0.3) < 0.01, dim
    with pytest.raises(ValueError, match="not both"):
        ops.fake_quantize(x, None, None, 2, 0, torch.rand(x.shape, device="cuda"), False, True, None)
    with pytest.raises(RuntimeError, match="generator"):  # a CPU generator for a CUDA tensor
        ops.fake_quantize(x, None, None, 2, 0, None, False, True, torch.Generator().manual_seed(1))
    g = torch.Generator(device="cuda").manual_seed(123)
    g.set_offset(8)
    want = torch.rand(3, generator=g, device="cuda").tolist()
    got = [_noise_at(123, 8, 4 * k, 13) for k in range(3)]
    assert all(abs(a - b) <= 2**-24 for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("shape", SHAPES + [(70000, 3), (600, 64)])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU and pyg_quant's compiled CUDA backend")
def test_mse_range_gpu_equals_cpu_and_is_deterministic(shape):
    rows, cols = shape
    for heavy, bits, dim in itertools.product((False, True), (1, 2, 4, 8), DIMS):
        x = _data(rows, cols, 3 * rows + cols + bits, heavy)
        cpu = torch.ops.pyg_quant.mse_range(x, dim, bits, list(MSE_GRID))
        xg = x.cuda()
        gpu = torch.ops.pyg_quant.mse_range(xg, dim, bits, list(MSE_GRID))
        again = torch.ops.pyg_quant.mse_range(xg, dim, bits, list(MSE_GRID))
        assert _equal(gpu[0], cpu[0]) and _equal(gpu[1], cpu[1]), (heavy, bits, dim)
        assert _equal(gpu[0], again[0]) and _equal(gpu[1], again[1])
    x = _data(rows, cols, 1)
    x[0, 0] = float("nan")
    for dim in DIMS:
        assert _equal(torch.ops.pyg_quant.mse_range(x.cuda(), dim, 2, list(MSE_GRID))[0],
                      torch.ops.pyg_quant.mse_range(x, dim, 2, list(MSE_GRID))[0])


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU and pyg_quant's compiled CUDA backend")
@pytest.mark.parametrize("shape", [(1, 1), (37, 9), (1300, 70), (40000, 3)])
def test_ema_range_gpu_equals_cpu(shape):
    """The CUDA kernels (a warp a row; per column and per tensor: partial min/max over row chunks and column tiles,
    then the search and the EMA step) give the CPU's range bits, NaN where the CPU has NaN."""
    x = _ema_data(*shape, 9) if shape[0] > 1 else randn(1, 1, 9)
    for dim, grid, bits, (s_lo, s_hi) in _ema_cases(x):
        cpu = torch.ops.pyg_quant.ema_range(x, s_lo, s_hi, 0.1, dim, grid, bits)
        gpu = torch.ops.pyg_quant.ema_range(x.cuda(), s_lo.cuda(), s_hi.cuda(), 0.1, dim, grid, bits)
        for g, c in zip(gpu, cpu):
            assert _equal(g, c), (dim, grid)
