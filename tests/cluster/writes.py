"""Every kind of registry write, tried with the MLflow account in this process's environment
(MLFLOW_TRACKING_URI, MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD), as someone holding
a host's env file would: run inside a cluster host by tests/cluster/test_serving_account.py.

    python -m tests.cluster.writes ADAPTER

ADAPTER is a registered adapter with a revision 1 (the writes to what exists). Prints one JSON
object: each write's name -> the status MLflow answered, and `read` -> a read's status (so a
refusal is told from an account that cannot sign in at all)."""

import json
import os
import sys

import httpx

CREATED = "takeover-bot"
"""The registered model and experiment a write tries to create (none exists by that name)."""


API = "/api/2.0/mlflow/"


def attempts(adapter: str, experiment_id: str) -> dict[str, tuple[str, str, dict]]:
    """Write name -> (method, path, body)."""
    me = os.environ["MLFLOW_TRACKING_USERNAME"]
    model = {"name": adapter}
    version = {"name": adapter, "version": "1"}
    models, versions = API + "registered-models/", API + "model-versions/"
    grant = {"username": me, "resource_type": "registered_model", "resource_id": adapter}
    return {
        "create registered model": ("POST", models + "create", {"name": CREATED}),
        "create experiment": ("POST", API + "experiments/create", {"name": CREATED}),
        "move alias": ("POST", models + "alias", model | {"alias": "production", "version": "1"}),
        "delete alias": ("DELETE", models + "alias", model | {"alias": "production"}),
        "set model tag": ("POST", models + "set-tag", model | {"key": "mint.kind", "value": "x"}),
        "delete model tag": ("DELETE", models + "delete-tag", model | {"key": "mint.kind"}),
        "describe model": ("PATCH", models + "update", model | {"description": "mine"}),
        "rename model": ("POST", models + "rename", model | {"new_name": CREATED}),
        "delete model": ("DELETE", models + "delete", model),
        "create version": ("POST", versions + "create", model | {"source": "s3://x/y"}),
        "set version tag": ("POST", versions + "set-tag", version | {"key": "k", "value": "v"}),
        "describe version": ("PATCH", versions + "update", version | {"description": "mine"}),
        "delete version": ("DELETE", versions + "delete", version),
        "create release run": ("POST", API + "runs/create", {"experiment_id": experiment_id}),
        "grant itself": (
            "POST", "/api/3.0/mlflow/users/permissions/grant", grant | {"permission": "MANAGE"}
        ),
    }  # fmt: skip


def main(adapter: str) -> None:
    base = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    auth = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"])
    with httpx.Client(base_url=base, auth=auth, timeout=30) as client:
        read = client.get(API + "registered-models/get", params={"name": adapter})
        answers = {"read": read.status_code}
        releases = client.get(
            API + "experiments/get-by-name", params={"experiment_name": "mint-releases"}
        )
        experiment_id = releases.json().get("experiment", {}).get("experiment_id", "0")
        for name, (method, path, body) in attempts(adapter, experiment_id).items():
            answers[name] = client.request(method, path, json=body).status_code
    print(json.dumps(answers))


if __name__ == "__main__":
    main(sys.argv[1])
