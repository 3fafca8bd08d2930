"""The memory floor of a CSR gather on the products-scale cluster batch (issue 3's 4-bit, d = 64 case).

A gather of A·X over a CSR adjacency must, for every entry, load its column index and then the source row's
packed codes (32 bytes at 4 bits and 64 features: ``BitTensor.row_codes()``).  These probe kernels do exactly that
and nothing else -- no sums, no epilogue, the loaded words XORed so the loads stay -- with every entry its own
thread (or 2 / 4 lanes an entry, as the real gather splits a row), i.e. the most loads in flight the batch allows.
Their time bounds from below what any gather of this batch in this layout can take; the script times
``bit_spmm_int`` (the real gather, cached row codes) and torch's fp32 CSR SpMM (``csr @ x``) in the same run, so
the ratio fp32 / floor is the best speedup over fp32 CSR a gather could reach.

Graph replay of 20 calls, median of 20 replays, twice.  Needs a CUDA GPU with sm_90 (the probe is compiled for
sm_90a at run time with torch.utils.cpp_extension.load_inline).

    python benchmarks/gather_floor.py --out results.json
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch
from torch.utils.cpp_extension import load_inline

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import pyg_quant as pq  # noqa: E402
from gpu_kernels import cluster_batch  # noqa: E402  (the products-scale batch gpu_kernels.py's bit_spmm rows use)
from quant_mlp_gpu import time_graph as graph_us  # noqa: E402  (median µs a call of a replayed graph of 20 calls)

PROBE = r'''
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
// Thread t loads part t % kLanes of entry t / kLanes: the entry's column, then 32 / kLanes bytes of its row.
template <int kLanes>
__global__ void floor_kernel(const int* __restrict__ col, long long nnz, const unsigned char* __restrict__ codes,
                             long long ld, unsigned* __restrict__ out) {
  constexpr int kWords = 8 / kLanes;
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long e = t / kLanes;
  unsigned acc = 0;
  if (e < nnz) {
    const unsigned* p = reinterpret_cast<const unsigned*>(codes + (long long)__ldg(col + e) * ld) + (t % kLanes) * kWords;
    if constexpr (kWords == 8) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(p)), b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
      acc = a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
    } else if constexpr (kWords == 4) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
      acc = a.x ^ a.y ^ a.z ^ a.w;
    } else {
      const uint2 a = __ldg(reinterpret_cast<const uint2*>(p));
      acc = a.x ^ a.y;
    }
  }
  if (acc == 0x9e3779b9u) out[t & 1023] = acc;  // a data-dependent store the compiler cannot drop
}
void run(torch::Tensor col, torch::Tensor codes, long long ld, torch::Tensor out, int lanes) {
  const long long nnz = col.numel(), threads = nnz * lanes;
  const int block = 256;
  const unsigned grid = static_cast<unsigned>((threads + block - 1) / block);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int* c = col.data_ptr<int>();
  const unsigned char* k = codes.data_ptr<unsigned char>();
  unsigned* o = reinterpret_cast<unsigned*>(out.data_ptr<int>());
  if (lanes == 1) floor_kernel<1><<<grid, block, 0, stream>>>(c, nnz, k, ld, o);
  else if (lanes == 2) floor_kernel<2><<<grid, block, 0, stream>>>(c, nnz, k, ld, o);
  else floor_kernel<4><<<grid, block, 0, stream>>>(c, nnz, k, ld, o);
}
'''


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("gather_floor.py needs an sm_90 GPU (the probe is compiled for sm_90a)")
    probe = load_inline("gather_floor_probe", cpp_sources=(
        "void run(torch::Tensor col, torch::Tensor codes, long long ld, torch::Tensor out, int lanes);"),
        cuda_sources=PROBE, functions=["run"], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
    d, bits = 64, 4
    edge_index, n = cluster_batch(None)
    adj = pq.BitAdjacency.from_edge_index(edge_index, n, min_tile_nnz=4097)  # every entry in the CSR form
    x_float = torch.randn(n, d, device="cuda")
    x = pq.to_bit(x_float, bits, dim=0, layout="col")
    codes = x.row_codes()
    row_bytes = codes.stride(0) * codes.element_size()
    columns = adj.res_col.to(torch.int32).contiguous()
    out = torch.zeros(1024, dtype=torch.int32, device="cuda")
    csr = torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.size(1), device="cuda"),
                                  (n, n)).coalesce().to_sparse_csr()
    spmm_args = (adj.window_ptr, adj.tile_col, adj.tile_bits, adj.res_ptr, adj.res_col, adj.res_val, x.planes)
    result = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": "python " + " ".join(sys.argv), "nodes": n, "entries": int(columns.numel()), "d": d,
              "bits": bits, "row_bytes": row_bytes, "runs": []}
    print(f"{result['device']}: {columns.numel()} entries, {row_bytes}-byte rows of codes", flush=True)
    for _ in range(2):
        run = {"bit_spmm_int_us": graph_us(lambda: torch.ops.pyg_quant.bit_spmm_int(*spmm_args, n, d, False, codes)),
               "fp32_csr_us": graph_us(lambda: csr @ x_float)}
        for lanes in (1, 2, 4):
            run[f"floor_{lanes}_lanes_us"] = graph_us(lambda: probe.run(columns, codes, row_bytes, out, lanes))
        result["runs"].append(run)
        print(" | ".join(f"{k} {v:.2f}" for k, v in run.items()), flush=True)
    best = min(min(r[f"floor_{lanes}_lanes_us"] for lanes in (1, 2, 4)) for r in result["runs"])
    fp32 = statistics.median([r["fp32_csr_us"] for r in result["runs"]])
    result["floor_us"], result["fp32_csr_us"] = best, fp32
    result["best_gather_speedup_vs_fp32"] = fp32 / best
    print(f"floor {best:.2f} us, fp32 CSR {fp32:.2f} us: no gather of this batch beats fp32 CSR by more than "
          f"{fp32 / best:.2f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
