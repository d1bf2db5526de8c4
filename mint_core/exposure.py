"""What a MinT service may expose where: a service listening beyond loopback must guard its
doors (keys, accounts, an auth string), and may speak TLS with the certificate it is given.

`check_guarded` is called at the edges (each `mint` command that listens, each starter of the
control plane's services) before anything is loaded: a worker on 0.0.0.0 without keys would
let anyone on the network admit, evict and read every revision. `advertised_url` is the URL
others reach a service at; it is a worker's name in placement, so it must be the one every
other host uses.
"""

import ipaddress
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from mint_core.errors import ConfigurationError

if TYPE_CHECKING:
    from mint_core.config import MintConfig

WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", ""})
"""Bind addresses that mean every address of the host: no address another host can use."""


@dataclass(frozen=True)
class TlsFiles:
    """A service's certificate and key (PEM files, MINT_TLS_CERT and MINT_TLS_KEY); neither
    set: plain HTTP."""

    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError(
                f"names a certificate {self.cert!r} and a key {self.key!r}; set both "
                "MINT_TLS_CERT and MINT_TLS_KEY (PEM files) for TLS, or neither"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.cert)


class Service(StrEnum):
    """A service that listens, as `check_guarded` knows it."""

    WORKER = "a serving worker (mint serve)"
    """A serving worker: its `/admin/...` endpoints admit, evict and show every revision."""
    TRAINER = "the trainer (mint trainer)"
    """The Tinker API: it trains and samples on the host's accelerator."""
    GATEWAY = "the gateway (mint gateway)"
    """The front door: it presents MINT_WORKER_API_KEY to workers that ask for keys."""
    MLFLOW = "the MLflow server"
    """The registry of record: its accounts decide who may move an alias."""
    PREFECT = "the Prefect server"
    """Flow runs and their parameters: anyone who reaches it can start a release."""
    S3_TEST = "the S3 test server (moto)"
    """The S3 test endpoint: no credentials at all, objects in memory."""


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or `localhost`: only this host
    reaches it. The wildcards 0.0.0.0 and :: are not: they listen on every address."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, others may reach it


def is_wildcard(host: str) -> bool:
    """Whether `host` binds every address of the host (0.0.0.0, ::)."""
    return host.strip() in WILDCARDS


def url_host(host: str) -> str:
    """`host` as it goes in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def advertised_url(host: str, port: int, given: str = "", tls: bool = False) -> str:
    """The URL other hosts reach a service listening on `host`:`port` at: `given` (the
    service's --advertise-url, a worker's MINT_WORKER_URL) if set, else the address it binds.
    A wildcard bind names no address another host can use: refused without `given`."""
    if given:
        if not given.startswith(("http://", "https://")):
            raise ConfigurationError(
                f"advertised URL {given!r} must start with http:// or https://, e.g. "
                f"http://<this host's name>:{port}"
            )
        return given.rstrip("/")
    if is_wildcard(host):
        raise ConfigurationError(
            f"listening on {host or '0.0.0.0'!r} (every address of this host) names no address "
            "other hosts can reach it at: set --advertise-url (for a worker, MINT_WORKER_URL) "
            f"to the URL they use, e.g. http://<this host's name>:{port}"
        )
    return f"{'https' if tls else 'http'}://{url_host(host)}:{port}"


def local_url(host: str, port: int, tls: bool = False) -> str:
    """The URL this host reaches a service listening on `host`:`port` at (loopback for a
    wildcard bind): where its own health probe goes."""
    reach = "127.0.0.1" if is_wildcard(host) else host
    return f"{'https' if tls else 'http'}://{url_host(reach)}:{port}"


def check_guarded(
    service: Service, host: str, config: "MintConfig | None" = None, guard: str = ""
) -> None:
    """Refuse (ConfigurationError, naming what to set) to let `service` listen on `host`
    beyond loopback with its doors open. The MinT services' guards come from `config`; the
    control plane's from `guard`: MLflow's admin account name, Prefect's auth string (empty:
    none). On loopback anything goes, as on one machine today."""
    if is_loopback(host):
        return
    missing = _missing_guard(service, config, guard)
    if missing:
        raise ConfigurationError(
            f"{service} would listen on {host or '0.0.0.0'!r}, beyond loopback, {missing}; "
            "or listen on 127.0.0.1 (--host) and reach it through a tunnel"
        )


def _missing_guard(service: Service, config: "MintConfig | None", guard: str) -> str:
    """What `service` lacks to be guarded, as the end of a sentence; empty if nothing."""
    match service:
        case Service.WORKER:
            keys = config.api_keys if config else {}
            admins = tuple(config.admin_principals) if config else ("admin",)
            if not keys:
                return (
                    "with its admin endpoints open to anyone: set MINT_API_KEYS "
                    f"('key=principal,...') with a key for an admin principal ({', '.join(admins)}"
                    "; MINT_ADMIN_PRINCIPALS)"
                )
            if not set(keys.values()) & set(admins):
                return (
                    "and no key in MINT_API_KEYS names an admin principal, so the pipeline "
                    f"cannot admit revisions: add a key for one of {', '.join(admins)} "
                    "(MINT_ADMIN_PRINCIPALS)"
                )
        case Service.TRAINER:
            if not (config and config.api_keys):
                return (
                    "with no keys, so anyone may train on it: set MINT_API_KEYS ('key=tenant,...')"
                )
        case Service.GATEWAY:
            if not (config and config.worker_api_key):
                return (
                    "with no key to present to the workers, which beyond loopback ask for one: "
                    "set MINT_WORKER_API_KEY to a key whose principal the workers' MINT_API_KEYS "
                    "name as admin"
                )
        case Service.MLFLOW:
            if not guard:
                return "without accounts: start it with accounts (`mint registry` always does)"
        case Service.PREFECT:
            if not guard:
                return (
                    "without an auth string, so anyone may start flow runs: set "
                    "PREFECT_SERVER_API_AUTH_STRING (`mint up --role control` makes one)"
                )
        case Service.S3_TEST:
            if guard != "test-network":
                return (
                    "and it has no credentials at all (moto, for tests): use a real S3 store "
                    "(MINT_S3_ENDPOINT_URL with its credentials) across hosts, or --test-network "
                    "on a closed test network"
                )
    return ""
