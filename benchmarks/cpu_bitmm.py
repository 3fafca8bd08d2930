"""CPU benchmark: pyg_quant.bitmm / bitmm_int / to_bit / bit_spmm against torch fp32.

GEMM: ``a @ b`` for square M=K=N in {512, 1024, 2048} and the GNN-like X·W shape
M=8192, K=256, N=64, at bit pairs (A bits, B bits) in (1,1), (2,2), (4,4), (8,8),
(1,4).  A is quantized per row (dim=1) in layout "row", B per column (dim=0) in
layout "col", so no repacking happens inside the timed region.  Timed:

* ``fp32``      torch ``a @ b`` (float32, the logical shape);
* ``to_bit A/B`` quantize + pack of each operand;
* ``bitmm_int`` the int32 code product Qa·Qb only (the C++ popcount kernel);
* ``bitmm``     the full float32 result, affine float64 epilogue included
  (timed interleaved with ``bitmm_int``, call for call, so both see the same
  machine state and their difference is the wrapper's share).

SpMM: ``bit_spmm(adj, x)`` on a synthetic planted-partition graph (fixed seed;
nodes numbered cluster by cluster) with 64 features at 1/2/4/8 bits, against
torch fp32 CSR SpMM (``torch.sparse_csr`` matrix @ dense x) on the same graph,
twice: with 16×256 tiles of at least 16 entries, and in the CSR form alone (what
``adjacency="auto"`` keeps for such graphs, whose tiles are ~2% full).

Every configuration is checked once before it is timed: the code product must
equal the float64 product of the codes exactly, and the float result's error
against the float64 product of the dequantized operands, over the same product
of the magnitudes of the terms the float32 epilogue adds, must stay within the
epilogue's bound (``pyg_quant.ops.reference.EPILOGUE_BOUND``).

Reported: median wall time in ms over the repetitions (after one warm-up call),
"binary GOPS" = 2·M·N·K·s·t / time (s, t the bit widths: the number of 1-bit
multiply-adds a bit-serial product performs), and the speed-up
fp32 time / pyg_quant time.

Usage (from the repository root)::

    python benchmarks/cpu_bitmm.py            # full run (~1 min on 2 idle cores; longer if measurements are retaken)
    python benchmarks/cpu_bitmm.py --quick    # seconds; a smoke test
    python benchmarks/cpu_bitmm.py --threads 1
    python benchmarks/cpu_bitmm.py --spmm-only  # the two SpMM tables alone (~10 s)

Writes JSON to benchmarks/out/cpu_bitmm.json (cpu_bitmm_quick.json with --quick).
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import pyg_quant as pq
except ImportError:  # run as `python benchmarks/cpu_bitmm.py` from a checkout without an install
    sys.path.insert(0, os.path.dirname(HERE))
    import pyg_quant as pq
from pyg_quant import ops  # noqa: E402
from pyg_quant.ops.reference import EPILOGUE_BOUND  # noqa: E402
from pyg_quant.quantization.quantize import exact_values, term_magnitudes  # noqa: E402

BIT_PAIRS = [(1, 1), (2, 2), (4, 4), (8, 8), (1, 4)]
SPMM_BITS = [1, 2, 4, 8]


# --- machine info --------------------------------------------------------------------
def cpu_model() -> dict:
    info = {"processor": platform.processor(), "machine": platform.machine()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("Model name", "Vendor ID", "CPU family", "Model", "CPU(s)",
                       "Thread(s) per core", "Hypervisor vendor", "L2 cache", "L3 cache"):
                info[key] = value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    if "Model name" not in info:
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        info["Model name"] = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
        info["popcnt"] = " popcnt" in flags
        info["avx512_vpopcntdq"] = "avx512_vpopcntdq" in flags
    return info


def git_commit(path: str) -> str:
    """``HEAD`` of the checkout pyg_quant was imported from (``+dirty`` with local changes), or ``""``."""
    try:
        rev = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def extension_info() -> dict:
    """Path and build time of the compiled extension (the working tree may differ from the commit)."""
    try:
        from pyg_quant import _C
    except ImportError:
        return {}
    path = getattr(_C, "__file__", None)
    if not path:
        return {}
    mtime = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
    return {"path": path, "built": mtime.isoformat(timespec="seconds")}


def machine_info(threads: int) -> dict:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyg_quant": pq.__version__,
        "pyg_quant_path": os.path.dirname(pq.__file__),
        "git_commit": git_commit(os.path.dirname(os.path.dirname(os.path.abspath(pq.__file__)))),
        "backends": pq.backends(),
        "extension": extension_info(),
        "threads": threads,
        "cpu": cpu_model(),
    }


# --- other load on the machine ---------------------------------------------------------
def _busy_cpu_s():
    """(CPU seconds all processes of the machine spent busy, CPU seconds of this process) so far."""
    own = os.times()
    own_s = own.user + own.system
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None, own_s
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK"), own_s


def foreign_load(start, elapsed_s: float):
    """Share of the machine's CPU time that other processes used since ``start`` (None if unknown)."""
    end = _busy_cpu_s()
    if start[0] is None or end[0] is None or elapsed_s <= 0:
        return None
    foreign = (end[0] - start[0]) - (end[1] - start[1])
    return max(0.0, foreign) / (elapsed_s * (os.cpu_count() or 1))


