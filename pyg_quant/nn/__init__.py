"""Drop-in quantized PyG layers: :class:`QGCNConv`, :class:`QGINConv` and their :class:`QuantLinear`; static
(calibrated) activation ranges for inference: :func:`calibrate`."""
from .calibration import calibrate, clear_calibration
from .qgcn_conv import QGCNConv
from .qgin_conv import QGINConv
from .quant_linear import QuantLinear

__all__ = ["QGCNConv", "QGINConv", "QuantLinear", "calibrate", "clear_calibration"]
