"""The cluster harness itself (about 5 s): hosts reach each other over the bridge, a cut host
is silent (connects time out, no RST) until it rejoins, the relay adds its delay, a killed host
runs nothing, and nothing is left once the cluster is closed or its run was killed. Then the
roles booted in their hosts (the lane's shared cluster)."""

import base64
import json
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from control.credentials import SECRETS_FILE
from tests.cluster import netns, roles

DELAY_MS = 40
REQUESTS = 12


def _load(cluster: netns.Cluster, url: str, *options: str) -> list[dict[str, object]]:
    done = cluster.call(
        "client", [sys.executable, "-m", "tests.cluster.load", "--url", url, *options]
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _p50(records: list[dict[str, object]]) -> float:
    assert all(r["status"] == 200 for r in records), records
    return statistics.median(float(r["t_end"]) - float(r["t_start"]) for r in records)  # type: ignore[arg-type]


def test_cut_rejoin_relay_and_teardown(small_cluster: netns.Cluster, tmp_path: Path) -> None:
    cluster = small_cluster
    server = cluster.host("server").address
    direct, relayed = f"http://{server}:8000/", f"http://{server}:8001/"
    cluster.run("server", "http", [sys.executable, "-m", "http.server", "--bind", server, "8000"],
                url=direct, health="", cwd=tmp_path)  # fmt: skip
    delay_file = tmp_path / "delay_ms"
    delay_file.write_text(str(DELAY_MS))
    relay = [sys.executable, "-m", "tests.cluster.relay", "--listen", f"{server}:8001",
             "--target", f"{server}:8000", "--delay-file", str(delay_file)]  # fmt: skip
    cluster.run("server", "relay", relay, health=lambda: netns.listens(server, 8001))

    added_s = _p50(_load(cluster, relayed, "--requests", str(REQUESTS))) - _p50(
        _load(cluster, direct, "--requests", str(REQUESTS))
    )
    assert added_s >= DELAY_MS / 1000, f"the relay added {added_s * 1000:.1f} ms at p50"

    cluster.cut("server")
    (cut,) = _load(cluster, direct, "--requests", "1", "--connect-timeout", "1")
    assert cut["error"] == "connect_timeout", cut  # silence, not a refusal or unreachable
    cluster.rejoin("server")
    (back,) = _load(cluster, direct, "--requests", "1", "--connect-timeout", "2")
    assert back["status"] == 200, back

    assert len(cluster.kill_host("server")) == 2  # the HTTP server and the relay
    deadline = time.monotonic() + 5
    while cluster.pids("server") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not cluster.pids("server")
    cluster.close()
    assert not netns.leftovers(cluster.namespaces, cluster.links)
    listed = netns._ip("netns", "list").stdout + netns._ip("-o", "link").stdout
    assert f"{netns.PREFIX}{cluster.tag}" not in listed and f"mc{cluster.tag}" not in listed


def test_a_killed_run_is_swept(namespaces_ok: None, tmp_path: Path) -> None:
    """A run SIGKILLed with its cluster up leaves a record; the next sweep removes it all."""
    make = (
        "import sys, time; from pathlib import Path; from tests.cluster.netns import Cluster; "
        "cluster = Cluster(['a', 'b'], Path(sys.argv[1])); cluster.open(); "
        "print(cluster.tag, flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", make, str(tmp_path)], cwd=netns.ROOT, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert owner.stdout is not None
    tag = owner.stdout.readline().strip()
    owner.kill()
    owner.wait()
    record = json.loads((netns.RECORDS / f"{tag}.json").read_text())
    made = record["namespaces"], record["links"]
    try:
        assert len(netns.leftovers(*made)) == 5  # 2 namespaces, the bridge, 2 veths
        assert tag in netns.sweep()
        assert not netns.leftovers(*made)
        assert not (netns.RECORDS / f"{tag}.json").exists()
    finally:
        netns.remove(tag, *made)


def test_roles_boot(mint_cluster: roles.Booted) -> None:
    """Every role answers from where its callers are, and only with its credentials; the
    gateway lists both workers by their advertised (relay) URLs (the boot waits for it)."""
    booted = mint_cluster
    (health,) = _load(booted.cluster, booted.gateway_url + "/health", "--requests", "1")
    assert health["status"] == 200, health  # the client host reaches the gateway
    for url in (*booted.worker_urls.values(), *booted.direct_urls.values()):
        assert _status(url + "/health") == 200, url
    search = booted.tracking_uri + "/api/2.0/mlflow/experiments/search?max_results=1"
    assert _status(search) == 401  # MLflow asks who is there
    pipeline = booted.pipeline_env
    login = f"{pipeline['MLFLOW_TRACKING_USERNAME']}:{pipeline['MLFLOW_TRACKING_PASSWORD']}"
    assert _status(search, basic=login) == 200
    workers = booted.prefect_api + "/work_pools/mint-train/workers/filter"
    assert _status(workers, post=True) == 401  # Prefect asks for its auth string
    assert _status(workers, basic="guess", post=True) == 401
    assert _status(booted.prefect_api + "/health") == 200  # but not for its health
    listed = _json(workers, basic=booted.prefect_auth, post=True)
    assert {w["name"] for w in listed} == set(roles.TRAIN)
    queues = _json(booted.prefect_api + "/work_pools/mint-train/queues/filter",
                   basic=booted.prefect_auth, post=True)  # fmt: skip
    # A run can be pinned to a train host (issue 37 pins a companion run to the second one).
    assert {f"host-{role}" for role in roles.TRAIN} <= {q["name"] for q in queues}
    pools = _json(booted.prefect_api + "/work_pools/filter", basic=booted.prefect_auth, post=True)
    assert {"mint-control", "mint-train"} <= {pool["name"] for pool in pools}
    deployments = _json(booted.prefect_api + "/deployments/filter", basic=booted.prefect_auth,
                        post=True)  # fmt: skip
    assert {d["work_pool_name"] for d in deployments} == {"mint-control", "mint-train"}


def test_the_control_host_hands_each_role_its_settings(mint_cluster: roles.Booted) -> None:
    """The env files ctl's `mint up --role control` wrote (0600), which the other hosts were
    started from: each role gets what it needs and no more."""
    booted = mint_cluster
    home = roles.home_of(booted.cluster, roles.CONTROL)
    secrets = json.loads((home / SECRETS_FILE).read_text())
    assert (home / SECRETS_FILE).stat().st_mode & 0o777 == 0o600
    envs = booted.host_envs
    for role, env in envs.items():
        assert (home / "hosts" / f"{role}.env").stat().st_mode & 0o777 == 0o600, role
        assert env["MLFLOW_TRACKING_URI"] == booted.tracking_uri, role
        assert env["MINT_FLEET"] == "registry", role
        assert env["MINT_WORKER_API_KEY"] == secrets["worker_api_key"], role
    # Only the train host talks to Prefect, and only it writes the registry.
    assert envs["train"]["PREFECT_API_URL"] == booted.prefect_api
    assert envs["train"]["PREFECT_API_AUTH_STRING"] == secrets["prefect_auth"]
    assert "PREFECT_API_AUTH_STRING" not in envs["serve"] | envs["gateway"]
    accounts = json.loads((home / "mlflow-accounts.json").read_text())
    assert envs["train"]["MLFLOW_TRACKING_USERNAME"] == accounts["pipeline"]["username"]
    assert envs["serve"]["MLFLOW_TRACKING_USERNAME"] == accounts["worker"]["username"]
    assert envs["serve"]["MINT_API_KEYS"] == f"{secrets['worker_api_key']}=admin"


def _request(url: str, basic: str | None, post: bool) -> urllib.request.Request:
    """`basic`: what HTTP basic auth encodes (MLflow's user:password, Prefect's auth string)."""
    headers = {"Content-Type": "application/json"}
    if basic is not None:
        token = base64.b64encode(basic.encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    return urllib.request.Request(url, b"{}" if post else None, headers)


def _status(url: str, basic: str | None = None, post: bool = False) -> int:
    try:
        with urllib.request.urlopen(_request(url, basic, post), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def _json(url: str, basic: str | None = None, post: bool = False) -> list[dict]:
    with urllib.request.urlopen(_request(url, basic, post), timeout=10) as response:
        return json.load(response)
