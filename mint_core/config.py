"""MinT's typed configuration, read from the environment only at the edges (CLI, flow entry
points, server start) through `MintConfig.from_env`.

Every setting is written once, in `MintConfig`'s table: its environment variable, its default
and what it means (`setting(...)`); `from_env` and `to_env` are derived from that table. The
defaults of lower layers (engine slots, batch size, admission, sync interval) are these, and
the few defaults that are not settings (ports, timeouts, canary window) are named here too."""

import os
import shlex
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from mint_core.access import ADMIN, read_api_keys, show_api_keys
from mint_core.backend_store import check_registry_db
from mint_core.connections import ConnectionBounds
from mint_core.errors import ConfigurationError
from mint_core.exposure import TlsFiles
from mint_core.membership import FleetWatch
from mint_core.model.base import BaseSource
from mint_core.retraining import RetrainSchedule
from mint_core.revisions import RevisionId, parse_pins
from mint_core.settings import (
    SETTING,
    Setting,
    default_of,
    milliseconds,
    names,
    one_of,
    setting,
    settings_of,
    show_milliseconds,
    urls,
    variable_of,
    whole,
)

LOOPBACK = "127.0.0.1"
"""Where MinT's own services listen unless told otherwise."""
MLFLOW_PORT = 5000
"""Port of the MLflow server (`mint registry`, `mint up`)."""
PREFECT_PORT = 4200
"""Port of the Prefect server `mint up` starts."""
WORKER_PORT = 8000
"""Port of a serving worker (`mint serve`, `mint up`)."""
GATEWAY_PORT = 8080
"""Port of the gateway (`mint gateway`)."""
TRAINER_PORT = 8100
"""Port of the Tinker-compatible training service (`mint trainer`, `mint up`)."""
READY_TIMEOUT_S = 300.0
"""How long the pipeline waits for workers to report a revision ready (prewarm, repair)."""
MAX_PROMPTS = 64
"""Prompts in one `/v1/completions` request, at most: a worker refuses more, and the control
plane's client splits longer lists into requests of this many."""
CANARY_PERCENT = 10.0
"""Share of production's requests a canary answers, in percent."""
CANARY_WINDOW_S = 300.0
"""Seconds a canary is watched (longer, up to three windows, until it has its requests)."""
CANARY_MIN_REQUESTS = 50
"""Requests a canary must serve to be judged."""
DEFAULT_CATALOG_SNAPSHOTS = 3
"""Catalog snapshots kept in the artifact store (`MintConfig.catalog_snapshots`)."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM accepts."""


class BackendKind(StrEnum):
    """What runs the model behind a worker (`MINT_BACKEND`)."""

    EMBEDDED = "embedded"
    """MinT's own torch engine in the worker's process."""
    VLLM = "vllm"
    """A vLLM OpenAI server the worker starts and supervises."""


