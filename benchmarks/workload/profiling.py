"""What one call costs besides its time: its error against a reference, its host synchronizations, its device
kernels."""
import collections
import os
import time
import traceback
import warnings
from typing import Optional

import torch

import pyg_quant as pq

from .recording import Runner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rel_err(out, ref) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 (a ``BitTensor`` ``out`` dequantized first); NaN when ``out`` is not
    finite."""
    out = pq.to_val(out) if isinstance(out, pq.BitTensor) else out
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def count_syncs(runner: Runner, fn, sites: Optional[collections.Counter] = None):
    """Host synchronizations in one call of ``fn`` (``torch.cuda.set_sync_debug_mode``'s warnings); None on the
    CPU.  With ``sites``, each one is also counted there under the innermost pyg_quant or benchmark frame that made
    it (``file:line``, or ``"?"``)."""
    if not runner.cuda:
        return None
    count = 0

    def record(message, *args, **kwargs):
        nonlocal count
        if "synchroniz" not in str(message).lower():
            return
        count += 1
        if sites is not None:
            frames = [f for f in traceback.extract_stack()[:-1] if "pyg_quant" in f.filename or "benchmarks" in f.filename]
            sites[f"{os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno}" if frames else "?"] += 1

    runner.sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # catch_warnings puts the previous one back
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    runner.sync()
    return count


def kernel_category(name: str) -> str:
    """A device kernel's family, from its name: pyg_quant's ops, cuSPARSE SpMM, dense GEMM, gathers, ..."""
    low = name.lower()
    if "bit_spmm" in low:
        return "pq bit_spmm"
    if "bitmm_affine" in low:
        return "pq bitmm epilogue"
    if "bitmm" in low:
        return "pq bitmm"
    if "quantize_pack" in low:
        return "pq quantize_pack"
    if "unpack" in low or "code_sums" in low:
        return "pq unpack/code_sums"
    if "csr_product" in low:
        return "pq csr_product"
    if "spmm" in low or "csrmm" in low or "sparse" in low or "cusparse" in low:
        return "float SpMM (cuSPARSE)"
    if "gemm" in low or "cutlass" in low or "sm90_" in low or "sm80_" in low or "ampere" in low:
        return "dense GEMM"
    if "scatter" in low or "index" in low or "gather" in low:
        return "gather/scatter/index"
    if "reduce" in low:
        return "reductions"
    if "elementwise" in low or "vectorized" in low or "copy" in low or "fill" in low:
        return "elementwise/copy"
    return "other"


def kernel_totals(kernels, key) -> dict:
    """``{key(event): [count, µs]}`` over profiled device kernels."""
    totals = {}
    for e in kernels:
        entry = totals.setdefault(key(e), [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
    return totals


def profile_batch(runner: Runner, fn) -> dict:
    """Device kernels (count, time, top names) of one call of ``fn``; CPU: top-level ops."""
    from torch.profiler import ProfilerActivity, profile
    from torch.autograd import DeviceType
    fn()
    runner.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.cuda else [])
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        runner.sync()
    wall_ms = (time.perf_counter() - t) * 1e3
    events = prof.events()
    top_level = sum(1 for e in events if e.cpu_parent is None and e.device_type == DeviceType.CPU
                    and "::" in e.name)
    if not runner.cuda:
        return dict(device="cpu", top_level_ops=top_level, profiled_wall_ms=wall_ms)
    device_events = [e for e in events if e.device_type == DeviceType.CUDA]
    kernels = [e for e in device_events if not e.name.startswith(("Memcpy", "Memset"))]
    launch_names = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
    launches = sum(1 for e in events if e.device_type == DeviceType.CPU and e.name.startswith(launch_names))
    by_name, by_cat = kernel_totals(kernels, lambda e: e.name[:90]), kernel_totals(kernels, lambda e: kernel_category(e.name))
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    note = None if kernels else "the profiler saw no device kernels (CUPTI unavailable?): count is top-level ops"
    return dict(device="cuda", kernels=len(kernels) or None, launch_calls=launches, top_level_ops=top_level, note=note,
                memcpy_memset=len(device_events) - len(kernels),
                kernel_us=sum(v[1] for v in by_name.values()), profiled_wall_ms=wall_ms,
                categories={k: dict(count=v[0], us=round(v[1], 1)) for k, v in
                            sorted(by_cat.items(), key=lambda kv: -kv[1][1])},
                top_kernels=[dict(name=k, count=v[0], us=round(v[1], 1)) for k, v in top])

