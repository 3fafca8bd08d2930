"""Builds pyg_quant._C: CPU kernels always, CUDA kernels when torch has CUDA and nvcc is found.

TORCH_CUDA_ARCH_LIST defaults to "8.0;9.0a" (native b1 tensor cores: Ampere's
mma.sync and Hopper's wgmma); set it to override.  PYG_QUANT_NO_EXTENSION=1
skips the extension (the pure-torch reference path is used then).
PYG_QUANT_PTXAS_VERBOSE=1 prints ptxas' register and spill report of every CUDA kernel;
PYG_QUANT_DEBUG_INFO=1 keeps the C++ debug info (-g) that the build otherwise drops.
"""
import glob
import os
import platform
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def extension_modules():
    if os.environ.get("PYG_QUANT_NO_EXTENSION") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    def rel(pattern):
        return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))

    sources = rel("csrc/*.cpp") + rel("csrc/cpu/*.cpp")
    cuda_sources = rel("csrc/cuda/*.cu")
    # The C++ files include only the ATen headers of the ops they call: <ATen/ATen.h> (every op's declaration)
    # would cost each file seconds of compile, and the two macros make such an include a compile error.
    cxx_flags = ["-O3", "-ffp-contract=off", "-fvisibility=hidden", "-DAT_PER_OPERATOR_HEADERS",
                 "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS"]
    if os.environ.get("PYG_QUANT_DEBUG_INFO") != "1":
        # Python's own CFLAGS pass -g: torch's headers' debug info costs about a quarter of the compile (and most
        # of the library's size), and torch's wheels carry none either.
        cxx_flags.append("-g0")
    link_flags = []
    if platform.machine() in ("x86_64", "AMD64"):
        cxx_flags.append("-mpopcnt")
    if sys.platform.startswith("linux"):
        # at::parallel_for expands to `#pragma omp parallel` inside our own
        # translation units (torch's CPU builds use OpenMP): without -fopenmp
        # every CPU kernel would run on one thread.
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    with_cuda = (
        bool(cuda_sources)
        and torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("PYG_QUANT_NO_CUDA") != "1"
    )
    # optional=True: a failed build still installs the package, which then says
    # why on import and runs the pure-torch reference path.
    kwargs = dict(name="pyg_quant._C", include_dirs=[os.path.join(HERE, "csrc")], optional=True)
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
        nvcc_flags = ["-O3", "-fmad=false", "--expt-relaxed-constexpr"]
        if os.environ.get("PYG_QUANT_PTXAS_VERBOSE") == "1":
            nvcc_flags.append("-Xptxas=-v")  # each kernel's registers, spills and shared memory, for kernel work
        archs = [a.strip().removesuffix("+PTX") for a in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")]
        if "9.0a" in archs:
            nvcc_flags.append("-DPYG_QUANT_SM90A")  # the host may pick the wgmma kernels
        ext = CUDAExtension(
            sources=sources + cuda_sources,
            define_macros=[("WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_flags,
            **kwargs,
        )
    else:
        ext = CppExtension(sources=sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags, **kwargs)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_modules()

setup(
    name="pyg_quant",
    version="0.1.0",
    description="Any-bitwidth quantized GNN kernels for PyTorch Geometric (bit planes on CPU popcount and 1-bit tensor cores)",
    author="The pyg_quant authors",
    url="https://github.com/pyg-quant/pyg_quant",
    license="MIT",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Environment :: GPU :: NVIDIA CUDA",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["pyg_quant", "pyg_quant.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "torch_geometric>=2.6,<2.9", "pymetis>=2023.1", "numpy"],
    extras_require={
        "sparse": ["torch_sparse", "torch_scatter"],
        # Planetoid reads Cora's raw files (pickled scipy matrices) with scipy: the main job's real data.
        "data": ["scipy"],
        # scipy: as in "data" (the Cora tests); nbclient, nbformat, ipykernel and matplotlib:
        # tests/test_examples.py executes notebooks/replace_gcnconv.ipynb (plots inline)
        "test": ["pytest>=7", "scipy", "nbclient>=0.7", "nbformat>=5", "ipykernel>=6", "matplotlib>=3.5"],
        "lightning": ["lightning>=2.0"],  # examples/lightning_cluster_gcn.py and its test
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
