"""The fast lane: pure domain code, plans, transition tables, packing on temporary files and
engine math on tiny models built in-process; seconds in all. No test here starts a process (a
server, a worker, a `mint` command, a subprocess of any kind): each refuses to (see
tests/process_leaks.py), and one that needs a process belongs in tests/integration."""

import pytest


@pytest.fixture(autouse=True)
def _no_processes(refuse_processes: None) -> None:
    """Every unit test refuses processes, so that the lane stays fast and honest."""
