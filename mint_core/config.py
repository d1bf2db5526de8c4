"""MinT's typed configuration, read from the environment only at the edges (CLI, flow entry
points, server start) through `MintConfig.from_env`."""

import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

from mint_core.access import ADMIN, parse_api_keys
from mint_core.errors import ConfigurationError
from mint_core.model.base import BaseSource
from mint_core.revisions import RevisionId, RevisionRef

DEFAULT_TRACKING_URI = "http://127.0.0.1:5000"
DEFAULT_WORKER_URL = "http://127.0.0.1:8000"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM accepts."""
DEFAULT_CATALOG_SNAPSHOTS = 3
"""Catalog snapshots kept in the artifact store (`MINT_CATALOG_SNAPSHOTS`)."""
REGISTRY_DB_SCHEMES = ("sqlite", "postgresql")
"""Databases MinT runs MLflow's backend store on (a `+driver` suffix is allowed)."""


class BackendKind(StrEnum):
    """What runs the model behind a worker (`MINT_BACKEND`)."""

    EMBEDDED = "embedded"
    """MinT's own torch engine in the worker's process."""
    VLLM = "vllm"
    """A vLLM OpenAI server the worker starts and supervises."""


@dataclass(frozen=True)
class RetrainSchedule:
    """Retrain `adapter` on the data at `data` (a path or s3:// URI, read afresh at each run) on
    a cron schedule (a Prefect deployment serves it)."""

    adapter: str
    data: str
    cron: str

    def __str__(self) -> str:
        return f"{self.adapter}|{self.data}|{self.cron}"

    @classmethod
    def parse_all(cls, text: str) -> tuple["RetrainSchedule", ...]:
        """`adapter|data|cron` entries separated by `;`, e.g.
        `support-bot|s3://team/support.jsonl|0 3 * * *;faq-bot|/data/faq.jsonl|30 3 * * 1`."""
        schedules = []
        for entry in filter(None, (part.strip() for part in text.split(";"))):
            parts = [part.strip() for part in entry.split("|")]
            if len(parts) != 3 or not all(parts) or len(parts[2].split()) != 5:
                raise ConfigurationError(
                    f"retrain schedule {entry!r} is not 'adapter|data file|<cron with 5 "
                    "fields>', e.g. 'support-bot|/data/support.jsonl|0 3 * * *'"
                )
            schedules.append(cls(*parts))
        return tuple(schedules)


