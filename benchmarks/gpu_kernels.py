"""GPU kernel benchmark: bitmm and bit_spmm on 1-bit tensor cores against torch.

One device call; prints markdown tables and writes JSON (``--out``).  Sections:
ceilings (the b1 MMA's register-only peak, device copy bandwidth), dense bitmm
(N = K, d, bit pairs) against bf16 matmul and ``torch._int_mm``, QGTC's table
shapes, bit_spmm on a products-scale cluster batch against fp32/bf16 CSR SpMM,
and the tensor-core instructions in the SASS of each hot kernel.

Times are medians of CUDA-event timings after warm-up; ``*_ms`` kernel times are
CUDA-graph replays of many calls back to back (GPU time, host launch cost
excluded; dense calls cycle through enough input sets to cover twice the L2),
``bitmm_int_kernel_ms`` the kernel's own duration from the profiler, and
``*_call_ms`` one call made eagerly from Python (host dispatch and launch
latency included).  Binary TOPS count
2·M·N·K·s·t (every bit-plane product's AND + popcount-accumulate as 2 ops).
"""
import argparse
import datetime
import glob
import itertools
import json
import math
import os
import re
import subprocess
import sys

import torch

import pyg_quant as pq
from pyg_quant import ops
from pyg_quant.synthetic import planted_partition_graph

HERE = os.path.dirname(os.path.abspath(__file__))


