"""Who may do what in the registry: MLflow's own basic-auth app, with MinT's accounts.

`mint registry` and `mint up` run MLflow's basic-auth app (in MinT's MLflow app, `mint_mlflow`).
Every account may read (the auth app's default permission); only the pipeline's principal may
write: it holds MANAGE on every registered model and experiment (register, move aliases, set
`mint.*` tags). Workers read with an account of their own; auditors read in the UI. The admin
account only manages users. Clients pass MLflow's usual variables, `MLFLOW_TRACKING_USERNAME`
and `MLFLOW_TRACKING_PASSWORD` (`Account.env`). The worker account writes in one place: experiment
`FLEET`, where serving workers announce themselves (MINT_FLEET=registry); the server creates it
and grants that account EDIT on it alone.

Passwords are generated once per state dir and kept, readable by its owner only, in
`mlflow-accounts.json` beside MLflow's files (`RegistryAccounts.load_or_create`). The server
keeps only their hashes (a deliberately slow key derivation), and checks one against its hash
once per password and hash: `VerifiedCredentials` remembers a check that passed as an HMAC, so
later requests with the same credentials cost microseconds, not a key derivation each.
"""

import functools
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from mint_core.errors import ConfigurationError

ACCOUNTS_FILE = "mlflow-accounts.json"
"""The accounts of one registry, in the folder that holds its files."""
USERNAME_VARIABLE = "MLFLOW_TRACKING_USERNAME"
PASSWORD_VARIABLE = "MLFLOW_TRACKING_PASSWORD"
FLEET = "mint-fleet"
"""The experiment serving workers announce themselves in (`mint_core.registry.members`)."""
AUTH_VARIABLE = "MINT_MLFLOW_AUTH"
"""Set in an MLflow server's environment: MinT's MLflow app (`mint_mlflow`) puts MLflow's
basic-auth app in front, with the settings MLFLOW_AUTH_CONFIG_PATH names."""


class RegistryRole(StrEnum):
    ADMIN = "admin"
    """Manages users and permissions; not used by MinT's processes."""
    PIPELINE = "pipeline"
    """The release pipeline (flows, CLI): registers revisions, moves aliases, sets tags."""
    WORKER = "worker"
    """Serving workers: read the registry; write only their heartbeats (experiment `FLEET`)."""
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


class VerifiedCredentials:
    """Which (username, password, stored hash) triples passed the slow hash check, so the
    check runs once per triple, not once per request.

    An entry is an HMAC-SHA256 of the triple under a key drawn at random when the object is
    made (once per server process): neither the password nor anything an attacker could test
    guesses against offline without that key is kept. The stored hash is part of the triple,
    so a changed password (a new hash) misses at once and an old password fails its full
    check; a removed account has no stored hash and is never looked up here. A wrong password
    misses too and gets the full check, slow by design. At most `capacity` entries, the
    least recently used leaving first."""

    def __init__(self, check: Callable[[str, str], bool], capacity: int = 1024) -> None:
        """`check(stored_hash, password)`: the slow check (werkzeug's check_password_hash)."""
        self._check = check
        self._capacity = capacity
        self._key = secrets.token_bytes(32)
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # the server answers requests on several threads

    def _digest(self, username: str, password: str, stored_hash: str) -> bytes:
        # Length-prefixed fields: no two different triples join into the same message.
        message = b"".join(
            len(field).to_bytes(4, "big") + field
            for field in (f.encode() for f in (username, password, stored_hash))
        )
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def verify(self, username: str, password: str, stored_hash: str) -> bool:
        """Whether `password` is `username`'s, whose stored hash is `stored_hash` now."""
        digest = self._digest(username, password, stored_hash)
        with self._lock:
            if digest in self._verified:
                self._verified.move_to_end(digest)
                return True
        # Outside the lock: checks of other credentials go on meanwhile.
        if not self._check(stored_hash, password):
            return False
        with self._lock:
            self._verified[digest] = None
            while len(self._verified) > self._capacity:
                self._verified.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._verified)

    def entries(self) -> tuple[bytes, ...]:
        """What it holds: digests only (for tests that look for a password in it)."""
        with self._lock:
            return tuple(self._verified)


