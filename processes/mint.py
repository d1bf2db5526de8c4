"""Starting one of MinT's own servers (`mint worker`, `mint gateway`, `mint trainer`) as a
child process."""

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from mint_core.config import LOOPBACK
from processes.managed import ManagedProcess, free_port, start_process

if TYPE_CHECKING:
    from mint_core.config import MintConfig


def start_mint(
    command: str,
    name: str,
    log: str,
    config: "MintConfig",
    port: int | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """`mint <command>` listening on loopback (on `port`, else a free one) in a child process
    with `config`'s environment plus `env`; returns once its `/health` answers. `name` says
    what it is in messages; it logs to logs/<log>-<port>.log under `config`'s state dir."""
    port = port or free_port()
    argv = [sys.executable, "-m", "mint_cli", command, "--host", LOOPBACK, "--port", str(port)]
    return start_process(
        name,
        argv,
        f"http://{LOOPBACK}:{port}",
        "/health",
        config.home / "logs" / f"{log}-{port}.log",
        config.to_env() | dict(env or {}),
        timeout_s,
    )
