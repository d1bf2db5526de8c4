"""The house's layout holds: the project's own modules import one another without cycles, no
module in the domain (`mint_core`) or the workers (`serving`) grows past about 500 lines, the
domain controls no processes and speaks no HTTP, the gateway (a stateless forwarder) is kept
apart from the engine, the flows that never train (and `mint promote` / `rollback`) load no model
library, the workers and the trainer lean on neither the control plane nor the pipeline, process
start-up is neutral ground, the engine sits below the worker, the registry is
composed of parts, and a module opens with its why, not a manual. Read from the source (ast),
so nothing is imported or started."""

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mint_core", "serving", "control", "tasks", "flows", "trainer", "mint_cli", "processes")
MAX_LINES = 520
"""About 500: a module past it holds more than one concept (the issue that set it said ~500)."""
NOT_IN_THE_DOMAIN = {
    "subprocess": "process control",
    "multiprocessing": "process control",
    "signal": "process control",
    "control": "process control",
    "processes": "process control",
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
TRAINING_LIBRARIES = {"torch", "transformers", "peft"}
"""What a process that trains nothing must not import: seconds and half a GB before it starts
(issue 48: a rollback's run spent 6.7 s of its ~23 s importing them)."""
NEVER_TRAIN = (
    "flows.promote",
    "flows.canary",
    "flows.repair",
    "flows.approval",
    "flows.catalog",
    "flows.usage",
    "mint_cli.main",
    "mint_cli.rollout",
)
"""The control pool's flows (`flows.deployments.POOLS`: each run imports its module alone) and
the `mint` command with its promote and rollback (which run `flows.promote` in-process).
tests/integration/test_control_imports.py checks the same in fresh interpreters, finding the
flows from the deployments themselves."""
PIPELINE = {"control", "tasks", "flows", "mint_cli"}
"""The control plane and the release pipeline: they drive workers and the trainer, never the
other way round (both run on hosts that have neither)."""
MAX_DOCSTRING_LINES = 25
"""A module's docstring says why it exists in a few lines; the how belongs in the README."""


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


def all_imports(path: Path) -> Iterator[str]:
    """Every module `path` names in an import, wherever the import stands: at module level,
    inside functions (deferred) and under `if TYPE_CHECKING:` alike."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def leaning_on(packages: tuple[str, ...], forbidden: set[str]) -> list[str]:
    """`module imports target` for each import, at any level, of a module under `packages` that
    reaches into one of the `forbidden` packages or modules."""
    return sorted(
        f"{name} imports {target}"
        for name, path in modules().items()
        if name.split(".")[0] in packages or name.startswith(packages)
        for target in all_imports(path)
        if target.split(".")[0] in forbidden
        or any(target == f or target.startswith(f"{f}.") for f in forbidden)
    )


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


def importing(start: str, libraries: set[str]) -> list[str]:
    """`module imports library` for each module that importing `start` imports (its top-level
    imports, followed through the project's modules) whose own import names one of
    `libraries`."""
    known = modules()
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(t for t in top_level_imports(known[name]) if t in known)
    return sorted(
        f"{name} imports {target}"
        for name in seen
        for target in top_level_imports(known[name])
        if target.split(".")[0] in libraries
    )


def test_the_gateway_imports_no_engine() -> None:
    """What `serving.gateway` imports when imported, followed through the project's modules,
    reaches no module that imports torch or a model library (a fresh interpreter checks the
    same in tests/integration/test_gateway_imports.py)."""
    assert importing("serving.gateway", MODEL_LIBRARIES) == []


@pytest.mark.parametrize("module", NEVER_TRAIN)
def test_what_never_trains_imports_no_training_library(module: str) -> None:
    """A promotion, a rollback or any control flow starts without torch, transformers or
    PEFT: the modules that train import them, and the seams into them (`tasks.training`,
    the packer, the trained and imported adapters named as types) are deferred."""
    assert importing(module, TRAINING_LIBRARIES) == []


def test_the_import_reader_sees_deferred_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\ndef f():\n    from tasks.packaging import x\n")
    assert list(all_imports(module)) == ["os", "tasks.packaging"]


def test_serving_imports_neither_the_control_plane_nor_the_pipeline() -> None:
    assert leaning_on(("serving",), PIPELINE) == []


def test_the_trainer_imports_neither_the_control_plane_nor_the_pipeline() -> None:
    assert leaning_on(("trainer",), PIPELINE) == []


def test_process_start_up_is_neutral_ground() -> None:
    """`processes` starts and stops child processes for every role (control plane, workers,
    the trainer), so it may lean on nothing but the standard library and the domain."""
    assert (ROOT / "processes" / "__init__.py").exists()
    wrong = [
        f"{name} imports {target}"
        for name, path in modules().items()
        if name.split(".")[0] == "processes"
        for target in all_imports(path)
        if target.split(".")[0] not in sys.stdlib_module_names | {"processes", "mint_core"}
    ]
    assert wrong == []


def test_the_engine_and_its_backends_sit_below_the_worker() -> None:
    """The engine and the backends are driven by the worker, its HTTP API and the gateway;
    none of them is imported back (which made package cycles through the worker's metrics)."""
    above = {"serving.worker", "serving.http", "serving.gateway"}
    assert leaning_on(("serving.engine", "serving.backends"), above) == []


def base_classes_defined_beside(package: Path) -> list[str]:
    """`Class(Base)` for each class under `package` whose base class is defined there too."""
    trees = {path: ast.parse(path.read_text()) for path in package.rglob("*.py")}
    defined = {
        node.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    return sorted(
        f"{path.name}: {node.name}({base.id})"
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for base in node.bases
        if isinstance(base, ast.Name) and base.id in defined
    )


def test_the_registry_is_composed_not_inherited() -> None:
    """An alias move is found by reading `Registry`'s fields, not an inheritance order."""
    assert base_classes_defined_beside(ROOT / "mint_core" / "registry") == []


@pytest.mark.parametrize("package", ["mint_core", "serving", "trainer", "control", "processes"])
def test_a_module_docstring_says_why_in_a_few_lines(package: str) -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in (ROOT / package).rglob("*.py")
        if (doc := ast.get_docstring(ast.parse(path.read_text()), clean=False))
        and (lines := len(doc.splitlines())) > MAX_DOCSTRING_LINES
    }
    assert long == {}, f"say why in a few lines; the how goes to the README: {long}"