# --- timing --------------------------------------------------------------------------
# Measurements during which other processes took more than this share of the
# machine's CPU time (or more than FOREIGN_MIN_S CPU seconds, whichever is larger:
# /proc/stat counts in 10 ms ticks) are thrown away and taken again once the
# machine is quiet, at most MAX_RETRIES times.
FOREIGN_MAX_SHARE = 0.05
FOREIGN_MIN_S = 0.03
MAX_RETRIES = 6
STATS = {"retried": 0, "disturbed": 0}


def wait_until_quiet(max_wait_s: float = 120.0, window_s: float = 0.5, quiet_windows: int = 2) -> None:
    """Sleeps until other processes leave the CPUs idle for ``quiet_windows`` windows in a row."""
    deadline, quiet = time.perf_counter() + max_wait_s, 0
    while quiet < quiet_windows and time.perf_counter() < deadline:
        start = _busy_cpu_s()
        if start[0] is None:
            return
        time.sleep(window_s)
        share = foreign_load(start, window_s)
        quiet = quiet + 1 if share is not None and share < FOREIGN_MAX_SHARE else 0


def bench(fn, min_reps: int, max_reps: int, budget_s: float, warmup: int = 1):
    """Median wall time (ms) of ``fn()`` after ``warmup`` calls.

    ``fn`` may be a list of functions: they are then timed interleaved (one call
    of each per repetition), so that all see the same machine state, and a list
    of results is returned.  Runs at least ``min_reps`` and at most ``max_reps``
    repetitions, stopping early once ``budget_s`` seconds have been spent (after
    ``min_reps``).  If other processes were busy meanwhile, waits for quiet and
    measures again.
    """
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    for attempt in range(MAX_RETRIES + 1):
        load_start, t_first = _busy_cpu_s(), time.perf_counter()
        for _ in range(warmup):
            for f in fns:
                f()
        times = [[] for _ in fns]
        start = time.perf_counter()
        while len(times[0]) < max_reps:
            for f, ts in zip(fns, times):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            if len(times[0]) >= min_reps and time.perf_counter() - start > budget_s:
                break
        window = time.perf_counter() - t_first
        share = foreign_load(load_start, window)
        ncpu = os.cpu_count() or 1
        disturbed = share is not None and share * window * ncpu > max(FOREIGN_MAX_SHARE * window * ncpu,
                                                                        FOREIGN_MIN_S)
        if not disturbed:
            break
        if attempt < MAX_RETRIES:
            STATS["retried"] += 1
            wait_until_quiet()
    else:
        STATS["disturbed"] += 1
    results = []
    for ts in times:
        ts.sort()
        n = len(ts)
        median = ts[n // 2] if n % 2 else 0.5 * (ts[n // 2 - 1] + ts[n // 2])
        results.append({"median_ms": median * 1e3, "min_ms": ts[0] * 1e3, "max_ms": ts[-1] * 1e3, "reps": n,
                        "foreign_cpu_share": share, "attempts": attempt + 1, "disturbed": disturbed})
    return results if isinstance(fn, (list, tuple)) else results[0]


def epilogue_err(out: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor) -> float:
    """The error of ``out`` against the float64 ``ref`` over the magnitudes of the terms its float32 epilogue adds
    (``terms``; at most ``EPILOGUE_BOUND``), norm-wise."""
    return float((out.double() - ref).norm() / terms.norm())


# --- GEMM ----------------------------------------------------------------------------
def run_gemm(shapes, bit_pairs, reps, seed: int):
    rows = []
    for (m, k, n) in shapes:
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(m, k, generator=gen)
        b = torch.randn(k, n, generator=gen)
        fp32 = bench(lambda: a @ b, **reps)
        fp32_gflops = 2.0 * m * n * k / (fp32["median_ms"] * 1e-3) / 1e9
        print(f"  [{m}x{k}x{n}] fp32 a @ b: {fp32['median_ms']:.3f} ms ({fp32_gflops:.1f} GFLOP/s)", flush=True)

        # quantized operands and their to_bit timings, cached per bit width
        a_bits, b_bits = {}, {}
        for s, t in bit_pairs:
            if s not in a_bits:
                qa = pq.to_bit(a, s, dim=1, layout="row")
                a_bits[s] = (qa, bench(lambda: pq.to_bit(a, s, dim=1, layout="row"), **reps))
            if t not in b_bits:
                qb = pq.to_bit(b, t, dim=0, layout="col")
                b_bits[t] = (qb, bench(lambda: pq.to_bit(b, t, dim=0, layout="col"), **reps))

        for s, t in bit_pairs:
            qa, tb_a = a_bits[s]
            qb, tb_b = b_bits[t]
            # correctness, once per configuration, before timing
            codes_ref = qa.codes().double() @ qb.codes().double()  # exact: entries < 2**53
            prod = pq.bitmm_int(qa, qb)
            assert prod.dtype == torch.int32 and torch.equal(prod.double(), codes_ref), \
                f"bitmm_int mismatch at {m}x{k}x{n} bits {s}x{t}"
            err = epilogue_err(pq.bitmm(qa, qb), exact_values(qa) @ exact_values(qb),
                               term_magnitudes(qa) @ term_magnitudes(qb))
            assert err <= EPILOGUE_BOUND, f"bitmm error {err:.3e} > {EPILOGUE_BOUND:.1e} at {m}x{k}x{n} bits {s}x{t}"
            del codes_ref, prod

            t_int, t_full = bench([lambda: pq.bitmm_int(qa, qb), lambda: pq.bitmm(qa, qb)], **reps)
            bin_ops = 2.0 * m * n * k * s * t
            row = {
                "M": m, "K": k, "N": n, "a_bits": s, "b_bits": t,
                "epilogue_err": err,
                "fp32": fp32, "fp32_gflops": fp32_gflops,
                "to_bit_a": tb_a, "to_bit_b": tb_b,
                "bitmm_int": t_int, "bitmm": t_full,
                "binary_ops": bin_ops,
                "bitmm_int_binary_gops": bin_ops / (t_int["median_ms"] * 1e-3) / 1e9,
                "bitmm_binary_gops": bin_ops / (t_full["median_ms"] * 1e-3) / 1e9,
                "speedup_int_vs_fp32": fp32["median_ms"] / t_int["median_ms"],
                "speedup_vs_fp32": fp32["median_ms"] / t_full["median_ms"],
                "epilogue_share": max(0.0, 1.0 - t_int["median_ms"] / t_full["median_ms"]),
            }
            rows.append(row)
            print(f"  [{m}x{k}x{n}] {s}x{t} bits: int {t_int['median_ms']:.3f} ms "
                  f"({row['bitmm_int_binary_gops']:.0f} GOPS), bitmm {t_full['median_ms']:.3f} ms, "
                  f"rel err {err:.1e}", flush=True)
    return rows


# --- SpMM ----------------------------------------------------------------------------
def planted_partition(num_nodes: int, clusters: int, avg_degree: int, p_in: float, seed: int):
    """Undirected planted-partition graph as a symmetric, duplicate- and loop-free edge_index.

    Node ``i`` belongs to cluster ``i // (num_nodes // clusters)`` (nodes numbered
    cluster by cluster, as after a METIS-style reordering).  ``num_nodes·avg_degree/2``
    pairs are drawn: a uniform endpoint, and with probability ``p_in`` a partner
    in its cluster, else one in another cluster; both directions are kept.
    """
    gen = torch.Generator().manual_seed(seed)
    size = num_nodes // clusters
    pairs = num_nodes * avg_degree // 2
    src = torch.randint(0, num_nodes, (pairs,), generator=gen)
    cluster = src // size
    inside = torch.rand(pairs, generator=gen) < p_in
    other = (cluster + torch.randint(1, clusters, (pairs,), generator=gen)) % clusters
    dst = torch.where(inside, cluster, other) * size + torch.randint(0, size, (pairs,), generator=gen)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    src, dst = torch.cat([src, dst]), torch.cat([dst, src])
    keys = torch.unique(dst * num_nodes + src)  # sorted by (target, source)
    edge_index = torch.stack([keys % num_nodes, keys // num_nodes])  # [source; target]
    intra = (edge_index[0] // size == edge_index[1] // size).float().mean().item()
    return edge_index, intra


def run_spmm(num_nodes, clusters, avg_degree, p_in, features, bits_list, reps, seed: int, min_tile_nnz: int = 16,
             adjacency: str = "tiles"):
    edge_index, intra = planted_partition(num_nodes, clusters, avg_degree, p_in, seed)
    nnz = edge_index.size(1)
    adj = pq.BitAdjacency.from_edge_index(edge_index, num_nodes, self_loops=0, min_tile_nnz=min_tile_nnz,
                                          adjacency=adjacency)
    # fp32 CSR with rows = targets, cols = sources, like BitAdjacency
    src, dst = edge_index[0], edge_index[1]
    crow = torch.zeros(num_nodes + 1, dtype=torch.int64)
    crow[1:] = torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0)
    with warnings.catch_warnings():  # "sparse CSR support is in beta" etc.
        warnings.simplefilter("ignore", UserWarning)
        csr = torch.sparse_csr_tensor(crow, src, torch.ones(nnz), size=(num_nodes, num_nodes),
                                      check_invariants=True)
        csr64 = csr.to(torch.float64)
    x = torch.randn(num_nodes, features, generator=torch.Generator().manual_seed(seed + 1))
    fp32 = bench(lambda: csr @ x, **reps)
    graph = {"num_nodes": num_nodes, "clusters": clusters, "cluster_size": num_nodes // clusters,
             "target_avg_degree": avg_degree, "p_in": p_in, "nnz": nnz, "edges_per_node": nnz / num_nodes,
             "intra_fraction": intra, "adj_bits": adj.bits, "tiles": adj.num_tiles,
             "windows": adj.window_ptr.numel() - 1, "tiles_per_window": adj.num_tiles / (adj.window_ptr.numel() - 1),
             "fill_ratio": adj.fill_ratio, "tile_nnz": adj.tile_nnz, "res_nnz": adj.res_nnz,
             "min_tile_nnz": min_tile_nnz, "adjacency": adjacency, "features": features}
    print(f"  graph: {num_nodes} nodes, {nnz} directed edges ({nnz / num_nodes:.1f}/node, "
          f"{100 * intra:.1f}% intra-cluster), {adj.num_tiles} tiles (fill {adj.fill_ratio:.4f}), "
          f"{adj.res_nnz} entries in the CSR residual; "
          f"fp32 CSR @ x[{features}]: {fp32['median_ms']:.3f} ms", flush=True)
    rows = []
    for bits in bits_list:
        qx = pq.to_bit(x, bits, dim=0, layout="col")
        tb = bench(lambda: pq.to_bit(x, bits, dim=0, layout="col"), **reps)
        wide = adj.max_row_sum * (2**bits - 1) > 2**31 - 1

        def kernel():  # the integer kernel alone, called exactly as bit_spmm calls it
            return ops.bit_spmm_int(adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col,
                                    adj.res_val, qx.planes, adj.num_rows, qx.cols, wide)

        codes_ref = csr64 @ qx.codes().double()
        assert torch.equal(kernel().double(), codes_ref), f"bit_spmm_int mismatch at {bits} bits"
        err = epilogue_err(pq.bit_spmm(adj, qx), csr64 @ exact_values(qx), csr64 @ term_magnitudes(qx))
        assert err <= EPILOGUE_BOUND, f"bit_spmm error {err:.3e} > {EPILOGUE_BOUND:.1e} at {bits} bits"
        t_int, t_full = bench([kernel, lambda: pq.bit_spmm(adj, qx)], **reps)
        # 2·nnz·F: the multiply-adds of A·X (what fp32 CSR does), as an effective rate
        edge_ops = 2.0 * nnz * features
        row = {"x_bits": bits, "epilogue_err": err, "fp32_csr": fp32, "to_bit_x": tb,
               "bit_spmm_int": t_int, "bit_spmm": t_full, "edge_ops": edge_ops,
               "fp32_csr_gops": edge_ops / (fp32["median_ms"] * 1e-3) / 1e9,
               "bit_spmm_int_gops": edge_ops / (t_int["median_ms"] * 1e-3) / 1e9,
               "bit_spmm_gops": edge_ops / (t_full["median_ms"] * 1e-3) / 1e9,
               "speedup_int_vs_fp32": fp32["median_ms"] / t_int["median_ms"],
               "speedup_vs_fp32": fp32["median_ms"] / t_full["median_ms"],
               "epilogue_share": max(0.0, 1.0 - t_int["median_ms"] / t_full["median_ms"])}
        rows.append(row)
        print(f"  x {bits} bits: int {t_int['median_ms']:.3f} ms, bit_spmm {t_full['median_ms']:.3f} ms, "
              f"to_bit {tb['median_ms']:.3f} ms, rel err {err:.1e}", flush=True)
    return {"graph": graph, "fp32_csr": fp32, "rows": rows}


# --- report --------------------------------------------------------------------------
def gemm_table(rows) -> str:
    head = ("| M×K×N | bits A×B | fp32 ms | to_bit A ms | to_bit B ms | bitmm_int ms | bitmm ms "
            "| epilogue share | int bin. GOPS | bitmm bin. GOPS | fp32/int | fp32/bitmm |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        lines.append(
            f"| {r['M']}×{r['K']}×{r['N']} | {r['a_bits']}×{r['b_bits']} | {r['fp32']['median_ms']:.3f} "
            f"| {r['to_bit_a']['median_ms']:.3f} | {r['to_bit_b']['median_ms']:.3f} "
            f"| {r['bitmm_int']['median_ms']:.3f} | {r['bitmm']['median_ms']:.3f} "
            f"| {100 * r['epilogue_share']:.0f}% | {r['bitmm_int_binary_gops']:.0f} | {r['bitmm_binary_gops']:.0f} "
            f"| {r['speedup_int_vs_fp32']:.2f} | {r['speedup_vs_fp32']:.2f} |")
    return "\n".join(lines)


def spmm_table(spmm) -> str:
    g, r0 = spmm["graph"], spmm["rows"][0]
    head = ("| x bits | fp32 CSR ms | to_bit x ms | bit_spmm_int ms | bit_spmm ms | epilogue share "
            "| int eff. GOP/s | fp32/int | fp32/bit_spmm |")
    lines = [f"Graph: {g['num_nodes']} nodes = {g['clusters']} clusters × {g['cluster_size']}, "
             f"{g['nnz']} directed edges ({g['edges_per_node']:.1f}/node, {100 * g['intra_fraction']:.1f}% "
             f"intra-cluster), {g['features']} features; {g['tiles']} stored 16×256 tiles "
             f"({g['tiles_per_window']:.1f} per row window, fill {g['fill_ratio']:.4f}, "
             f"{g['tile_nnz']} entries) + {g['res_nnz']} entries in the CSR residual "
             f"(adjacency={g['adjacency']!r}, min_tile_nnz={g['min_tile_nnz']}).  "
             f"fp32 CSR: {r0['fp32_csr_gops']:.1f} GFLOP/s; "
             f"eff. GOP/s = 2·nnz·F / time.", "",
             head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in spmm["rows"]:
        lines.append(
            f"| {r['x_bits']} | {r['fp32_csr']['median_ms']:.3f} | {r['to_bit_x']['median_ms']:.3f} "
            f"| {r['bit_spmm_int']['median_ms']:.3f} | {r['bit_spmm']['median_ms']:.3f} "
            f"| {100 * r['epilogue_share']:.0f}% | {r['bit_spmm_int_gops']:.1f} "
            f"| {r['speedup_int_vs_fp32']:.2f} | {r['speedup_vs_fp32']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions (smoke test)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch intra-op threads (default: torch.get_num_threads())")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spmm-only", action="store_true", help="skip the GEMM section")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/out/cpu_bitmm[_quick].json)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)

    info = machine_info(torch.get_num_threads())
    cpu = info["cpu"]
    print(f"# pyg_quant CPU benchmark  ({info['date']})")
    print(f"torch {info['torch']}, pyg_quant {info['pyg_quant']} ({info['pyg_quant_path']}, "
          f"commit {info['git_commit'] or '?'}, extension built {info['extension'].get('built', '?')}), "
          f"backends {info['backends']}, "
          f"threads {info['threads']}, python {info['python']}")
    print(f"CPU: {cpu.get('Model name', '?')} (family {cpu.get('CPU family', '?')}, model {cpu.get('Model', '?')}), "
          f"processor={cpu['processor']!r}, {cpu.get('CPU(s)', '?')} CPUs, popcnt={cpu.get('popcnt')}, "
          f"avx512_vpopcntdq={cpu.get('avx512_vpopcntdq')}")
    if not info["backends"]["cpu"]:
        print("WARNING: the C++ extension is not loaded; timing the pure-torch reference path", flush=True)

    if args.quick:
        shapes = [(128, 128, 128), (1024, 256, 64)]
        reps = dict(min_reps=2, max_reps=3, budget_s=0.05)
        graph = dict(num_nodes=800, clusters=5, avg_degree=40, p_in=0.8, features=64)
    else:
        shapes = [(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (8192, 256, 64)]
        reps = dict(min_reps=5, max_reps=20, budget_s=0.5)
        graph = dict(num_nodes=8000, clusters=5, avg_degree=40, p_in=0.8, features=64)

    t_start, load_start = time.perf_counter(), _busy_cpu_s()
    gemm = []
    if not args.spmm_only:
        print("\nGEMM (check + timing):", flush=True)
        gemm = run_gemm(shapes, BIT_PAIRS, reps, args.seed)
    print("\nSpMM (check + timing):", flush=True)
    spmm = run_spmm(bits_list=SPMM_BITS, reps=reps, seed=args.seed, **graph)
    print("\nSpMM, CSR form only (check + timing):", flush=True)
    spmm_csr = run_spmm(bits_list=SPMM_BITS, reps=reps, seed=args.seed, adjacency="csr", **graph)
    elapsed = time.perf_counter() - t_start
    other = foreign_load(load_start, elapsed)

    if gemm:
        print(f"\n## GEMM: pyg_quant.bitmm / bitmm_int vs torch fp32 a @ b ({info['threads']} threads)\n")
        print(gemm_table(gemm))
    print(f"\n## SpMM: pyg_quant.bit_spmm vs torch fp32 CSR @ x ({info['threads']} threads)\n")
    print(spmm_table(spmm))
    print(f"\n## SpMM, CSR form only ({info['threads']} threads)\n")
    print(spmm_table(spmm_csr))
    print(f"\nmedian of {reps['min_reps']}-{reps['max_reps']} reps after 1 warm-up (int kernel and full op "
          f"timed interleaved); binary GOPS = "
          f"2·M·N·K·s·t / time; all configurations passed the correctness check "
          f"(error over the terms' magnitudes ≤ {EPILOGUE_BOUND:.1e}); total {elapsed:.1f} s")
    if other is not None:
        print(f"other processes used {100 * other:.1f}% of the machine's CPU time during the run; "
              f"{STATS['retried']} measurements were retaken because of it, "
              f"{STATS['disturbed']} stayed disturbed after {MAX_RETRIES} retries")
    if STATS["disturbed"]:
        print("WARNING: some timings are disturbed by other processes (\"disturbed\": true in the JSON); "
              "rerun on a quiet machine")

    out = args.out or os.path.join(HERE, "out", "cpu_bitmm_quick.json" if args.quick else "cpu_bitmm.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": {**info, "quick": args.quick, "reps": reps, "epilogue_bound": EPILOGUE_BOUND,
                            "elapsed_s": elapsed, "foreign_cpu_share": other,
                            "foreign_max_share": FOREIGN_MAX_SHARE, "retaken_measurements": STATS["retried"],
                            "disturbed_measurements": STATS["disturbed"]},
                   "gemm": gemm, "spmm": spmm, "spmm_csr": spmm_csr}, f, indent=1)
    print(f"wrote {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
