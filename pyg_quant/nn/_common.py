"""Small pieces shared by QGCNConv and QGINConv."""
from typing import Callable, Optional, Tuple

from torch import Tensor

from ..quantization.quantize import quantize

SUM_AGGREGATIONS = ("add", "sum")


def check_aggr(kwargs: dict, layer: str) -> None:
    kwargs.setdefault("aggr", "add")
    if kwargs["aggr"] not in SUM_AGGREGATIONS:
        raise ValueError(f"{layer} aggregates by sum only (the bit kernels add); got aggr={kwargs['aggr']!r}")


def check_out_dim(out_dim) -> Optional[int]:
    if out_dim is not None and (isinstance(out_dim, bool) or out_dim not in (0, 1)):
        raise ValueError(f"out_dim must be None, 0 or 1, got {out_dim!r}")
    return out_dim


def node_matrix(y: Tensor) -> Tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``[*, N, C]`` as ``[N, (*)·C]`` (one column per batch and channel) and the way back."""
    if y.dim() == 2:
        return y, lambda out: out
    lead, channels = y.shape[:-2], y.size(-1)
    matrix = y.movedim(-2, 0).reshape(y.size(-2), -1)
    return matrix, lambda out: out.reshape((out.size(0),) + lead + (channels,)).movedim(0, -2)


def check_node_dim(node_dim: int, x: Tensor, layer: str) -> None:
    if x.dim() < 2 or node_dim % x.dim() != x.dim() - 2:
        raise ValueError(f"{layer} expects node features of shape [*, num_nodes, channels] with node_dim=-2, "
                         f"got x of shape {tuple(x.shape)} and node_dim={node_dim}")


def requantize_output(out: Tensor, out_bits: Optional[int], out_dim: Optional[int], bit_kernels: bool,
                      col_keys: Optional[Tensor] = None):
    """The layer's result as a :class:`BitTensor` when ``out_bits`` is set and the bit kernels run (``col_keys``: the
    column keys of ``out``, see :func:`~pyg_quant.quantization.quantize.quantize`)."""
    if out_bits is None or not bit_kernels:
        return out
    if out.dim() != 2:
        raise ValueError(f"out_bits needs 2-D node features, got a result of shape {tuple(out.shape)}")
    return quantize(out, out_bits, out_dim, "col" if out_dim == 0 else "row", col_keys)


def quant_options_repr(weight_bits, act_bits, out_bits) -> str:
    parts = []
    if weight_bits is not None or act_bits is not None:
        parts.append(f"bits={weight_bits}" if weight_bits == act_bits
                     else f"weight_bits={weight_bits}, act_bits={act_bits}")
    if out_bits is not None:
        parts.append(f"out_bits={out_bits}")
    return ", ".join(parts)
