"""The import rules of docs/architecture.md, enforced on the package's source (every import
statement, at module level or inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rocketkv_cli"

# sub-package → rocketkv_cli sub-packages it may import (besides itself, `errors` and the version)
MAY_IMPORT = {
    "core": set(),
    "ops": {"core", "kernels"},
    "model": {"core", "ops"},
    "store": {"core"},
    "methods": {"core", "ops"},  # stage-1 methods: one class per file, registered by name
    "engine": {"core", "ops", "model", "store", "methods"},
    "api": {"core", "model", "store", "engine"},  # the answering service and the Python API
    "batch": {"core", "api"},  # batch jobs (local pool, Ray), above the Python API
    "eval": {"core", "ops", "model", "store", "methods", "engine"},
    "serve": {"core", "api", "batch"},  # the warm server, above the Python API (and batch: it runs batch rows)
    # cli: signals, the process's signal state; entry, the console script (only `python -m rocketkv_cli.cli`)
    "cli": {"api", "batch", "eval", "core", "methods", "signals", "entry", "serve"},
    "kernels": set(),
}
# third-party packages only one sub-package may import
OWNED = {"transformers": "model", "safetensors": "store", "triton": "kernels", "typer": "cli", "rich": "cli",
         "ray": "batch", "starlette": "serve", "uvicorn": "serve"}  # fmt: skip
NO_TORCH = {"cli"}  # the CLI parses and prints: no tensor math


def modules() -> list[tuple[str, Path]]:
    found = [(p.relative_to(PACKAGE).parts[0], p) for p in sorted(PACKAGE.rglob("*.py")) if len(p.parts) > 0]
    found += [("kernels", p) for p in sorted((ROOT / "rocketkv_kernels").glob("*.py"))]
    return [(part.removesuffix(".py"), p) for part, p in found]


def imports(path: Path, package: str) -> set[str]:
    """Absolute names imported by `path`; relative imports resolved inside rocketkv_cli."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT / "rocketkv_kernels" if package == "kernels" else PACKAGE).with_suffix("")
    here = (["rocketkv_cli", "kernels"] if package == "kernels" else ["rocketkv_cli"]) + list(rel.parts)[:-1]
    if path.name == "__init__.py":
        here = here + [rel.parts[-2]] if len(rel.parts) > 1 else here
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names |= {mod} if node.module else {f"{mod}.{a.name}" for a in node.names}
            else:
                names.add(node.module or "")
    return names


CASES = [(pkg, p) for pkg, p in modules()]


@pytest.mark.parametrize("package, path", CASES, ids=[str(p.relative_to(ROOT)) for _, p in CASES])
def test__imports_follow_the_architecture(package, path):
    allowed = MAY_IMPORT.get(package, set(MAY_IMPORT))  # top-level modules (errors, __init__) are shared
    for name in imports(path, package):
        top = name.split(".")[0]
        if top in OWNED:
            assert OWNED[top] == package, f"{path.name} imports {name}; only {OWNED[top]}/ may"
        if top == "torch":
            assert package not in NO_TORCH, f"{path.name} imports torch; the CLI does no tensor math"
        if top != "rocketkv_cli" or name in ("rocketkv_cli", "rocketkv_cli.errors", "rocketkv_cli.__version__"):
            continue
        sub = name.split(".")[1]
        if sub in ("errors", "__version__") or package not in MAY_IMPORT or sub == package:
            continue
        assert sub in allowed, f"{path.relative_to(ROOT)} imports {name}: {package}/ may import only {sorted(allowed)}"


