"""``csr_pair``: a float aggregation's ``M = diag(row_scale) · (A + diag(diag))`` and ``Mᵀ`` in CSR from an edge list.

The kernels (a counting sort on the CPU, a radix sort over the keys' bits on the GPU) must give the reference's
matrices exactly: the same int32 row pointers and columns (each row's entries in edge order, a row's diagonal entry
after its edges) and the same values (one product each, in the same order).
"""
import pytest
import torch

from conftest import DEVICES, requires_compiled, requires_cuda
from pyg_quant import ops
from pyg_quant.ops import reference as ref


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_case(num_rows, num_cols, edges, seed, *, values=None, keep=False, scaled=False, diag=False,
                index_dtype=torch.int64):
    """Arguments of csr_pair for a random edge list (repeated entries and self-loops included)."""
    g = gen(seed)
    rows = torch.randint(num_rows, (edges,), generator=g).to(index_dtype)
    cols = torch.randint(num_cols, (edges,), generator=g).to(index_dtype)
    vals = None
    if values == "float":
        vals = torch.randn(edges, generator=g, dtype=torch.float64)
    elif values == "count":
        vals = torch.randint(1, 5, (edges,), generator=g)
    return (rows, cols, vals, rows != cols if keep else None,
            torch.rand(num_rows, generator=g) + 0.1 if scaled else None,
            torch.rand(num_rows, generator=g) * 2 if diag else None, num_rows, num_cols)


CASES = [dict(values=v, keep=k, scaled=s, diag=d) for v in (None, "float", "count") for k in (False, True)
         for s, d in ((False, False), (True, False), (True, True), (False, True))]


def assert_same(got, want):
    assert len(got) == len(want) == 6
    for name, a, b in zip(("crow", "col", "val", "crow_t", "col_t", "val_t"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.cpu(), b.cpu()), name


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernels_equal_the_reference(device, case, dtype):
    args = random_case(60, 60, 700, seed=len(str(case)), **case)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    for transpose in (True, False):
        got = torch.ops.pyg_quant.csr_pair(*args, dtype, transpose)
        assert got[0].device.type == device
        assert_same(got, ref.csr_pair(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], dtype,
                                      transpose))


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
def test_matrices_are_the_sums_of_the_entries(device):
    """M's dense form is the scaled sum of its entries (repeated ones summed), Mᵀ its transpose; int32 indices; each
    row's columns in edge order, the diagonal entry last."""
    rows = torch.tensor([2, 0, 2, 1, 2, 0, 1])
    cols = torch.tensor([1, 3, 1, 0, 2, 3, 1])
    values = torch.tensor([0.5, 1.0, 2.0, -1.0, 4.0, 3.0, 7.0], dtype=torch.float64)
    keep = torch.tensor([True, True, True, True, True, True, False])
    scale = torch.tensor([2.0, 3.0, 5.0, 7.0], dtype=torch.float64)
    diag = torch.tensor([0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    crow, col, val, crow_t, col_t, val_t = ops.csr_pair(rows.to(device), cols.to(device), values.to(device),
                                                        keep.to(device), scale.to(device), diag.to(device), 4, 4,
                                                        torch.float64)
    kept = torch.where(keep, values, torch.zeros_like(values))
    dense = torch.zeros(4, 4, dtype=torch.float64).index_put_((rows, cols), kept, accumulate=True) + torch.diag(diag)
    dense = scale.view(-1, 1) * dense
    m = torch.sparse_csr_tensor(crow.cpu(), col.cpu(), val.cpu(), (4, 4))
    m_t = torch.sparse_csr_tensor(crow_t.cpu(), col_t.cpu(), val_t.cpu(), (4, 4))
    assert torch.equal(m.to_dense(), dense) and torch.equal(m_t.to_dense(), dense.t())
    assert crow.dtype == col.dtype == crow_t.dtype == col_t.dtype == torch.int32
    assert col.tolist() == [3, 3, 0, 0, 1, 1, 1, 1, 2, 2, 3]  # rows 0..3 in edge order, each diagonal entry last


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
def test_empty_edge_lists_and_empty_rows(device):
    rows = torch.zeros(0, dtype=torch.int64, device=device)
    got = ops.csr_pair(rows, rows, None, None, None, None, 5, 3, torch.float32)
    assert [t.tolist() for t in got] == [[0] * 6, [], [], [0] * 4, [], []]
    diag = torch.arange(1.0, 4.0, device=device)
    crow, col, val = ops.csr_pair(rows, rows, None, None, None, diag, 3, 3, torch.float32)[:3]
    assert crow.tolist() == [0, 1, 2, 3] and col.tolist() == [0, 1, 2] and val.tolist() == [1.0, 2.0, 3.0]
    got = ops.csr_pair(torch.tensor([4, 4], device=device), torch.tensor([0, 2], device=device), None, None, None,
                       None, 9, 3, torch.float32)
    assert got[0].tolist() == [0, 0, 0, 0, 0, 2, 2, 2, 2, 2] and got[3].tolist() == [0, 1, 1, 2]


@requires_compiled
@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_are_named(device):
    rows = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match="one length"):
        ops.csr_pair(rows, rows[:2], None, None, None, None, 3, 3, torch.float32)
    with pytest.raises(TypeError, match="both be int64 or both int32"):
        ops.csr_pair(rows.float(), rows, None, None, None, None, 3, 3, torch.float32)
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        ops.csr_pair(rows, rows, None, None, None, None, 3, 3, torch.float16)
    with pytest.raises(ValueError, match="values must be one per edge"):
        ops.csr_pair(rows, rows, torch.ones(2, device=device), None, None, None, 3, 3, torch.float32)
    with pytest.raises(TypeError, match="keep must be a bool"):
        ops.csr_pair(rows, rows, None, rows, None, None, 3, 3, torch.float32)
    with pytest.raises(ValueError, match="one value per row"):
        ops.csr_pair(rows, rows, None, None, torch.ones(2, device=device), None, 3, 3, torch.float32)
    with pytest.raises(ValueError, match="diag needs a square matrix"):
        ops.csr_pair(rows, rows, None, None, None, torch.ones(3, device=device), 3, 4, torch.float32)
    if device == "cpu":  # (on the GPU a device-side assert: it would end the process's CUDA context)
        with pytest.raises(ValueError, match="rows holds an index out of"):
            ops.csr_pair(rows, rows, None, None, None, None, 2, 3, torch.float32)
        with pytest.raises(ValueError, match="cols holds an index out of"):
            ops.csr_pair(rows, rows - 1, None, None, None, None, 3, 3, torch.float32)


@requires_compiled
def test_opcheck():
    for args in (random_case(20, 30, 90, seed=1, values="float", keep=True),
                 random_case(20, 20, 90, seed=2, scaled=True, diag=True, index_dtype=torch.int32)):
        for transpose in (True, False):
            torch.library.opcheck(torch.ops.pyg_quant.csr_pair.default, args + (torch.float32, transpose))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("num_nodes", [1, 255, 256, 70_000])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_sorts_every_key_bit(num_nodes, index_dtype):
    """Keys over 1 to 17 bits and the direction bit above them (the sort reads only those): the GPU gives the CPU
    kernel's matrices."""
    for case in (dict(), dict(values="float", keep=True, scaled=True, diag=True)):
        args = random_case(num_nodes, num_nodes, 5 * num_nodes + 3, seed=num_nodes, index_dtype=index_dtype, **case)
        want = torch.ops.pyg_quant.csr_pair(*args, torch.float32)
        got = torch.ops.pyg_quant.csr_pair(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args],
                                           torch.float32)
        assert_same(got, want)
