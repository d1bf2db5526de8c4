"""MLflow's backend store, the database `mint registry` and `mint up` run MLflow on
(MINT_REGISTRY_DB): which ones MinT takes, and how a URI is named in messages."""

from urllib.parse import urlsplit

from mint_core.errors import ConfigurationError

REGISTRY_DB_SCHEMES = ("sqlite", "postgresql")
"""Databases MinT runs MLflow's backend store on (a `+driver` suffix is allowed)."""


def check_registry_db(uri: str) -> str:
    """`uri` if it names a database MLflow's backend store can run on here; else
    ConfigurationError naming it (its password hidden) and what to give instead."""
    scheme = urlsplit(uri).scheme.partition("+")[0]
    if scheme not in REGISTRY_DB_SCHEMES or "://" not in uri:
        raise ConfigurationError(
            f"registry database {without_password(uri)!r} is not a sqlite:// or postgresql:// "
            "URI; give MLflow's backend store as postgresql://user:password@host:port/database "
            "(or sqlite:///path/mlflow.db), or leave MINT_REGISTRY_DB unset for sqlite under "
            "MINT_HOME"
        )
    return uri


def without_password(uri: str) -> str:
    """`uri` with its password, if any, written `***`."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()
