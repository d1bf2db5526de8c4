"""Rollback benchmark: how long a rollback (and a promotion) takes to reach users, each way a
user starts one, against MinT as `mint up` runs it (issue 48 item 5: Submit in the Prefect UI
to done took ~23 s, `mint promote` 21.7 s, while the alias move itself took ~0.5 s).

Every service is its own process on loopback, with authentication on: MLflow as `mint registry`
runs it (`harness.start_registry`), Prefect with basic auth, an embedded worker signed in as
the worker, and `mint flows serve` (the flow server, as `mint up` starts it). Two random
LoRAs of one adapter are released by the `import` flow (r1, then r2 in production). Then each
round takes production r2 -> r1 -> r2 in each way in turn:

- **alias**: the registry call alone (`aliases.move`, the roll-out slot taken off the clock);
- **cli**: `mint rollback --adapter A` and `mint promote --adapter A --revision 2`, each a fresh
  process, to its exit (it returns once the alias moved and the worker serves the revision);
- **ui**: a run of the `rollback` / `promote` deployment created as the Prefect UI's Submit
  creates it (`create_flow_run_from_deployment`), until a client asking the worker for
  `A@production` is answered by the other revision; and, from the run's state history, its
  start delay (Scheduled -> Running: the flow server's poll, the run's process and its
  imports) and its own run (Running -> Completed);
- **pool** (unless `--no-pool`): the same as ui once the deployments are in work pools (`mint
  flows deploy`) and a `prefect worker` of the control pool runs them, as `mint up --role
  control` starts it, the flow server stopped.

Each figure is a median over its samples (one per direction per round). `--poll-s 10` runs it
with Prefect's own poll interval (MinT's flow server and pool workers poll every second).
Writes bench/results/rollback.json.

    .venv/bin/python bench/rollback.py                          # 5 rounds
    .venv/bin/python bench/rollback.py --rounds 1 --no-pool     # a smoke run
"""

import dataclasses
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Named, not made: Prefect makes it when it first writes (a mkdtemp here was a folder left
# behind by every run, used or not).
os.environ.setdefault(
    "PREFECT_HOME", os.path.join(tempfile.gettempdir(), f"mint-bench-prefect-{os.getpid()}")
)

import httpx
from peft import LoraConfig, get_peft_model
from prefect import get_client
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

from bench import harness
from control.credentials import PREFECT_CLIENT_AUTH
from control.services import start_prefect, start_prefect_worker
from flows.deployments import start_flow_server
from flows.pools import deploy_to_pools
from flows.release import import_adapter
from mint_core.config import MintConfig
from mint_core.model.base import BaseSource, load_base
from mint_core.model.generate import seeded
from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION, RevisionId
from serving.worker.server import start_worker
from tasks.pipeline import rollout_lock

ADAPTER = "rollback-bench"
OLD, NEW = RevisionId(ADAPTER, 1), RevisionId(ADAPTER, 2)
AIMS_S = {"cli_p50_s": 3.0, "ui_served_p50_s": 5.0, "ui_start_p50_s": 2.0}
"""Issue 48's aims on 2 cores with the services running."""


def make_adapter(config: MintConfig, folder: Path, seed: int) -> Path:
    """A random rank-8 LoRA of the base, saved as PEFT saves one."""
    base = load_base(config.base, config.home)
    with seeded(seed):
        model = get_peft_model(base.model, LoraConfig(r=8, lora_alpha=16))
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.data.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


class Users:
    """A client of the worker asking for `ADAPTER@production`, as users do."""

    def __init__(self, url: str) -> None:
        self._http = httpx.Client(base_url=url, timeout=60)
        self._body = {
            "inputs": "rollback=",
            "parameters": {"adapter_id": f"{ADAPTER}@{PRODUCTION}", "max_new_tokens": 1},
        }

    def served(self) -> str:
        response = self._http.post("/generate", json=self._body)
        return response.headers.get("X-Mint-Revision", f"HTTP {response.status_code}")

    def wait_for(self, revision: RevisionId, since: float, timeout_s: float = 300.0) -> float:
        """Seconds from `since` (monotonic) until users are answered by `revision`."""
        while str(revision) != (seen := self.served()):
            if time.monotonic() - since > timeout_s:
                raise RuntimeError(f"users still get {seen}, not {revision}")
            time.sleep(0.02)  # a client's pace, not a load on the worker's cores
        return time.monotonic() - since


def alias_move(registry: Registry, target: RevisionId) -> float:
    """The registry call alone: production moved to `target`, the slot held off the clock."""
    with rollout_lock(ADAPTER) as slot:
        return harness.seconds(
            lambda: registry.aliases.move(target, PRODUCTION, "bench", "alias alone", slot=slot)
        )


def cli(config: MintConfig, target: RevisionId, users: Users) -> dict[str, float]:
    """`mint rollback` (to OLD) or `mint promote` (to NEW) in a fresh process: to its exit,
    and until users get `target`."""
    command = (
        ["rollback", "--adapter", ADAPTER]
        if target == OLD
        else ["promote", "--adapter", ADAPTER, "--revision", str(target.number)]
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mint_cli", *command, "--actor", "bench"],
        env=os.environ | config.to_env(),
        capture_output=True,
        text=True,
    )
    exited = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"mint {' '.join(command)}: {done.stdout[-500:]}{done.stderr[-2000:]}")
    return {"exit_s": exited, "served_s": users.wait_for(target, started)}


