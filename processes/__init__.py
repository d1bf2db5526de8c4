"""Process start-up for every role: the control plane, the workers, the gateway and the trainer
start their children through it. It leans on nothing but the standard library and `mint_core`,
so serving and the trainer can start processes without importing the control plane."""

from processes.managed import (
    ManagedProcess,
    free_port,
    group_running,
    responds_ok,
    start_process,
    start_together,
    stop_all,
)
from processes.mint import start_mint

__all__ = [
    "ManagedProcess",
    "free_port",
    "group_running",
    "responds_ok",
    "start_mint",
    "start_process",
    "start_together",
    "stop_all",
]
