"""Who may do what in the registry: MLflow's own basic-auth app, with MinT's accounts.

`mint registry` and `mint up` run MLflow's basic-auth app (in MinT's MLflow app, `mint_mlflow`).
Every account may read (the auth app's default permission); only the pipeline's principal may
write: it holds MANAGE on every registered model and experiment (register, move aliases, set
`mint.*` tags). Workers read with an account of their own; auditors read in the UI. The admin
account only manages users. Clients pass MLflow's usual variables, `MLFLOW_TRACKING_USERNAME`
and `MLFLOW_TRACKING_PASSWORD` (`Account.env`).

Passwords are generated once per state dir and kept, readable by its owner only, in
`mlflow-accounts.json` beside MLflow's files (`RegistryAccounts.load_or_create`).
"""

import json
import os
import secrets
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from mint_core.errors import ConfigurationError, RegistryError

ACCOUNTS_FILE = "mlflow-accounts.json"
"""The accounts of one registry, in the folder that holds its files."""
USERNAME_VARIABLE = "MLFLOW_TRACKING_USERNAME"
PASSWORD_VARIABLE = "MLFLOW_TRACKING_PASSWORD"
AUTH_VARIABLE = "MINT_MLFLOW_AUTH"
"""Set in an MLflow server's environment: MinT's MLflow app (`mint_mlflow`) puts MLflow's
basic-auth app in front, with the settings MLFLOW_AUTH_CONFIG_PATH names."""


class RegistryRole(StrEnum):
    ADMIN = "admin"
    """Manages users and permissions; not used by MinT's processes."""
    PIPELINE = "pipeline"
    """The release pipeline (flows, CLI): registers revisions, moves aliases, sets tags."""
    WORKER = "worker"
    """Serving workers: read the registry, write nothing."""
    AUDITOR = "auditor"
    """People reading the registry in MLflow's UI: read only."""


@dataclass(frozen=True)
class Account:
    username: str
    password: str

    def env(self) -> dict[str, str]:
        """MLflow's client variables that make a process act as this account."""
        return {USERNAME_VARIABLE: self.username, PASSWORD_VARIABLE: self.password}


@dataclass(frozen=True)
class RegistryAccounts:
    """The accounts of one registry, one per role (auditors: any number)."""

    admin: Account
    pipeline: Account
    worker: Account
    auditors: tuple[Account, ...]
    secret_key: str
    """The server's key for its forms' CSRF tokens (`MLFLOW_FLASK_SERVER_SECRET_KEY`): kept, so
    a restarted server accepts a page it served before."""

    @classmethod
    def generate(cls, auditors: tuple[str, ...] = ("auditor",)) -> "RegistryAccounts":
        """New accounts with random passwords: `mint-admin`, `mint-pipeline`, `mint-worker`
        and the named auditors."""

        def new(username: str) -> Account:
            return Account(username, secrets.token_urlsafe(18))

        return cls(
            new("mint-admin"),
            new("mint-pipeline"),
            new("mint-worker"),
            tuple(new(name) for name in auditors),
            secrets.token_urlsafe(32),
        )

    def account(self, role: RegistryRole) -> Account:
        """The account of `role` (the first auditor's for AUDITOR)."""
        if role is RegistryRole.AUDITOR:
            return self.auditors[0]
        return {
            RegistryRole.ADMIN: self.admin,
            RegistryRole.PIPELINE: self.pipeline,
            RegistryRole.WORKER: self.worker,
        }[role]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "RegistryAccounts":
        fields = json.loads(text)
        return cls(
            Account(**fields["admin"]),
            Account(**fields["pipeline"]),
            Account(**fields["worker"]),
            tuple(Account(**a) for a in fields["auditors"]),
            fields["secret_key"],
        )

    @classmethod
    def load(cls, folder: Path) -> "RegistryAccounts | None":
        """The accounts kept in `folder`; None if it keeps none."""
        path = folder / ACCOUNTS_FILE
        try:
            return cls.from_json(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigurationError(
                f"{path} is not a readable accounts file ({e}); restore it, or remove it and "
                f"the auth database beside it to start over with new accounts"
            ) from e

    @classmethod
    def load_or_create(cls, folder: Path) -> "RegistryAccounts":
        """The accounts kept in `folder`, generated and kept there (owner-only) the first
        time."""
        found = cls.load(folder)
        if found is not None:
            return found
        accounts = cls.generate()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / ACCOUNTS_FILE
        # Created owner-only: the passwords are never readable by anyone else, even briefly.
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(handle, "w") as file:
            file.write(accounts.to_json())
        return accounts


def auth_config(accounts: RegistryAccounts, database_uri: str) -> str:
    """The auth app's settings (the ini `MLFLOW_AUTH_CONFIG_PATH` names): every account reads,
    and the admin is created with its password on the first start."""
    return (
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = {database_uri}\n"
        f"admin_username = {accounts.admin.username}\n"
        f"admin_password = {accounts.admin.password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )


def provision(url: str, accounts: RegistryAccounts) -> None:
    """Create the accounts that do not exist yet on the auth app at `url` (as its admin), and
    give the pipeline MANAGE on every registered model and experiment, present and future.
    Idempotent. RegistryError naming the call if the server refuses."""
    from mlflow.server.auth.routes import CREATE_USER, GET_USER, GRANT_USER_PERMISSION
    from mlflow.utils.rest_utils import MlflowHostCreds, http_request

    admin = MlflowHostCreds(url, username=accounts.admin.username, password=accounts.admin.password)

    def call(endpoint: str, method: str, **kwargs: object) -> int:
        response = http_request(admin, endpoint, method, max_retries=0, **kwargs)
        if response.status_code >= 400 and response.status_code not in (400, 404):
            raise RegistryError(
                f"MLflow's auth app at {url} refused {endpoint} ({response.status_code}): "
                f"{response.text[:300]}; check {ACCOUNTS_FILE}'s admin password"
            )
        return response.status_code

    for account in (accounts.pipeline, accounts.worker, *accounts.auditors):
        if call(GET_USER, "GET", params={"username": account.username}) == 200:
            continue
        body = {"username": account.username, "password": account.password}
        call(CREATE_USER, "POST", json=body)
    for resource_type in ("registered_model", "experiment"):
        grant = {
            "username": accounts.pipeline.username,
            "resource_type": resource_type,
            "resource_id": "*",
            "permission": "MANAGE",
        }
        call(GRANT_USER_PERMISSION, "POST", json=grant)  # 400: granted already
