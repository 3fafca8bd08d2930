"""Drop-in quantized PyG layers: :class:`QGCNConv`, :class:`QGINConv` and their :class:`QuantLinear`."""
from .qgcn_conv import QGCNConv
from .qgin_conv import QGINConv
from .quant_linear import QuantLinear

__all__ = ["QGCNConv", "QGINConv", "QuantLinear"]
