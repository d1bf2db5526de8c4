"""Starting one of MinT's own servers (`mint serve`, `mint gateway`, `mint trainer`) as a
child process."""

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from mint_core.config import LOOPBACK
from mint_core.exposure import advertised_url, local_url
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
    host: str = LOOPBACK,
    advertise: str = "",
) -> ManagedProcess:
    """`mint <command>` listening on `host` (default loopback; on `port`, else a free one) in a
    child process with `config`'s environment plus `env`; returns once its `/health` answers
    here. Its `url` is `advertise` if given (what other hosts use), else its address. `name`
    says what it is in messages; it logs to logs/<log>-<port>.log under `config`'s state dir."""
    port = port or free_port(host)
    argv = [sys.executable, "-m", "mint_cli", command, "--host", host, "--port", str(port)]
    tls = config.tls.enabled
    url = advertised_url(host, port, advertise, tls)  # refused before anything starts
    service = start_process(
        name,
        argv,
        local_url(host, port, tls),
        "/health",
        config.home / "logs" / f"{log}-{port}.log",
        config.to_env() | dict(env or {}),
        timeout_s,
    )
    service.url = url
    return service
