"""MLflow with its own authentication, as `mint registry` runs it: only the pipeline's account
writes (register, move aliases, set `mint.*` tags); auditors and workers read; nobody signs
in anonymously. Against the real `mlflow server --app-name basic-auth`."""

import signal
import stat
import subprocess
from pathlib import Path

import httpx
import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from control.services import free_port
from mint_core.errors import RegistryError
from mint_core.registry import Registry
from mint_core.registry_accounts import ACCOUNTS_FILE, Account, RegistryAccounts
from mint_core.revisions import PRODUCTION, RevisionId, RevisionRef
from tests.helpers import make_policy
from tests.integration.helpers import mint_env, start_mint, stop_and_check, wait_for


def acting_as(monkeypatch: pytest.MonkeyPatch, account: Account) -> None:
    """This process's MLflow clients sign in as `account` from now on (MLflow reads its
    variables at each request)."""
    for name, value in account.env().items():
        monkeypatch.setenv(name, value)


def refused(call: object, *args: object) -> MlflowException:
    with pytest.raises(MlflowException) as raised:
        call(*args)  # type: ignore[operator]
    return raised.value


@pytest.mark.slow
def test_mint_registry_lets_only_the_pipeline_write(
    started: list[subprocess.Popen[bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "registry.log"
    registry_process = start_mint(
        started, ["registry", "--port", str(port)], mint_env(MINT_HOME=str(tmp_path)), log
    )
    wait_for(lambda: "Ctrl-C stops it" in log.read_text(), registry_process, log, timeout_s=180)
    assert f"passwords in {tmp_path / ACCOUNTS_FILE}" in log.read_text()
    accounts = RegistryAccounts.load(tmp_path)
    assert accounts is not None
    assert stat.S_IMODE((tmp_path / ACCOUNTS_FILE).stat().st_mode) == 0o600

    # Nobody anonymous, not even to read; health stays open for probes.
    assert httpx.get(f"{url}/api/2.0/mlflow/registered-models/search").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200

    # The pipeline registers and activates through MinT's registry.
    acting_as(monkeypatch, accounts.pipeline)
    registry = Registry(url)
    policy = make_policy(adapter="guarded-bot")
    uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
    r1 = registry.register(policy, uri, policy.base_digest).id
    assert registry.move_alias(r1, PRODUCTION, actor="release") is None
    second = make_policy(adapter="guarded-bot", content_digest="sha256:" + "e" * 64)
    r2 = registry.register(second, uri, second.base_digest).id
    registry.set_revision_tag(r2, "mint.note", "by the pipeline")

    # An auditor reads everything and changes nothing: not the alias, not a mint.* tag.
    for reader in (accounts.auditors[0], accounts.worker):
        acting_as(monkeypatch, reader)
        client = MlflowClient(url, registry_uri=url)
        assert client.get_model_version_by_alias("guarded-bot", PRODUCTION).version == "1"
        assert client.get_model_version("guarded-bot", "2").tags["mint.note"] == "by the pipeline"
        for call, args in (
            (client.set_registered_model_alias, ("guarded-bot", PRODUCTION, "2")),
            (client.delete_registered_model_alias, ("guarded-bot", PRODUCTION)),
            (client.set_registered_model_tag, ("guarded-bot", "mint.gates", "{}")),
            (client.set_model_version_tag, ("guarded-bot", "2", "mint.stage", "active")),
        ):
            error = refused(call, *args)
            assert error.error_code == "PERMISSION_DENIED", (reader.username, call, error)
            assert "403" in str(error)
        with pytest.raises(RegistryError, match="403"):
            Registry(url).move_alias(r2, PRODUCTION, actor=reader.username)
        assert Registry(url).resolve(RevisionRef("guarded-bot", alias=PRODUCTION)).id == r1

    # The pipeline still moves it.
    acting_as(monkeypatch, accounts.pipeline)
    assert registry.move_alias(r2, PRODUCTION, actor="promote") == 1
    assert registry.resolve(RevisionRef("guarded-bot", alias=PRODUCTION)).id == RevisionId(
        "guarded-bot", 2
    )
    stop_and_check(registry_process, signal.SIGTERM, [f"{url}/health"], log)
