"""MLflow with its own authentication, as `mint registry` runs it: only the pipeline's account
writes (register, move aliases, set `mint.*` tags); auditors and workers read; nobody signs
in anonymously; a refusal is MLflow's JSON error. Credentials are checked as strictly as
MLflow's own app checks them (a wrong password, a changed one, a removed account: refused at
once) though the slow hash check runs once per password. Against the real `mlflow server`
with MLflow's basic-auth app in MinT's (`mint_mlflow`)."""

import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from mlflow.exceptions import MlflowException
from mlflow.server.auth.routes import CREATE_USER, DELETE_USER, UPDATE_USER_PASSWORD
from mlflow.tracking import MlflowClient

from control.services import start_mlflow
from mint_core.errors import AccessDeniedError, RegistryError
from mint_core.registry import KIND_TAG, Registry
from mint_core.registry._mlflow import ADAPTER_KIND, BASE_DIGEST_TAG
from mint_core.registry_accounts import ACCOUNTS_FILE, Account, RegistryAccounts
from mint_core.revisions import PRODUCTION, RevisionId, RevisionRef
from processes import ManagedProcess, free_port
from tests.helpers import make_policy
from tests.integration.browser import TIMEOUT_MS
from tests.integration.helpers import (
    MINT,
    mint_env,
    move_alias,
    start_mint,
    stop_and_check,
    wait_for,
)

if TYPE_CHECKING:
    from playwright.sync_api import Browser

SEARCH = "/api/2.0/mlflow/registered-models/search"
SET_MODEL_TAG = "/api/2.0/mlflow/registered-models/set-tag"
CHANGE_SEEN_S = 3.0
"""How soon a changed password or a removed account must be refused: "within a few seconds"
(MinT's check refuses it at the next request; the margin is the machine's)."""


@pytest.fixture(scope="module")
def guarded(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ManagedProcess, RegistryAccounts]]:
    """A registry with MinT's accounts, started as `mint registry` starts it."""
    accounts = RegistryAccounts.generate()
    server = start_mlflow(tmp_path_factory.mktemp("guarded-registry"), accounts=accounts)
    yield server, accounts
    server.stop()


def reads(url: str, username: str, password: str) -> int:
    """The status of a small registry read signed in as `username` with `password`."""
    answer = httpx.get(url + SEARCH, params={"max_results": 1}, auth=(username, password))
    return answer.status_code


def as_admin(url: str, accounts: RegistryAccounts, method: str, path: str, body: dict) -> None:
    admin = (accounts.admin.username, accounts.admin.password)
    answer = httpx.request(method, url + path, json=body, auth=admin, timeout=60)
    assert answer.status_code == 200, answer.text


