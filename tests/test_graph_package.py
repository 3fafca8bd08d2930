"""pyg_quant.graph stands on its own: its modules import each other without a cycle, and nothing above them.

The graph package (adjacency types, input formats, the per-call graph and its cache) sits below ``nn``, ``qat``,
``loader`` and ``captured_step``, which all use it; an import from it back up to them, or between its own modules
in both directions, would bring back the cycles the package was made to remove.  Deferred imports (inside a
function) count as edges too.
"""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRAPH = os.path.join(ROOT, "pyg_quant", "graph")
# What the graph may import from the rest of pyg_quant: the low-level modules below it.
BELOW = {"pyg_quant", "pyg_quant._utils", "pyg_quant._extension", "pyg_quant.layout", "pyg_quant.bit_tensor",
         "pyg_quant.ops"}


def graph_modules():
    names = sorted(f[:-3] for f in os.listdir(GRAPH) if f.endswith(".py"))
    return {("pyg_quant.graph" if name == "__init__" else f"pyg_quant.graph.{name}"): os.path.join(GRAPH, f"{name}.py")
            for name in names}


def imported_modules(module: str, path: str):
    """The pyg_quant modules ``module`` imports, anywhere in its source (``from . import x`` names module ``x``)."""
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
            found.update(f"{base}.{alias.name}" for alias in node.names if is_module(f"{base}.{alias.name}"))
    return {name for name in found if name == "pyg_quant" or name.startswith("pyg_quant.")}


def is_module(name: str) -> bool:
    path = os.path.join(ROOT, *name.split("."))
    return os.path.exists(path + ".py") or os.path.exists(os.path.join(path, "__init__.py"))


def test_graph_imports_only_itself_and_the_layers_below():
    for module, path in graph_modules().items():
        outside = {name for name in imported_modules(module, path)
                   if not name.startswith("pyg_quant.graph") and name not in BELOW}
        assert not outside, f"{module} imports {sorted(outside)}"


def test_graph_modules_import_each_other_without_a_cycle():
    modules = graph_modules()
    edges = {module: {name for name in imported_modules(module, path) if name in modules and name != module}
             for module, path in modules.items()}
    done, path = set(), []

    def visit(module):
        assert module not in path, "import cycle: " + " -> ".join(path[path.index(module):] + [module])
        if module in done:
            return
        path.append(module)
        for name in sorted(edges[module]):
            visit(name)
        path.pop()
        done.add(module)

    for module in sorted(modules):
        visit(module)


def test_graph_imports_without_the_packages_above_it():
    """Every graph module, imported under an empty ``pyg_quant`` (its ``__init__`` not run), loads no nn, qat, loader,
    distributed or captured_step module."""
    code = f"""
import importlib, sys, types
package = types.ModuleType("pyg_quant")
package.__path__ = [{os.path.join(ROOT, "pyg_quant")!r}]
sys.modules["pyg_quant"] = package
for name in {sorted(graph_modules())!r}:
    importlib.import_module(name)
above = sorted(name for name in sys.modules if name.startswith(("pyg_quant.nn", "pyg_quant.qat", "pyg_quant.loader",
                                                                "pyg_quant.distributed", "pyg_quant.captured_step")))
assert not above, above
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