def module_name(package: str, path: Path) -> str:
    """The dotted name of a module of the package (`rocketkv_kernels/x.py` is `rocketkv_cli.kernels.x`)."""
    rel = path.relative_to(ROOT / "rocketkv_kernels" if package == "kernels" else PACKAGE).with_suffix("")
    parts = ["rocketkv_cli"] + (["kernels"] if package == "kernels" else []) + list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(found: list[tuple[str, Path]]) -> dict[str, set[str]]:
    """module → the package's modules it imports, from every import statement (module level, inside
    functions, under TYPE_CHECKING). `from pkg import name` imports the module `pkg.name` when
    there is one, else `pkg`; a name that is no module resolves to its longest module prefix. An
    import of one of the module's own parent packages (`from .. import __version__`) is no edge:
    Python imports them before the module anyway."""
    names = {module_name(pkg, p): (pkg, p) for pkg, p in found}

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts and ".".join(parts) not in names:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, set[str]] = {}
    for name, (pkg, path) in names.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                targets |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in names else resolve(mod) for a in node.names}
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {t for t in targets if t is not None and t != name and t not in parents}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, …, a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test__no_import_cycles():
    """No module of the package imports, directly or through others, a module that imports it."""
    cycle = find_cycle(import_graph(modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test__a_cycle_is_caught():
    """The cycle finder itself: two probe modules that import each other are named."""
    a, b = PACKAGE / "core" / "_probe_cycle_a.py", PACKAGE / "core" / "_probe_cycle_b.py"
    a.write_text("def f():\n    from . import _probe_cycle_b\n")
    b.write_text("from ._probe_cycle_a import f\n")
    try:
        graph = import_graph(modules())
        cycle = find_cycle({name: graph[name] for name in graph if name.startswith("rocketkv_cli.core.")})
        probes = ["rocketkv_cli.core._probe_cycle_a", "rocketkv_cli.core._probe_cycle_b"]
        assert cycle == [*probes, probes[0]], cycle
    finally:
        a.unlink()
        b.unlink()


def test__rules_see_every_sub_package():
    found = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert found == set(MAY_IMPORT) - {"kernels"}, found


def test__a_forbidden_import_is_caught():
    """The checker itself: a core module importing transformers, or the engine, fails."""
    bad = PACKAGE / "core" / "_probe_bad_import.py"
    bad.write_text("import transformers\n")
    try:
        with pytest.raises(AssertionError, match="only model/ may"):
            test__imports_follow_the_architecture("core", bad)
        bad.write_text("from ..engine import api\n")
        with pytest.raises(AssertionError, match="core/ may import only"):
            test__imports_follow_the_architecture("core", bad)
    finally:
        bad.unlink()


# scripts/ (reports) and benchmarks/ (timings) use the package through its layers (docs/architecture.md)
SCRIPTS_MAY_IMPORT = {"api", "batch", "core", "engine", "eval", "methods", "model", "serve", "store"}
BENCHMARKS_MAY_IMPORT = SCRIPTS_MAY_IMPORT | {"ops", "kernels"}
SCRIPTS_NOT_THIRD_PARTY = {"transformers", "safetensors", "triton"}  # the layers that own them are in between
TOOLS = [(d, p) for d in ("scripts", "benchmarks") for p in sorted((ROOT / d).glob("*.py"))]


@pytest.mark.parametrize("folder, path", TOOLS, ids=[f"{d}/{p.name}" for d, p in TOOLS])
def test__scripts_and_benchmarks_import_only_public_layers(folder, path):
    """Every import statement of scripts/ and benchmarks/: no private name, no `cli` (reports run the
    installed CLI in a subprocess), reports no `ops`, `kernels` or the third-party packages a layer
    owns, and each imported module and name exists (a module moved by a refactor fails here, not in
    a report run months later)."""
    import importlib
    import importlib.util

    allowed = SCRIPTS_MAY_IMPORT if folder == "scripts" else BENCHMARKS_MAY_IMPORT
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found = [(node.module or "", [a.name for a in node.names])]
        else:
            continue
        for module, names in found:
            where, parts = f"{folder}/{path.name} imports {module}", module.split(".")
            if folder == "scripts":
                assert parts[0] not in SCRIPTS_NOT_THIRD_PARTY, f"{where}: only through the package's layers"
            if parts[0] != "rocketkv_cli":
                continue
            assert not [n for n in parts[1:] + names if n.startswith("_") and n != "__version__"], f"{where}: private"
            if len(parts) > 1 and parts[1] not in ("errors", "__version__"):
                assert parts[1] in allowed, f"{where}: {folder}/ may import only {sorted(allowed)}"
            mod = importlib.import_module(module)
            for name in names:
                is_module = hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
                assert hasattr(mod, name) or is_module, f"{where}: it has no {name} (moved?)"


def test__a_forbidden_script_import_is_caught(tmp_path):
    """The scripts' checker itself: a report importing a kernel, a private name or a moved module fails."""
    for text, match in (("from rocketkv_cli.kernels import sparse_attention\n", "may import only"),
                        ("from rocketkv_cli.core.quant import _no_such\n", "private"),
                        ("from rocketkv_cli.core.config import no_such_name\n", "no no_such_name"),
                        ("import transformers\n", "layers")):  # fmt: skip
        bad = tmp_path / "report.py"
        bad.write_text(text)
        with pytest.raises(AssertionError, match=match):
            test__scripts_and_benchmarks_import_only_public_layers("scripts", bad)
