#!/usr/bin/env bash
# Compiles CUDA sources (nvcc -c, no link) against the installed torch's headers, so that a machine with nvcc but a
# CPU-only torch can catch compile errors in csrc/cuda/*.cu before a GPU run.  A CPU wheel lacks two generated
# headers (c10/cuda/impl/cuda_cmake_macros.h, ATen/cuda/CUDAConfig.h); stubs of them are written to a temporary
# include directory.
# Usage (from the repository root): tools/check_cuda_compile.sh [file.cu ...]   (default: every csrc/cuda/*.cu)
set -uo pipefail
cd "$(dirname "$0")/.."
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
mkdir -p "$stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
mkdir -p "$stub/ATen/cuda"
printf '#pragma once\n#define AT_ROCM_ENABLED() 0\n#define AT_CUDNN_ENABLED() 1\n#define AT_MAGMA_ENABLED() 0\n' \
  > "$stub/ATen/cuda/CUDAConfig.h"
torch_include=$(python -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])") || exit 1
python_include=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])") || exit 1
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(csrc/cuda/*.cu)
status=0
for f in "${files[@]}"; do
  if nvcc -c -std=c++17 -O0 -arch=sm_90a -DPYG_QUANT_SM90A -DWITH_CUDA -DAT_PER_OPERATOR_HEADERS \
      --expt-relaxed-constexpr -diag-suppress 3306 -I"$stub" -I"$torch_include" \
      -I"$torch_include/torch/csrc/api/include" -I"$python_include" -Icsrc -Xcompiler -fPIC "$f" \
      -o "$stub/$(basename "$f").o" > "$stub/log" 2>&1; then
    echo "ok   $f"
  else
    echo "FAIL $f"; grep -E "error" "$stub/log" | head -20; status=1
  fi
done
exit $status
