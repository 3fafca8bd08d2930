"""The Python side's list of compiled ops matches the C++ library, and each op has its kernels."""
import glob
import os
import re

import pytest
import torch

from pyg_quant import _extension

CSRC = os.path.join(os.path.dirname(__file__), "..", "csrc")
LIBRARY = os.path.join(CSRC, "library.cpp")


def defined_ops():
    with open(LIBRARY) as f:
        return set(re.findall(r'm\.def\(\s*"([a-z_0-9]+)\(', f.read()))


def test_every_defined_op_is_dispatched_to_its_kernel():
    # An op left out of _OPS is never reported as compiled, so its callers run the torch reference.
    ops = defined_ops()
    assert len(ops) >= 15
    assert ops == set(_extension._OPS)


@pytest.mark.skipif(not _extension.LOADED, reason="the compiled extension is not built")
@pytest.mark.parametrize("op", sorted(defined_ops()))
def test_compiled_op_has_cpu_kernel(op):
    assert _extension.has_kernel(op, "cpu")
    assert _extension.use_compiled(op, torch.device("cpu"))


def cuda_registered_ops():
    ops = set()
    for path in glob.glob(os.path.join(CSRC, "*.cpp")):
        with open(path) as f:
            for block in re.findall(r"TORCH_LIBRARY_IMPL\(pyg_quant, CUDA, m\) \{([^}]*)\}", f.read()):
                ops.update(re.findall(r'm\.impl\("([a-z_0-9]+)"', block))
    return ops


def test_cuda_registrations_are_defined_ops():
    cuda_ops = cuda_registered_ops()
    assert "bit_spmm_int" in cuda_ops and "pack_row_codes" in cuda_ops
    assert cuda_ops <= defined_ops()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", sorted(cuda_registered_ops()))
def test_compiled_op_has_cuda_kernel(op):
    assert _extension.has_kernel(op, "cuda")
