r"""Float sparse-dense products for the layers' float aggregation: ``A`` and ``Aᵀ`` prebuilt in CSR.

Training computes ``Â · y`` in float (fake-quantized values, or ``bits=None``).  PyG's
``edge_index`` path materialises an ``[edges, F]`` message matrix (``index_select``) and
scatters it back (``index_add``), and autograd's backward of ``torch.sparse.mm`` on a
COO matrix transposes and coalesces it (a sort of every edge) at every call.  A graph
here keeps ``A`` (rows = targets) and ``Aᵀ`` (rows = sources) in CSR, built once in one op
(:func:`pyg_quant.ops.csr_pair`: a stable sort of each direction's keys), and
:func:`pyg_quant.ops.csr_product` runs the forward and the backward as one CSR product each; GCN's training
aggregation ``D^-1/2 Â`` takes its row scaling and self-loop term folded into the matrix (:func:`scaled_csr_pair`).
"""
import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import ops


def csr_tensor(crow: Tensor, col: Tensor, values: Tensor, num_rows: int, num_cols: int) -> Tensor:
    """The CSR matrix of row pointers ``crow``, columns ``col`` and ``values`` (indices int32 where they fit)."""
    index_dtype = ops.reference.csr_index_dtype(col.numel(), num_rows, num_cols)
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state", once per process
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow.to(index_dtype), col.to(index_dtype), values, (num_rows, num_cols),
                                       check_invariants=False)


def csr_matrix(rows: Tensor, cols: Tensor, values: Optional[Tensor], num_rows: int, num_cols: int,
               dtype: torch.dtype) -> Tensor:
    """``M[rows[e], cols[e]] += values[e]`` (ones when None) as CSR, repeated entries kept (SpMM sums them)."""
    crow, col, val = ops.csr_pair(rows, cols, values, None, None, None, num_rows, num_cols, dtype, False)[:3]
    return csr_tensor(crow, col, val, num_rows, num_cols)


def csr_pair(rows: Tensor, cols: Tensor, values: Optional[Tensor], num_rows: int, num_cols: int,
             dtype: torch.dtype, keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(M, Mᵀ)`` of :func:`csr_matrix`, in one op (:func:`pyg_quant.ops.csr_pair`); ``keep`` (bool, one per edge)
    zeroes the values of the edges it drops."""
    return scaled_csr_pair(rows, cols, values, None, None, num_rows, num_cols, dtype, keep)


def scaled_csr_pair(rows: Tensor, cols: Tensor, values: Optional[Tensor], row_scale: Optional[Tensor],
                    diag: Optional[Tensor], num_rows: int, num_cols: int, dtype: torch.dtype,
                    keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(M, Mᵀ)`` in CSR for ``M = diag(row_scale) · (A + diag(diag))``, ``A[rows[e], cols[e]] += values[e]`` (ones
    when None; 0 where ``keep`` is False): GCN's aggregation ``D^-1/2 Â`` with its row scaling and self-loop term
    folded into one product (``diag`` needs a square ``A``), built in one op."""
    crow, col, val, crow_t, col_t, val_t = ops.csr_pair(rows, cols, values, keep, row_scale, diag, num_rows,
                                                        num_cols, dtype)
    return csr_tensor(crow, col, val, num_rows, num_cols), csr_tensor(crow_t, col_t, val_t, num_cols, num_rows)


class RebuiltOnCopy(dict):
    """A dict of values derived from their owner on first use; copies and pickles start empty.

    Sparse CSR tensors can be neither deep-copied nor pickled, and a model holding a graph
    (``QGCNConv(cached=True)``) is both, e.g. by :func:`~pyg_quant.qat.convert`.
    """

    def __deepcopy__(self, memo):
        return type(self)()

    def __reduce__(self):
        return type(self), ()
