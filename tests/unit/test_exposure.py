"""Where a service may listen with what guarding it, the URL others reach it at, and TLS handed
to uvicorn: `mint_core.exposure` and `serving.http.server.uvicorn_options`."""

import pytest

from control.services import allowed_hosts
from mint_core.config import MintConfig
from mint_core.connections import ConnectionBounds
from mint_core.errors import ConfigurationError
from mint_core.exposure import (
    Service,
    TlsFiles,
    advertised_url,
    check_guarded,
    is_loopback,
    local_url,
)
from serving.http.server import uvicorn_options

ADMIN_KEY = MintConfig(api_keys={"k1": "admin"})
TENANT_KEY = MintConfig(api_keys={"k1": "alice"})
OPEN = MintConfig()
GATEWAY_KEY = MintConfig(worker_api_key="k1")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("127.255.0.9", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("192.168.1.2", False),
        ("ctl.example", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# host x what guards it -> None (allowed) or words the refusal must hold
CASES = [
    (Service.WORKER, "127.0.0.1", OPEN, "", None),
    (Service.WORKER, "127.0.0.2", OPEN, "", None),
    (Service.WORKER, "0.0.0.0", OPEN, "", "MINT_API_KEYS"),
    (Service.WORKER, "10.1.2.3", OPEN, "", "MINT_API_KEYS"),
    (Service.WORKER, "0.0.0.0", TENANT_KEY, "", "admin principal"),
    (Service.WORKER, "0.0.0.0", ADMIN_KEY, "", None),
    (Service.TRAINER, "0.0.0.0", OPEN, "", "MINT_API_KEYS"),
    (Service.TRAINER, "0.0.0.0", TENANT_KEY, "", None),
    (Service.TRAINER, "localhost", OPEN, "", None),
    (Service.GATEWAY, "0.0.0.0", OPEN, "", "MINT_WORKER_API_KEY"),
    (Service.GATEWAY, "0.0.0.0", ADMIN_KEY, "", "MINT_WORKER_API_KEY"),
    (Service.GATEWAY, "0.0.0.0", GATEWAY_KEY, "", None),
    (Service.MLFLOW, "0.0.0.0", None, "", "accounts"),
    (Service.MLFLOW, "0.0.0.0", None, "mint-admin", None),
    (Service.PREFECT, "10.1.2.3", None, "", "PREFECT_SERVER_API_AUTH_STRING"),
    (Service.PREFECT, "10.1.2.3", None, "s3cret", None),
    (Service.PREFECT, "127.0.0.1", None, "", None),
    (Service.S3_TEST, "0.0.0.0", None, "", "real S3 store"),
    (Service.S3_TEST, "0.0.0.0", None, "anything", "real S3 store"),
    (Service.S3_TEST, "10.1.2.3", None, "test-network", None),
    (Service.S3_TEST, "127.0.0.1", None, "", None),
]


@pytest.mark.parametrize(("service", "host", "config", "guard", "refusal"), CASES)
def test_guarded(
    service: Service, host: str, config: MintConfig | None, guard: str, refusal: str | None
) -> None:
    if refusal is None:
        check_guarded(service, host, config, guard)
        return
    with pytest.raises(ConfigurationError) as caught:
        check_guarded(service, host, config, guard)
    message = str(caught.value)
    assert refusal in message
    assert str(service) in message and repr(host) in message
    assert "127.0.0.1" in message  # the other way out: listen on loopback


def test_worker_refusal_names_the_admin_principals() -> None:
    config = MintConfig(admin_principals=("ops", "pipeline"))
    with pytest.raises(ConfigurationError, match="ops, pipeline"):
        check_guarded(Service.WORKER, "0.0.0.0", config)
    check_guarded(
        Service.WORKER, "0.0.0.0", MintConfig(api_keys={"k": "ops"}, admin_principals=("ops",))
    )


@pytest.mark.parametrize(
    ("host", "port", "given", "tls", "url"),
    [
        ("127.0.0.1", 8000, "", False, "http://127.0.0.1:8000"),
        ("10.0.0.2", 8001, "", True, "https://10.0.0.2:8001"),
        ("::1", 8000, "", False, "http://[::1]:8000"),
        ("0.0.0.0", 8000, "http://serve-1:8001/", False, "http://serve-1:8001"),
        ("10.0.0.2", 8000, "https://serve-1.example", False, "https://serve-1.example"),
    ],
)
def test_advertised_url(host: str, port: int, given: str, tls: bool, url: str) -> None:
    assert advertised_url(host, port, given, tls) == url


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_wildcard_needs_an_advertised_url(host: str) -> None:
    with pytest.raises(ConfigurationError, match=r"--advertise-url .*MINT_WORKER_URL"):
        advertised_url(host, 8000)


def test_advertised_url_needs_a_scheme() -> None:
    with pytest.raises(ConfigurationError, match="http:// or https://"):
        advertised_url("0.0.0.0", 8000, "serve-1:8000")


def test_local_url_probes_a_wildcard_on_loopback() -> None:
    assert local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert local_url("10.0.0.2", 8000, tls=True) == "https://10.0.0.2:8000"


def test_tls_goes_to_uvicorn() -> None:
    plain = uvicorn_options("0.0.0.0", 8000, ConnectionBounds())
    assert "ssl_certfile" not in plain and "ssl_keyfile" not in plain
    tls = uvicorn_options("0.0.0.0", 8000, ConnectionBounds(), TlsFiles("/c.pem", "/k.pem"))
    assert tls["ssl_certfile"] == "/c.pem" and tls["ssl_keyfile"] == "/k.pem"
    assert {k: v for k, v in tls.items() if not k.startswith("ssl_")}.keys() == plain.keys()


def test_tls_needs_both_files() -> None:
    with pytest.raises(ValueError, match="MINT_TLS_CERT and MINT_TLS_KEY"):
        TlsFiles("/c.pem", "")


def test_mlflow_allows_the_host_headers_it_is_reached_by() -> None:
    # MLflow 3.17 answers 403 to any other Host header; its defaults cover no host name.
    allowed = allowed_hosts("0.0.0.0", "http://ctl.example:5000")
    assert {"ctl.example", "ctl.example:*", "127.0.0.1:*", "localhost:*"} <= set(allowed)
    assert "0.0.0.0" not in allowed
    assert {"10.0.0.1:*", "ctl:*"} <= set(allowed_hosts("10.0.0.1", "http://ctl:5000"))
