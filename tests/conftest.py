"""Shared helpers and fixtures of the pyg_quant test suite (no autouse fixtures).

Test modules import the plain helpers with ``from conftest import ...`` (pytest
puts this rootless ``tests/`` folder on ``sys.path``).

Oracles used throughout:

* ``deq64(bt)``: the value a BitTensor *represents*, ``lo + scale·q`` evaluated in
  float64 from the float32 ``lo``/``scale`` and the codes decoded by the pure-torch
  reference (:mod:`pyg_quant.ops.reference`), independent of the compiled kernels.
* ``mag64(bt)``: ``|lo| + |scale·q|``, the size of the terms the affine identity
  adds up; float32 results are checked against ``1e-6 · (|A| @ mag)``-style
  bounds (see the comments at the call sites).
"""
import ast
import os
import subprocess
import sys

import pytest
import torch

import pyg_quant as pq
from pyg_quant.ops import reference as ref

# --- devices and backends -------------------------------------------------------------
COMPILED = bool(pq.backends()["cpu"])
CUDA_OK = bool(torch.cuda.is_available() and pq.backends()["cuda"])

requires_compiled = pytest.mark.skipif(
    not COMPILED, reason="pyg_quant._C (the compiled CPU backend) is not built/loadable")
requires_cuda = pytest.mark.skipif(
    not CUDA_OK, reason="needs a CUDA GPU and pyg_quant's compiled CUDA backend")

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if CUDA_OK else [])


def _built_for_sm90a() -> bool:
    """Whether setup.py built the sm_90a image (it reads TORCH_CUDA_ARCH_LIST, default "8.0;9.0a")."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0a").replace(" ", ";").split(";")
    return "9.0a" in [a.strip().removesuffix("+PTX") for a in archs]


# The wgmma kernels: an sm_90 device and the extension's sm_90a image.
requires_sm90a = pytest.mark.skipif(
    not CUDA_OK or torch.cuda.get_device_capability() != (9, 0) or not _built_for_sm90a(),
    reason="the wgmma kernels need an sm_90 GPU and the extension's sm_90a image (setup.py reads TORCH_CUDA_ARCH_LIST)")


def cuda_kernel_names(fn):
    """Names of the CUDA kernels `fn()` launches, from the profiler (the test skips where CUPTI records none, e.g.
    under compute-sanitizer)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not names:
        pytest.skip("the profiler records no CUDA kernels here (CUPTI unavailable, e.g. under compute-sanitizer)")
    return names


def skip_unless_compiled():
    """Imperative form of ``requires_compiled``."""
    if not COMPILED:
        pytest.skip("pyg_quant._C (the compiled CPU backend) is not built/loadable")


@pytest.fixture(params=DEVICES)
def device(request):
    """Every device with a compiled backend: ``"cpu"``, plus ``"cuda"`` (marked ``cuda``) when usable."""
    return request.param


@pytest.fixture
def devices():
    """The plain list of usable device names."""
    return ["cpu"] + (["cuda"] if CUDA_OK else [])


