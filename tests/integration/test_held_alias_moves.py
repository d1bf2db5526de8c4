"""An alias moved outside the pipeline (the MLflow UI, a script) is held: workers keep serving
the target the pipeline last set, report the move (`/health`, `mint status`, an alias event),
and take the alias only when the pipeline moves it. Table cases for the rule, then the real
MLflow server with a worker's catalog, then a real worker and the promote flow."""

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from mint_cli import main as mint
from mint_core.alias_intents import AliasIntent, HeldMove, sanctioned
from mint_core.artifacts.digests import sha256_json
from mint_core.catalog.catalog import Catalog
from mint_core.config import MintConfig
from mint_core.errors import NotFoundError
from mint_core.model.base import BaseModel
from mint_core.registry import Registry
from mint_core.revisions import CANDIDATE, PRODUCTION, RevisionId, RevisionRef
from processes import ManagedProcess
from serving.http.common import REVISION_HEADER
from serving.worker.server import start_worker
from tests.helpers import make_policy
from tests.integration.helpers import move_alias, register_random_adapter


def intent(revision: int | None, previous: int | None, done: bool = True) -> AliasIntent:
    return AliasIntent(revision, previous, "mint", "", done)


@pytest.mark.parametrize(
    ("alias", "intended", "served", "held"),
    [
        (2, intent(2, 1), 2, None),  # the pipeline's move, done
        (1, intent(2, 1, done=False), 1, None),  # under way: the alias has not moved yet
        (2, intent(2, 1, done=False), 2, None),  # under way: the alias has moved
        (3, intent(2, 1), 2, 3),  # moved by hand after the pipeline's move
        (1, intent(2, 1), 2, 1),  # moved back by hand to where the pipeline moved it from
        (3, intent(2, 1, done=False), 1, 3),  # moved by hand while the pipeline stopped midway
        (None, intent(2, 1), 2, None),  # removed by hand
        (4, None, None, 4),  # set by hand, never by the pipeline (which set `candidate`)
        (None, intent(None, 2), None, None),  # removed by the pipeline
        (5, intent(None, 2), None, 5),  # set by hand after the pipeline removed it
    ],
)
def test_an_alias_is_served_where_the_pipeline_moved_it(
    alias: int | None, intended: AliasIntent | None, served: int | None, held: int | None
) -> None:
    # The pipeline also set `candidate`: the adapter's aliases are moved with intents.
    aliases = {CANDIDATE: 1} | ({} if alias is None else {PRODUCTION: alias})
    intents = {CANDIDATE: intent(1, None)} | ({} if intended is None else {PRODUCTION: intended})
    serving, moves = sanctioned("bot", aliases, intents)
    assert serving == {CANDIDATE: 1} | ({} if served is None else {PRODUCTION: served})
    accounted = alias == served or (alias is None and served is None)
    if accounted:
        assert moves == []
    else:
        assert moves == [HeldMove("bot", PRODUCTION, held, served)]


def test_an_adapter_last_moved_before_intents_were_recorded_is_followed_as_it_is() -> None:
    assert sanctioned("old-bot", {PRODUCTION: 3}, {}) == ({PRODUCTION: 3}, [])


def test_a_catalog_holds_an_alias_moved_by_hand_until_the_pipeline_moves_it(
    mlflow_server: ManagedProcess, prefect_api: str, tmp_path: Path
) -> None:
    registry = Registry(mlflow_server.url)
    adapter = "hand-moved-forms"
    revisions = []
    for number in (1, 2, 3):
        policy = make_policy(adapter=adapter, content_digest=sha256_json([adapter, number]))
        uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
        revisions.append(registry.revisions.register(policy, uri, policy.base_digest).id)
    r1, r2, r3 = revisions
    move_alias(registry, r1, PRODUCTION, actor="release")
    registry.aliases.point(r2, CANDIDATE)
    catalog = Catalog(registry, folder=tmp_path, audit_interval_s=0.0)
    try:
        catalog.sync()
        assert catalog.alias_target(adapter, PRODUCTION) == 1
        assert catalog.held_moves() == []

        # The MLflow UI moves production and sets an alias MinT never set.
        ui = MlflowClient(mlflow_server.url)
        ui.set_registered_model_alias(adapter, PRODUCTION, "3")
        ui.set_registered_model_alias(adapter, "shadow", "3")
        catalog.sync()
        assert catalog.alias_target(adapter, PRODUCTION) == 1
        assert catalog.resolve(RevisionRef(adapter, alias=PRODUCTION)).id == r1
        assert catalog.held_moves() == [
            HeldMove(adapter, PRODUCTION, 3, 1),
            HeldMove(adapter, "shadow", 3, None),
        ]
        assert RevisionId(adapter, 3) not in catalog.desired()
        with pytest.raises(NotFoundError, match="outside the pipeline"):
            catalog.resolve(RevisionRef(adapter, alias="shadow"))

        # The pipeline's move takes production; removing the candidate is no held move.
        move_alias(registry, r3, PRODUCTION, actor="promote")
        registry.aliases.drop(adapter, CANDIDATE)
        catalog.sync()
        assert catalog.alias_target(adapter, PRODUCTION) == 3
        assert catalog.alias_target(adapter, CANDIDATE) is None
        assert catalog.held_moves() == [HeldMove(adapter, "shadow", 3, None)]
    finally:
        catalog.close()


