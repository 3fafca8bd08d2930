"""``degree_inv_sqrt``: GCN's degrees of an unweighted edge list and ``d^-1/2`` in one op.

The kernels (a loop on the CPU, 64-bit integer atomics on the GPU) must give the reference's floats exactly: the
integer sums are exact in any order, then one float32 rounding, the diagonal term's float32 add, and
``inv_sqrt_degree``'s float64 sqrt and division rounded once.
"""
import pytest
import torch

from conftest import DEVICES, requires_compiled, requires_cuda
import pyg_quant as pq
from pyg_quant import ops
from pyg_quant.graph.cache import graph_cache_disabled
from pyg_quant.ops import reference as ref


def case(num_nodes, edges, seed, *, keep=False, count=False, diag=False, index_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    targets = num_nodes - 10 if num_nodes > 20 else num_nodes  # the last 10 nodes receive no edge
    dst = torch.randint(targets, (edges,), generator=g).to(index_dtype)
    return (dst, torch.rand(edges, generator=g) < 0.8 if keep else None,
            torch.randint(1, 6, (edges,), generator=g) if count else None,
            torch.rand(num_nodes, generator=g) * 3 if diag else None, num_nodes)


CASES = [dict(keep=k, count=c, diag=d) for k in (False, True) for c in (False, True) for d in (False, True)]


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", CASES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_kernels_equal_the_reference(device, options, index_dtype):
    args = case(50, 400, seed=len(str(options)), index_dtype=index_dtype, **options)
    want = ref.degree_inv_sqrt(*args)
    got = torch.ops.pyg_quant.degree_inv_sqrt(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args])
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.device.type == device
        assert torch.equal(a.cpu(), b)
    deg, inv_sqrt = want
    isolated = deg == 0
    assert int(isolated.sum()) == (0 if options["diag"] else 10)
    assert torch.equal(inv_sqrt[isolated], torch.zeros(int(isolated.sum())))


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
def test_a_gcn_layer_on_an_edge_index_gets_the_normalization_of_its_degrees(device):
    """The layer's degrees are the edges into each node that are not self-loops plus the added self-loop (the edge
    list's loops replaced by it), and its ``D^-1/2`` ``inv_sqrt_degree`` of those, bit for bit."""
    g = torch.Generator().manual_seed(3)
    edge_index = torch.randint(60, (2, 500), generator=g)
    edge_index[:, :20] = torch.arange(20).repeat(2, 1)  # some self-loops
    conv = pq.QGCNConv(8, 4, bits=4).to(device)
    with graph_cache_disabled():
        graph = conv._graph(torch.zeros(60, 8, device=device), edge_index.to(device), None)
    assert graph.deg_inv_sqrt.device.type == device
    src, dst = edge_index
    expected = torch.bincount(dst[src != dst], minlength=60).to(torch.float32) + 1.0
    assert torch.equal(graph.degree().cpu(), expected)
    assert torch.equal(graph.deg_inv_sqrt.cpu(), ref.inv_sqrt_degree(expected))


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_are_named(device):
    dst = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(TypeError, match="dst must be int64 or int32"):
        ops.degree_inv_sqrt(dst.float(), None, None, None, 3)
    with pytest.raises(ValueError, match="keep must be one per edge"):
        ops.degree_inv_sqrt(dst, torch.ones(2, dtype=torch.bool, device=device), None, None, 3)
    with pytest.raises(TypeError, match="count must hold integers"):
        ops.degree_inv_sqrt(dst, None, torch.ones(3, device=device), None, 3)
    with pytest.raises(ValueError, match="diag must hold one value per node"):
        ops.degree_inv_sqrt(dst, None, None, torch.ones(2, device=device), 3)
    if device == "cpu":  # (on the GPU a device-side assert: it would end the process's CUDA context)
        with pytest.raises(ValueError, match="dst holds an index out of"):
            ops.degree_inv_sqrt(dst, None, None, None, 2)


@requires_compiled
def test_opcheck():
    for args in (case(20, 90, 1, keep=True, count=True, diag=True), case(20, 0, 2), case(7, 30, 3)):
        torch.library.opcheck(torch.ops.pyg_quant.degree_inv_sqrt.default, args)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("num_nodes", [1, 3000, 70_000])
def test_gpu_equals_the_cpu_kernel(num_nodes):
    """Many edges into few targets (the atomics collide) and many targets alike."""
    for options in (dict(), dict(keep=True, count=True, diag=True)):
        args = case(num_nodes, 20 * num_nodes + 5, seed=num_nodes, **options)
        want = torch.ops.pyg_quant.degree_inv_sqrt(*args)
        got = torch.ops.pyg_quant.degree_inv_sqrt(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b)
