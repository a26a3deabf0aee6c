"""The shape of the package, read from the code: layers, no import cycle, no private name crossing a module.

Static (the ``import`` statements of every module, those inside functions too),
so a lazy import cannot hide a cycle or a dependency pointing the wrong way.
The layers are those of docs/architecture.md.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Import name -> folder of each package of the project.
PACKAGES = {"ckptfmt": ROOT / "ckptfmt", "ckptfmt.converters": ROOT / "converters", "ckptfmt.tui": ROOT / "tui"}
#: The core's subpackages, lowest first: a module may import its own layer and those below it.
LAYERS = [
    {"errors", "_platform", "_deprecation", "_collector", "_teardown", "kernels"},
    {"format"},
    {"storage"},
    {"repository"},
    {"tensors"},  # the torch side of the line: nothing below it imports torch
    {"metadata"},
    {"loading"},
    {"groups"},  # who saves together: a process alone, or a torch.distributed group
    {"saving"},  # the one save pipeline, over any group
    {"distributed"},  # torch.distributed's own: the DCP storage layer, steps gathered for rank 0
    {"tools"},
    {"lifecycle"},
    {"analytics"},
    {"__init__", "dcp"},  # the public facade: ckptfmt.save, ckptfmt.dcp.StorageWriter, ...
    {"cli", "integrations"},  # the command line; the frameworks' plug-ins (nothing in the core imports them)
]


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, name imported from it or None, line) for every import of a project module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import (use absolute imports)"
            if node.module and node.module.split(".")[0] == "ckptfmt":
                found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.split(".")[0] == "ckptfmt"]
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from package import module`` counts as the module)."""
    edges = {}
    for module, path in MODULES.items():
        targets = set()
        for imported, name, _ in imports(path):
            target = f"{imported}.{name}" if f"{imported}.{name}" in MODULES else imported
            if target in MODULES and target != module:
                targets.add(target)
        edges[module] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_cycles():
    """Negative control: the checks below would see a cycle, however long."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_projects_modules():
    edges = graph()
    assert len(edges) > 100 and "ckptfmt.saving.core" in edges["ckptfmt.saving.pipeline"]
    assert cycles(edges) == []


def test_no_module_reaches_into_another_modules_private_names():
    offenders = []
    for module, path in MODULES.items():
        aliases = {}
        for imported, name, line in imports(path):
            if name and name.startswith("_") and not name.startswith("__"):
                offenders.append(f"{module}:{line}: from {imported} import {name}")
            if name and f"{imported}.{name}" in MODULES:
                aliases[name] = f"{imported}.{name}"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({alias.asname: alias.name for alias in node.names if alias.asname})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                offenders.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr}")
    assert offenders == []


def layer_of(module: str) -> int | None:
    """The layer of a core module (None for the converters and the TUI, which sit on top)."""
    parts = module.split(".")
    if parts[:2] in (["ckptfmt", "converters"], ["ckptfmt", "tui"]):
        return None
    top = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_every_core_folder_has_a_layer():
    tops = {path.relative_to(ROOT / "ckptfmt").parts[0].removesuffix(".py") for path in (ROOT / "ckptfmt").iterdir()
            if path.suffix == ".py" or (path / "__init__.py").exists()}
    assert tops == set().union(*LAYERS)


def test_dependencies_point_down_the_layers():
    offenders = []
    for module, targets in graph().items():
        layer = layer_of(module)
        if layer is None:
            continue
        for target in targets:
            if layer_of(target) is None or layer_of(target) > layer:
                offenders.append(f"{module} -> {target}")
    assert offenders == []


#: The repository's top level (docs/architecture.md): anything else committed there is a mistake
#: (a generated checkpoint folder, a scratch file).
TOP_LEVEL = {".ci", ".gitignore", "CHANGELOG.md", "Makefile", "README.md", "bench", "ckptfmt", "constraints-dev.txt",
             "converters", "docs", "examples", "pyproject.toml", "spec", "tests", "tui"}


def test_the_repository_tracks_only_the_documented_top_level():
    result = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist)")
    tracked = {path.split("/")[0] for path in result.stdout.splitlines()}
    assert tracked <= TOP_LEVEL, sorted(tracked - TOP_LEVEL)


#: The core modules each client on top may import beyond the public API (docs/architecture.md, "the
#: reader's surface"): what a checkpoint holds and how it is read and shown, never what saves, stores or
#: coordinates ranks. A new import outside its set belongs in the docs' list first, or in the public API.
READERS_SURFACE = {
    "ckptfmt.converters": {"ckptfmt.format.values", "ckptfmt.format.rng_states", "ckptfmt.tensors.values",
                           "ckptfmt.tensors.dtypes", "ckptfmt.tensors.sharded", "ckptfmt.metadata.timing",
                           "ckptfmt.repository.repository", "ckptfmt.tools.formatting", "ckptfmt.tools.output",
                           "ckptfmt.tools.diff"},
    "ckptfmt.tui": {"ckptfmt.format.manifest", "ckptfmt.format.shards", "ckptfmt.format.dtypes",
                    "ckptfmt.loading.checkpoint", "ckptfmt.loading.reader", "ckptfmt.repository.repository",
                    "ckptfmt.tools.describe", "ckptfmt.tools.diff", "ckptfmt.tools.verify", "ckptfmt.tools.formatting",
                    "ckptfmt.tools.output", "ckptfmt.analytics", "ckptfmt.analytics.tables",
                    "ckptfmt.analytics.stragglers", "ckptfmt.analytics.compare", "ckptfmt.analytics.certify",
                    "ckptfmt.analytics.grids"},
}
PUBLIC_API = {"ckptfmt", "ckptfmt.errors"}


@pytest.mark.parametrize("client", sorted(READERS_SURFACE))
def test_the_converters_and_the_tui_import_the_public_api_and_their_readers_surface_only(client):
    imported = {target for module, targets in graph().items() if module.startswith(client) for target in targets
                if not target.startswith(client) and target.startswith("ckptfmt")}
    assert imported - PUBLIC_API - READERS_SURFACE[client] == set()
    docs = (ROOT / "docs" / "architecture.md").read_text()
    listed = docs[docs.index(f"- {client.removeprefix('ckptfmt.')}/:"):]
    listed = listed[:listed.index("\n\n")]
    for module in READERS_SURFACE[client]:
        assert f"`{module.removeprefix('ckptfmt.').replace('.', '/')}.py`" in listed or f"`{module}`" in listed, module
