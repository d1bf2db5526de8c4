"""Every library the project's code imports is declared in pyproject.toml, not merely installed
because something else needs it: a dependency of a dependency can be dropped by its next
release, and a fresh install would then fail on import."""

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = (
    "mint_core", "serving", "control", "flows", "tasks", "trainer", "mint_cli", "processes",
    "bench", "mint_demo.py", "mint_mlflow.py",
)  # fmt: skip
"""The project's own code: the package's modules and the benchmarks."""
OWN = {Path(name).stem for name in CODE} | {"tests"}
OWN_ENVIRONMENT = ROOT / "tests" / "integration" / "cookbook"
"""Scripts run by the tinker-cookbook's own environment (`make cookbook`), not MinT's."""


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extras: tuple[str, ...] = ()) -> set[str]:
    """Distribution names pyproject.toml declares: the dependencies, plus `extras`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return {_normalized(re.split(r"[\s\[=<>!~;]", r, maxsplit=1)[0]) for r in requirements}


def imported(folders: tuple[str, ...]) -> dict[str, str]:
    """Top-level third-party modules imported by the Python files under `folders` (or named
    files), each with one file that imports it."""
    found: dict[str, str] = {}
    for folder in folders:
        path = ROOT / folder
        for source in [path] if path.is_file() else sorted(path.rglob("*.py")):
            if source.is_relative_to(OWN_ENVIRONMENT):
                continue
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OWN:
                        found.setdefault(top, str(source.relative_to(ROOT)))
    return found


def undeclared(folders: tuple[str, ...], extras: tuple[str, ...] = ()) -> list[str]:
    names = declared(extras)
    distributions = importlib.metadata.packages_distributions()
    return [
        f"{module} (imported by {where}; installed from {distributions.get(module)})"
        for module, where in sorted(imported(folders).items())
        if not {_normalized(d) for d in distributions.get(module, [module])} & names
    ]


def test_the_package_and_benchmarks_declare_what_they_import() -> None:
    assert undeclared(CODE) == []


def test_the_tests_declare_what_they_import() -> None:
    assert undeclared(("tests",), extras=("dev",)) == []


def test_no_test_module_imports_another() -> None:
    """A test module imports shared helpers from tests/helpers.py (or, in the integration lane,
    tests/integration/helpers.py), never from another test module: importing one runs its
    module-level code and hands its fixtures to the importer, and a helper there is easy to
    change for its own tests only."""
    found = []
    for source in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                package = "tests" if node.level else node.module or ""
                within = f"{package}.{node.module}" if node.level and node.module else package
                modules = [within, *(f"{within}.{alias.name}" for alias in node.names)]
            else:
                continue
            found += [
                f"{source.relative_to(ROOT)}:{node.lineno} imports {module}"
                for module in modules
                if module.split(".")[0] == "tests" and module.split(".")[-1].startswith("test_")
            ]
    assert found == [], "move what they share to tests/helpers.py"
