"""pyg_quant: any-bitwidth quantized GNN compute for PyTorch Geometric.

Values are stored as bit planes (:mod:`pyg_quant.layout`), products run as
AND + popcount on the planes (C++ on the CPU, 1-bit tensor cores on the GPU).
"""
from ._extension import backends
from .bit_tensor import BitTensor, to_val
from .quantization.quantize import to_bit
from .bitmm import bitmm, bitmm_int
from .graph import BitAdjacency, bit_spmm
from . import loader  # noqa: E402  (pyg_quant.loader: QuantClusterData, QuantClusterLoader)
from .nn import QGCNConv, QGINConv  # noqa: E402  (pyg_quant.nn: drop-in quantized PyG layers)
from . import qat  # noqa: E402  (pyg_quant.qat: quantization-aware training, prepare/convert)
from .captured_step import CapturedTrainStep  # noqa: E402  (training steps replayed from CUDA graphs)

__version__ = "0.1.0"

__all__ = [
    "BitAdjacency",
    "BitTensor",
    "CapturedTrainStep",
    "QGCNConv",
    "QGINConv",
    "backends",
    "bit_spmm",
    "bitmm",
    "bitmm_int",
    "to_bit",
    "to_val",
]