# --- data -----------------------------------------------------------------------------
def gen(seed: int, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def randn(rows: int, cols: int, seed: int, device="cpu", shift: float = 0.0, spread: float = 1.0):
    """Random float32 data, never all zeros (and never constant unless 1x1)."""
    x = torch.randn(rows, cols, generator=gen(seed)) * spread + shift
    return x.to(device)


def scale_view(bt):
    return {None: (1, 1), 0: (1, -1), 1: (-1, 1)}[bt.dim]


def ref_codes(bt) -> torch.Tensor:
    """Codes decoded by the pure-torch reference (int64 [rows, cols])."""
    outer = bt.cols if bt.layout == "col" else bt.rows
    # only the logical outer rows are decoded (the padding rows hold zero codes anyway)
    return ref.unpack_codes(bt.planes[:, :outer], bt.rows, bt.cols, bt.layout == "col").long()


def deq64(bt) -> torch.Tensor:
    view = scale_view(bt)
    return bt.lo.double().view(view) + bt.scale.double().view(view) * ref_codes(bt).double()


def mag64(bt) -> torch.Tensor:
    view = scale_view(bt)
    return bt.lo.double().abs().view(view) + bt.scale.double().abs().view(view) * ref_codes(bt).double()


EPILOGUE_BOUND = ref.EPILOGUE_BOUND  # csrc/epilogue.h's bound, as the library states it


def assert_fp32_close(out, expected, bound, rel_norm=1e-6, scale=None):
    """Norm-wise ``||out-ref|| <= rel_norm·||scale||`` (``scale``: the reference itself unless given, e.g. the
    magnitudes of the terms an epilogue adds) and elementwise ``|out-ref| <= bound``."""
    out = out.double().cpu()
    expected = expected.double().cpu()
    bound = bound.double().cpu()
    assert out.shape == expected.shape, (out.shape, expected.shape)
    assert torch.isfinite(out).all()
    diff = (out - expected).abs()
    norm = (expected if scale is None else scale.double().cpu()).norm()
    assert diff.norm() <= rel_norm * norm + 1e-30, f"norm-wise error {float(diff.norm() / norm):.3e}"
    bad = diff > bound
    assert not bad.any(), (
        f"{int(bad.sum())} entries exceed the fp32 bound; worst excess ratio "
        f"{float((diff / bound.clamp_min(1e-300)).max()):.3e}")


def round_up(n: int, m: int) -> int:
    """Written out again here (not imported from pyg_quant.layout) so the padding checks are independent."""
    n = max(n, 1)
    return -(-n // m) * m


# --- graphs ---------------------------------------------------------------------------
def random_edges(num_src: int, num_dst: int, num_edges: int, seed: int, loops: bool = True):
    g = gen(seed)
    src = torch.randint(num_src, (num_edges,), generator=g)
    dst = torch.randint(num_dst, (num_edges,), generator=g)
    if not loops:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    return torch.stack([src, dst])


def dense_from_edges(edge_index, num_src: int, num_dst: int) -> torch.Tensor:
    """A[i, j] = number of edges j -> i (duplicates summed), float64."""
    dense = torch.zeros(num_dst, num_src, dtype=torch.float64)
    ei = edge_index.long().cpu()
    dense.index_put_((ei[1], ei[0]), torch.ones(ei.size(1), dtype=torch.float64), accumulate=True)
    return dense


# --- package layering (tests/test_graph_package.py, tests/test_quantization_package.py) ----------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_path(name: str):
    """The source file of the pyg_quant module ``name``, or None if it is not a module of the tree."""
    path = os.path.join(ROOT, *name.split("."))
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.exists(candidate):
            return candidate
    return None


def package_modules(package: str) -> dict:
    """``{module: source path}`` of the package ``package`` (``"pyg_quant.graph"``) and its modules."""
    folder = os.path.join(ROOT, *package.split("."))
    return {(package if name == "__init__" else f"{package}.{name}"): os.path.join(folder, f"{name}.py")
            for name in sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py"))}


def imported_modules(module: str, path: str) -> set:
    """The pyg_quant modules ``module`` imports, anywhere in its source, deferred imports (inside a function)
    included; ``from . import x`` names module ``x``."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if module_path(f"{base}.{alias.name}"))
    return {name for name in found if name == "pyg_quant" or name.startswith("pyg_quant.")}


def import_cycle(modules: dict):
    """An import cycle among ``modules`` (``{module: path}``) as a list ``[a, b, ..., a]``, or None."""
    edges = {module: sorted(name for name in imported_modules(module, path) if name in modules and name != module)
             for module, path in modules.items()}
    done, stack = set(), []

    def visit(module):
        if module in stack:
            return stack[stack.index(module):] + [module]
        if module in done:
            return None
        stack.append(module)
        for name in edges[module]:
            cycle = visit(name)
            if cycle:
                return cycle
        stack.pop()
        done.add(module)
        return None

    for module in sorted(modules):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def modules_loaded_by(modules, prefixes) -> list:
    """The modules starting with one of ``prefixes`` that importing ``modules`` loads, each imported under an empty
    ``pyg_quant`` (its ``__init__``, which imports every package, not run), in a fresh interpreter."""
    code = f"""
import importlib, sys, types
package = types.ModuleType("pyg_quant")
package.__path__ = [{os.path.join(ROOT, "pyg_quant")!r}]
sys.modules["pyg_quant"] = package
for name in {sorted(modules)!r}:
    importlib.import_module(name)
print(sorted(name for name in sys.modules if name.startswith({tuple(prefixes)!r})))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])