def refused_within(url: str, username: str, password: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while reads(url, username, password) != 401:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


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
    started: list[subprocess.Popen[bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    prefect_api: str,
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
    r1 = registry.revisions.register(policy, uri, policy.base_digest).id
    assert move_alias(registry, r1, PRODUCTION, actor="release") is None
    second = make_policy(adapter="guarded-bot", content_digest="sha256:" + "e" * 64)
    r2 = registry.revisions.register(second, uri, second.base_digest).id
    registry.revisions.set_tag(r2, "mint.note", "by the pipeline")

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
            assert f"Permission denied: {reader.username} may not" in str(error)
        with pytest.raises(RegistryError, match="Permission denied"):
            move_alias(Registry(url), r2, PRODUCTION, actor=reader.username)
        assert (
            Registry(url).revisions.resolve(RevisionRef("guarded-bot", alias=PRODUCTION)).id == r1
        )

    # The pipeline still moves it.
    acting_as(monkeypatch, accounts.pipeline)
    assert move_alias(registry, r2, PRODUCTION, actor="promote") == 1
    assert registry.revisions.resolve(
        RevisionRef("guarded-bot", alias=PRODUCTION)
    ).id == RevisionId("guarded-bot", 2)
    stop_and_check(registry_process, signal.SIGTERM, [f"{url}/health"], log)


@pytest.mark.slow
def test_a_wrong_password_or_an_unknown_account_is_refused(
    guarded: tuple[ManagedProcess, RegistryAccounts],
) -> None:
    server, accounts = guarded
    worker = accounts.worker
    for _ in range(3):  # the check that passed is remembered; a wrong password is not let in
        assert reads(server.url, worker.username, worker.password) == 200
        assert reads(server.url, worker.username, worker.password + "x") == 401
        assert reads(server.url, worker.username, "") == 401
        assert reads(server.url, "mint-nobody", worker.password) == 401
        assert reads(server.url, accounts.pipeline.username, worker.password) == 401


@pytest.mark.slow
def test_a_changed_password_is_refused_within_seconds(
    guarded: tuple[ManagedProcess, RegistryAccounts],
) -> None:
    server, accounts = guarded
    name, old, new = "rotating-auditor", "first-password-1", "second-password-2"
    as_admin(server.url, accounts, "POST", CREATE_USER, {"username": name, "password": old})
    assert reads(server.url, name, old) == 200
    assert reads(server.url, name, old) == 200  # now remembered
    as_admin(
        server.url, accounts, "PATCH", UPDATE_USER_PASSWORD, {"username": name, "password": new}
    )
    assert refused_within(server.url, name, old, CHANGE_SEEN_S)
    assert reads(server.url, name, new) == 200


@pytest.mark.slow
def test_a_removed_account_is_refused_within_seconds(
    guarded: tuple[ManagedProcess, RegistryAccounts],
) -> None:
    server, accounts = guarded
    name, password = "leaving-auditor", "leaving-password-1"
    as_admin(server.url, accounts, "POST", CREATE_USER, {"username": name, "password": password})
    assert reads(server.url, name, password) == 200
    assert reads(server.url, name, password) == 200
    as_admin(server.url, accounts, "DELETE", DELETE_USER, {"username": name})
    assert refused_within(server.url, name, password, CHANGE_SEEN_S)


@pytest.mark.slow
def test_a_refusal_is_mlflows_json_error(
    guarded: tuple[ManagedProcess, RegistryAccounts], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's UI shows a refusal with a text body as INTERNAL_ERROR; with MLflow's JSON error
    it says permission denied, and MLflow's client reads the same code and message."""
    server, accounts = guarded
    acting_as(monkeypatch, accounts.pipeline)
    MlflowClient(server.url, registry_uri=server.url).create_registered_model("refusing-bot")
    auditor = accounts.auditors[0]
    answer = httpx.post(
        server.url + SET_MODEL_TAG,
        json={"name": "refusing-bot", "key": "mint.note", "value": "by hand"},
        auth=(auditor.username, auditor.password),
    )
    assert answer.status_code == 403
    assert answer.headers["content-type"].startswith("application/json"), answer.text
    error = answer.json()
    assert error["error_code"] == "PERMISSION_DENIED"
    assert error["message"].startswith("Permission denied")
    assert auditor.username in error["message"] and "pipeline" in error["message"]

    acting_as(monkeypatch, auditor)
    client = MlflowClient(server.url, registry_uri=server.url)
    raised = refused(client.set_registered_model_tag, "refusing-bot", "mint.note", "by hand")
    assert raised.error_code == "PERMISSION_DENIED"
    assert f"Permission denied: {auditor.username} may not" in raised.message


def refused_edit(browser: "Browser", url: str, auditor: Account, page_path: str) -> int:
    """Open MLflow's UI page `page_path` as `auditor`, edit its description and Save: how many
    times the page then tells the refusal (waiting for the first), with no INTERNAL_ERROR."""
    context = browser.new_context(
        http_credentials={"username": auditor.username, "password": auditor.password},
        viewport={"width": 1400, "height": 900},
    )
    context.set_default_timeout(TIMEOUT_MS)
    try:
        page = context.new_page()
        page.goto(f"{url}/#/{page_path}", wait_until="domcontentloaded")
        page.get_by_text("kept as registered").first.wait_for()
        page.get_by_role("button", name="Edit", exact=True).first.click()
        page.locator("textarea").first.fill("changed by an auditor")
        with page.expect_response(lambda r: r.url.endswith("/update")) as update:
            page.get_by_role("button", name="Save", exact=True).click()
        assert update.value.status == 403
        refusal = page.get_by_text(f"Permission denied: {auditor.username} may not")
        refusal.first.wait_for()
        assert page.get_by_text("INTERNAL_ERROR").count() == 0
        return refusal.count()
    finally:
        context.close()


@pytest.mark.slow
def test_the_ui_tells_an_auditor_permission_denied(
    guarded: tuple[ManagedProcess, RegistryAccounts],
    monkeypatch: pytest.MonkeyPatch,
    browser: "Browser",
) -> None:
    """An auditor who edits an adapter's description in MLflow's UI is told the change was
    refused and why, not shown an INTERNAL_ERROR; the description stays as it was."""
    server, accounts = guarded
    acting_as(monkeypatch, accounts.pipeline)
    client = MlflowClient(server.url, registry_uri=server.url)
    client.create_registered_model("audited-bot", description="kept as registered")
    shown = refused_edit(browser, server.url, accounts.auditors[0], "models/audited-bot")
    assert shown == 1
    description = client.get_registered_model("audited-bot").description
    assert description == "kept as registered"


@pytest.mark.slow
def test_the_version_page_tells_an_auditor_permission_denied(
    guarded: tuple[ManagedProcess, RegistryAccounts],
    monkeypatch: pytest.MonkeyPatch,
    browser: "Browser",
) -> None:
    """The version page's editor closes on Save whatever the answer: a refusal is shown to the
    auditor who tried (MinT's page shows what MLflow's leaves out), once, and the description
    stays as it was."""
    server, accounts = guarded
    acting_as(monkeypatch, accounts.pipeline)
    registry = Registry(server.url)
    policy = make_policy(adapter="audited-version-bot")
    uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
    registry.revisions.register(policy, uri, policy.base_digest)
    client = MlflowClient(server.url, registry_uri=server.url)
    client.update_model_version("audited-version-bot", "1", "kept as registered")
    page = "models/audited-version-bot/versions/1"
    assert refused_edit(browser, server.url, accounts.auditors[0], page) == 1
    description = client.get_model_version("audited-version-bot", "1").description
    assert description.startswith("kept as registered")


@pytest.mark.slow
def test_mint_registry_accepts_its_accounts_as_soon_as_health_says_ok(
    started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """A process started beside the registry (a worker) waits for `/health`, then signs in:
    it must not get a 401 because the accounts are still being made."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "registry.log"
    registry_process = start_mint(
        started, ["registry", "--port", str(port)], mint_env(MINT_HOME=str(tmp_path)), log
    )

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            time.sleep(0.02)
            return False

    wait_for(healthy, registry_process, log, timeout_s=180)
    accounts = RegistryAccounts.load(tmp_path)  # written before the server starts
    assert accounts is not None
    for account in (accounts.worker, accounts.pipeline, accounts.auditors[0]):
        assert reads(url, account.username, account.password) == 200, account.username
    stop_and_check(registry_process, signal.SIGTERM, [f"{url}/health"], log)


@pytest.mark.slow
def test_only_the_pipeline_and_admins_create_models_and_experiments(
    guarded: tuple[ManagedProcess, RegistryAccounts],
) -> None:
    """MLflow makes the creator of a registered model its manager: an account on every serve
    host that could create `support-bot` before its first release could move its aliases
    later. Refused on the REST and the UI's paths; the pipeline and the admin still create."""
    server, accounts = guarded
    creates = ("registered-models/create", "experiments/create")
    for reader in (accounts.worker, accounts.auditors[0]):
        for api in ("/api/2.0/mlflow/", "/ajax-api/2.0/mlflow/"):
            for path in creates:
                answer = httpx.post(
                    server.url + api + path,
                    json={"name": f"taken-by-{reader.username}"},
                    auth=(reader.username, reader.password),
                )
                assert answer.status_code == 403, (reader.username, api + path, answer.text)
                assert f"Permission denied: {reader.username} may not" in answer.text
    for writer in (accounts.pipeline, accounts.admin):
        for path in creates:
            answer = httpx.post(
                server.url + "/api/2.0/mlflow/" + path,
                json={"name": f"made-by-{writer.username}"},
                auth=(writer.username, writer.password),
            )
            assert answer.status_code == 200, (writer.username, path, answer.text)


@pytest.mark.slow
def test_a_release_into_a_model_others_may_write_is_refused_until_the_grant_goes(
    guarded: tuple[ManagedProcess, RegistryAccounts], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter made outside MinT (here by the admin, in MLflow's own API, untagged) with
    a grant to the workers' account: registering into it is refused, naming the account, its
    grant and `mint grants`' fix; once `mint grants --revoke` removed it, the release goes in
    and makes the model MinT's (kind and base tags), so the fleet's change feed follows it."""
    server, accounts = guarded
    adapter = "made-elsewhere-bot"
    as_admin(server.url, accounts, "POST", "/api/2.0/mlflow/registered-models/create",
             {"name": adapter})  # fmt: skip
    grant = {"username": accounts.worker.username, "resource_type": "registered_model",
             "resource_id": adapter, "permission": "EDIT"}  # fmt: skip
    as_admin(server.url, accounts, "POST", "/api/3.0/mlflow/users/permissions/grant", grant)

    acting_as(monkeypatch, accounts.pipeline)
    registry = Registry(server.url)
    policy = make_policy(adapter=adapter)
    uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
    with pytest.raises(AccessDeniedError) as refused_release:
        registry.revisions.register(policy, uri, policy.base_digest)
    message = str(refused_release.value)
    assert f"{accounts.worker.username} (EDIT)" in message
    assert f"mint grants {adapter} --revoke {accounts.worker.username}" in message
    assert registry.revisions.of(adapter) == []

    env = mint_env(MLFLOW_TRACKING_URI=server.url, **accounts.pipeline.env())
    fixed = subprocess.run(
        [MINT, "grants", adapter, "--revoke", accounts.worker.username],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert f"revoked {accounts.worker.username}'s grant on {adapter}" in fixed.stdout
    assert accounts.worker.username not in fixed.stdout.split("revoked", 1)[1].split("\n", 1)[1]

    before_ms = int(time.time() * 1000)
    r1 = registry.revisions.register(policy, uri, policy.base_digest).id
    assert r1 == RevisionId(adapter, 1)
    tags = registry.store.client.get_registered_model(adapter).tags
    assert tags[KIND_TAG] == ADAPTER_KIND and tags[BASE_DIGEST_TAG] == policy.base_digest
    followed = {a.adapter: a for a in registry.changes.since(before_ms)}
    assert followed[adapter].base_digest == policy.base_digest
