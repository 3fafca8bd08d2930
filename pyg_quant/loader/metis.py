r"""METIS input preparation and the partitioning backends.

METIS wants a simple undirected graph: every edge stored in both directions,
no self-loops, no repeated entries.  :func:`undirected_csr` builds that CSR
from any ``edge_index``; :func:`partition_nodes` runs one of the backends on
it and returns the part of every node.
"""
import warnings
from typing import Tuple

import numpy as np
import torch

BACKENDS = ("pymetis", "pyg_lib", "torch_sparse")


def undirected_csr(edge_index: torch.Tensor, num_nodes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""The simple undirected graph of ``edge_index`` as CSR.

    Args:
        edge_index (Tensor): int64 ``[2, E]`` on the CPU, indices in ``[0, num_nodes)``.
        num_nodes (int): ``N``.

    Returns:
        ``(indptr, index)``: int64 ``[N + 1]`` and int64 ``[nnz]``; the neighbours of
        ``i`` are ``index[indptr[i]:indptr[i + 1]]``, sorted, each listed once, ``i``
        itself never; ``j`` is a neighbour of ``i`` exactly when ``i`` is one of ``j``.
    """
    src, dst = edge_index[0], edge_index[1]
    not_loop = src != dst
    src, dst = src[not_loop], dst[not_loop]
    keys = torch.cat([src * num_nodes + dst, dst * num_nodes + src])
    # numpy's sort (SIMD quicksort) sorts int64 values several times faster than
    # torch.sort, which always computes the permutation as well; only values are needed.
    keys = torch.from_numpy(np.sort(keys.numpy()))
    if keys.numel() > 1:
        keys = keys[torch.cat([keys.new_ones(1, dtype=torch.bool), keys[1:] != keys[:-1]])]
    rows = torch.div(keys, num_nodes, rounding_mode="floor")
    index = keys - rows * num_nodes
    indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(rows, minlength=num_nodes), 0)
    return indptr, index


def partition_nodes(indptr: torch.Tensor, index: torch.Tensor, num_parts: int, recursive: bool,
                    backend: str = "pymetis") -> torch.Tensor:
    r"""Partitions the undirected CSR graph into ``num_parts`` parts.

    Args:
        indptr, index (Tensor): the output of :func:`undirected_csr`.
        num_parts (int): number of parts; some may come back empty.
        recursive (bool): multilevel recursive bisection instead of k-way
            (passed explicitly: pymetis' own default depends on ``num_parts``).
        backend (str): ``"pymetis"``, ``"pyg_lib"`` or ``"torch_sparse"``.

    Returns:
        int64 ``[N]``: the part of every node, in ``[0, num_parts)``.
    """
    num_nodes = indptr.numel() - 1
    if num_parts == 1:  # METIS mishandles one part (pymetis special-cases it too)
        return torch.zeros(num_nodes, dtype=torch.int64)
    if backend == "pymetis":
        return _pymetis(indptr, index, num_parts, recursive)
    if backend == "pyg_lib":
        try:
            import pyg_lib
        except ImportError as error:
            raise ImportError("backend='pyg_lib' needs pyg-lib built with METIS; it is not "
                              f"installed ({error}); use backend='pymetis'") from error
        return pyg_lib.partition.metis(indptr, index, num_parts, recursive=recursive).long()
    if backend == "torch_sparse":
        try:
            import torch_sparse  # noqa: F401  (registers torch.ops.torch_sparse)
            partition = torch.ops.torch_sparse.partition
        except (ImportError, AttributeError, RuntimeError) as error:
            raise ImportError("backend='torch_sparse' needs torch_sparse built with METIS; it is not "
                              f"available ({error}); use backend='pymetis'") from error
        return partition(indptr, index, None, num_parts, recursive).long()
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _pymetis(indptr: torch.Tensor, index: torch.Tensor, num_parts: int, recursive: bool) -> torch.Tensor:
    import pymetis

    # Arrays in METIS' own index width are passed without a copy (pymetis >= 2023).
    zero_copy = getattr(pymetis, "zero_copy_dtype", None)
    dtype = zero_copy() if zero_copy is not None else np.int64
    xadj = np.ascontiguousarray(indptr.numpy(), dtype=dtype)
    adjncy = np.ascontiguousarray(index.numpy(), dtype=dtype)
    if hasattr(pymetis, "CSRAdjacency"):  # pymetis >= 2025.2; xadj/adjncy are deprecated there
        result = pymetis.part_graph(num_parts, pymetis.CSRAdjacency(adj_starts=xadj, adjacent=adjncy),
                                    recursive=recursive)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            result = pymetis.part_graph(num_parts, xadj=xadj, adjncy=adjncy, recursive=recursive)
    return torch.from_numpy(np.asarray(result.vertex_part).astype(np.int64, copy=False)).clone()
