r"""Small helpers that several packages of pyg_quant share, with no pyg_quant imports of their own.

They sit below :mod:`pyg_quant.graph`, :mod:`pyg_quant.nn` and :mod:`pyg_quant.bitmm`, so that each of those can use
them without importing another's private modules: the int32 accumulator bound, whether ``torch.compile`` is tracing,
the finite-input check the layers and the graph run where it costs no host synchronization, whether a
module's forward hooks would run, and a context variable set for a block.
"""
import contextvars
import math
from contextlib import contextmanager
from typing import Iterator

import torch

_module = torch.nn.modules.module  # holds the global hook tables

INT32_MAX = 2**31 - 1  # the largest integer sum the int32 kernels hold; above it they accumulate in int64


# Whether ``torch.compile`` is tracing the caller (data-dependent checks and Python-side caches step aside): torch's
# own function, bound once (the layers' eval checks ask it several times a call).
is_compiling = torch.compiler.is_compiling


def capturing(x: torch.Tensor) -> bool:
    """Whether ``x`` is on a GPU whose current stream is capturing a CUDA graph."""
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_finite(x: torch.Tensor, name: str, *, always: bool = False) -> None:
    """Raise a ValueError naming ``name`` if ``x`` holds NaN or inf, where that costs no host synchronization.

    On the CPU the check runs at every eager call.  On a GPU it would stall the host until the kernels before it
    finish, so it runs only with ``always`` (fixed, calibrated ranges: their codes cannot carry a NaN, so it would
    vanish silently); otherwise a NaN or inf propagates as in the float layers: the dynamic range of every row or
    column that holds one is NaN (the quantizers and ``quant_mlp`` reduce their extrema as ``amin`` / ``amax`` do),
    and so is every value it reaches.  Never inside a traced or captured region.

    A finite sum proves every element finite (a NaN or an inf makes any sum NaN or infinite), at a fraction of
    the cost of ``isfinite(x).all()``; only when the sum is not finite (a NaN or inf, or finite values whose sum
    overflows) is every element tested, so large finite inputs are never rejected.
    """
    if is_compiling() or (x.device.type != "cpu" and (not always or capturing(x))):
        return
    x = x.detach()
    if not x.is_floating_point():
        return
    total = x.sum()
    # on the CPU the sum's value read as a Python float costs one op where isfinite on the tensor costs five
    if math.isfinite(total.item()) if x.device.type == "cpu" else bool(torch.isfinite(total)):
        return
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or inf; quantized layers need finite inputs")


@contextmanager
def context_value(var: contextvars.ContextVar, value) -> Iterator[None]:
    """``var`` set to ``value`` inside the block (the package's switches: ranges in place, ranges local)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def no_hooks(*modules) -> bool:
    """Whether no forward hook (global, or on one of ``modules``) would run in a call: a fused call skips them.
    (Runs in every eval layer call: plain loops, no generators.)"""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False
    for module in modules:
        if module._forward_hooks or module._forward_pre_hooks:
            return False
    return True
