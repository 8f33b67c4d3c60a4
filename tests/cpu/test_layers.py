"""The layer rules of docs/design.md, checked on the source: data flows down, nothing reaches up.

- no import cycle among defrag's modules (imports inside functions count);
- no module imports another module's private name, or reaches through an
  object into a private name that only another defrag module defines;
- the pure parts (heap, planner) import neither torch nor the driver, and
  every module that imports the heap, the planner or vmm imports no torch.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = {"defrag": ROOT / "defrag", "defrag.kernels": ROOT / "kernels"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


@functools.cache
def _tree(module: str) -> ast.Module:
    """`module`'s syntax tree, parsed once for every rule (read only)."""
    return ast.parse(MODULES[module].read_text())


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in `module`, nested ones too."""
    tree = _tree(module)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:  # `from . import tensors`: the submodule itself
                    out.append((sub, None, node.lineno))
                else:
                    out.append((target, alias.name, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in _imports(module):
            # Importing a submodule runs its package's __init__ too, but the
            # package initialisers only re-export: an edge to the package itself
            # is counted only when the package is what is named.
            if target in MODULES and target != module and not module.startswith(target + "."):
                graph[module].add(target)
    return graph


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@functools.cache
def _class_privates(module: str) -> frozenset[str]:
    """Private methods and attributes that `module`'s classes define (`def _x`, `self._x = ...`)."""
    tree = _tree(module)
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)  # dataclass fields
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


def test_no_module_reaches_into_another_modules_private_names():
    owners: dict[str, set[str]] = {}
    for m in MODULES:
        for n in _class_privates(m):
            owners.setdefault(n, set()).add(m)
    problems = []
    for module, path in MODULES.items():
        aliases = set()
        for target, name, line in _imports(module):
            if name and name.startswith("_") and not name.startswith("__") and target.startswith("defrag"):
                problems.append(f"{path.name}:{line} imports {target}.{name}")
        tree = _tree(module)
        for node in ast.walk(tree):  # names bound to defrag modules: `from . import tensors as tz`
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if f"{_resolve(module, node)}.{alias.name}" in MODULES:
                        aliases.add(alias.asname or alias.name)
        mine = _class_privates(module)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                problems.append(f"{path.name}:{node.lineno} reaches {node.value.id}.{attr}")
            elif attr in owners and attr not in mine:
                problems.append(f"{path.name}:{node.lineno} reaches .{attr} (defined in {', '.join(sorted(owners[attr]))})")
    assert not problems, "\n".join(problems)


def _imports_torch(module: str) -> bool:
    return any(t == "torch" or t.startswith("torch.") for t, _, _ in _imports(module))


def test_the_pure_parts_import_neither_torch_nor_the_driver():
    for pure in ("defrag.planner", "defrag.mesh_planner", "defrag.units", "defrag.page_runs"):
        targets = {t for t, _, _ in _imports(pure)}
        assert not any(t.startswith("torch") for t in targets), pure
        assert not any(t.startswith("defrag.driver") or t.startswith("cuda") for t in targets), pure


def test_modules_over_the_heap_planner_or_vmm_import_no_torch():
    low = {"defrag.planner", "defrag.mesh_planner", "defrag.vmm"}
    users = [m for m in MODULES if m not in low and any(t in low for t, _, _ in _imports(m))]
    assert {"defrag.core", "defrag.compactor", "defrag.backing"} <= set(users)
    assert [m for m in users if _imports_torch(m)] == []


def test_the_core_layers_import_no_torch_at_all():
    for module in ("defrag.core", "defrag.backing", "defrag.readout", "defrag.residency", "defrag.compactor",
                   "defrag.vmm", "defrag.planner", "defrag.errors", "defrag.threads", "defrag.movability", "defrag.stats",
                   "defrag.dry", "defrag.units"):
        assert not _imports_torch(module), module


def test_capture_sees_pools_only_through_their_public_face_and_installs_nothing():
    # `Pool.capture()` uses defrag.capture, and defrag.allocator_install builds on it: neither way round again.
    targets = {t for t, _, _ in _imports("defrag.capture")}
    assert not {"defrag.pool", "defrag.allocator_install"} & targets, targets
    assert "defrag.capture" in {t for t, _, _ in _imports("defrag.allocator_install")}
