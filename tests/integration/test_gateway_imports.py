"""The gateway is a stateless forwarder: importing it loads no engine. Each check runs in a
fresh interpreter, since this test process has long imported torch for other tests."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "safetensors.torch")
"""What a process that serves no model must not import."""


@pytest.mark.parametrize(
    "module",
    [
        "serving.gateway",
        "serving.http.common",
        "serving.http.errors",
        "serving.http.limits",
        "serving.http.client",
        "serving.http.wire",
        "processes",
    ],
)
def test_importing_loads_no_engine(module: str) -> None:
    check = (
        f"import sys, {module}\n"
        f"loaded = [name for name in {HEAVY!r} if name in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"importing {module} loaded an engine:\n{done.stderr}"