@dataclass(frozen=True)
class MintConfig:
    """Where MinT keeps state and which services it talks to."""

    home: Path = Path(".mint")
    """State dir: base cache, frozen adapters, artifact store, MLflow's database (`MINT_HOME`)."""
    tracking_uri: str = DEFAULT_TRACKING_URI
    """MLflow tracking server, the registry of record (`MLFLOW_TRACKING_URI`)."""
    worker_urls: tuple[str, ...] = (DEFAULT_WORKER_URL,)
    """Serving workers that must report a revision ready before it is activated
    (`MINT_WORKER_URLS`, comma-separated)."""
    artifact_store: str = "local"
    """Which artifact store exports go to: `local` (a folder under `home`) or `s3`
    (`MINT_ARTIFACT_STORE`)."""
    s3_bucket: str = ""
    """Bucket of the S3 store (`MINT_S3_BUCKET`); credentials come from boto3's usual chain."""
    s3_prefix: str = "mint"
    """Key prefix in the bucket (`MINT_S3_PREFIX`)."""
    s3_endpoint_url: str | None = None
    """S3 API endpoint for non-AWS stores such as MinIO (`MINT_S3_ENDPOINT_URL`)."""
    base: BaseSource = field(default_factory=BaseSource)
    """The resident base model every adapter is trained on and served over (`MINT_BASE_MODEL`:
    a model folder or a hub id in the local Hugging Face cache, unset for the embedded default;
    `MINT_DTYPE`, `MINT_DEVICE`)."""
    retrain: tuple[RetrainSchedule, ...] = ()
    """Scheduled retraining, served as Prefect deployments (`MINT_RETRAIN`, see
    `RetrainSchedule.parse_all`)."""
    api_keys: Mapping[str, str] = field(default_factory=dict)
    """Worker API keys -> principals (`MINT_API_KEYS` as `key=principal,...`, or
    `MINT_API_KEYS_FILE`, a JSON object). Never hard-coded."""
    device_slots: int = 64
    """Adapters a worker holds beside the base at once (`MINT_DEVICE_SLOTS`)."""
    host_cache_mb: int = 1024
    """Host memory for verified adapter weights, in MiB (`MINT_HOST_CACHE_MB`); a revision is
    ready on a worker only while it is in this cache."""
    max_batch: int = 64
    """Most sequences a worker decodes in one step (`MINT_MAX_BATCH`)."""
    admission_k: int = 1
    """Revisions a worker prewarms at once (`MINT_ADMISSION_K`); the rest queue."""
    sync_interval_s: float = 1.0
    """How often a worker catches up with the registry (`MINT_SYNC_INTERVAL_MS`); activation
    also nudges every worker to sync at once."""
    alias_audit_interval_s: float = 30.0
    """How often a worker reads every adapter's aliases, changed or not
    (`MINT_ALIAS_AUDIT_INTERVAL_MS`): an alias moved outside the pipeline (the MLflow UI)
    leaves no other trace a sync finds, and is reported within this time."""
    pins: tuple[RevisionId, ...] = ()
    """Revisions every worker holds whatever the aliases say (`MINT_PINS`, `name:rN,...`)."""
    worker_api_key: str = ""
    """The key the pipeline presents to workers' admin endpoints (`MINT_WORKER_API_KEY`); with
    `api_keys`, its principal must be one of `admin_principals`."""
    backend: BackendKind = BackendKind.EMBEDDED
    """What runs the model behind a worker (`MINT_BACKEND`: embedded or vllm)."""
    host_adapters: int = 256
    """Most revisions a worker's host tier holds, whatever their size (`MINT_HOST_ADAPTERS`),
    on either backend, besides `host_cache_mb`; a vLLM worker's `--max-cpu-loras`."""
    catalog_snapshots: int = DEFAULT_CATALOG_SNAPSHOTS
    """Catalog snapshots kept in the artifact store (`MINT_CATALOG_SNAPSHOTS`): publishing one
    removes all but the newest this many (about 1 GB each at a million revisions). The current
    one is always kept, and more than one lets a worker that read the manifest just before a
    publish still fetch the snapshot it names."""
    max_lora_rank: int = 16
    """Highest adapter rank a vLLM worker takes (`MINT_MAX_LORA_RANK`, one of vLLM's
    `--max-lora-rank` values); a revision of higher rank ends `failed` there."""
    vllm_python: str = ""
    """The Python of vLLM's own environment (`MINT_VLLM_PYTHON`; default: `.venv-vllm` beside
    MinT's sources, which `make vllm` builds)."""
    vllm_args: tuple[str, ...] = ()
    """More arguments for the vLLM server (`MINT_VLLM_ARGS`, shell words), e.g.
    `--tensor-parallel-size 2 --gpu-memory-utilization 0.85` on GPUs."""
    admin_principals: tuple[str, ...] = (ADMIN,)
    """Principals a worker with `api_keys` lets use its admin endpoints (`/admin/...`: admit,
    sync, events) and see every revision in `/v1/adapters/{name}` (`MINT_ADMIN_PRINCIPALS`,
    comma-separated; default `admin`). A worker without keys leaves all of that open."""
    registry_db: str = ""
    """MLflow's backend store for `mint registry` and `mint up` (`MINT_REGISTRY_DB`): a
    `postgresql://user:password@host:port/database` URI, or `sqlite:///path`; unset, a sqlite
    file under `home`."""

    def __post_init__(self) -> None:
        if self.registry_db:
            check_registry_db(self.registry_db)
        if self.sync_interval_s <= 0:
            raise ConfigurationError(f"sync_interval_s={self.sync_interval_s} must be positive")
        if self.alias_audit_interval_s <= 0:
            raise ConfigurationError(
                f"MINT_ALIAS_AUDIT_INTERVAL_MS={self.alias_audit_interval_s * 1000:g} must be "
                "positive"
            )
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigurationError(
                f"MINT_MAX_LORA_RANK={self.max_lora_rank} is not one of vLLM's ranks "
                f"{', '.join(map(str, VLLM_LORA_RANKS))}; pick the smallest that covers your "
                "adapters"
            )
        for name in (
            "device_slots",
            "host_cache_mb",
            "host_adapters",
            "max_batch",
            "admission_k",
            "catalog_snapshots",
        ):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name}={getattr(self, name)} must be at least 1")
        if not self.admin_principals:
            raise ConfigurationError(
                "admin_principals is empty; name at least one (MINT_ADMIN_PRINCIPALS), or the "
                "pipeline cannot admit revisions on workers that have API keys"
            )
        if not self.worker_urls:
            raise ConfigurationError("worker_urls is empty; name at least one serving worker")
        for url in (self.tracking_uri, *self.worker_urls):
            if not url.startswith(("http://", "https://")):
                raise ConfigurationError(f"service URL {url!r} must start with http:// or https://")
        if self.artifact_store == "s3" and not self.s3_bucket:
            raise ConfigurationError(
                "MINT_ARTIFACT_STORE=s3 needs a bucket: set MINT_S3_BUCKET (and "
                "MINT_S3_ENDPOINT_URL for a store other than AWS)"
            )

    @property
    def artifact_root(self) -> Path:
        return self.home / "artifacts"

    @property
    def frozen_root(self) -> Path:
        return self.home / "frozen"

    @property
    def work_root(self) -> Path:
        """Scratch space for training output and packing before export."""
        return self.home / "work"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "MintConfig":
        env = os.environ if environ is None else environ
        workers = env.get("MINT_WORKER_URLS", DEFAULT_WORKER_URL)
        return cls(
            home=Path(env.get("MINT_HOME", ".mint")).absolute(),
            tracking_uri=env.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI),
            worker_urls=tuple(url.strip().rstrip("/") for url in workers.split(",") if url.strip()),
            artifact_store=env.get("MINT_ARTIFACT_STORE", "local"),
            s3_bucket=env.get("MINT_S3_BUCKET", ""),
            s3_prefix=env.get("MINT_S3_PREFIX", "mint"),
            s3_endpoint_url=env.get("MINT_S3_ENDPOINT_URL") or None,
            base=BaseSource(
                env.get("MINT_BASE_MODEL", ""),
                env.get("MINT_DTYPE", ""),
                env.get("MINT_DEVICE", ""),
            ),
            retrain=RetrainSchedule.parse_all(env.get("MINT_RETRAIN", "")),
            api_keys=_api_keys(env),
            device_slots=_integer(env, "MINT_DEVICE_SLOTS", 64),
            host_cache_mb=_integer(env, "MINT_HOST_CACHE_MB", 1024),
            max_batch=_integer(env, "MINT_MAX_BATCH", 64),
            admission_k=_integer(env, "MINT_ADMISSION_K", 1),
            sync_interval_s=float(_integer(env, "MINT_SYNC_INTERVAL_MS", 1000)) / 1000,
            alias_audit_interval_s=_integer(env, "MINT_ALIAS_AUDIT_INTERVAL_MS", 30_000) / 1000,
            pins=tuple(_pin(text) for text in env.get("MINT_PINS", "").split(",") if text.strip()),
            worker_api_key=env.get("MINT_WORKER_API_KEY", ""),
            admin_principals=_names(env.get("MINT_ADMIN_PRINCIPALS", "")) or (ADMIN,),
            backend=_backend(env.get("MINT_BACKEND", "") or BackendKind.EMBEDDED),
            host_adapters=_integer(env, "MINT_HOST_ADAPTERS", 256),
            catalog_snapshots=_integer(env, "MINT_CATALOG_SNAPSHOTS", DEFAULT_CATALOG_SNAPSHOTS),
            max_lora_rank=_integer(env, "MINT_MAX_LORA_RANK", 16),
            vllm_python=env.get("MINT_VLLM_PYTHON", ""),
            vllm_args=tuple(shlex.split(env.get("MINT_VLLM_ARGS", ""))),
            registry_db=env.get("MINT_REGISTRY_DB", ""),
        )

    def to_env(self) -> dict[str, str]:
        """The environment that makes `from_env` give this configuration back (for child
        processes: workers, flow runs)."""
        return {
            "MINT_HOME": str(self.home),
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "MINT_WORKER_URLS": ",".join(self.worker_urls),
            "MINT_ARTIFACT_STORE": self.artifact_store,
            "MINT_S3_BUCKET": self.s3_bucket,
            "MINT_S3_PREFIX": self.s3_prefix,
            "MINT_S3_ENDPOINT_URL": self.s3_endpoint_url or "",
            "MINT_BASE_MODEL": self.base.name,
            "MINT_DTYPE": self.base.dtype,
            "MINT_DEVICE": self.base.device,
            "MINT_RETRAIN": ";".join(str(r) for r in self.retrain),
            "MINT_API_KEYS": ",".join(f"{key}={who}" for key, who in self.api_keys.items()),
            "MINT_DEVICE_SLOTS": str(self.device_slots),
            "MINT_HOST_CACHE_MB": str(self.host_cache_mb),
            "MINT_MAX_BATCH": str(self.max_batch),
            "MINT_ADMISSION_K": str(self.admission_k),
            "MINT_SYNC_INTERVAL_MS": str(round(self.sync_interval_s * 1000)),
            "MINT_ALIAS_AUDIT_INTERVAL_MS": str(round(self.alias_audit_interval_s * 1000)),
            "MINT_PINS": ",".join(str(pin) for pin in self.pins),
            "MINT_WORKER_API_KEY": self.worker_api_key,
            "MINT_ADMIN_PRINCIPALS": ",".join(self.admin_principals),
            "MINT_BACKEND": self.backend,
            "MINT_HOST_ADAPTERS": str(self.host_adapters),
            "MINT_MAX_LORA_RANK": str(self.max_lora_rank),
            "MINT_VLLM_PYTHON": self.vllm_python,
            "MINT_VLLM_ARGS": shlex.join(self.vllm_args),
            "MINT_REGISTRY_DB": self.registry_db,
        }