@dataclass(frozen=True)
class MintConfig:
    """Where MinT keeps state and which services it talks to: one row per setting."""

    home: Path = setting(
        "MINT_HOME",
        Path(".mint"),
        "State dir: base cache, frozen adapters, artifact store, MLflow's database.",
        parse=lambda text: Path(text).absolute(),
    )
    tracking_uri: str = setting(
        "MLFLOW_TRACKING_URI",
        f"http://{LOOPBACK}:{MLFLOW_PORT}",
        "MLflow tracking server, the registry of record.",
    )
    worker_urls: tuple[str, ...] = setting(
        "MINT_WORKER_URLS",
        (f"http://{LOOPBACK}:{WORKER_PORT}",),
        "Serving workers that must report a revision ready before it is activated "
        "(comma-separated); with MINT_FLEET=registry, only those that do not announce "
        "themselves (unset: none).",
        parse=urls,
        show=",".join,
    )
    artifact_store: str = setting(
        "MINT_ARTIFACT_STORE",
        "local",
        "Which artifact store exports go to: `local` (a folder under `home`) or `s3`.",
    )
    s3_bucket: str = setting(
        "MINT_S3_BUCKET", "", "Bucket of the S3 store; credentials come from boto3's usual chain."
    )
    s3_prefix: str = setting("MINT_S3_PREFIX", "mint", "Key prefix in the bucket.")
    s3_endpoint_url: str | None = setting(
        "MINT_S3_ENDPOINT_URL",
        None,
        "S3 API endpoint for non-AWS stores such as MinIO.",
        parse=lambda text: text or None,
        show=lambda url: url or "",
    )
    base: BaseSource = field(
        default=BaseSource(),
        metadata={
            SETTING: Setting(
                ("MINT_BASE_MODEL", "MINT_DTYPE", "MINT_DEVICE"),
                "The resident base model every adapter is trained on and served over: a model "
                "folder or a hub id in the local Hugging Face cache, unset for the embedded "
                "default; its dtype and device.",
                BaseSource,
                lambda base: (base.name, base.dtype, base.device),
            )
        },
    )
    retrain: tuple[RetrainSchedule, ...] = setting(
        "MINT_RETRAIN",
        (),
        "Scheduled retraining, served as Prefect deployments (see `RetrainSchedule.parse_all`).",
        parse=RetrainSchedule.parse_all,
        show=lambda schedules: ";".join(map(str, schedules)),
    )
    api_keys: Mapping[str, str] = field(
        default_factory=dict,
        metadata={
            SETTING: Setting(
                ("MINT_API_KEYS", "MINT_API_KEYS_FILE"),
                "Worker API keys -> principals (`key=principal,...`, and/or a file holding a "
                "JSON object). Never hard-coded.",
                read_api_keys,
                show_api_keys,
            )
        },
    )
    tenancy_file: str = setting(
        "MINT_TENANCY_FILE",
        "",
        "Each principal's weight and quota on a shared fleet, a JSON file (README, \"Teams "
        'sharing a fleet"), read again when it changes. Unset: equal weights, no quotas.',
    )
    tenancy_shares: int = setting(
        "MINT_TENANCY_SHARES",
        1,
        "Services enforcing each quota side by side (gateways behind a balancer), each 1/N.",
        parse=whole,
        blank_is_default=True,
    )
    device_slots: int = setting(
        "MINT_DEVICE_SLOTS",
        64,
        "Adapters a worker holds beside the base at once.",
        parse=whole,
        blank_is_default=True,
    )
    host_cache_mb: int = setting(
        "MINT_HOST_CACHE_MB",
        1024,
        "Host memory for verified adapter weights, in MiB; a revision is ready on a worker "
        "only while it is in this cache.",
        parse=whole,
        blank_is_default=True,
    )
    max_batch: int = setting(
        "MINT_MAX_BATCH",
        64,
        "Most sequences a worker decodes in one step.",
        parse=whole,
        blank_is_default=True,
    )
    admission_k: int = setting(
        "MINT_ADMISSION_K",
        1,
        "Revisions a worker prewarms at once; the rest queue.",
        parse=whole,
        blank_is_default=True,
    )
    sync_interval_s: float = setting(
        "MINT_SYNC_INTERVAL_MS",
        1.0,
        "How often a worker (and a gateway) catches up with the registry, in seconds (the "
        "variable: milliseconds); activation also nudges every worker to sync at once.",
        parse=milliseconds,
        show=show_milliseconds,
        blank_is_default=True,
    )
    drain_timeout_s: float = setting(
        "MINT_DRAIN_TIMEOUT_MS",
        30.0,
        "How long a worker told to stop (SIGTERM, Ctrl-C) keeps serving the requests it has, in "
        "seconds (the variable: milliseconds): it says it is leaving, gateways stop sending to "
        "it, and it exits once they are done; past this it exits anyway, cutting what is left.",
        parse=milliseconds,
        show=show_milliseconds,
        blank_is_default=True,
    )
    alias_audit_interval_s: float = setting(
        "MINT_ALIAS_AUDIT_INTERVAL_MS",
        30.0,
        "How often a worker reads every adapter's aliases, changed or not, in seconds (the "
        "variable: milliseconds): an alias moved outside the pipeline (the MLflow UI) leaves "
        "no other trace a sync finds, and is reported within this time.",
        parse=milliseconds,
        show=show_milliseconds,
        blank_is_default=True,
    )
    pins: tuple[RevisionId, ...] = setting(
        "MINT_PINS",
        (),
        "Revisions every worker holds whatever the aliases say (`name:rN,...`).",
        parse=parse_pins,
        show=lambda pins: ",".join(map(str, pins)),
    )
    worker_api_key: str = setting(
        "MINT_WORKER_API_KEY",
        "",
        "The key the pipeline presents to workers' admin endpoints; with `api_keys`, its "
        "principal must be one of `admin_principals`.",
    )
    backend: BackendKind = setting(
        "MINT_BACKEND",
        BackendKind.EMBEDDED,
        "What runs the model behind a worker: embedded or vllm.",
        parse=one_of(BackendKind),
        blank_is_default=True,
    )
    host_adapters: int = setting(
        "MINT_HOST_ADAPTERS",
        256,
        "Most revisions a worker's host tier holds, whatever their size, on either backend, "
        "besides `host_cache_mb`; a vLLM worker's `--max-cpu-loras`.",
        parse=whole,
        blank_is_default=True,
    )
    replicas: int = setting(
        "MINT_REPLICAS",
        1,
        "Workers of its base that hold each revision (its placement, by rendezvous hashing "
        "over the live workers), unless the adapter's gates say otherwise (`mint gates "
        "--replicas`); hot revisions get more.",
        parse=whole,
        blank_is_default=True,
    )
    hot_rate: float = setting(
        "MINT_HOT_RATE",
        20.0,
        "Requests per second per replica above which a revision gets another replica (the "
        "gateway's count); it gives it up again below half that.",
        parse=float,
        blank_is_default=True,
    )
    worker_url: str = setting(
        "MINT_WORKER_URL",
        "",
        "A worker's own URL as MINT_WORKER_URLS names it, for placement (unset: "
        "http://127.0.0.1:<its port>). A worker's peers are the other URLs there.",
        parse=lambda text: text.strip().rstrip("/"),
    )
    trainer_max_rank: int = setting(
        "MINT_TRAINER_MAX_RANK",
        64,
        "`mint trainer`: the highest LoRA rank a tenant may create (its adapter and AdamW state "
        "grow with it).",
        parse=whole,
        blank_is_default=True,
    )
    trainer_models: int = setting(
        "MINT_TRAINER_MODELS",
        8,
        "`mint trainer`: training models one principal may hold at once.",
        parse=whole,
        blank_is_default=True,
    )
    trainer_queue: int = setting(
        "MINT_TRAINER_QUEUE",
        64,
        "`mint trainer`: requests one training model may have waiting; more are answered 429 "
        "(the SDK waits and sends them again).",
        parse=whole,
        blank_is_default=True,
    )
    trainer_batch_tokens: int = setting(
        "MINT_TRAINER_BATCH_TOKENS",
        8192,
        "`mint trainer`: tokens (rows x longest row) in one forward/backward pass over the "
        "base; the tenants' rows waiting are batched up to this, a longer request is split.",
        parse=whole,
        blank_is_default=True,
    )
    catalog_snapshots: int = setting(
        "MINT_CATALOG_SNAPSHOTS",
        DEFAULT_CATALOG_SNAPSHOTS,
        "Catalog snapshots kept in the artifact store: publishing one removes all but the "
        "newest this many (about 1 GB each at a million revisions). The current one is always "
        "kept, and more than one lets a worker that read the manifest just before a publish "
        "still fetch the snapshot it names.",
        parse=whole,
        blank_is_default=True,
    )
    max_lora_rank: int = setting(
        "MINT_MAX_LORA_RANK",
        16,
        "Highest adapter rank a vLLM worker takes (one of vLLM's `--max-lora-rank` values); a "
        "revision of higher rank ends `failed` there.",
        parse=whole,
        blank_is_default=True,
    )
    vllm_python: str = setting(
        "MINT_VLLM_PYTHON",
        "",
        "The Python of vLLM's own environment (default: `.venv-vllm` beside MinT's sources, "
        "which `make vllm` builds).",
    )
    vllm_args: tuple[str, ...] = setting(
        "MINT_VLLM_ARGS",
        (),
        "More arguments for the vLLM server (shell words), e.g. `--tensor-parallel-size 2 "
        "--gpu-memory-utilization 0.85` on GPUs.",
        parse=lambda text: tuple(shlex.split(text)),
        show=shlex.join,
    )
    admin_principals: tuple[str, ...] = setting(
        "MINT_ADMIN_PRINCIPALS",
        (ADMIN,),
        "Principals a worker with `api_keys` lets use its admin endpoints (`/admin/...`: "
        "admit, sync, events) and see every revision in `/v1/adapters/{name}` "
        "(comma-separated). A worker without keys leaves all of that open.",
        parse=lambda text: names(text) or (ADMIN,),  # "," names nobody: the default
        show=",".join,
        blank_is_default=True,
    )
    registry_retry_s: float = setting(
        "MINT_REGISTRY_RETRY_S",
        120.0,
        "How long a command that runs the pipeline (`mint release`, `promote`, ..., `mint flows "
        "serve`'s runs) waits out an MLflow that does not answer before it fails, in seconds; "
        "it says so on the terminal when it starts waiting. 0: fail at once. Workers never "
        "wait: they serve what their catalog holds.",
        parse=float,
        blank_is_default=True,
    )
    registry_db: str = setting(
        "MINT_REGISTRY_DB",
        "",
        "MLflow's backend store for `mint registry` and `mint up`: a "
        "`postgresql://user:password@host:port/database` URI, or `sqlite:///path`; unset, a "
        "sqlite file under `home`.",
    )
    http_bounds: ConnectionBounds = setting(
        "MINT_HTTP_BOUNDS",
        ConnectionBounds(),
        "How long a worker's, gateway's or trainer's connection may wait to send its request's "
        "head and body, or stay idle, and how many connections each takes (`ConnectionBounds`).",
        parse=ConnectionBounds.parse,
        blank_is_default=True,
    )

    host: str = setting(
        "MINT_HOST",
        "",
        "This host's name in flow runs, MLflow runs and the fleet's roster (unset: the "
        "machine's hostname).",
        parse=str.strip,
    )
    fleet: FleetWatch = field(
        default=FleetWatch(),
        metadata={
            SETTING: Setting(
                ("MINT_FLEET", "MINT_HEARTBEAT_MS", "MINT_FLEET_STALE_MS", "MINT_FLEET_FORGET_MS"),
                "Where the fleet's workers are found: `static` (MINT_WORKER_URLS) or `registry` "
                "(also every worker announcing itself in MLflow); how often a worker announces "
                "itself, and after how long (ms) a silent one is left out and forgotten.",
                FleetWatch.parse,
                FleetWatch.texts,
                blank_is_default=True,
            )
        },
    )
    tls: TlsFiles = field(
        default=TlsFiles(),
        metadata={
            SETTING: Setting(
                ("MINT_TLS_CERT", "MINT_TLS_KEY"),
                "PEM certificate and key a worker, gateway or trainer serves HTTPS with (both or "
                "neither; clients trust a private CA through SSL_CERT_FILE).",
                TlsFiles,
                lambda tls: (tls.cert, tls.key),
            )
        },
    )
    train_address: str = setting(
        "MINT_TRAIN_ADDRESS",
        "",
        "The address other train hosts reach this one at: node 0 of a training launch on "
        "several hosts (`--nnodes`) listens there (`mint up --role train --host` sets it).",
        parse=str.strip,
    )
    train_pool: str = setting(
        "MINT_TRAIN_POOL",
        "mint-train",
        "The Prefect work pool of the flows that train (release, import, retrain, rl).",
        blank_is_default=True,
    )
    control_pool: str = setting(
        "MINT_CONTROL_POOL",
        "mint-control",
        "The Prefect work pool of the other flows (promote, rollback, canary, repair, ...).",
        blank_is_default=True,
    )

    def __post_init__(self) -> None:
        if self.registry_db:
            check_registry_db(self.registry_db)
        if self.sync_interval_s <= 0:
            raise ConfigurationError(f"sync_interval_s={self.sync_interval_s} must be positive")
        if self.drain_timeout_s < 0:
            raise ConfigurationError(f"drain_timeout_s={self.drain_timeout_s} must be 0 or more")
        if self.alias_audit_interval_s <= 0:
            raise ConfigurationError(
                f"{variable('alias_audit_interval_s')}={self.alias_audit_interval_s * 1000:g} "
                "must be positive"
            )
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigurationError(
                f"{variable('max_lora_rank')}={self.max_lora_rank} is not one of vLLM's ranks "
                f"{', '.join(map(str, VLLM_LORA_RANKS))}; pick the smallest that covers your "
                "adapters"
            )
        for name in (
            "device_slots", "host_cache_mb", "host_adapters", "max_batch", "admission_k",
            "catalog_snapshots", "replicas", "trainer_max_rank", "trainer_models",
            "trainer_queue", "trainer_batch_tokens", "tenancy_shares",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name}={getattr(self, name)} must be at least 1")
        if not 0 <= self.registry_retry_s < float("inf"):
            raise ConfigurationError(
                f"{variable('registry_retry_s')}={self.registry_retry_s:g} must be 0 or more "
                "seconds (0: fail at once when MLflow does not answer)"
            )
        if self.hot_rate <= 0:
            raise ConfigurationError(
                f"{variable('hot_rate')}={self.hot_rate:g} must be positive (requests per second)"
            )
        if self.worker_url and not self.worker_url.startswith(("http://", "https://")):
            raise ConfigurationError(
                f"{variable('worker_url')}={self.worker_url!r} must start with http:// or https://"
            )
        if not self.admin_principals:
            raise ConfigurationError(
                "admin_principals is empty; name at least one "
                f"({variable('admin_principals')}), or the pipeline cannot admit revisions on "
                "workers that have API keys"
            )
        if not self.worker_urls:
            raise ConfigurationError("worker_urls is empty; name at least one serving worker")
        for url in (self.tracking_uri, *self.worker_urls):
            if not url.startswith(("http://", "https://")):
                raise ConfigurationError(f"service URL {url!r} must start with http:// or https://")
        if self.artifact_store == "s3" and not self.s3_bucket:
            raise ConfigurationError(
                f"{variable('artifact_store')}=s3 needs a bucket: set {variable('s3_bucket')} "
                f"(and {variable('s3_endpoint_url')} for a store other than AWS)"
            )

    @property
    def host_name(self) -> str:
        """This host's name: MINT_HOST, else the machine's hostname."""
        return self.host or socket.gethostname()

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
        """The configuration `environ` (default: this process's environment) sets; each
        variable left unset (or, for numbers and names, blank) gives its field's default."""
        env = os.environ if environ is None else environ
        return cls(**{f.name: entry.read(env, default_of(f)) for f, entry in settings_of(cls)})

    def to_env(self) -> dict[str, str]:
        """The environment that makes `from_env` give this configuration back (for child
        processes: workers, flow runs)."""
        variables: dict[str, str] = {}
        for f, entry in settings_of(MintConfig):
            variables |= entry.write(getattr(self, f.name))
        return variables


def variable(name: str) -> str:
    """The environment variable that sets `MintConfig` field `name` (its first, where several
    do), for messages that tell which one to change."""
    return variable_of(MintConfig, name)
