"""MintConfig's settings table: every field is one row (its variables, default and doc), the
environment gives each default when unset, and `to_env` gives back every field, none left out."""

import dataclasses
import socket
from pathlib import Path

import pytest

from mint_core.config import (
    SETTING,
    BackendKind,
    MintConfig,
    Setting,
    variable,
)
from mint_core.connections import ConnectionBounds
from mint_core.errors import ConfigurationError
from mint_core.exposure import TlsFiles
from mint_core.membership import FleetSource, FleetWatch
from mint_core.model.base import BaseSource
from mint_core.retraining import RetrainSchedule
from mint_core.revisions import RevisionId

CHANGED = MintConfig(
    home=Path("/srv/mint"),
    tracking_uri="https://mlflow.example:5443",
    worker_urls=("http://w1:8000", "http://w2:8000"),
    artifact_store="s3",
    s3_bucket="team",
    s3_prefix="",
    s3_endpoint_url="http://minio:9000",
    base=BaseSource("/models/base", "float16", "cpu"),
    retrain=(RetrainSchedule("support-bot", "/data/support.jsonl", "0 3 * * *"),),
    api_keys={"k1": "alice", "k2": "admin"},
    tenancy_file="/srv/mint/tenancy.json",
    tenancy_shares=2,
    device_slots=8,
    host_cache_mb=64,
    max_batch=4,
    admission_k=2,
    sync_interval_s=0.25,
    drain_timeout_s=12.5,
    alias_audit_interval_s=5.0,
    pins=(RevisionId("support-bot", 3),),
    worker_api_key="k2",
    backend=BackendKind.VLLM,
    host_adapters=16,
    replicas=2,
    hot_rate=5.0,
    worker_url="http://w1:8000",
    trainer_max_rank=32,
    trainer_models=2,
    trainer_queue=16,
    trainer_batch_tokens=4096,
    catalog_snapshots=5,
    max_lora_rank=64,
    vllm_python="/opt/vllm/bin/python",
    vllm_args=("--seed", "1 2"),
    admin_principals=("ops", "admin"),
    registry_retry_s=7.5,
    registry_db="sqlite:////srv/mint/mlflow.db",
    http_bounds=ConnectionBounds(keep_alive_s=2.5, head_s=4, body_s=30, connections=50),
    host="train-1",
    fleet=FleetWatch(FleetSource.REGISTRY, heartbeat_s=0.5, stale_s=2.5, forget_s=30),
    tls=TlsFiles("/etc/mint/tls.crt", "/etc/mint/tls.key"),
    train_address="10.0.0.5",
    train_pool="gpu-train",
    control_pool="ops",
)
"""Every field away from its default."""


def test_every_field_is_a_documented_row_of_the_table() -> None:
    for field in dataclasses.fields(MintConfig):
        setting = field.metadata[SETTING]
        assert isinstance(setting, Setting) and setting.env and setting.doc, field.name
        assert getattr(CHANGED, field.name) != getattr(MintConfig(), field.name), field.name
    names = [
        name for field in dataclasses.fields(MintConfig) for name in field.metadata[SETTING].env
    ]
    assert len(names) == len(set(names))


def test_unset_variables_give_the_defaults_and_to_env_gives_every_field_back() -> None:
    assert MintConfig.from_env({}) == dataclasses.replace(
        MintConfig(), home=Path(".mint").absolute()
    )
    assert MintConfig.from_env(CHANGED.to_env()) == CHANGED
    assert MintConfig.from_env(MintConfig().to_env()).home == Path(".mint").absolute()


@pytest.mark.parametrize(
    ("environ", "value"),
    [
        ({"MINT_DEVICE_SLOTS": " "}, ("device_slots", 64)),
        ({"MINT_BACKEND": ""}, ("backend", BackendKind.EMBEDDED)),
        ({"MINT_S3_PREFIX": ""}, ("s3_prefix", "")),
        ({"MINT_SYNC_INTERVAL_MS": "250"}, ("sync_interval_s", 0.25)),
        ({"MINT_WORKER_URLS": " http://a/, http://b ,"}, ("worker_urls", ("http://a", "http://b"))),
        ({"MINT_HTTP_BOUNDS": " head_s=3, "}, ("http_bounds", ConnectionBounds(head_s=3))),
        ({"MINT_HTTP_BOUNDS": ""}, ("http_bounds", ConnectionBounds())),
    ],
)
def test_a_variable_reads_as_its_row_says(
    environ: dict[str, str], value: tuple[str, object]
) -> None:
    name, expected = value
    assert getattr(MintConfig.from_env(environ), name) == expected


def test_a_bad_value_is_refused_naming_its_variable() -> None:
    with pytest.raises(ConfigurationError, match=r"MINT_MAX_BATCH='many' is not a whole number"):
        MintConfig.from_env({"MINT_MAX_BATCH": "many"})
    with pytest.raises(ConfigurationError, match=r"MINT_PINS entry 'bot@production' names an"):
        MintConfig.from_env({"MINT_PINS": "bot@production"})
    assert variable("sync_interval_s") == "MINT_SYNC_INTERVAL_MS"
    assert variable("base") == "MINT_BASE_MODEL"


@pytest.mark.parametrize("text", ["-1", "nan", "inf"])
def test_a_registry_wait_that_is_not_a_length_of_time_is_refused(text: str) -> None:
    with pytest.raises(ConfigurationError, match=f"MINT_REGISTRY_RETRY_S={text} must be 0 or"):
        MintConfig.from_env({"MINT_REGISTRY_RETRY_S": text})


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("head=3", "names 'head'; the bounds are keep_alive_s, head_s, body_s, connections"),
        ("body_s=soon", "has body_s='soon', which is not a number"),
        ("head_s=0", "has head_s=0; it must be a positive number of seconds"),
        ("keep_alive_s=inf", "has keep_alive_s=inf; it must be a positive"),
        ("connections=1.5", "has connections='1.5', which is not a number"),
        ("connections=0", "has connections=0; it must be at least 1"),
    ],
)
def test_connection_bounds_that_are_no_bounds_are_refused(text: str, refusal: str) -> None:
    with pytest.raises(ConfigurationError, match=f"MINT_HTTP_BOUNDS='{text}' {refusal}"):
        MintConfig.from_env({"MINT_HTTP_BOUNDS": text})


@pytest.mark.parametrize(
    ("environ", "refusal"),
    [
        ({"MINT_FLEET": "dns"}, "MINT_FLEET='dns' is not one of static, registry"),
        ({"MINT_HEARTBEAT_MS": "9000"}, "has heartbeat 9 s, stale after 8 s and forgotten"),
        ({"MINT_FLEET_FORGET_MS": "soon"}, "MINT_FLEET_FORGET_MS='soon' is not a whole"),
        ({"MINT_TLS_KEY": "/k.pem"}, "set both MINT_TLS_CERT and MINT_TLS_KEY"),
    ],
)
def test_a_fleet_watch_or_tls_pair_that_cannot_work_is_refused(
    environ: dict[str, str], refusal: str
) -> None:
    with pytest.raises(ConfigurationError, match=refusal):
        MintConfig.from_env(environ)


def test_the_host_name_is_the_machines_unless_set() -> None:
    assert MintConfig.from_env({"MINT_HOST": " serve-2 "}).host_name == "serve-2"
    assert MintConfig().host_name == socket.gethostname()
