"""The package's import structure: no module imports a module above it, there are no import
cycles, and no module outside ``vllm/platforms`` probes the device.

Layers, bottom to top (a module may import its own layer or any layer below):
  0 vllm.logger, vllm.kernels          leaf helpers and the compiled-kernel wrappers
  1 vllm.platforms                     the one place that asks what the machine has
  2 vllm.config, plain data types      configuration data
  3 vllm.model_executor                models, layers, quantization, expert cache
  4 vllm.core, vllm.worker             scheduler / runner
  5 vllm.engine                        the engine
  6 vllm.entrypoints, vllm (package)   user-facing
Every ``import`` statement counts, including those inside functions (a lazy import is still a
dependency), so neither an upward edge nor a cycle can hide behind one.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm")

RANKS = {"vllm.logger": 0, "vllm.kernels": 0, "vllm.platforms": 1, "vllm.config": 2,
         "vllm.sampling_params": 2, "vllm.inputs": 2, "vllm.outputs": 2,
         "vllm.model_executor": 3, "vllm.core": 4, "vllm.worker": 4, "vllm.engine": 5,
         "vllm.entrypoints": 6, "vllm": 6}
CUDA_PROBES = {"is_available", "get_device_capability", "mem_get_info", "get_device_name",
               "device_count", "get_device_properties"}
"""torch.cuda.<these> are device probes; so is ``load_cpu_kernels`` (are the C kernels built?)."""


def find_modules(root: str = ROOT) -> dict[str, str]:
    """Dotted module name -> file path, for every .py file under ``root``."""
    mods = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = path
    return mods


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every vllm name an import statement anywhere in ``source`` names (module or symbol)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:
                parts = module.split(".")
                base = parts[:len(parts) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return {m for m in out if m == "vllm" or m.startswith("vllm.")}


def rank(module: str) -> int:
    best = max((p for p in RANKS if module == p or module.startswith(p + ".")), key=len)
    return RANKS[best]


def dependency_graph(mods: dict[str, str]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:   # ``from a.b import c`` may name a symbol of a.b
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None
    graph = {}
    for mod, path in mods.items():
        names = imported_names(open(path).read(), mod, path.endswith("__init__.py"))
        graph[mod] = {resolve(n) for n in names} - {None, mod}
    return graph


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    # "vllm" (the package) re-exports lazily through a module __getattr__; importing it from
    # below is how every module reaches DEFAULT_MODEL and is not an upward dependency.
    return [f"{m} (layer {rank(m)}) imports {d} (layer {rank(d)})"
            for m, deps in sorted(graph.items()) for d in sorted(deps)
            if d != "vllm" and rank(d) > rank(m)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d == "vllm":
                continue
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def device_probes(source: str) -> list[int]:
    """Line numbers of torch.cuda probes and ``load_cpu_kernels`` uses in ``source``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in CUDA_PROBES and \
                ast.unparse(node.value) in ("torch.cuda", "cuda"):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Name, ast.alias)) and \
                getattr(node, "id", getattr(node, "name", None)) == "load_cpu_kernels":
            lines.append(getattr(node, "lineno", 0))
    return lines


def test_no_module_imports_a_layer_above_it():
    bad = upward_edges(dependency_graph(find_modules()))
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    found = cycles(dependency_graph(find_modules()))
    assert not found, "\n".join(" -> ".join(c) for c in found)


def test_only_platforms_probe_the_device():
    found = [f"{mod}:{line}" for mod, path in find_modules().items()
             if not mod.startswith(("vllm.platforms", "vllm.kernels"))
             for line in device_probes(open(path).read())]
    assert not found, "device probed outside vllm/platforms:\n" + "\n".join(found)


def test_the_checks_catch_what_they_guard(tmp_path):
    """A synthetic tree with a lazy upward import that closes a cycle, and a probe."""
    pkg = tmp_path / "vllm"
    (pkg / "config").mkdir(parents=True)
    (pkg / "engine").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text(
        "def f():\n    from vllm.engine.args import X\n    return X\n")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "args.py").write_text("from ..config import f\nX = 1\n")
    graph = dependency_graph(find_modules(str(pkg)))
    assert graph["vllm.engine.args"] == {"vllm.config"}          # relative import resolved
    assert upward_edges(graph) == ["vllm.config (layer 2) imports vllm.engine.args (layer 5)"]
    assert cycles(graph) == [["vllm.config", "vllm.engine.args", "vllm.config"]]
    assert device_probes("import torch\nok = torch.cuda.is_available()\n") == [2]
    assert device_probes("from vllm.kernels.cpu.build import load_cpu_kernels\n") == [1]
    assert device_probes("p.get_device_capability()\n") == []   # asking a platform is fine