def check_registry_db(uri: str) -> str:
    """`uri` if it names a database MLflow's backend store can run on here; else
    ConfigurationError naming it (its password hidden) and what to give instead."""
    scheme = urlsplit(uri).scheme.partition("+")[0]
    if scheme not in REGISTRY_DB_SCHEMES or "://" not in uri:
        raise ConfigurationError(
            f"registry database {_without_password(uri)!r} is not a sqlite:// or postgresql:// "
            "URI; give MLflow's backend store as postgresql://user:password@host:port/database "
            "(or sqlite:///path/mlflow.db), or leave MINT_REGISTRY_DB unset for sqlite under "
            "MINT_HOME"
        )
    return uri


def _without_password(uri: str) -> str:
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


def _api_keys(env: Mapping[str, str]) -> dict[str, str]:
    keys = parse_api_keys(env.get("MINT_API_KEYS", ""))
    if path := env.get("MINT_API_KEYS_FILE"):
        try:
            keys.update(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise ConfigurationError(
                f"MINT_API_KEYS_FILE={path} is not a readable JSON object of key -> principal: {e}"
            ) from e
    return keys


def _backend(text: str) -> BackendKind:
    try:
        return BackendKind(text.strip().lower())
    except ValueError:
        choices = ", ".join(BackendKind)
        raise ConfigurationError(f"MINT_BACKEND={text!r} is not one of {choices}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _integer(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "")
    if not text.strip():
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigurationError(f"{name}={text!r} is not a whole number") from None


def _pin(text: str) -> RevisionId:
    ref = RevisionRef.parse(text.strip())
    if ref.revision is None:
        raise ConfigurationError(
            f"MINT_PINS entry {text.strip()!r} names an alias; pin exact revisions, 'name:rN'"
        )
    return RevisionId(ref.adapter, ref.revision)
