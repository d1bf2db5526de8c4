"""Who may use a revision: API keys name principals, policy records list allowed principals.

A request without a key is the `anonymous` principal; a policy record that lists `*` allows
everyone, anonymous included. Refusals name only the adapter asked for, never others. Admin
principals (`MINT_ADMIN_PRINCIPALS`) may also queue prewarms, sync and read every revision's
readiness on a worker; the pipeline presents an admin key.
"""

import json
from collections.abc import Collection, Mapping
from pathlib import Path

from mint_core.errors import AccessDeniedError, AuthenticationError, ConfigurationError
from mint_core.revisions import PolicyRecord, RevisionId

ANONYMOUS = "anonymous"
EVERYONE = "*"
ADMIN = "admin"
"""The admin principal when `MINT_ADMIN_PRINCIPALS` names none."""


def parse_api_keys(text: str) -> dict[str, str]:
    """`key=principal,key=principal` -> {key: principal}."""
    keys: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, principal = item.partition("=")
        if not key.strip() or not principal.strip():
            raise ConfigurationError(
                f"API key entry {item.split('=')[0][:4]}... is not 'key=principal'; write "
                "MINT_API_KEYS as 'key1=alice,key2=bob'"
            )
        keys[key.strip()] = principal.strip()
    return keys


def read_api_keys(text: str, path: str) -> dict[str, str]:
    """The keys MINT_API_KEYS (`text`) names and MINT_API_KEYS_FILE (`path`, a JSON object of
    key -> principal) adds."""
    keys = parse_api_keys(text)
    if path:
        try:
            keys.update(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise ConfigurationError(
                f"MINT_API_KEYS_FILE={path} is not a readable JSON object of key -> principal: {e}"
            ) from e
    return keys


def show_api_keys(keys: Mapping[str, str]) -> tuple[str, str]:
    """The MINT_API_KEYS and MINT_API_KEYS_FILE texts `read_api_keys` gives `keys` back from."""
    # The keys a file added are written out with the others: the file is read once.
    return ",".join(f"{key}={who}" for key, who in keys.items()), ""


def principal_for(api_keys: Mapping[str, str], key: str | None) -> str:
    """The principal an API key names; `anonymous` without one."""
    if key is None:
        return ANONYMOUS
    try:
        return api_keys[key]
    except KeyError:
        raise AuthenticationError("the API key is not known to this worker") from None


def principal_of_header(api_keys: Mapping[str, str], authorization: str | None) -> str:
    """The principal an `Authorization: Bearer <key>` header names; `anonymous` without the
    header, or where there are no keys (everyone is anonymous, the header ignored)."""
    if not api_keys or authorization is None:
        return ANONYMOUS
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthenticationError("send the API key as 'Authorization: Bearer <key>'")
    return principal_for(api_keys, key.strip())


def allows(policy: PolicyRecord, principal: str) -> bool:
    return EVERYONE in policy.principals or principal in policy.principals


def check_access(policy: PolicyRecord, principal: str, revision: RevisionId) -> None:
    if not allows(policy, principal):
        raise AccessDeniedError(f"principal {principal!r} may not use adapter {revision.adapter!r}")


def check_admin(principal: str, admins: Collection[str]) -> None:
    if principal not in admins:
        raise AccessDeniedError(
            f"principal {principal!r} is not an admin of this worker; use a key whose principal "
            "is in the worker's MINT_ADMIN_PRINCIPALS"
        )
