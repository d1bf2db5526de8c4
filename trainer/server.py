"""Starting `mint trainer`: in this process (`serve_trainer`) or as a child process
(`start_trainer`)."""

import logging
import os
from collections.abc import Mapping

from mint_core.config import LOOPBACK, TRAINER_PORT, MintConfig
from mint_core.model.base import load_base
from processes import ManagedProcess, start_mint
from serving.http.server import serve_http
from trainer.app import create_app
from trainer.futures import Futures
from trainer.service import Trainer


def serve_trainer(config: MintConfig, host: str = LOOPBACK, port: int = TRAINER_PORT) -> None:
    """Load the base once and serve the Tinker API until stopped."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

    def make(futures: Futures) -> Trainer:
        return Trainer(config, load_base(config.base, config.home), futures)

    serve_http(create_app(make, config.api_keys), host, port, config.http_bounds, config.tls)


def start_trainer(
    config: MintConfig,
    port: int | None = None,
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    host: str = LOOPBACK,
    advertise: str = "",
) -> ManagedProcess:
    """`mint trainer` in a child process on `host` (default loopback); returns once it answers
    (base loaded). `env`: more of its environment (e.g. the registry account it registers
    revisions with); `advertise`: the URL other hosts reach it at."""
    return start_mint(
        "trainer", "trainer", "trainer", config, port, timeout_s, env, host, advertise
    )
