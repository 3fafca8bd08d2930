r"""``bit_spmm``: the aggregation ``A·X`` on a :class:`~pyg_quant.BitAdjacency`, and the operands its kernels read.

``bit_spmm(adj, x)[i] = Σ_{(j→i)} x[j]`` (rows of ``adj`` are message targets), with an optional fused epilogue
(self terms, row scaling, bias, ReLU); :func:`bit_spmm_codes` is the bare integer product ``A·Q`` for callers that
finish the affine correction themselves, and :func:`gather_operands` what a product reads of the features (their
planes, and their row codes where the CUDA kernels gather).  The eval path of the layers calls the same helpers, so
every route to a product passes the kernels the same operands.
"""
from typing import Optional, Tuple

import torch

from .. import ops
from ..bit_tensor import BitTensor
from ..layout import packed_words, padded_outer
from .bit_adjacency import BitAdjacency


def _float_vector(value, length: int, device: torch.device, name: str,
                  scalar: bool = False) -> Optional[torch.Tensor]:
    """None, a Python number or a 1-D tensor of ``length`` -> float32 ``[length]`` on ``device`` (or None); with
    ``scalar``, a number or a 0-dim tensor becomes ``[1]``, which the op broadcasts (no fill kernel)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if not isinstance(value, torch.Tensor):
        return torch.full((1 if scalar else length,), float(value), dtype=torch.float32, device=device)
    if value.dim() == 0:
        value = value.detach().to(device=device, dtype=torch.float32)
        return value.reshape(1) if scalar else value.expand(length).contiguous()
    if value.dim() != 1 or value.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got shape {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the operands are on {device}")
    return value.detach().to(torch.float32).contiguous()


def bit_spmm(adj: BitAdjacency, x: BitTensor, *, self_weight=None, row_scale=None, bias=None,
             relu: bool = False) -> torch.Tensor:
    r"""``(A + diag·I) · to_val(x)`` on the bit tiles, as float32 ``[num_rows, x.cols]``.

    With the optional epilogue (fused into the kernel, one pass over the output):

    .. math::
        \mathrm{out} = \mathrm{relu}\big(\mathrm{diag}(s)\,(A + \mathrm{diag}(d + w))\,X + b\big)

    where ``d`` is ``adj.diag`` (its self loops), ``w = self_weight`` (GIN's
    ``1 + eps``), ``s = row_scale`` (GCN's ``D^{-1/2}`` after aggregation) and
    ``b = bias``.

    ``x`` must be scaled per column or per tensor (``dim=0`` or ``None``) so that
    ``(A·X)_ik = lo_k·Σ_j A_ij + scale_k·(A·Q)_ik`` factors exactly; it is read
    in ``layout="col"`` (a ``"row"`` input is repacked once and cached).  The
    result equals the float64 value up to a few float32 roundings of its terms (``csrc/epilogue.h``).

    Args:
        adj (BitAdjacency): ``[num_rows, num_cols]``.
        x (BitTensor): ``[num_cols, F]``.
        self_weight (float or Tensor, optional): ``[num_rows]`` or a scalar; needs a square ``adj``.
        row_scale (Tensor, optional): ``[num_rows]``.
        bias (Tensor, optional): ``[F]``.
        relu (bool): clamp the result at zero.
    """
    if not isinstance(adj, BitAdjacency):
        raise TypeError(f"adj must be a BitAdjacency, got {type(adj).__name__}")
    if not isinstance(x, BitTensor):
        raise TypeError(f"x must be a BitTensor, got {type(x).__name__}")
    if x.rows != adj.num_cols:
        raise ValueError(f"x has {x.rows} rows but adj has {adj.num_cols} source nodes")
    if x.device != adj.device:
        raise ValueError(f"x is on {x.device} but adj is on {adj.device}")
    if x.dim not in (None, 0):
        raise ValueError("x must be scaled per column (dim=0) or per tensor (dim=None) for A·X to "
                         "factor exactly; got per-row ranges (dim=1)")
    if not isinstance(relu, bool):
        raise TypeError(f"relu must be a bool, got {type(relu).__name__}")
    rows, cols, device = adj.num_rows, x.cols, x.device
    self_term = _float_vector(self_weight, rows, device, "self_weight", scalar=True)
    if self_term is not None and adj.num_rows != adj.num_cols:
        raise ValueError("self_weight needs a square adjacency (num_rows == num_cols)")
    if adj.diag is not None:
        self_term = adj.diag if self_term is None else adj.diag + self_term
    row_scale = _float_vector(row_scale, rows, device, "row_scale")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a tensor, got {type(bias).__name__}")
    bias = _float_vector(bias, cols, device, "bias")
    x_col = x.as_layout("col")
    wide = adj.wide_sums(x.bits)
    lo = x.lo.expand(cols).contiguous()
    scale = x.scale.expand(cols).contiguous()
    x_planes, x_codes = gather_operands(adj, x_col, self_term is not None)
    return ops.bit_spmm_affine(adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val,
                               x_planes, lo, scale, adj.row_sums, self_term, row_scale, bias, relu, rows, cols,
                               wide, x_codes)


def adjacency_args(adj: BitAdjacency) -> tuple:
    """The adjacency's operands of the aggregation ops, in their schemas' order: ``window_ptr, tile_col, tile_bits,
    res_ptr, res_col, res_val, row_sums``."""
    return adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val, adj.row_sums


def gathered_codes(adj: "BitAdjacency", x_col: BitTensor, self_term: bool) -> Optional[torch.Tensor]:
    """``x_col``'s cached row codes where the CUDA kernels gather from them (a CSR residual, or a self term); the
    CPU kernels walk their own unpacked codes, so there it is None and nothing is packed."""
    if x_col.device.type != "cuda" or (adj.res_col.numel() == 0 and not self_term):
        return None
    return x_col.row_codes()


def gather_operands(adj: "BitAdjacency", x_col: BitTensor,
                    self_term: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(x_planes, x_codes)`` of a ``bit_spmm`` op on ``x_col``: its planes and :func:`gathered_codes`.  A
    BitTensor held as row codes (:meth:`BitTensor.from_row_codes`) keeps them where nothing reads its planes: on
    CUDA (compiled kernels) with an adjacency without tiles, the kernels read only the row codes and take the planes'
    shape from the ``x_planes`` argument, which is then an allocated, unread tensor of that shape."""
    if (x_col.has_planes or adj.tile_col.numel() > 0 or x_col.device.type != "cuda"
            or not ops.use_compiled("bit_spmm_int", x_col.device)):
        return x_col.planes, gathered_codes(adj, x_col, self_term)
    shape = (x_col.bits, padded_outer(x_col.cols), packed_words(x_col.rows))
    return torch.empty(shape, dtype=torch.int32, device=x_col.device), x_col.row_codes()


def bit_spmm_codes(adj: BitAdjacency, x_planes: torch.Tensor, x_bits: int, cols: int,
                   x_codes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The integer product ``A · Q`` of ``adj``'s stored entries (diagonal term excluded) and column-layout codes
    (``x_codes``: their cached row codes, see :func:`pyg_quant.graph.spmm.gathered_codes`)."""
    return ops.bit_spmm_int(adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val,
                            x_planes, adj.num_rows, cols, adj.wide_sums(x_bits), x_codes)
