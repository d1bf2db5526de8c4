"""The house's layout holds: the project's own modules import one another without cycles, no
module in the domain (`mint_core`) or the workers (`serving`) grows past about 500 lines, the
domain controls no processes and speaks no HTTP, and the gateway (a stateless forwarder) is
kept apart from the engine. Read from the source (ast), so nothing is imported or started."""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mint_core", "serving", "control", "tasks", "flows", "trainer", "mint_cli")
MAX_LINES = 520
"""About 500: a module past it holds more than one concept (the issue that set it said ~500)."""
NOT_IN_THE_DOMAIN = {
    "subprocess": "process control",
    "multiprocessing": "process control",
    "signal": "process control",
    "control": "process control",
    "httpx": "HTTP",
    "fastapi": "HTTP",
    "starlette": "HTTP",
    "uvicorn": "HTTP",
    "prefect": "Prefect",
    "serving": "the workers",
    "tasks": "the pipeline",
    "flows": "the pipeline",
}
"""What `mint_core` never imports, and why it would be wrong there."""
MODEL_LIBRARIES = {"torch", "transformers", "peft", "safetensors", "vllm"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {
        module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }


def top_level_imports(path: Path) -> Iterator[str]:
    """The modules `path` imports when it is imported: its module-level imports, not those
    inside functions (deferred on purpose) nor those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` imports the module (and its package, as any import
            # of a module does); `from module import name` imports the module.
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            submodules = [
                m
                for m in submodules
                if (ROOT / Path(*m.split("."))).exists()
                or (ROOT / Path(*m.split("."))).with_suffix(".py").exists()
            ]
            yield from submodules or [node.module]


def own_graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {target for target in top_level_imports(path) if target in known and target != name}
        for name, path in known.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_project_imports_without_cycles() -> None:
    assert cycles(own_graph()) == []


@pytest.mark.parametrize("package", ["mint_core", "serving", "trainer"])
def test_no_module_is_over_about_500_lines(package: str) -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in (ROOT / package).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by concept (at most {MAX_LINES} lines): {long}"


def test_the_domain_controls_no_processes_and_speaks_no_http() -> None:
    wrong = [
        f"{name} imports {target} ({NOT_IN_THE_DOMAIN[target.split('.')[0]]})"
        for name, path in modules().items()
        if name.startswith("mint_core")
        for target in top_level_imports(path)
        if target.split(".")[0] in NOT_IN_THE_DOMAIN
    ]
    assert wrong == []


def test_the_gateway_imports_no_engine() -> None:
    """What `serving.gateway` imports when imported, followed through the project's modules,
    reaches no module that imports torch or a model library (a fresh interpreter checks the
    same in tests/integration/test_gateway_imports.py)."""
    known = modules()
    seen, todo = set(), ["serving.gateway"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(t for t in top_level_imports(known[name]) if t in known)
    heavy = sorted(
        f"{name} imports {target}"
        for name in seen
        for target in top_level_imports(known[name])
        if target.split(".")[0] in MODEL_LIBRARIES
    )
    assert heavy == []
