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
    "serve": {"core", "engine", "api"},  # the warm server, above the Python API
    "cli": {"api", "batch", "engine", "eval", "core", "methods", "entry", "serve"},  # entry: the signal state
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
