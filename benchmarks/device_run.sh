#!/usr/bin/env bash
# Device-side steps, run from the repo root on the GPU machine:
#   bash benchmarks/device_run.sh build test sanitize bench
# build: the extension with its CUDA kernels (ptxas register/spill report kept);
# test: the CUDA tests and then the whole suite; sanitize: compute-sanitizer
# memcheck and racecheck over the CUDA tests; bench: benchmarks/gpu_kernels.py.
set -uo pipefail
export MAX_JOBS=16 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0a}"
OUT="${OUT:-/tmp/pyg_quant_out}"; mkdir -p "$OUT"
# The lent machine sets CXX=/opt/gcc/bin/g++; an extension built with it segfaults on
# any C++ exception (a ValueError from an op's argument check), one built with the
# system compiler raises it (both GCC 13.3; measured with the segv step below).
if [ -x /usr/bin/g++ ] && [ -z "${KEEP_CXX:-}" ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case "$step" in
    build)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/device.txt"
      start=$(date +%s)
      python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
      echo "build: $(( $(date +%s) - start )) s"
      grep -E "bytes spill|Used [0-9]+ registers" "$OUT/build.log" | grep -v " 0 bytes spill" | sort | uniq -c | head -20
      python3 -c "import pyg_quant as pq; print('backends', pq.backends())" ;;
    cudatest|test)
      python3 -m pytest -q -m cuda -rs tests 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
      [ "$step" = cudatest ] && continue
      python3 -m pytest -q -p no:cacheprovider tests > "$OUT/pytest_all.log" 2>&1; echo "full suite exit $?"; grep -E "passed|failed|Fatal|line [0-9]+ in test_" "$OUT/pytest_all.log" | head -12 ;;
    sanitize)
      export PYTORCH_NO_CUDA_MEMORY_CACHING=1
      # racecheck only matters for kernels that share memory, and is ~10x slower than memcheck.
      for tool in memcheck racecheck; do
        if [ $tool = memcheck ]; then filter="${MEMCHECK_FILTER:-not unbiased}"; else
          filter="${RACECHECK_FILTER:-bitmm_int_gpu_equals_cpu and 37x300 or bit_spmm_int_gpu_equals_cpu and 3 or from_edge_index_gpu}"; fi
        timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool $tool --error-exitcode 9 \
          python3 -m pytest -q -x -p no:cacheprovider -m cuda ${SANITIZE_FILES:-tests/test_cuda.py} -k "$filter" \
          > "$OUT/sanitizer_$tool.log" 2>&1
        echo "compute-sanitizer $tool: exit $? | $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')"
      done
      unset PYTORCH_NO_CUDA_MEMORY_CACHING ;;
    throwdiag)
      # A C++ exception thrown by a compiled op must surface as a Python ValueError.
      python3 - <<'PY'
import torch, pyg_quant
try:
    torch.ops.pyg_quant.quantize_pack(torch.randn(4, 5), torch.zeros(1, 1), torch.ones(1, 1), 9, False, None)
except ValueError as e:
    print("raised ValueError:", str(e).splitlines()[0])
PY
      echo "throw exit $?"
      ldd pyg_quant/_C*.so | grep -E "stdc|gcc_s|gomp"
      [ -x .carry/diag_throw.sh ] && bash .carry/diag_throw.sh 2>&1 | tail -30 ;;
    segv)
      # Why does a C++ exception from our ops segfault here? A backtrace, then the same
      # throw from a CPU-only build and from a build with the system compiler.
      THROW="import torch, pyg_quant, sys; print(pyg_quant.__file__, pyg_quant.backends())
try: torch.ops.pyg_quant.quantize_pack(torch.randn(4, 5), torch.zeros(1, 1), torch.ones(1, 1), 9, False, None)
except ValueError as e: print('raised ValueError')"
      for v in cpuonly sysgcc; do
        rm -rf /tmp/$v && mkdir /tmp/$v && cp -r csrc pyg_quant setup.py README.md /tmp/$v/
        if [ $v = cpuonly ]; then (cd /tmp/$v && PYG_QUANT_NO_CUDA=1 python3 setup.py build_ext --inplace > build.log 2>&1) &
        else (cd /tmp/$v && CXX=/usr/bin/g++ CC=/usr/bin/gcc python3 setup.py build_ext --inplace > build.log 2>&1) & fi
      done
      timeout 120 cuda-gdb -batch -ex run -ex bt --args python3 -c "$THROW" 2>&1 | grep -v -E "^\[(New|Thread|Detaching)" | tail -40
      wait
      for v in cpuonly sysgcc; do (cd /tmp/$v && tail -2 build.log && PYTHONPATH=/tmp/$v:/tmp/site python3 -c "$THROW"; echo "$v throw exit $?"); done ;;
    bench)
      python3 benchmarks/gpu_kernels.py ${BENCH_ARGS:-} --out "$OUT/gpu_kernels.json" 2>&1 | tee "$OUT/gpu_kernels.log" ;;
  esac
done