def submitted(target: RevisionId, users: Users) -> dict[str, float]:
    """A run of the `rollback` (to OLD) or `promote` (to NEW) deployment, created as the
    Prefect UI's Submit creates it: until users get `target`, and its states' times."""
    name, parameters = (
        ("rollback/rollback", {"adapter": ADAPTER, "actor": "bench"})
        if target == OLD
        else ("promote/promote", {"adapter": ADAPTER, "revision": target.number, "actor": "bench"})
    )
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(name)
        started = time.monotonic()
        run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
        served_s = users.wait_for(target, started)
        while not (state := client.read_flow_run(run.id).state) or not state.is_final():
            time.sleep(0.1)
        if not state.is_completed():
            raise RuntimeError(f"{name} run {run.name}: {state.type.value} {state.message}")
        ended_s = time.monotonic() - started
        at = {s.type.value: s.timestamp for s in client.read_flow_run_states(run.id)}
    scheduled, running, completed = at["SCHEDULED"], at["RUNNING"], at["COMPLETED"]
    return {
        "served_s": served_s,
        "completed_s": ended_s,
        "start_s": (running - scheduled).total_seconds(),
        "pending_s": (at["PENDING"] - scheduled).total_seconds() if "PENDING" in at else 0.0,
        "run_s": (completed - running).total_seconds(),
    }


def rounds(
    count: int, ways: dict[str, Callable[[RevisionId], dict[str, float]]]
) -> dict[str, dict[str, list[float]]]:
    """Each way takes production r2 -> r1 -> r2 once a round, ways taking turns."""
    samples: dict[str, dict[str, list[float]]] = {way: {} for way in ways}
    for number in range(count):
        for way in harness.alternating(number, list(ways)):
            for target in (OLD, NEW):
                figures = ways[way](target)
                direction = "rollback" if target == OLD else "promote"
                for key, value in figures.items():
                    samples[way].setdefault(f"{direction}_{key}", []).append(value)
                    samples[way].setdefault(key, []).append(value)
                said = ", ".join(f"{key} {value:.2f} s" for key, value in figures.items())
                print(f"round {number + 1} {way} {direction}: {said}", flush=True)
    return samples


