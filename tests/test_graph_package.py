"""pyg_quant.graph stands on its own: its modules import each other without a cycle, and nothing above them.

The graph package (adjacency types, input formats, the per-call graph and its cache) sits below ``nn``, ``qat``,
``loader`` and ``captured_step``, which all use it; an import from it back up to them, or between its own modules
in both directions, would bring back the cycles the package was made to remove.  Deferred imports (inside a
function) count as edges too.
"""
from conftest import import_cycle, imported_modules, modules_loaded_by, package_modules

# What the graph may import from the rest of pyg_quant: the low-level modules below it.
BELOW = {"pyg_quant", "pyg_quant._utils", "pyg_quant._extension", "pyg_quant.layout", "pyg_quant.bit_tensor",
         "pyg_quant.ops"}


def test_graph_imports_only_itself_and_the_layers_below():
    for module, path in package_modules("pyg_quant.graph").items():
        outside = {name for name in imported_modules(module, path)
                   if not name.startswith("pyg_quant.graph") and name not in BELOW}
        assert not outside, f"{module} imports {sorted(outside)}"


def test_graph_modules_import_each_other_without_a_cycle():
    cycle = import_cycle(package_modules("pyg_quant.graph"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_graph_imports_without_the_packages_above_it():
    """Every graph module, imported under an empty ``pyg_quant`` (its ``__init__`` not run), loads no nn, qat, loader,
    distributed or captured_step module."""
    above = modules_loaded_by(package_modules("pyg_quant.graph"),
                              ("pyg_quant.nn", "pyg_quant.qat", "pyg_quant.loader", "pyg_quant.distributed",
                               "pyg_quant.captured_step"))
    assert not above, above
