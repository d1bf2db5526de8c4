"""What a worker's catalog asks of the real MLflow for a name it has not synced yet (a worker
just restarted under a burst of requests), and what it answers when the name has no revision
there: concurrent lookups of one name share one registry read, and an adapter registered but
never released says so, listing its revisions."""

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import requests

from mint_core.artifacts.digests import sha256_json
from mint_core.catalog.catalog import Catalog
from mint_core.errors import NotFoundError
from mint_core.registry import RegisteredRevision, Registry
from mint_core.revisions import PRODUCTION, RevisionId, RevisionRef
from processes import ManagedProcess
from tests.helpers import make_policy
from tests.integration.helpers import move_alias

BURST = 50
"""Requests at once for one adapter, as in the issue's burst after a worker restart."""


def registered(registry: Registry, adapter: str, revisions: int) -> None:
    """`revisions` revisions of `adapter`, metadata only (nothing is served)."""
    for number in range(revisions):
        digest = sha256_json(["test_catalog_lookups", adapter, number])
        policy = make_policy(adapter=adapter, content_digest=digest)
        uri = "mint-local://sha256/" + digest.removeprefix("sha256:")
        registry.revisions.register(policy, uri, policy.base_digest)


@pytest.fixture
def mlflow_requests(
    monkeypatch: pytest.MonkeyPatch, mlflow_server: ManagedProcess
) -> Iterator[list[str]]:
    """The requests this process sends to the session's MLflow from now on, from any thread."""
    sent: list[str] = []
    send = requests.Session.send

    def counted(session: requests.Session, request: Any, **kwargs: Any) -> Any:
        if request.url.startswith(mlflow_server.url):
            sent.append(f"{request.method} {request.path_url.split('?')[0]}")  # atomic
        return send(session, request, **kwargs)

    monkeypatch.setattr(requests.Session, "send", counted)
    yield sent


def at_once(call: Callable[[], RegisteredRevision], times: int) -> list[object]:
    """`call()` from `times` threads released together: each one's answer or error."""
    start = threading.Barrier(times)

    def one() -> object:
        start.wait()
        try:
            return call()
        except Exception as e:  # the test compares what each thread got
            return e

    with ThreadPoolExecutor(times) as pool:
        return list(pool.map(lambda _: one(), range(times)))


def test_concurrent_lookups_of_one_unsynced_name_share_one_registry_read(
    mlflow_server: ManagedProcess, mlflow_requests: list[str], prefect_api: str
) -> None:
    registry = Registry(mlflow_server.url)
    adapter = f"burst-{uuid.uuid4().hex[:8]}"
    registered(registry, adapter, 2)
    move_alias(registry, RevisionId(adapter, 2), PRODUCTION, reason="test")
    catalog = Catalog(registry)  # a restarted worker: nothing synced yet
    try:
        mlflow_requests.clear()
        answers = at_once(lambda: catalog.resolve(RevisionRef(adapter)), BURST)
        assert [getattr(a, "id", a) for a in answers] == [RevisionId(adapter, 2)] * BURST
        assert mlflow_requests == ["GET /api/2.0/mlflow/registered-models/alias"], mlflow_requests

        mlflow_requests.clear()
        answers = at_once(lambda: catalog.resolve(RevisionRef(adapter, revision=1)), BURST)
        assert [getattr(a, "id", a) for a in answers] == [RevisionId(adapter, 1)] * BURST
        assert mlflow_requests == ["GET /api/2.0/mlflow/model-versions/get"], mlflow_requests

        # A refusal is shared too, by the callers whose read it was (it is not kept: a caller
        # that comes after it asks again).
        mlflow_requests.clear()
        answers = at_once(lambda: catalog.resolve(RevisionRef(adapter, revision=9)), BURST)
        assert all(isinstance(a, NotFoundError) for a in answers), answers
        reads = mlflow_requests.count("GET /api/2.0/mlflow/model-versions/get")
        assert 1 <= reads < BURST // 10, mlflow_requests
    finally:
        catalog.close()


def test_an_adapter_without_a_production_revision_says_which_revisions_it_has(
    mlflow_server: ManagedProcess, worker: ManagedProcess
) -> None:
    registry = Registry(mlflow_server.url)
    adapter = f"tk-upper-{uuid.uuid4().hex[:6]}"
    registered(registry, adapter, 1)
    expected = f"{adapter} has no production revision yet (registered: r1)"

    with pytest.raises(NotFoundError) as raised:
        registry.revisions.resolve(RevisionRef(adapter))
    assert str(raised.value).startswith(expected), raised.value

    body = {"inputs": "abc=", "parameters": {"adapter_id": adapter}}
    answer = httpx.post(
        worker.url + "/generate",
        json=body,
        headers={"Authorization": "Bearer key-admin"},
        timeout=60,
    )
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"].startswith(expected), answer.text

    registered(registry, adapter, 2)
    with pytest.raises(NotFoundError, match=r"\(registered: r1, r2, r3\)"):
        registry.revisions.resolve(RevisionRef(adapter, alias="candidate"))
    unknown = f"nobody-{uuid.uuid4().hex[:6]}"
    with pytest.raises(NotFoundError, match=f"adapter '{unknown}' is not registered"):
        registry.revisions.resolve(RevisionRef(unknown))
