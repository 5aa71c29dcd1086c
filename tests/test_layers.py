"""The library's layers only point down (docs/ARCHITECTURE.md "Layers"), and no import forms a cycle.

Every import counts, the ones inside functions and under TYPE_CHECKING too: a lazy import that dodges a
cycle is still the cycle. The checks read the source (no module is imported), so they are fast and see
code paths no test runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import its own layer and the ones below it, never one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("home", "settings", "files", "storage", "s3", "tracking", "stats", "llm"),
    ("umls", "kg", "text", "embed", "qa"),
    ("gnn",),
    ("retrieval",),
    ("methods",),
    ("rl",),
    ("eval",),
    ("cli",),
)
# The orchestration packages sit above the whole library: medgraph never imports them (nor dagster).
ABOVE_THE_LIBRARY = ("dagster", "dagster_aws", "dagster_dbt", "platform_assets", "resources", "sensors", "jobs",
                     "definitions")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file, at any depth; `from a.b import c` gives a.b.c and
    a.b (c may be a module or a name), relative imports resolved against `package`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def layer_of(module: str) -> int | None:
    """The layer of a `medgraph.*` module: that of its first-level package or module."""
    parts = module.split(".")
    if parts[0] != "medgraph" or len(parts) < 2:
        return None
    return next((i for i, names in enumerate(LAYERS) if parts[1] in names), None)


def layering_errors(root: Path) -> list[str]:
    """Each import in `root/medgraph` that points up a layer or out of the library, and each module of no layer."""
    errors = []
    for path in sorted((root / "medgraph").rglob("*.py")):
        module = _module_name(path, root)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        own = layer_of(module)
        if own is None:
            if module != "medgraph":
                errors.append(f"{path.relative_to(root)}: {module} is in no layer (add it to LAYERS and "
                              "docs/ARCHITECTURE.md)")
            continue
        for line, imported in _imported_modules(path, package):
            where = f"{path.relative_to(root)}:{line}"
            if imported.split(".")[0] in ABOVE_THE_LIBRARY:
                errors.append(f"{where}: {module} imports {imported}, which sits above the library")
                continue
            target = layer_of(imported)
            if target is not None and target > own:
                errors.append(f"{where}: {module} (layer {own}) imports {imported} (layer {target})")
    return errors


def import_cycles(root: Path) -> list[list[str]]:
    """The strongly connected components (of more than one module) of the module import graph."""
    modules = {_module_name(p, root): p for p in (root / "medgraph").rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        graph[module] = sorted({name for _, name in _imported_modules(path, package)
                                if name in modules and name != module})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_the_library_layers_only_point_down():
    assert layering_errors(ROOT) == []


def test_no_import_cycle_between_library_modules():
    assert import_cycles(ROOT) == []


def _write(root: Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    for parent in path.relative_to(root).parents:
        if str(parent) != ".":
            (root / parent / "__init__.py").touch()


def test_the_checks_fail_on_an_upward_import_a_lazy_one_a_cycle_and_an_unknown_package(tmp_path: Path):
    _write(tmp_path, "medgraph/kg/graph.py", "from medgraph.storage import Warehouse\n")
    _write(tmp_path, "medgraph/kg/qa.py", "from medgraph.eval.questions import QaItem\n")
    _write(tmp_path, "medgraph/gnn/tokens.py", "def train():\n    from medgraph.methods import a2rag\n")
    _write(tmp_path, "medgraph/methods/a2rag.py", "import dagster\nfrom . import tools\n")
    _write(tmp_path, "medgraph/methods/tools.py", "def late():\n    from medgraph.methods import a2rag\n")
    _write(tmp_path, "medgraph/eval/questions.py", "QaItem = object\n")
    _write(tmp_path, "medgraph/newthing/x.py", "")

    errors = layering_errors(tmp_path)

    assert any(e.startswith("medgraph/kg/qa.py:1: medgraph.kg.qa (layer 1) imports medgraph.eval.questions")
               for e in errors)
    assert any(e.startswith("medgraph/gnn/tokens.py:2: medgraph.gnn.tokens (layer 2) imports medgraph.methods")
               for e in errors)
    assert "medgraph/methods/a2rag.py:1: medgraph.methods.a2rag imports dagster, which sits above the library" \
        in errors
    assert any("medgraph.newthing.x is in no layer" in e for e in errors)
    assert not any(e.startswith("medgraph/kg/graph.py") for e in errors)  # down is fine
    assert import_cycles(tmp_path) == [["medgraph.methods.a2rag", "medgraph.methods.tools"]]


@pytest.mark.parametrize("module, layer", [("medgraph.qa.item", 1), ("medgraph.gnn.graph_tokens", 2),
                                           ("medgraph.rl.hiim", 5), ("medgraph.stats", 0), ("numpy", None)])
def test_layer_of_names_the_package_layer(module: str, layer: int | None):
    assert layer_of(module) == layer


# The whole tree, lowest first: the library, the resources over it, the assets, jobs, sensors, the benchmarks and
# the code location that gathers them. A package imports its own level and the ones below it.
TOP_LEVEL = ("medgraph", "resources", "platform_assets", "jobs", "sensors", "benchmarks", "definitions")


def tree_errors(root: Path) -> list[str]:
    """Each import, in any package above the library, of a package above it; and each private `dagster._`
    import without a `# Private...` comment (the reason) in the three lines above it."""
    errors = []
    for rank, package in enumerate(TOP_LEVEL[1:], start=1):
        paths = [root / "definitions.py"] if package == "definitions" else sorted((root / package).rglob("*.py"))
        for path in (p for p in paths if p.exists()):
            module = _module_name(path, root)
            for line, imported in _imported_modules(path, module if path.name == "__init__.py"
                                                    else module.rpartition(".")[0] or module):
                top = imported.split(".")[0]
                if top in TOP_LEVEL and TOP_LEVEL.index(top) > rank:
                    errors.append(f"{path.relative_to(root)}:{line}: {package} imports {imported}, which sits above it")
            lines = path.read_text().splitlines()
            for number, text in enumerate(lines, start=1):
                if text.lstrip().startswith(("from dagster._", "import dagster._")) and not any(
                        "# Private" in above for above in lines[max(0, number - 4):number - 1]) and not any(
                        prev.lstrip().startswith("from dagster._") for prev in lines[number - 2:number - 1]):
                    errors.append(f"{path.relative_to(root)}:{number}: a private Dagster import without its reason")
    return errors


def test_the_whole_tree_points_down():
    assert tree_errors(ROOT) == []


def test_the_tree_check_fails_on_an_upward_import_and_an_unexplained_private_import(tmp_path: Path):
    _write(tmp_path, "resources/warehouse.py", "def build():\n    from platform_assets.dbt_project import x\n")
    _write(tmp_path, "platform_assets/kg.py", "from resources.dbt import dbt_project\nimport jobs\n")
    _write(tmp_path, "jobs/executor.py", "# Private on purpose: no public hook.\nfrom dagster._core.a import b\n"
                                         "from dagster._core.c import d\n")
    _write(tmp_path, "jobs/recovery.py", "from dagster._core.storage.runs import SqliteRunStorage\n")
    _write(tmp_path, "sensors/registry.py", "from jobs import evaluate_job\nfrom platform_assets import kg\n")

    errors = tree_errors(tmp_path)

    assert errors == [
        "resources/warehouse.py:2: resources imports platform_assets.dbt_project, which sits above it",
        "resources/warehouse.py:2: resources imports platform_assets.dbt_project.x, which sits above it",
        "platform_assets/kg.py:2: platform_assets imports jobs, which sits above it",
        "jobs/recovery.py:1: a private Dagster import without its reason",
    ]


PRODUCT_PACKAGES = ("medgraph", "platform_assets", "resources", "jobs", "sensors")


def test_the_catalog_is_asked_in_one_place():
    """Whether a table exists, and which tables there are, is asked through medgraph/storage.py
    (`table_exists`, `list_tables`, `read_rows`, `Warehouse.exists`): one query, not one per module."""
    asking = [str(path.relative_to(ROOT)) for package in PRODUCT_PACKAGES for path in (ROOT / package).rglob("*.py")
              if "information_schema" in path.read_text() and path != ROOT / "medgraph" / "storage.py"]
    assert asking == []


def test_no_function_is_longer_than_a_screen():
    """No function of the product packages is over 60 lines: split it by what its parts do."""
    long = set()
    for package in PRODUCT_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60:
                    long.add(f"{path.relative_to(ROOT)}::{node.name}")
    assert long == set()
