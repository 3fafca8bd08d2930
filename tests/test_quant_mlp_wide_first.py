"""quant_mlp's kernels for a first layer wider than the rest (65 to 128 inputs, every later width at most 64: GIN's
and GCN's first layers on 100 features), which keep the first layer's values in their own registers.

Each chain below takes that path on the GPU; the GPU must equal the CPU bit for bit for float input
(``quant_mlp``) and for the codes of a packed tensor in both layouts (``quant_mlp_planes``), with and without a row
scale and column keys (``quant_mlp_keys`` / ``quant_mlp_planes_keys``), at row counts that leave partial groups and
take several grid-stride trips.  Both CPU and GPU are also checked against the layer-by-layer definition on the CPU.
"""
import pytest
import torch

import pyg_quant as pq

from conftest import requires_cuda
from test_col_keys import expected_keys
from test_quant_mlp import composition, make_case, row_scale_for

pytestmark = pytest.mark.cuda

# (widths, seed): one or two later chunks, widths that are and are not multiples of 4 or 16, ReLU or not
CHAINS = [([100, 16], 0), ([100, 64, 64], 1), ([128, 64, 47], 2), ([65, 32, 1], 3), ([100, 64], 4),
          ([97, 7, 33, 64], 5)]


@requires_cuda
@pytest.mark.parametrize("n", [5, 259, 70_003])
@pytest.mark.parametrize("keys", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("k", range(len(CHAINS)))
def test_float_input_gpu_equals_cpu(k, scaled, keys, n):
    widths, seed = CHAINS[k]
    args, wts = make_case(seed, n=n, widths=widths)
    cuda_args, _ = make_case(seed, n=n, device="cuda", widths=widths)
    scale = row_scale_for(n, seed) if scaled else None
    op = torch.ops.pyg_quant.quant_mlp_keys if keys else torch.ops.pyg_quant.quant_mlp
    want = op(*args, scale)
    got = op(*cuda_args, None if scale is None else scale.cuda())
    if keys:
        (want, cpu_keys), (got, gpu_keys) = want, got
        assert gpu_keys.is_cuda and gpu_keys.dtype == torch.int64 and gpu_keys.shape == (2 * widths[-1],)
        assert torch.equal(gpu_keys.cpu(), cpu_keys)
        assert torch.equal(cpu_keys, expected_keys(want))
    assert torch.equal(got.cpu(), want)
    if n < 1000 and not scaled:
        assert torch.equal(want, composition(args[0], wts, args[5], args[6], args[8]))


@requires_cuda
@pytest.mark.parametrize("n", [5, 259, 70_003])
@pytest.mark.parametrize("keys", [False, True])
@pytest.mark.parametrize("layout", ["col", "row"])
@pytest.mark.parametrize("k", range(len(CHAINS)))
def test_planes_input_gpu_equals_cpu(k, layout, keys, n):
    widths, seed = CHAINS[k]
    args, _ = make_case(seed, n=n, widths=widths)
    x = pq.to_bit(args[0], 1 + seed % 8, dim=0, layout=layout)
    layers = args[1:]
    cuda_layers = make_case(seed, n=n, device="cuda", widths=widths)[0][1:]
    scale = row_scale_for(n, seed)

    def planes(t):
        return (t.planes, t.rows, t.cols, t.layout == "col", t.lo, t.scale, 0)

    op = torch.ops.pyg_quant.quant_mlp_planes_keys if keys else torch.ops.pyg_quant.quant_mlp_planes
    want = op(*planes(x), *layers, scale)
    got = op(*planes(x.to("cuda")), *cuda_layers, scale.cuda())
    if keys:
        (want, cpu_keys), (got, gpu_keys) = want, got
        assert gpu_keys.is_cuda and gpu_keys.dtype == torch.int64 and gpu_keys.shape == (2 * widths[-1],)
        assert torch.equal(gpu_keys.cpu(), cpu_keys)
        assert torch.equal(cpu_keys, expected_keys(want))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want, torch.ops.pyg_quant.quant_mlp(pq.to_val(x), *layers, scale))