def medians(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {
        way: {key: statistics.median(values) for key, values in figures.items()}
        for way, figures in samples.items()
    }


def main() -> None:
    parser = harness.command_line(__doc__, "rollback")
    parser.add_argument("--rounds", type=int, default=5, help="r2 -> r1 -> r2 per way")
    parser.add_argument("--no-pool", action="store_true", help="skip the control work pool")
    harness.add_home(parser)
    parser.add_argument(
        "--poll-s",
        type=int,
        default=None,
        help="seconds between the flow server's and the pool worker's polls for runs to start "
        "(PREFECT_RUNNER_POLL_FREQUENCY, PREFECT_WORKER_QUERY_SECONDS); default: MinT's (1 s); "
        "10 is Prefect's own",
    )
    args = parser.parse_args()
    if args.poll_s is not None:  # the services started below inherit them
        os.environ["PREFECT_RUNNER_POLL_FREQUENCY"] = str(args.poll_s)
        os.environ["PREFECT_WORKER_QUERY_SECONDS"] = str(args.poll_s)

    folder = harness.default_base(args.home)
    with harness.scratch("rollback") as (work, services):
        auth = f"mint:{secrets.token_hex(12)}"
        prefect = start_prefect(work / "prefect", auth=auth)
        services.append(prefect)
        api = f"{prefect.url}/api"
        # For the `mint` commands it starts, and for this process: Prefect read its settings
        # when it was imported (it would start a temporary server of its own).
        os.environ.update({"PREFECT_API_URL": api, PREFECT_CLIENT_AUTH: auth})
        prefect_settings = {PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth}
        with temporary_settings(updates=prefect_settings):
            mlflow = harness.start_registry(work / "registry", services)
            config = MintConfig(
                home=work / "home", tracking_uri=mlflow.url, base=BaseSource(str(folder))
            )
            worker = start_worker(config, env=harness.worker_env(mlflow))
            services.append(worker)
            config = dataclasses.replace(config, worker_urls=(worker.url,))
            os.environ.update(config.to_env())  # the flows read their configuration from it
            flow_server = start_flow_server(config, api)
            services.append(flow_server)

            started = time.perf_counter()
            for seed, revision in enumerate((OLD, NEW)):
                path = make_adapter(config, work / f"lora-{seed}", seed)
                report = import_adapter(ADAPTER, str(path), actor="bench")
                assert report.revision == str(revision), report
            setup_s = time.perf_counter() - started
            users = Users(worker.url)
            users.wait_for(NEW, time.monotonic())
            registry = Registry(config.tracking_uri)

            ways: dict[str, Callable[[RevisionId], dict[str, float]]] = {
                "alias": lambda target: {"move_s": alias_move(registry, target)},
                "cli": lambda target: cli(config, target, users),
                "ui": lambda target: submitted(target, users),
            }
            samples = rounds(args.rounds, ways)
            if not args.no_pool:
                flow_server.stop()
                services.remove(flow_server)
                deploy_to_pools(config)
                pool_worker = start_prefect_worker(config, config.control_pool, api, auth)
                services.append(pool_worker)
                samples |= rounds(args.rounds, {"pool": lambda target: submitted(target, users)})

    figures = medians(samples)
    result: dict[str, Any] = {
        "rounds": args.rounds,
        "poll_s": args.poll_s,
        "setup_s": setup_s,
        "samples_s": samples,
        "median_s": figures,
        "alias_move_p50_s": figures["alias"]["move_s"],
        "cli_p50_s": figures["cli"]["exit_s"],
        "cli_rollback_p50_s": figures["cli"]["rollback_exit_s"],
        "cli_promote_p50_s": figures["cli"]["promote_exit_s"],
        "ui_served_p50_s": figures["ui"]["served_s"],
        "ui_start_p50_s": figures["ui"]["start_s"],
        "ui_run_p50_s": figures["ui"]["run_s"],
        "aims_s": AIMS_S,
        "machine": harness.machine(),
    }
    if "pool" in figures:
        result |= {
            "pool_served_p50_s": figures["pool"]["served_s"],
            "pool_start_p50_s": figures["pool"]["start_s"],
        }
    for key, aim in AIMS_S.items():
        print(f"{key}: {result[key]:.2f} s (aim <= {aim} s)")
    harness.write(args.out, result)


if __name__ == "__main__":
    main()
