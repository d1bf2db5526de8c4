"""The gateway is a stateless forwarder: importing it loads no engine. Each check runs in a
fresh interpreter, since this test process has long imported torch for other tests."""

import pytest

from tests.helpers import loaded_on_import

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
    loaded = loaded_on_import(module, HEAVY, timeout_s=120)
    assert not loaded, f"importing {module} loaded an engine:\n{loaded}"
