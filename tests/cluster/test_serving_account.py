"""The serving account cannot take over an adapter (issue 48, item 1): from a serve host and
from the gateway's host, with nothing but the env file ctl wrote for that role (the workers'
MLflow account), every registry write is refused: creating a registered model or an
experiment (which would make the account its manager), moving or deleting an alias, tags,
descriptions, versions, a run in the releases' experiment, a grant to itself. Reads still
answer, and the adapter is as the pipeline left it."""

import json
import sys

import pytest

from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION, RevisionRef
from tests.cluster import roles, writes
from tests.helpers import make_policy

ADAPTER = "acl-bot"


def test_a_host_with_the_serving_account_can_write_nothing(
    mint_cluster: roles.Booted, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = mint_cluster.pipeline_env
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, env[name])
    registry = Registry(mint_cluster.tracking_uri)
    policy = make_policy(adapter=ADAPTER)
    uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
    r1 = registry.revisions.register(policy, uri, policy.base_digest).id
    registry.store.client.set_registered_model_alias(ADAPTER, PRODUCTION, "1")

    for role, host in (("serve", roles.SERVE[0]), ("gateway", roles.GATEWAY)):
        host_env = mint_cluster.host_envs[role]
        assert host_env["MLFLOW_TRACKING_USERNAME"] != env["MLFLOW_TRACKING_USERNAME"]
        probe = [sys.executable, "-m", "tests.cluster.writes", ADAPTER]
        done = mint_cluster.cluster.call(host, probe, env=host_env)
        assert done.returncode == 0, done.stdout + done.stderr
        answers = json.loads(done.stdout.strip().splitlines()[-1])
        assert answers.pop("read") == 200, (host, answers)
        assert set(answers) == set(writes.attempts(ADAPTER, "0")), answers
        allowed = {write: status for write, status in answers.items() if status != 403}
        assert not allowed, f"{host} with {role}.env was allowed: {allowed}"

    assert registry.revisions.resolve(RevisionRef(ADAPTER, alias=PRODUCTION)).id == r1
    assert registry.store.model_or_none(writes.CREATED) is None
    writers = registry.grants.writers(ADAPTER)
    assert writers is not None
    assert {g.account for g in writers} == {env["MLFLOW_TRACKING_USERNAME"]}
