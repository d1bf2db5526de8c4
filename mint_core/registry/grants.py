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

from dataclasses import dataclass

from mint_core.errors import AccessDeniedError
from mint_core.registry._mlflow import MlflowStore
from mint_core.registry_accounts import USERNAME_VARIABLE


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
    """Reading and removing the grants on adapters' registered models. The calls are MinT's
    additions to the store's client (`_mlflow._Answering`), so a client that stands in for it
    in tests answers them too."""

    store: MlflowStore

    def writers(self, adapter: str) -> tuple[Grant, ...] | None:
        """Every account that may write `adapter`'s registered model; None where the server
        does not say (MLflow without MinT's guarded app: no authentication, so no grants)."""
        with self.store.failing(f"read who may write {adapter!r}"):
            found = self.store.client.registered_model_writers(adapter)  # type: ignore[attr-defined]
        if found is None:
            return None
        return tuple(Grant(g["account"], g["permission"], bool(g["admin"])) for g in found)

    def check_only_pipeline_writes(self, adapter: str) -> None:
        """AccessDeniedError naming every account besides this client's own and the admins
        that may write `adapter`'s registered model, and how to remove each."""
        writers = self.writers(adapter)
        if not writers:
            return
        me = self.store.client.username  # type: ignore[attr-defined]
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
        with self.store.failing(f"revoke {account}'s grant on {adapter!r}"):
            self.store.client.revoke_registered_model_grant(adapter, account)  # type: ignore[attr-defined]