def cuda_ms(fn, reps=20, warmup=3, budget_ms=300.0):
    """Median CUDA-event time of ``fn``; fewer repetitions for slow calls (at least 3)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    reps = max(3, min(reps, int(budget_ms / max(start.elapsed_time(stop), 1e-3))))
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn, reps=20, inner=1):
    """GPU time per call with the host out of the loop: ``fn`` captured ``inner`` times in a CUDA graph, the
    graph replayed, the time divided by ``inner`` (``inner > 1`` also hides the graph's own launch latency,
    which is most of a few-microsecond kernel's time otherwise).

    Falls back to eager timing (and says so) for a call that cannot be captured.
    """
    try:
        return _graph_ms(fn, reps, inner)
    except RuntimeError as error:
        print(f"(not capturable, timed eagerly: {str(error).splitlines()[0][:120]})")
        torch.cuda.synchronize()
        return cuda_ms(fn, reps=reps)


def _graph_ms(fn, reps, inner):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return cuda_ms(graph.replay, reps=reps) / inner


def _run_peak(source, exe, arch):
    subprocess.run(["nvcc", "-O3", f"-I{os.path.join(HERE, '..', 'csrc')}", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                    os.path.join(HERE, "peak", source), "-o", exe], check=True)
    return json.loads(subprocess.run([exe], check=True, capture_output=True, text=True).stdout)


def ceilings():
    """The b1 instruction peaks (mma.sync everywhere, wgmma on sm_90) and the copy bandwidth.

    ``binary_tops`` is the peak of the instruction bitmm uses on this device:
    wgmma on sm_90 (the int32 path), mma.sync elsewhere.
    """
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}{'a' if major == 9 else ''}"
    peak = dict(mma_sync=_run_peak("bmma_peak.cu", "/tmp/pyg_quant_bmma_peak", arch))
    peak["binary_tops"] = peak["mma_sync"]["binary_tops"]
    peak["instruction"] = peak["mma_sync"]["instruction"]
    if (major, minor) == (9, 0):
        peak["wgmma"] = _run_peak("wgmma_peak.cu", "/tmp/pyg_quant_wgmma_peak", arch)
        peak["binary_tops"] = peak["wgmma"]["binary_tops"]
        peak["instruction"] = peak["wgmma"]["instruction"]
    src = torch.empty(2**28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), reps=10)
    peak["copy_gbps"] = 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
    return peak


def profiled_kernel(fn, pattern="bitmm", reps=5):
    """The kernel ``fn`` launches whose name contains ``pattern`` and its median device duration (ms) over ``reps``
    calls, from the profiler's CUDA activity records (the kernel alone: no launch latency, no gap).  The name keeps
    its template arguments and drops namespaces and parameters (e.g. ``bitmm_wgmma_tma_kernel<256, true, 1, 4>``:
    which path and tile ran).  ("", NaN) when the profiler records no CUDA kernels (no CUPTI)."""
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
    except RuntimeError:
        return "", float("nan")
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and pattern in e.name]
    if not events:
        return "", float("nan")
    m = re.search(r"(\w*" + pattern + r"\w*(?:<[^()]*>)?)", events[0].name)
    times = sorted(e.time_range.elapsed_us() for e in events)
    return (m.group(1) if m else events[0].name), times[len(times) // 2] * 1e-3


def rotating_graph_ms(calls, call_ms, graph_target_ms=0.5, max_inner=64):
    """GPU time per call of a graph that replays ``calls`` round robin, each on its own inputs.

    One call per replay would time the graph's launch latency too (~17 us measured for a one-kernel graph on an
    H200: the GPU idles from the start event until the host's launch reaches it), so a replay holds enough calls
    for ``graph_target_ms`` (``call_ms`` is an eager estimate).  Several input sets, cycled, keep back-to-back calls
    from finding their operands in L2 where one set alone would.
    """
    inner = max(1, min(max_inner, math.ceil(graph_target_ms / max(call_ms, 1e-3))))
    inner = math.ceil(inner / len(calls)) * len(calls)
    turn = itertools.cycle(calls)
    return graph_ms(lambda: next(turn)(), inner=inner)


def input_sets(working_bytes, max_sets=4):
    """How many input sets a timing cycles through: enough that they cover twice the L2 cache, at most 4."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    return max(1, min(max_sets, math.ceil(2 * l2 / max(working_bytes, 1))))


# max_ops: every shape of the dense table (N <= 16384, d <= 512, 8 x 8 bits: 1.8e16 ops, ~3.5 ms on an H100) runs;
# larger ones would add seconds per call, not information.
def dense_rows(peak_tops, copy_gbps, sizes, dims, pairs, gen, max_ops=2e16):
    rows = []
    for n in sizes:
        a_float = torch.randn(n, n, device="cuda", generator=gen)
        a_bf16 = a_float.bfloat16()
        a_i8 = torch.randint(-127, 127, (n, n), device="cuda", dtype=torch.int8, generator=gen)
        for d in dims:
            b_float = torch.randn(n, d, device="cuda", generator=gen)
            b_bf16 = b_float.bfloat16()
            # the peers timed as bitmm_int is (graph replays of calls back to back; their A alone covers the L2
            # at the large shapes)
            t_bf16 = rotating_graph_ms([lambda: a_bf16 @ b_bf16], cuda_ms(lambda: a_bf16 @ b_bf16))
            b_i8 = torch.randint(-127, 127, (n, d), device="cuda", dtype=torch.int8, generator=gen)
            try:
                t_i8 = rotating_graph_ms([lambda: torch._int_mm(a_i8, b_i8)], cuda_ms(lambda: torch._int_mm(a_i8, b_i8)))
            except RuntimeError:
                t_i8 = float("nan")
            for s, t in pairs:
                if 2.0 * n * n * d * s * t > max_ops:
                    continue  # seconds per call: adds time, not information
                a = pq.to_bit(a_float, s, dim=1, layout="row")
                b = pq.to_bit(b_float, t, dim=0, layout="col")
                wide = n * (2**s - 1) * (2**t - 1) > 2**31 - 1
                t_call = cuda_ms(lambda: ops.bitmm_int(a.planes, b.planes, n, d, wide))
                bytes_moved = a.planes.numel() * 4 + b.planes.numel() * 4 + n * d * (8 if wide else 4)
                sets = input_sets(bytes_moved)
                # the other sets: the same codes in fresh memory (shuffled planes would time the same; copies
                # keep every set's result equal to the first's)
                operands = [(a.planes, b.planes)] + [(a.planes.clone(), b.planes.clone()) for _ in range(sets - 1)]
                calls = [lambda pa=pa, pb=pb: ops.bitmm_int(pa, pb, n, d, wide) for pa, pb in operands]
                t_int = rotating_graph_ms(calls, t_call)
                kernel, t_kernel = profiled_kernel(calls[0])
                del operands, calls
                t_full = cuda_ms(lambda: pq.bitmm(a, b))
                ops_count = 2.0 * n * n * d * s * t
                tops = ops_count / (t_int * 1e-3) / 1e12
                roof_ms = max(ops_count / (peak_tops * 1e12), bytes_moved / (copy_gbps * 1e9)) * 1e3
                rows.append(dict(n=n, d=d, s=s, t=t, kernel=kernel, bitmm_int_ms=t_int, bitmm_int_call_ms=t_call, bitmm_int_kernel_ms=t_kernel,
                                 input_sets=sets, bitmm_ms=t_full, binary_tops=tops,
                                 pct_peak=100 * tops / peak_tops, pct_roofline=100 * roof_ms / t_int,
                                 bf16_ms=t_bf16, int8_ms=t_i8, speedup_vs_bf16=t_bf16 / t_int,
                                 speedup_vs_int8=t_i8 / t_int))
    return rows


def cluster_batch(gen):
    # repeated pairs dropped (~1%): a real graph's binary adjacency, not a multigraph's weighted one
    edge_index = torch.unique(planted_partition_graph(20, 1600, 40, 0.8, torch.Generator().manual_seed(0)), dim=1).cuda()
    return edge_index, 32000


INNER = 20  # calls per captured graph in the bit_spmm timings (see graph_ms)


def block_steps(adj):
    """k256 steps of the wgmma bit_spmm kernel: distinct (128-row block, 256-column chunk) pairs among the tiles."""
    if adj.num_tiles == 0:
        return 0
    window = torch.repeat_interleave(torch.arange(adj.window_ptr.numel() - 1, device=adj.device),
                                      adj.window_ptr[1:] - adj.window_ptr[:-1])
    chunks = (adj.num_cols + 255) // 256
    return int(torch.unique((window // 8) * chunks + adj.tile_col.long()).numel())


def tensor_core_ops(adj, d, bits, steps):
    """Binary ops (2 per AND-popcount) the tensor cores execute: on sm_90 the wgmma kernel multiplies each of its
    `steps` (block_steps(adj)) 128 x 256 blocks with n = kBlockN columns a feature tile (bits' planes stacked in 1, 2,
    4 or 8 slots of 64, 64, 64 or 32 features: csrc/cuda/spmm_wgmma_cuda.cu); elsewhere (or a multi-bit adjacency)
    every 16 x 256 tile with every pair of planes (the build is assumed to have its sm_90a image, as
    benchmarks/device_run.sh builds)."""
    if adj.bits == 1 and adj.device.type == "cuda" and torch.cuda.get_device_capability(adj.device) == (9, 0):
        slots = 1 if bits == 1 else 2 if bits == 2 else 4 if bits <= 4 else 8
        tile_n = 32 if slots == 8 else 64
        return 2.0 * steps * 128 * 256 * slots * tile_n * ((d + tile_n - 1) // tile_n)
    return 2.0 * adj.num_tiles * 16 * 256 * d * adj.bits * bits


def spmm_rows(peak_tops, copy_gbps, gen):
    edge_index, n = cluster_batch(gen)
    csr = torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.size(1), device="cuda"),
                                  (n, n)).coalesce().to_sparse_csr()
    rows = []
    # 8, 16: tile thresholds (tiles + CSR residual, tensor cores; 16 is the default); 4097: no block qualifies,
    # every entry stays in the CSR and the gather kernel runs (CUDA cores, row-major codes).
    for min_tile_nnz in (8, 16, 4097):
        adj = pq.BitAdjacency.from_edge_index(edge_index, n, min_tile_nnz=min_tile_nnz)
        steps = block_steps(adj)
        t_build = cuda_ms(lambda: pq.BitAdjacency.from_edge_index(edge_index, n, min_tile_nnz=min_tile_nnz), reps=5)
        adj_gcn = pq.BitAdjacency.from_edge_index(edge_index, n, self_loops=1, min_tile_nnz=min_tile_nnz)
        dinv = adj_gcn.degree().pow(-0.5)
        bias = torch.randn(128, device="cuda", generator=gen)
        for d in (16, 64, 128):  # 16: GCN's hidden width
            x_float = torch.randn(n, d, device="cuda", generator=gen)
            t_fp32 = graph_ms(lambda: csr @ x_float, inner=INNER)
            try:
                csr_bf16 = csr.to(torch.bfloat16)
                x_bf16 = x_float.bfloat16()
                t_bf16 = graph_ms(lambda: csr_bf16 @ x_bf16, inner=INNER)
            except RuntimeError:
                t_bf16 = float("nan")
            for bits in (1, 2, 4, 8):
                x = pq.to_bit(x_float, bits, dim=0, layout="col")
                wide = adj.max_row_sum * (2**bits - 1) > 2**31 - 1
                args = (adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val,
                        x.planes, n, d, wide)
                t_int = graph_ms(lambda: ops.bit_spmm_int(*args), inner=INNER)  # packs x's row codes inside
                codes = x.row_codes()
                t_int_cached = graph_ms(lambda: ops.bit_spmm_int(*args, codes), inner=INNER)
                t_unpack = (graph_ms(lambda: ops.pack_row_codes(x.planes, d, True), inner=INNER)
                            if adj.res_nnz else 0.0)
                t_full = graph_ms(lambda: pq.bit_spmm(adj, x), inner=INNER)
                t_call = cuda_ms(lambda: pq.bit_spmm(adj, x))
                # GCN's aggregation: D^-1/2 (A + I) X' + b, relu, fused into the same pass
                adj_loops = adj_gcn
                t_gcn = graph_ms(lambda: pq.bit_spmm(adj_loops, x, row_scale=dinv, bias=bias[:d], relu=True),
                                 inner=INNER)
                tile_ops = tensor_core_ops(adj, d, bits, steps)
                # Bytes: the adjacency and x once, the output once, and every residual entry's gathered row codes
                # (they mostly come from L2: x's codes are ~1 MB; counting them at the copy bandwidth makes this
                # roofline a gather bound, not a DRAM one, and the DRAM-only bound is reported beside it).
                row_bytes = codes.size(1)
                dram_bytes = adj.nbytes + x.planes.numel() * 4 + codes.numel() + n * d * (8 if wide else 4)
                bytes_moved = dram_bytes + adj.res_nnz * row_bytes
                roof_ms = max(tile_ops / (peak_tops * 1e12), bytes_moved / (copy_gbps * 1e9)) * 1e3
                dram_roof_ms = max(tile_ops / (peak_tops * 1e12), dram_bytes / (copy_gbps * 1e9)) * 1e3
                rows.append(dict(format="tiles+csr" if adj.num_tiles else "csr", min_tile_nnz=min_tile_nnz, d=d,
                                 bits=bits, tiles=adj.num_tiles, fill=adj.fill_ratio, residual=adj.res_nnz,
                                 nnz=adj.nnz, tile_steps=steps, tensor_core_ops=tile_ops,
                                 build_ms=t_build, bit_spmm_int_ms=t_int, bit_spmm_int_cached_ms=t_int_cached,
                                 bit_spmm_ms=t_full, bit_spmm_call_ms=t_call, gcn_fused_ms=t_gcn,
                                 pack_row_codes_ms=t_unpack, row_code_bytes=row_bytes,
                                 csr_fp32_ms=t_fp32, csr_bf16_ms=t_bf16, speedup_vs_fp32=t_fp32 / t_int_cached,
                                 speedup_full_vs_fp32=t_fp32 / t_full, roofline_ms=roof_ms,
                                 pct_roofline=100 * roof_ms / t_int_cached, dram_roofline_ms=dram_roof_ms))
    return rows


def sass_report():
    libs = glob.glob(os.path.join(os.path.dirname(pq.__file__), "_C*.so"))
    if not libs:
        return {}
    text = subprocess.run(["cuobjdump", "--dump-sass", libs[0]], capture_output=True, text=True).stdout
    report, current, arch = {}, None, None
    for line in text.splitlines():
        m = re.search(r"arch = (sm_\w+)", line)
        if m:
            arch = m.group(1)
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = f"{arch}:{m.group(1)}"
            report[current] = {}
            continue
        m = re.search(r"\b(BMMA|IMMA|HMMA|HGMMA|IGMMA|BGMMA|LDSM)[.\w]*", line)
        if m and current:
            report[current][m.group(0)] = report[current].get(m.group(0), 0) + 1
    return {k: v for k, v in report.items() if v}


def table(rows, cols):
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "out", "gpu_kernels.json"))
    parser.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    parser.add_argument("--spmm-only", action="store_true", help="ceilings and bit_spmm only (no dense GEMMs)")
    parser.add_argument("--dense-only", action="store_true", help="ceilings and dense GEMMs only (no bit_spmm)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not pq.backends()["cuda"]:
        sys.exit("gpu_kernels.py needs a GPU and the compiled CUDA backend")
    gen = torch.Generator(device="cuda").manual_seed(0)
    info = dict(device=torch.cuda.get_device_name(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                torch=torch.__version__, command=" ".join(sys.argv))
    print(f"# {info['device']}  {info['date']}  torch {info['torch']}")
    peak = ceilings()
    print(f"\nceilings: b1 mma.sync peak {peak['mma_sync']['binary_tops']:.0f} binary TOPS"
          + (f", wgmma peak {peak['wgmma']['binary_tops']:.0f}" if "wgmma" in peak else "")
          + f", copy {peak['copy_gbps']:.0f} GB/s (% of peak below: {peak['instruction']})")
    sizes = [] if args.spmm_only else [2048, 4096] if args.quick else [2048, 4096, 8192, 16384]
    pairs = [(1, 1), (1, 2), (1, 4), (4, 4), (8, 8)]
    # Expected for 16384 x 16384 x 512 at 1 x 1 bit (bitmm_wgmma_cuda.cu): 2.75e11 binary ops, 17.8 us at the
    # ~15.5 POPS peak; A and the int32 result (33.5 MB each) cross memory once, ~16 us at ~4.2 TB/s.  Overlapped
    # ~18 us, one after the other ~34 us.  Measured on an H200 (2026-11-26): 34.5 us, 51% of the peak.
    dense = dense_rows(peak["binary_tops"], peak["copy_gbps"], sizes, [64, 128, 512], pairs, gen)
    print("\n## dense bitmm (A: N x N, B: N x d)\n")
    print(table(dense, ["n", "d", "s", "t", "kernel", "bitmm_int_ms", "bitmm_int_kernel_ms", "bitmm_int_call_ms", "input_sets", "bitmm_ms",
                        "binary_tops", "pct_peak", "pct_roofline",
                        "bf16_ms", "int8_ms", "speedup_vs_bf16", "speedup_vs_int8"]))
    qgtc_sizes = [] if args.spmm_only else [2048, 4096, 8192]
    qgtc = dense_rows(peak["binary_tops"], peak["copy_gbps"], qgtc_sizes, [32, 64], [(1, 1), (1, 2), (1, 3), (1, 4)],
                      gen)
    print("\n## QGTC table shapes (1-bit A x 1..4-bit X)\n")
    print(table(qgtc, ["n", "d", "s", "t", "bitmm_int_ms", "bitmm_ms", "binary_tops", "bf16_ms"]))
    # tiles run wgmma on sm_90 (a binary adjacency), mma.sync elsewhere
    spmm = [] if args.dense_only else spmm_rows(peak["binary_tops"], peak["copy_gbps"], gen)
    print("\n## bit_spmm on a products-scale cluster batch (32,000 nodes, 20 clusters, ~1.28M edges)\n")
    print(table(spmm, ["format", "min_tile_nnz", "d", "bits", "tiles", "tile_steps", "fill", "residual", "build_ms", "pack_row_codes_ms",
                       "bit_spmm_int_ms", "bit_spmm_int_cached_ms", "bit_spmm_ms", "bit_spmm_call_ms", "gcn_fused_ms", "csr_fp32_ms", "csr_bf16_ms",
                       "speedup_vs_fp32", "speedup_full_vs_fp32", "roofline_ms", "pct_roofline"]))
    sass = sass_report()
    print("\n## tensor-core instructions in SASS\n")
    for name, counts in sass.items():
        print(f"- {name}: {counts}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(info=info, ceilings=peak, dense=dense, qgtc=qgtc, spmm=spmm, sass=sass), f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
