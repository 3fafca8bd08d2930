#pragma once
// PYG_QUANT_HOST_DEVICE marks a function that the C++ compiler and nvcc (host and device code alike) compile from
// one definition, so that the CPU and CUDA kernels share a single copy of the arithmetic they must agree on.
#if defined(__CUDACC__)
#define PYG_QUANT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PYG_QUANT_HOST_DEVICE inline
#endif