# --- A real worker and the promote flow ------------------------------------------------------


AUDIT_INTERVAL_S = 0.5


@pytest.fixture(scope="module")
def audited(
    config: MintConfig, base: BaseModel, prefect_api: str
) -> Iterator[tuple[MintConfig, ManagedProcess]]:
    """A worker of its own that reads every adapter's aliases twice a second."""
    own = dataclasses.replace(config, alias_audit_interval_s=AUDIT_INTERVAL_S, sync_interval_s=0.5)
    worker = start_worker(own)
    try:
        yield dataclasses.replace(own, worker_urls=(worker.url,)), worker
    finally:
        worker.stop()


def served_by(worker: ManagedProcess, adapter: str) -> str:
    body = {"inputs": "abc=", "parameters": {"adapter_id": adapter, "max_new_tokens": 1}}
    answer = httpx.post(
        worker.url + "/generate",
        json=body,
        headers={"Authorization": "Bearer key-admin"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return answer.headers[REVISION_HEADER]


def wait_health(
    worker: ManagedProcess, adapter: str, held: bool, timeout_s: float = 30
) -> tuple[dict[str, object], list[dict[str, object]]]:
    """The worker's health once it holds (or no longer holds) a move of `adapter`'s aliases,
    and those held moves (others' adapters, moved by other tests, are not this test's)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(worker.url + "/health", timeout=10).json()
        moves = [m for m in health.get("held_alias_moves", []) if m["adapter"] == adapter]
        if bool(moves) == held or time.monotonic() > deadline:
            return health, moves
        time.sleep(0.2)


@pytest.mark.slow
def test_a_worker_keeps_serving_production_moved_by_hand_until_a_promote(
    audited: tuple[MintConfig, ManagedProcess],
    base: BaseModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from flows.promote import promote

    config, worker = audited
    for name, value in config.to_env().items():  # the flows read it, as at any entry point
        monkeypatch.setenv(name, value)
    name = "held-bot"
    r1, r2 = (
        register_random_adapter(config, base, name, tmp_path / f"r{seed}", seed) for seed in (1, 2)
    )
    assert promote(name, r1.number, actor="release") == str(r1)
    assert served_by(worker, name) == str(r1)

    # Someone moves production in the MLflow UI, past prewarm, gates and approval.
    MlflowClient(config.tracking_uri).set_registered_model_alias(name, PRODUCTION, "2")
    health, moves = wait_health(worker, name, held=True)
    held = {"adapter": name, "alias": PRODUCTION, "registry_revision": 2, "serving_revision": 1}
    assert moves == [held], health
    time.sleep(3 * AUDIT_INTERVAL_S)  # a few more syncs change nothing
    assert served_by(worker, name) == str(r1)
    assert served_by(worker, f"{name}@production") == str(r1)
    adapter_status = httpx.get(
        f"{worker.url}/v1/adapters/{name}", headers={"Authorization": "Bearer key-admin"}
    ).json()
    states = {entry["revision"]: entry["state"] for entry in adapter_status["revisions"]}
    assert states.get(2, "not_admitted") == "not_admitted", states  # nothing prewarmed it

    assert mint(["status"]) == 0
    shown = capsys.readouterr().out
    assert f"HELD {name}@production -> r2 outside the pipeline, serving r1" in shown, shown

    events = httpx.get(
        worker.url + "/admin/events", headers={"Authorization": "Bearer key-admin"}
    ).json()["alias_events"]
    events = [e for e in events if e["adapter"] == name]  # not other tests' adapters
    assert [(e["kind"], e["adapter"], e["registry_revision"]) for e in events] == [
        ("held", name, 2)
    ]

    # The pipeline's promote takes it: prewarmed, then moved with its intent.
    assert promote(name, r2.number, actor="release-manager") == str(r2)
    health, moves = wait_health(worker, name, held=False)
    assert moves == [], health
    assert served_by(worker, name) == str(r2)
    events = httpx.get(
        worker.url + "/admin/events", headers={"Authorization": "Bearer key-admin"}
    ).json()["alias_events"]
    mine = [(e["kind"], e["adapter"]) for e in events if e["adapter"] == name]
    assert mine == [("held", name), ("released", name)]
