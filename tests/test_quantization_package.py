"""pyg_quant.quantization stands on its own: its modules import each other without a cycle, and nothing above them.

The quantization primitives (bit-width arguments, ranges and their affine parameters, quantize / fake-quantize /
dequantize, fixed ranges) and the quantizers built on them (range observers, ``FakeQuantize``) sit below ``nn``,
``qat``, ``loader`` and ``captured_step``, which all use them, and beside ``graph``, which needs none of them; they
build on ``ops``, ``bit_tensor``, ``layout``, ``_utils`` and the ranks of ``distributed.group`` /
``distributed.ranges`` only, and those never import them back.  Deferred imports (inside a function) count as edges
too.
"""
from conftest import import_cycle, imported_modules, modules_loaded_by, module_path, package_modules

PACKAGE = "pyg_quant.quantization"
# The two modules of pyg_quant.distributed the observers and FakeQuantize use (the ranks, their seeds, the reduction of
# observed ranges over them); the package's __init__ loads nothing until asked.
RANK_MODULES = {"pyg_quant.distributed", "pyg_quant.distributed.group", "pyg_quant.distributed.ranges"}
# What the quantization package may import from the rest of pyg_quant: the low-level modules below it.
BELOW = {"pyg_quant", "pyg_quant._utils", "pyg_quant._extension", "pyg_quant.layout", "pyg_quant.bit_tensor",
         "pyg_quant.ops", "pyg_quant.ops.reference"} | RANK_MODULES


def test_quantization_imports_only_itself_and_the_layers_below():
    for module, path in package_modules(PACKAGE).items():
        outside = {name for name in imported_modules(module, path)
                   if not name.startswith(PACKAGE) and name not in BELOW}
        assert not outside, f"{module} imports {sorted(outside)}"


def test_the_layers_below_do_not_import_quantization():
    for module in sorted(BELOW - {"pyg_quant"}):
        up = {name for name in imported_modules(module, module_path(module)) if name.startswith(PACKAGE)}
        assert not up, f"{module} imports {sorted(up)}"


def test_quantization_modules_import_each_other_without_a_cycle():
    cycle = import_cycle(package_modules(PACKAGE))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_quantization_imports_without_the_packages_above_it():
    """Every quantization module, imported under an empty ``pyg_quant`` (its ``__init__`` not run), loads no nn, qat,
    loader, graph, distributed or captured_step module."""
    above = modules_loaded_by(package_modules(PACKAGE),
                              ("pyg_quant.nn", "pyg_quant.qat", "pyg_quant.loader", "pyg_quant.graph",
                               "pyg_quant.distributed", "pyg_quant.captured_step"))
    assert set(above) <= RANK_MODULES, above
