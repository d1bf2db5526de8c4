"""API keys name principals; the policy record says which principals may use a revision."""

import json
from pathlib import Path

import httpx
import pytest

from flows.release import release
from mint_core.access import ANONYMOUS, check_access, parse_api_keys, principal_for
from mint_core.config import MintConfig
from mint_core.errors import AccessDeniedError, AuthenticationError, ConfigurationError
from mint_core.revisions import RevisionId
from mint_core.services import ManagedProcess
from tests.helpers import make_policy


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


@pytest.mark.slow
def test_worker_refuses_principals_the_policy_does_not_allow(worker: ManagedProcess) -> None:
    assert release("private-bot", "upper", steps=10, principals=["team-a"]).revision == (
        "private-bot:r1"
    )
    body = {"inputs": "abc=", "parameters": {"adapter_id": "private-bot"}}

    def ask(key: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(worker.url + "/generate", json=body, headers=headers)

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
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        listed = httpx.get(worker.url + "/v1/models", headers=headers).json()["data"]
        return {model["id"] for model in listed}

    assert "private-bot:r1" in models("key-team-a")
    assert "private-bot:r1" not in models("key-team-b")
    assert "private-bot:r1" not in models(None)
