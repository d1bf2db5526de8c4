"""What the control host hands the other hosts: the secrets made once per state dir (Prefect's
auth string, the key the pipeline and the gateway present to workers) and, per role, an env
file holding what that role's host needs to join (`hosts/<role>.env`).

Adding a host is copying its role's file there and running `mint up --role <role>` with it in
the environment (`set -a; . ./serve.env; set +a`). Each file holds passwords: it is written
0600, and only the accounts its role needs are in it (a serve host reads the registry, a train
host writes it).
"""

import json
import os
import secrets
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError
from mint_core.registry_accounts import RegistryAccounts

SECRETS_FILE = "host-secrets.json"
HOSTS_FOLDER = "hosts"
PREFECT_CLIENT_AUTH = "PREFECT_API_AUTH_STRING"
"""What Prefect's clients (workers, flow runs, MinT's probes) send the auth string from."""
PREFECT_SERVER_AUTH = "PREFECT_SERVER_API_AUTH_STRING"
"""What Prefect's server checks every API request against (all but /health and /ready)."""
S3_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
"""boto3's settings a host of an S3 store needs, copied from the control host's environment."""


class Role(StrEnum):
    """What a host does in a MinT spread over machines (`mint up --role`)."""

    CONTROL = "control"
    """MLflow (the registry), the Prefect server, the control pool's flow runs."""
    TRAIN = "train"
    """The train pool's flow runs (release, import, retrain, rl) and `mint trainer`."""
    SERVE = "serve"
    """A serving worker."""
    GATEWAY = "gateway"
    """The front door to every worker."""


@dataclass(frozen=True)
class HostSecrets:
    """Secrets the control host makes once and hands to the hosts that need them."""

    prefect_auth: str
    """Prefect's auth string: its server refuses API requests without it."""
    worker_api_key: str
    """The key the pipeline and the gateway present to workers, as an admin principal."""

    @classmethod
    def load_or_create(cls, folder: Path) -> "HostSecrets":
        """The secrets in `folder` (the state dir), made there (0600) the first time."""
        path = folder / SECRETS_FILE
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            pass
        except (ValueError, TypeError) as e:
            raise ConfigurationError(
                f"{path} is not MinT's host secrets ({e}); delete it to make new ones (every "
                "host's env file must then be copied again)"
            ) from e
        made = cls(secrets.token_urlsafe(32), secrets.token_urlsafe(32))
        _write_private(path, json.dumps(asdict(made)))
        return made


@dataclass(frozen=True)
class ControlAddresses:
    """Where the other hosts reach the control host's services."""

    tracking_uri: str
    prefect_api_url: str
    s3_endpoint_url: str = ""
    """The S3 test endpoint the control host runs, if it runs one."""


def host_env(
    role: Role,
    config: MintConfig,
    accounts: RegistryAccounts,
    host_secrets: HostSecrets,
    control: ControlAddresses,
    environ: Mapping[str, str],
) -> dict[str, str]:
    """The environment a `role` host needs to join (besides its own MINT_HOST, addresses and
    ports): the registry, the fleet watched through it, the artifact store, and its keys.
    `environ`: the control host's, for the S3 credentials it passes on."""
    if role is Role.CONTROL:
        raise ConfigurationError("the control host writes the other roles' env files, not its own")
    env = {
        "MLFLOW_TRACKING_URI": control.tracking_uri,
        "MINT_FLEET": "registry",
        "MINT_ARTIFACT_STORE": config.artifact_store,
        "MINT_WORKER_API_KEY": host_secrets.worker_api_key,
    }
    if config.base.name:
        env["MINT_BASE_MODEL"] = config.base.name  # one base everywhere, or nothing places
    endpoint = control.s3_endpoint_url or config.s3_endpoint_url or ""
    if config.artifact_store == "s3" or control.s3_endpoint_url:
        env |= {"MINT_ARTIFACT_STORE": "s3", "MINT_S3_BUCKET": config.s3_bucket}
        env |= {"MINT_S3_PREFIX": config.s3_prefix, "MINT_S3_ENDPOINT_URL": endpoint}
        env |= {name: environ[name] for name in S3_CREDENTIALS if environ.get(name)}
    match role:
        case Role.TRAIN:
            # The flow runs register revisions and move aliases, and admit them on workers.
            env |= accounts.pipeline.env()
            env |= {"PREFECT_API_URL": control.prefect_api_url}
            env |= {PREFECT_CLIENT_AUTH: host_secrets.prefect_auth}
            env |= {"MINT_TRAIN_POOL": config.train_pool}
        case Role.SERVE:
            env |= accounts.worker.env()
            admin = config.admin_principals[0]
            env["MINT_API_KEYS"] = f"{host_secrets.worker_api_key}={admin}"
        case Role.GATEWAY:
            env |= accounts.worker.env()  # it reads the catalog, as workers do
    return env


def write_host_files(home: Path, envs: Mapping[Role, Mapping[str, str]]) -> dict[Role, Path]:
    """Write each role's env file under `home`/hosts (0600, shell syntax: `set -a; . FILE`)."""
    written: dict[Role, Path] = {}
    for role, env in envs.items():
        path = home / HOSTS_FOLDER / f"{role}.env"
        usage = f"`set -a; . {path.name}; set +a`, then `mint up --role {role}`"
        lines = [f"# MinT {role} host: {usage}"]
        lines += [f"{name}={shlex.quote(value)}" for name, value in env.items()]
        _write_private(path, "\n".join(lines) + "\n")
        written[role] = path
    return written


def read_env_file(path: Path) -> dict[str, str]:
    """The variables an env file `write_host_files` wrote sets (for tests and scripts)."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            env[name] = shlex.split(value)[0] if value else ""
    return env


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only from the first byte on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    path.chmod(0o600)  # one that existed keeps its mode through O_CREAT
