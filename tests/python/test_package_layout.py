"""The package's layout rules (docs/package-layout.md):
small modules, no import cycle among them, the sub-packages' and root modules'
dependencies running one way in the order docs/package-layout.md draws (this file reads
the drawing, so the order is written once), the documented import paths importable, and
``import trainstream`` loading neither compiled module."""
import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "trainstream"
LAYOUT_DOC = ROOT / "docs" / "package-layout.md"
MAX_LINES = 500
# What the build puts beside the sources: the compiled modules and the build's record.
# Only their loaders in _native/ import them, so they count as part of _native.
BUILT = ("trainstream._C", "trainstream._control", "trainstream._build_info")


def _modules():
    """{dotted name: path} of every module in the source package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules) -> set:
    """The package's modules that ``name`` imports, at the top or inside a function
    (a deferred import still runs, and can still close a cycle). ``modules``: the
    package's module names (BUILT included)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from . import x` imports the module x when there is one (its package is
            # imported already); otherwise it takes a name from the module `prefix`.
            subs = [f"{prefix}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in modules] or [prefix]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph():
    modules = _modules()
    known = set(modules) | set(BUILT)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    return {**graph, **{b: set() for b in BUILT}}  # (compiled: they import none of ours)


def _unit(module: str) -> str:
    """The unit of the dependency order a module belongs to: its sub-package, or the
    root module itself (each root module is a unit: api, report, options, ...; the
    package's own ``__init__`` is ``trainstream``). BUILT modules are _native's."""
    if module in BUILT:
        return "_native"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _unit_graph(graph):
    """{unit: {unit it imports: [(module, module it imports), ...]}}, between units only."""
    out = defaultdict(lambda: defaultdict(list))
    for a, targets in graph.items():
        for b in targets:
            if _unit(a) != _unit(b):
                out[_unit(a)][_unit(b)].append((a, b))
    return out


def _documented_layers():
    """The layers of docs/package-layout.md's drawing ("Dependencies run one way"), top
    first: each a list of unit names, one per cell of the drawing's row."""
    section = LAYOUT_DOC.read_text().split("## Dependencies run one way", 1)[1]
    drawing = section.split("```", 2)[1]
    return [[cell.strip() for cell in line.split("|")[1:-1]]
            for line in drawing.splitlines() if line.startswith("|")]


def _against_order(units, layers):
    """Each import between units that does not go down the layers (a unit uses only
    units on rows below its own: not its row's others, not a row above)."""
    row = {u: i for i, layer in enumerate(layers) for u in layer}
    return [f"{a} -> {b} ({', '.join(f'{x} imports {y}' for x, y in sorted(why))})"
            for a in sorted(units) for b, why in sorted(units[a].items())
            if row[a] >= row[b]]


def _cycle(graph):
    """One import cycle as a list of modules, or None. A package's ``__init__`` that
    re-exports its own modules is not a cycle with them (Python imports the package
    first), so edges from a package to its own sub-modules are left out."""
    def edges(n):
        return [m for m in graph[n] if not m.startswith(n + ".")]
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in edges(n):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = "done"
        stack.pop()
        return None
    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_module_over_500_lines():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_no_import_cycle():
    graph = _graph()
    assert "trainstream.api" in graph and graph["trainstream.api"], "the import walk found nothing"
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_drawing_names_every_unit_once():
    layers = _documented_layers()
    drawn = [u for layer in layers for u in layer]
    assert len(layers) >= 5 and "api" in drawn, "the drawing was not found or not read"
    assert len(drawn) == len(set(drawn)), f"a unit drawn twice: {drawn}"
    units = {_unit(m) for m in _graph()}
    assert set(drawn) == units, (f"in the code, not drawn: {sorted(units - set(drawn))}; "
                                 f"drawn, not in the code: {sorted(set(drawn) - units)}")


def test_no_package_level_cycle():
    units = _unit_graph(_graph())
    assert units["api"], "the import walk found nothing"
    cycle = _cycle({u: set(units[u]) for u in {_unit(m) for m in _graph()}})
    assert cycle is None, (f"import cycle among sub-packages and root modules: "
                           f"{' -> '.join(cycle)}")


def test_imports_follow_the_documented_order():
    """Every import, deferred ones included, goes down docs/package-layout.md's layers."""
    wrong = _against_order(_unit_graph(_graph()), _documented_layers())
    assert not wrong, ("imports against the order docs/package-layout.md draws (move what "
                       "is needed to the lower layer, or pass it in):\n" + "\n".join(wrong))


def test_the_order_check_finds_an_import_up_or_across():
    layers = [["top"], ["left", "right"], ["bottom"]]
    down = {"top": {"left": [("top.a", "left.b")]}, "left": {"bottom": [("left.b", "bottom")]}}
    assert _against_order(down, layers) == []
    up = {"bottom": {"top": [("bottom", "top.a")]}, "left": {"right": [("left.b", "right")]}}
    assert _against_order(up, layers) == ["bottom -> top (bottom imports top.a)",
                                          "left -> right (left.b imports right)"]
    assert _unit("trainstream._C") == "_native" and _unit("trainstream") == "trainstream"
    assert _unit("trainstream.memory.planner") == "memory" and _unit("trainstream.api") == "api"


def test_the_cycle_finder_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "p": {"p.x"}, "p.x": {"p"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"p": {"p.x"}, "p.x": {"p"}}) is None


def _run(code: str):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


def test_import_trainstream_loads_no_compiled_module():
    r = _run("import sys, trainstream; "
             "print(sorted(m for m in ('trainstream._C', 'trainstream._control') "
             "if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("path, names", [
    ("trainstream", ["wrap", "unwrap", "memory_report", "pinned_stats", "transfer_stats",
                     "find_blocks", "OffloadAdamW", "ActivationOffloader", "TrainStreamSession",
                     "TrainStreamError", "DaemonError", "NonFiniteGradientError",
                     "quantize_tensor", "quantize_model", "QuantizedTensor", "profile_hardware",
                     "HardwareProfile", "ParamPager", "GradientOffloader", "ParamReadyHooks"]),
    # Documented in docs/quantization.md, docs/base-cache.md and the README.
    ("trainstream.quantization", ["quantize_tensor", "quantize_model", "quant_report",
                                  "QuantizedTensor", "QuantLinear"]),
    ("trainstream.base", ["load_base", "SharedBase"]),
    ("trainstream.integrations.huggingface", ["load_model", "resolve_quantize",
                                              "TrainStreamTrainer"]),
])
def test_documented_import_paths(path, names):
    import importlib
    module = importlib.import_module(path)
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{path} lacks {missing}"


def test_the_public_names_stay():
    import trainstream
    assert sorted(trainstream.__all__) == sorted([
        "ActivationOffloader", "DaemonError", "NonFiniteGradientError", "OffloadAdamW",
        "TrainStreamError", "TrainStreamSession", "find_blocks", "memory_report",
        "pinned_stats", "transfer_stats", "unwrap", "wrap", "quantize_tensor",
        "quantize_model", "QuantizedTensor", "profile_hardware", "HardwareProfile", "ParamPager",
        "GradientOffloader", "ParamReadyHooks", "chunked_cross_entropy", "causal_lm_loss"])
