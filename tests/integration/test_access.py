"""API keys name principals; the policy record says which principals may use a revision."""

import json
from pathlib import Path

import httpx
import pytest

from mint_core.access import ANONYMOUS, check_access, parse_api_keys, principal_for
from mint_core.config import MintConfig
from mint_core.errors import AccessDeniedError, AuthenticationError, ConfigurationError
from mint_core.revisions import RevisionId
from processes import ManagedProcess
from tests.helpers import make_policy
from tests.integration.helpers import toy_release as release


def test_api_keys_parse_from_env_and_file(tmp_path: Path) -> None:
    assert parse_api_keys(" k1=alice, k2=bob ,") == {"k1": "alice", "k2": "bob"}
    with pytest.raises(ConfigurationError, match="key=principal"):
        parse_api_keys("k1alice")
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"k3": "carol"}))
    config = MintConfig.from_env(
        {"MINT_API_KEYS": "k1=alice", "MINT_API_KEYS_FILE": str(keys_file)}
    )
    assert config.api_keys == {"k1": "alice", "k3": "carol"}
    with pytest.raises(ConfigurationError, match="MINT_API_KEYS_FILE"):
        MintConfig.from_env({"MINT_API_KEYS_FILE": str(tmp_path / "missing.json")})


def test_principals_and_policy() -> None:
    assert principal_for({"k": "alice"}, None) == ANONYMOUS
    assert principal_for({"k": "alice"}, "k") == "alice"
    with pytest.raises(AuthenticationError, match="not known"):
        principal_for({"k": "alice"}, "other")
    revision = RevisionId("support-bot", 3)
    check_access(make_policy(principals=("*",)), ANONYMOUS, revision)
    check_access(make_policy(principals=("team-a",)), "team-a", revision)
    with pytest.raises(AccessDeniedError, match="'mallory' may not use adapter 'support-bot'"):
        check_access(make_policy(principals=("team-a",)), "mallory", revision)


def test_admin_principals_come_from_the_environment_and_go_back_to_it() -> None:
    assert MintConfig().admin_principals == ("admin",)
    assert MintConfig.from_env({"MINT_ADMIN_PRINCIPALS": " "}).admin_principals == ("admin",)
    config = MintConfig.from_env({"MINT_ADMIN_PRINCIPALS": " ops, pipeline ,"})
    assert config.admin_principals == ("ops", "pipeline")
    assert MintConfig.from_env(config.to_env()).admin_principals == ("ops", "pipeline")
    with pytest.raises(ConfigurationError, match="MINT_ADMIN_PRINCIPALS"):
        MintConfig(admin_principals=())


def call(
    worker: ManagedProcess, method: str, path: str, key: str | None, body: object = None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, worker.url + path, json=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def private_bot(worker: ManagedProcess) -> None:
    """`private-bot` r1 for team-a and r2 (production) for team-b, released through the
    pipeline, which reads the worker's readiness with its admin key (`key-admin`)."""
    released = [
        release("private-bot", "upper", steps=10, principals=[team]).revision
        for team in ("team-a", "team-b")
    ]
    assert released == ["private-bot:r1", "private-bot:r2"]


@pytest.mark.slow
def test_worker_refuses_principals_the_policy_does_not_allow(
    worker: ManagedProcess, private_bot: None
) -> None:
    body = {"inputs": "abc=", "parameters": {"adapter_id": "private-bot:r1"}}

    def ask(key: str | None) -> httpx.Response:
        return call(worker, "POST", "/generate", key, body)

    assert ask("key-team-a").status_code == 200
    for key in (None, "key-team-b"):
        refused = ask(key)
        assert refused.status_code == 403
        assert "private-bot" in refused.json()["error"]
        assert "upper-bot" not in refused.text and "team-a" not in refused.text
    unknown = ask("stolen-key")
    assert unknown.status_code == 401
    assert unknown.headers["WWW-Authenticate"] == "Bearer"

    def models(key: str | None) -> set[str]:
        listed = call(worker, "GET", "/v1/models", key).json()["data"]
        return {model["id"] for model in listed} & {"private-bot:r1", "private-bot:r2"}

    assert models("key-team-a") == {"private-bot:r1"}
    assert models("key-team-b") == {"private-bot:r2"}
    assert models(None) == set()


ADMIN_ROUTES = [
    ("POST", "/admin/admit", {"adapter": "private-bot", "revision": 1}, 202),
    ("POST", "/admin/sync", None, 202),
    ("GET", "/admin/events", None, 200),
    ("GET", "/admin/routing", None, 200),
    ("GET", "/admin/outcomes", None, 200),
    ("GET", "/admin/usage", None, 200),
]
"""Every admin route, what it is sent and how it answers an admin."""


@pytest.mark.slow
def test_admin_endpoints_need_an_admin_key(worker: ManagedProcess, private_bot: None) -> None:
    listed = httpx.get(worker.url + "/openapi.json").json()["paths"]
    assert {path for path in listed if path.startswith("/admin")} == {
        path for _, path, _, _ in ADMIN_ROUTES
    }, "a new admin route belongs in ADMIN_ROUTES"
    for method, path, body, status in ADMIN_ROUTES:
        unauthenticated = call(worker, method, path, None, body)
        assert unauthenticated.status_code == 401, (path, unauthenticated.text)
        assert unauthenticated.headers["WWW-Authenticate"] == "Bearer"
        assert unauthenticated.json() == {
            "error": f"{method} {path} needs an admin key of this worker; send 'Authorization: "
            "Bearer <key>' with a key whose principal is in MINT_ADMIN_PRINCIPALS",
            "error_type": "unauthenticated",
        }
        forbidden = call(worker, method, path, "key-team-a", body)
        assert forbidden.status_code == 403, (path, forbidden.text)
        assert forbidden.json() == {
            "error": "principal 'team-a' is not an admin of this worker; use a key whose "
            "principal is in the worker's MINT_ADMIN_PRINCIPALS",
            "error_type": "forbidden",
        }
        assert call(worker, method, path, "key-admin", body).status_code == status, path


@pytest.mark.slow
def test_adapter_status_shows_only_revisions_the_caller_may_use(
    worker: ManagedProcess, private_bot: None
) -> None:
    def revisions(key: str) -> list[int]:
        response = call(worker, "GET", "/v1/adapters/private-bot", key)
        assert response.status_code == 200, response.text
        return [entry["revision"] for entry in response.json()["revisions"]]

    assert revisions("key-team-a") == [1]
    assert revisions("key-team-b") == [2]
    assert revisions("key-admin") == [1, 2]
    # As generation does: refused, naming only the adapter asked for.
    refused = call(worker, "GET", "/v1/adapters/private-bot", None)
    assert refused.status_code == 403
    assert refused.json() == {
        "error": "principal 'anonymous' may not use adapter 'private-bot'",
        "error_type": "forbidden",
    }
    assert call(worker, "GET", "/v1/adapters/private-bot", "stolen-key").status_code == 401
    assert call(worker, "GET", "/v1/adapters/no-such-bot", "key-team-a").status_code == 404