ACCESS_READS_S = 2.0
"""How long the registry server answers an account's or a grant's read from memory: a change
made through the server is seen at once; one made past it (another server on the same
database, a hand edit) within this bound."""
ACCESS_READS = frozenset({"get_user", "list_grants"})
"""The auth store's reads MLflow's checks repeat on every request (seven account reads and four
grant reads for one search of registered models): `RecentAccessReads` remembers them."""
ACCESS_WRITES = ("create_", "update_", "delete_", "grant_", "revoke_", "add_", "remove_", "set_")
"""Prefixes of the auth store's methods that change accounts, roles or permissions."""


class RecentAccessReads:
    """MLflow's auth store with its `ACCESS_READS` answered from memory for `ttl_s` seconds,
    forgotten at once when a write goes through it.

    MLflow's auth app reads the caller's account and grants from its database several times
    for every request (about 10 ms of a small read's 13 on two cores); an answer a couple of
    seconds old is as good for all but a change, and a change made through this server clears
    them. Every other attribute is the store's own."""

    def __init__(
        self,
        store: object,
        ttl_s: float = ACCESS_READS_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._clock = clock
        self._answers: dict[tuple[object, ...], tuple[float, object]] = {}
        self._lock = threading.Lock()  # the server answers requests on several threads

    def __getattr__(self, name: str) -> object:
        attribute = getattr(self._store, name)
        if name in ACCESS_READS:
            return functools.partial(self._read, name, attribute)
        if name.startswith(ACCESS_WRITES):
            return functools.partial(self._write, attribute)
        return attribute

    def _read(
        self, name: str, read: Callable[..., object], *args: object, **kwargs: object
    ) -> object:
        key = (name, *map(_hashable, args), *sorted(kwargs.items()))
        now = self._clock()
        with self._lock:
            kept = self._answers.get(key)
        if kept is not None and now - kept[0] < self._ttl_s:
            return kept[1]
        answer = read(*args, **kwargs)  # an error (no such account) is not remembered
        with self._lock:
            self._answers[key] = (now, answer)
        return answer

    def _write(self, write: Callable[..., object], *args: object, **kwargs: object) -> object:
        try:
            return write(*args, **kwargs)
        finally:
            with self._lock:
                self._answers.clear()


def _hashable(argument: object) -> object:
    """A read's argument as part of a key (`list_grants` takes a set of resource types)."""
    return frozenset(argument) if isinstance(argument, set | frozenset) else argument


AUTHORIZATION_FUNCTION = "mint_mlflow:authenticate_request"
"""MinT's authorization function for MLflow's basic-auth app (its `authorization_function`
setting): MLflow's check, with `VerifiedCredentials` in front of the slow hash."""
GRANTS_PATH = "/api/2.0/mint/registered-models/grants"
"""MinT's MLflow app: every account that may write a registered model (EDIT or MANAGE, however
granted), for callers that may manage it (`mint_core.registry.grants`)."""
ACCOUNTS_VARIABLE = "MINT_MLFLOW_ACCOUNTS"
"""Set in an MLflow server's environment: the JSON of the `RegistryAccounts` its auth app
creates before it answers its first request (`mint_mlflow`)."""


def auth_config(accounts: RegistryAccounts, database_uri: str) -> str:
    """The auth app's settings (the ini `MLFLOW_AUTH_CONFIG_PATH` names): every account reads,
    the admin is created with its password on the first start, and MinT's authorization
    function checks the credentials."""
    return (
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = {database_uri}\n"
        f"admin_username = {accounts.admin.username}\n"
        f"admin_password = {accounts.admin.password}\n"
        f"authorization_function = {AUTHORIZATION_FUNCTION}\n"
    )
