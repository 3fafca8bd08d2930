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

# Every op csrc/library.cpp defines (tests/test_extension.py keeps the two lists equal): an op missing here
# silently runs its torch reference.
_OPS = ("quantize_pack", "pack_codes", "quantize_pack_ranges", "fake_quantize", "mse_range", "unpack_codes", "dequantize",
        "packed_code_sums", "pack_row_codes", "bitmm_int", "bitmm_affine", "bit_spmm_int", "bit_spmm_affine",
        "tile_plan", "expand_tiles", "quant_mlp", "quant_mlp_keys", "quant_mlp_planes", "quant_mlp_planes_keys",
        "quant_mlp_quantized", "quant_mlp_row_codes", "quant_mlp_planes_row_codes", "planes_from_row_codes", "expand_csr",
        "expand_wire", "mlp_weight_codes",
        "gin_conv_eval",
        "gcn_conv_eval", "qat_gcn_conv_eval", "qat_gcn_conv_eval_quantized", "qat_gin_conv_eval", "qat_linear",
        "csr_product", "csr_pair", "degree_inv_sqrt", "ema_range", "ema_fake_quantize")
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
# Ops registered once for every backend (composed of other ops in C++, or of torch's): they run where the ops they
# call have kernels.
_COMPOSITES = {"qat_linear": ("fake_quantize",), "csr_product": (), "ema_fake_quantize": ("ema_range", "fake_quantize")}
_COMPOSITE_KEYS = ("CompositeImplicitAutograd", "CompositeExplicitAutograd")
# Filled once at import (the dispatcher query touches no device), so that
# torch.compile traces has_kernel as a plain dict lookup.
_KERNELS: Dict[tuple, bool] = {
    (op, device_type): LOADED and torch._C._dispatch_has_kernel_for_dispatch_key(f"pyg_quant::{op}", key)
    for op in _OPS if op not in _COMPOSITES
    for device_type, key in _DISPATCH_KEYS.items()
}
_KERNELS.update({
    (op, device_type): LOADED
    and any(torch._C._dispatch_has_kernel_for_dispatch_key(f"pyg_quant::{op}", key) for key in _COMPOSITE_KEYS)
    and all(_KERNELS[(part, device_type)] for part in parts)
    for op, parts in _COMPOSITES.items()
    for device_type in _DISPATCH_KEYS
})


def has_kernel(op: str, device_type: str) -> bool:
    """Whether ``pyg_quant::op`` has a compiled kernel for ``device_type``."""
    return _KERNELS.get((op, device_type), False)


_tensor_core_cache: Dict[int, bool] = {}


def _assume_constant(fn):
    # Dynamo runs it once while tracing and bakes the answer into the graph.
    decorator = getattr(torch.compiler, "assume_constant_result", None)
    return decorator(fn) if decorator is not None else fn


@_assume_constant
def _cuda_tensor_cores(device: torch.device) -> bool:
    """Whether the CUDA kernels may run on ``device``: they need b1 tensor cores (sm_80+)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _tensor_core_cache:
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        if major < 8:
            warnings.warn(f"pyg_quant: {name} (sm_{major}{minor}) has no 1-bit tensor cores; "
                          "using the pure-torch reference kernels on it", RuntimeWarning, stacklevel=3)
        elif major >= 10:
            warnings.warn(f"pyg_quant: {name} (sm_{major}{minor}) emulates 1-bit MMA; results are exact "
                          "but slower than on sm_80/sm_90", RuntimeWarning, stacklevel=3)
        _tensor_core_cache[index] = major >= 8
    return _tensor_core_cache[index]


def use_compiled(op: str, device: torch.device) -> bool:
    """Whether ``op`` on ``device`` runs a compiled kernel (else the reference)."""
    if not has_kernel(op, device.type):
        return False
    return device.type != "cuda" or _cuda_tensor_cores(device)


def backends() -> Dict[str, bool]:
    """Which compiled backends are built and usable here, e.g. ``{"cpu": True, "cuda": False}``.

    ``False`` everywhere means the pure-torch reference path runs (see the
    warning emitted at import for why the extension is missing).
    """
    return {
        "cpu": has_kernel("bitmm_int", "cpu"),
        "cuda": has_kernel("bitmm_int", "cuda") and torch.cuda.is_available(),
    }
