"""The package's layout rules (issue 17, item 7; docs/package-layout.md): small modules,
no import cycle among them, the documented import paths importable, and ``import
trainstream`` loading neither compiled module."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "trainstream"
MAX_LINES = 500


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
    (a deferred import still runs, and can still close a cycle)."""
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
    return {name: _imports(name, path, modules) for name, path in modules.items()}


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
