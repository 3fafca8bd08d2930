"""Graph reuse: the one-sync range check of edge_index, the graph cache shared by the layers, the QAT CSR product."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pyg_quant.nn._adjacency_formats import to_edge_set


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


# --- the range check -----------------------------------------------------------------------
def test_range_check_reads_the_extrema_in_one_reduction():
    edge_index = torch.randint(10, (2, 40), generator=torch.Generator().manual_seed(0))
    with OpCounter() as ops:
        to_edge_set(edge_index, None, 10, 10, "source_to_target")
    # one reduction for the four extrema and one host read of them (.tolist() dispatches
    # nothing on the CPU; on a GPU it is one copy): no per-extremum .item()
    assert ops.counts["aminmax"] == 1
    assert ops.counts["_local_scalar_dense"] == 0
    assert ops.counts["min"] + ops.counts["max"] == 0


@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
def test_range_check_names_the_side_out_of_range(flow):
    # a bipartite graph: 6 sources, 4 targets, in the direction `flow` reads them
    src, dst = torch.tensor([0, 5, 2]), torch.tensor([3, 0, 1])
    edge_index = torch.stack((src, dst) if flow == "source_to_target" else (dst, src))
    edges = to_edge_set(edge_index, None, 6, 4, flow)
    assert edges.src.tolist() == src.tolist() and edges.dst.tolist() == dst.tolist()
    with pytest.raises(ValueError, match="out of range for a graph of 5 sources and 4 targets"):
        to_edge_set(edge_index, None, 5, 4, flow)  # source 5 has no row
    with pytest.raises(ValueError, match="out of range for a graph of 6 sources and 3 targets"):
        to_edge_set(edge_index, None, 6, 3, flow)  # target 3 has no row
    for row in (0, 1):
        negative = edge_index.clone()
        negative[row, 1] = -1
        with pytest.raises(ValueError, match="negative"):
            to_edge_set(negative, None, 6, 4, flow)
