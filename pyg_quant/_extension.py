"""Loads the compiled extension once and reports which backends it provides."""
import warnings
from typing import Dict, Optional

import torch

LOAD_ERROR: Optional[str] = None
try:
    from . import _C  # noqa: F401  (importing runs the TORCH_LIBRARY registrations)

    LOADED = True
except ImportError as error:  # not built, or built against another torch
    LOADED = False
    LOAD_ERROR = str(error)
    warnings.warn(
        f"pyg_quant: the compiled extension could not be loaded ({LOAD_ERROR}); "
        "falling back to the pure-torch reference kernels, which are correct but slow. "
        "Reinstall with `pip install --no-build-isolation -e .` to build it.",
        RuntimeWarning,
        stacklevel=2,
    )

_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_kernel_cache: Dict[tuple, bool] = {}


def has_kernel(op: str, device_type: str) -> bool:
    """Whether ``pyg_quant::op`` has a compiled kernel for ``device_type``."""
    key = (op, device_type)
    if key not in _kernel_cache:
        dispatch_key = _DISPATCH_KEYS.get(device_type)
        _kernel_cache[key] = (
            LOADED
            and dispatch_key is not None
            and torch._C._dispatch_has_kernel_for_dispatch_key(f"pyg_quant::{op}", dispatch_key)
        )
    return _kernel_cache[key]


def backends() -> Dict[str, bool]:
    """Which compiled backends are built and usable here, e.g. ``{"cpu": True, "cuda": False}``.

    ``False`` everywhere means the pure-torch reference path runs (see the
    warning emitted at import for why the extension is missing).
    """
    return {
        "cpu": has_kernel("bitmm_int", "cpu"),
        "cuda": has_kernel("bitmm_int", "cuda") and torch.cuda.is_available(),
    }
