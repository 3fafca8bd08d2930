r"""PyG's explainer edge masks on the pyg_quant layers.

PyG's explainers (:class:`torch_geometric.explain.Explainer` with GNNExplainer,
PGExplainer, Captum, ...) set a mask on every ``MessagePassing`` layer
(:func:`torch_geometric.explain.algorithm.utils.set_masks`: ``explain = True``,
``_edge_mask``, ``_loop_mask``, ``_apply_sigmoid``), and
``MessagePassing.explain_message`` multiplies the message of edge ``e`` by
``sigmoid(_edge_mask[e])`` (``_edge_mask[e]`` itself when ``_apply_sigmoid`` is
False), while the self-loops GCN adds keep a factor of 1 (its input's own
self-loops are dropped from the edges and re-added as loops, so they too).

The layers here have no ``propagate`` call.  They scale each edge's coefficient
by that factor in their float aggregation
(:meth:`~pyg_quant.graph.quant_graph.QuantGraph.aggregate_float`), whose edges are
those of ``edge_index`` in its order, GCN's self-loops apart in an unmasked
diagonal term: the same products as PyG's.  The degrees are those of the
unmasked graph, as in PyG's ``gcn_norm``.  While a mask is set the layers do
not run their bit kernels, which take none (:func:`explaining`, checked by
:func:`~pyg_quant.nn.quant_linear.bit_kernels_apply`): in ``eval()`` the float
path computes the same quantized values.  A method ``explain_message``
overridden on a layer is not called.
"""
from typing import Optional

import torch
from torch import Tensor
from torch_geometric.utils import is_torch_sparse_tensor


def explaining(module: torch.nn.Module) -> bool:
    """Whether an explainer's edge mask is set on ``module`` (PyG's ``MessagePassing.explain`` is True)."""
    if hasattr(type(module), "_explain"):  # a class attribute or descriptor: the ordinary lookup
        return getattr(module, "_explain", None) is True
    # Otherwise only the instance's dict can hold True (a parameter, buffer or submodule of that name is never True),
    # and reading it spares the layers' eval checks nn.Module.__getattr__'s AttributeError for every Linear.
    return module.__dict__.get("_explain") is True


def explain_edge_mask(module: torch.nn.Module, edge_index, graph) -> Optional[Tensor]:
    """The factor of each edge of ``graph`` while an explainer's mask is set on ``module``, else None.

    ``edge_index`` is the adjacency the layer was called with: the mask's entries are its edges, so other formats
    (sparse tensors, a BitAdjacency), whose edges the layer reads in another order, are refused.
    """
    if not explaining(module):
        return None
    mask = getattr(module, "_edge_mask", None)
    if mask is None:  # PyG's own message for this case
        raise ValueError("Could not find a pre-defined 'edge_mask' to explain. Did you forget to initialize it?")
    name = type(module).__name__
    if not isinstance(edge_index, Tensor) or is_torch_sparse_tensor(edge_index):
        raise TypeError(f"{name}: an explainer's edge mask needs edge_index as a [2, num_edges] tensor (the mask has "
                        f"one entry per column), got {type(edge_index).__name__}"
                        f"{' (sparse)' if isinstance(edge_index, Tensor) else ''}")
    edges = graph.edges
    num_edges = edges.src.numel() if edges.src is not None and edges.bit_adj is None else None
    if mask.dim() != 1 or num_edges is None or mask.numel() != num_edges:
        raise ValueError(f"{name}: the explainer's edge mask has shape {tuple(mask.shape)}, but the graph the layer "
                         f"aggregates over has {num_edges} edges (a graph cached from another input, with "
                         f"cached=True, cannot be masked)")
    return mask.sigmoid() if getattr(module, "_apply_sigmoid", True) else mask
