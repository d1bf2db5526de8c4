"""Who may write an adapter's registered model, and the pipeline's refusal to register into one
that others may change.

With MLflow's authentication, an account that may write a registered model (EDIT, MANAGE) can
move its aliases: serve any revision as `production`. MinT's server lets only the pipeline and
admins create registered models (`mint_mlflow`), but a model made before that, or a grant an
admin gave, still lets another account in; registering into it would hand that account the
revision. So the pipeline asks the server who may write the model (`GRANTS_PATH`) before it
registers into an existing one, and refuses, naming each account and its grant, unless only
itself and admins may. `mint grants ADAPTER --revoke ACCOUNT` removes a grant on the model
(MLflow's own API, which the pipeline's MANAGE allows)."""

import json
from dataclasses import dataclass

from mlflow.exceptions import MlflowException
from mlflow.utils.rest_utils import http_request

from mint_core.errors import AccessDeniedError
from mint_core.registry._mlflow import MlflowStore
from mint_core.registry_accounts import GRANTS_PATH, USERNAME_VARIABLE

REVOKE_PATH = "/api/3.0/mlflow/users/permissions/revoke"
"""MLflow's per-user revoke (allowed to whoever may manage the resource)."""


@dataclass(frozen=True)
class Grant:
    """An account that may write a registered model."""

    account: str
    permission: str
    """MLflow's permission it resolves to: EDIT or MANAGE."""
    admin: bool = False

    def __str__(self) -> str:
        return f"{self.account} ({self.permission}{', admin' if self.admin else ''})"


@dataclass(frozen=True)
class Grants:
    """Reading and removing the grants on adapters' registered models."""

    store: MlflowStore

    def writers(self, adapter: str) -> tuple[Grant, ...] | None:
        """Every account that may write `adapter`'s registered model; None where the server
        does not say (MLflow without MinT's guarded app: no authentication, so no grants)."""
        creds = self.store.client._tracking_client.store.get_host_creds()
        with self.store.failing(f"read who may write {adapter!r}"):
            answer = http_request(
                creds, GRANTS_PATH, "GET", params={"name": adapter}, raise_on_status=False
            )
            if answer.status_code == 404:
                return None
            if answer.status_code != 200:
                raise MlflowException(f"{answer.status_code} {answer.text[:300]}")
            found = json.loads(answer.text)["grants"]
        return tuple(Grant(g["account"], g["permission"], bool(g["admin"])) for g in found)

    def check_only_pipeline_writes(self, adapter: str) -> None:
        """AccessDeniedError naming every account besides this client's own and the admins
        that may write `adapter`'s registered model, and how to remove each."""
        writers = self.writers(adapter)
        if not writers:
            return
        me = self.store.client._tracking_client.store.get_host_creds().username
        others = [g for g in writers if not g.admin and g.account != me]
        if others:
            named = ", ".join(map(str, others))
            fixes = "; ".join(f"mint grants {adapter} --revoke {g.account}" for g in others)
            raise AccessDeniedError(
                f"adapter {adapter!r} is registered in MLflow with write access for {named}, "
                f"who could move its aliases and serve any of its revisions; MinT registers "
                f"only into adapters that the pipeline ({me or USERNAME_VARIABLE + ' unset'}) "
                f"and admins alone may write. Remove the grant first ({fixes}), or release "
                f"under another name"
            )

    def revoke(self, adapter: str, account: str) -> None:
        """Remove `account`'s own grant on `adapter`'s registered model (a grant on every
        model, or through a role, stays: `writers` still lists it)."""
        creds = self.store.client._tracking_client.store.get_host_creds()
        body = {"username": account, "resource_type": "registered_model", "resource_id": adapter}
        with self.store.failing(f"revoke {account}'s grant on {adapter!r}"):
            answer = http_request(creds, REVOKE_PATH, "POST", json=body, raise_on_status=False)
            if answer.status_code != 200:
                raise MlflowException(f"{answer.status_code} {answer.text[:300]}")
