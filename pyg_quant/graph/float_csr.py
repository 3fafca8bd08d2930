r"""Float sparse-dense products for the layers' float aggregation: ``A`` and ``Aᵀ`` prebuilt in CSR.

Training computes ``Â · y`` in float (fake-quantized values, or ``bits=None``).  PyG's
``edge_index`` path materialises an ``[edges, F]`` message matrix (``index_select``) and
scatters it back (``index_add``), and autograd's backward of ``torch.sparse.mm`` on a
COO matrix transposes and coalesces it (a sort of every edge) at every call.  A graph
here keeps ``A`` (rows = targets) and ``Aᵀ`` (rows = sources) in CSR, built once with
one sort each, and :func:`pyg_quant.ops.csr_product` runs the forward and the backward as one CSR
product each; GCN's training aggregation ``D^-1/2 Â`` takes its row scaling and self-loop term folded into the
matrix (:func:`scaled_csr_pair`).
"""
import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor


def _index_dtype(nnz: int, num_rows: int, num_cols: int) -> torch.dtype:
    return torch.int32 if max(nnz, num_rows, num_cols) < 2**31 else torch.int64


def csr_tensor(crow: Tensor, col: Tensor, values: Tensor, num_rows: int, num_cols: int) -> Tensor:
    """The CSR matrix of row pointers ``crow``, columns ``col`` and ``values`` (indices int32 where they fit)."""
    index_dtype = _index_dtype(col.numel(), num_rows, num_cols)
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state", once per process
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow.to(index_dtype), col.to(index_dtype), values, (num_rows, num_cols),
                                       check_invariants=False)


def csr_matrix(rows: Tensor, cols: Tensor, values: Optional[Tensor], num_rows: int, num_cols: int,
               dtype: torch.dtype) -> Tensor:
    """``M[rows[e], cols[e]] += values[e]`` (ones when None) as CSR, repeated entries kept (SpMM sums them)."""
    return _csr_matrices(rows, cols, values, num_rows, num_cols, dtype, with_transpose=False)[0]


def csr_pair(rows: Tensor, cols: Tensor, values: Optional[Tensor], num_rows: int, num_cols: int,
             dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``(M, Mᵀ)`` of :func:`csr_matrix`, the indices cast once for both (and the ones shared)."""
    return _csr_matrices(rows, cols, values, num_rows, num_cols, dtype, with_transpose=True)


def _csr_matrices(rows: Tensor, cols: Tensor, values: Optional[Tensor], num_rows: int, num_cols: int,
                  dtype: torch.dtype, with_transpose: bool) -> tuple:
    index_dtype = _index_dtype(rows.numel(), num_rows, num_cols)
    # Indices in the CSR's own dtype first: int32 sort keys take half the radix passes of int64's (the same stable
    # order), and the sorted columns need no cast afterwards.
    rows, cols = rows.to(index_dtype), cols.to(index_dtype)
    ones = torch.ones(rows.numel(), dtype=dtype, device=rows.device) if values is None else None

    def build(keys: Tensor, other: Tensor, n_keys: int, n_other: int) -> Tensor:
        # One sort gives the row pointers and the column order; a stable one fixes the order of each row's sum.
        sorted_keys, order = torch.sort(keys, stable=True)
        crow = torch._convert_indices_from_coo_to_csr(sorted_keys, n_keys, out_int32=index_dtype == torch.int32)
        entries = ones if values is None else values.index_select(0, order).to(dtype)
        return csr_tensor(crow, other.index_select(0, order), entries, n_keys, n_other)

    matrix = build(rows, cols, num_rows, num_cols)
    return (matrix, build(cols, rows, num_cols, num_rows)) if with_transpose else (matrix,)


def scaled_csr_pair(rows: Tensor, cols: Tensor, values: Optional[Tensor], row_scale: Tensor, diag: Optional[Tensor],
                    num_rows: int, num_cols: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``(M, Mᵀ)`` in CSR for ``M = diag(row_scale) · (A + diag(diag))``, ``A[rows[e], cols[e]] += values[e]`` (ones
    when None): GCN's aggregation ``D^-1/2 Â`` with its row scaling and self-loop term folded into one product
    (``diag`` needs a square ``A``)."""
    scale = row_scale.to(dtype)
    entries = scale.index_select(0, rows)
    if values is not None:
        entries = entries * values.to(dtype)
    if diag is not None:
        nodes = torch.arange(num_rows, dtype=rows.dtype, device=rows.device)
        rows, cols = torch.cat((rows, nodes)), torch.cat((cols, nodes))
        entries = torch.cat((entries, scale * diag.to(dtype)))
    return csr_pair(rows, cols, entries, num_rows, num_cols, dtype)


class RebuiltOnCopy(dict):
    """A dict of values derived from their owner on first use; copies and pickles start empty.

    Sparse CSR tensors can be neither deep-copied nor pickled, and a model holding a graph
    (``QGCNConv(cached=True)``) is both, e.g. by :func:`~pyg_quant.qat.convert`.
    """

    def __deepcopy__(self, memo):
        return type(self)()

    def __reduce__(self):
        return type(self), ()
