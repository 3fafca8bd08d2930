r"""The graph: the bit adjacency, the input formats the layers accept, and the graph operand of one layer call.

Modules, each with one job, listed from the bottom up (each imports only those above it in this list, and none of
:mod:`pyg_quant.nn`, :mod:`pyg_quant.qat` or :mod:`pyg_quant.loader`, which build on it):

* :mod:`.adjacency_form`: tiles or CSR, the ``adjacency="auto" | "tiles" | "csr"`` rule and its thresholds;
* :mod:`.bit_adjacency`: :class:`BitAdjacency` (bit tiles + CSR residual, what the kernels read) and
  :class:`CompactAdjacency` (its tile plan, one byte per edge, the wire form of a loader batch);
* :mod:`.spmm`: :func:`bit_spmm`, the integer product ``bit_spmm_codes`` and the operands they read;
* :mod:`.packing`: edge lists packed into a BitAdjacency (``pack_entries``) and decoded back;
* :mod:`.edge_ops`: packing and product in one registered op, for ``torch.compile``;
* :mod:`.float_csr`: the float aggregation's CSR matrices and their autograd product;
* :mod:`.cache`: the graphs built from one ``edge_index`` tensor, shared across layers and steps;
* :mod:`.input_formats`: ``edge_index`` (with weights), ``torch.sparse``, ``SparseTensor`` and BitAdjacency inputs
  read into one edge list (``EdgeSet``);
* :mod:`.quant_graph`: ``QuantGraph``, a layer call's ``Â`` in float or on bit planes.

:class:`BitAdjacency` and :func:`bit_spmm` are also ``pyg_quant.BitAdjacency`` and ``pyg_quant.bit_spmm``.
"""
from .bit_adjacency import BitAdjacency, CompactAdjacency
from .spmm import bit_spmm

__all__ = ["BitAdjacency", "CompactAdjacency", "bit_spmm"]
