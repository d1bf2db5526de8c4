"""The unit lane's guard holds: whatever way a unit test tries to start a process, it fails
saying where such a test belongs, and nothing is started."""

import os
import subprocess
import sys
from collections.abc import Callable

import pytest


def fork() -> int:
    pid = os.fork()  # looked up when called: the guard replaces it after this module is imported
    if pid == 0:  # only where the guard failed: the child must not run the rest of the suite
        os._exit(0)
    return pid


STARTS: dict[str, Callable[[], object]] = {
    "subprocess.run": lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
    "os.system": lambda: os.system("true"),
    "os.fork": fork,
    "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], {}),
}


@pytest.mark.parametrize("start", STARTS.values(), ids=STARTS.keys())
def test_a_unit_test_cannot_start_a_process(start: Callable[[], object]) -> None:
    with pytest.raises(AssertionError, match="belongs in tests/integration"):
        start()
