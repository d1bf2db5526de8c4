"""MinT's flows as Prefect deployments: what `mint flows serve` (and `mint up`) serves, and what
`mint flows deploy` puts in work pools (`flows.pools`) when flow runs go to other hosts.

`release`, `import`, `promote`, `rollback`, `canary`, `repair`, `retrain`, `rl` and `approve`
run from the Prefect UI with a parameter form (a roll-out paused for approval also shows its own
form on its run); each configured retrain schedule (`MINT_RETRAIN`) adds a `retrain-<adapter>`
deployment on its cron. `catalog-snapshot` publishes the catalog snapshot workers start from;
`usage-report` each revision's use over the last day as the Artifacts page's `usage` table
(give it a schedule in the UI: hourly, say);
`train-node` is started by a release training on several hosts, one run per other host.
Served, they need no work pool, but the serving process must keep running: flow runs start as
its subprocesses, with its environment (MinT's configuration included). Deployed, each goes to
its `Pool`: the flows that train to the train hosts, the others to the control host.
"""

import asyncio
import contextlib
import os
import sys
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from prefect import Flow
from prefect.deployments.runner import RunnerDeployment
from prefect.exceptions import TerminationSignal
from prefect.runner import Runner
from prefect.types.entrypoint import EntrypointType

from control.services import RUN_POLL_S
from flows.approval import approve
from flows.canary import canary
from flows.catalog import catalog_snapshot
from flows.promote import promote, rollback
from flows.release import SCHEDULED, import_adapter, release, retrain
from flows.repair import repair
from flows.rl import rl
from flows.train_node import train_node
from flows.usage import usage_report
from flows.warm_runs import warm_runs
from mint_core.config import MintConfig
from mint_core.revisions import check_adapter_name
from processes import ManagedProcess, responds_ok, start_process
from processes.managed import basic_auth

# Flows are found by module path, so runs start from any working directory.
_BY_MODULE = {"entrypoint_type": EntrypointType.MODULE_PATH, "tags": ["mint"]}

PERSON_FIELDS = ("actor", "reviewer")
"""Parameters that name who acts: a form leaves them blank and requires them, so a run started
from the Prefect UI records a person (the flows' Python default, `mint`, is for callers in
code; `mint` commands pass the user)."""


class Pool(StrEnum):
    """Where a flow's runs go when the deployments are in work pools (`mint flows deploy`):
    each names a Prefect process pool, which MinT's configuration names."""

    TRAIN = "train"
    """The flows that train (release, import, retrain, rl): on the hosts with the accelerator,
    one run at a time each (MINT_TRAIN_POOL)."""
    CONTROL = "control"
    """The others: they move aliases, ask the workers, answer approvals and publish the
    catalog, needing no accelerator (MINT_CONTROL_POOL)."""

    def work_pool(self, config: MintConfig) -> str:
        """The Prefect work pool's name in `config`."""
        return config.train_pool if self is Pool.TRAIN else config.control_pool


def pool_modules(pool: Pool) -> list[str]:
    """The modules of `pool`'s flows: what their runs import."""
    return sorted({flow.fn.__module__ for flow, name, _ in _SERVED if POOLS[name] is pool})


def build_deployments(config: MintConfig) -> list[RunnerDeployment]:
    return [_guided(deployment) for deployment in _deployments(config)]


def deployments_by_pool(config: MintConfig) -> dict[Pool, list[RunnerDeployment]]:
    """`build_deployments`, each in its flow's pool (`POOLS`)."""
    pooled: dict[Pool, list[RunnerDeployment]] = {pool: [] for pool in Pool}
    for deployment in build_deployments(config):
        pooled[POOLS[deployment.flow_name]].append(deployment)
    return pooled


def _guided(deployment: RunnerDeployment) -> RunnerDeployment:
    """`deployment` with a parameter form that guides a person: each field's description comes
    from its flow's docstring (`Args:`); an optional field is a plain field of its type, left
    empty for its default, rather than a choice between that type and "None"; and the fields
    in PERSON_FIELDS are required, with no default."""
    # Prefect 3.9 builds the form from the flow's signature and keeps it in a private field,
    # which `to_deployment` offers no way to adjust.
    schema = deployment._parameter_openapi_schema
    for name, field in schema.properties.items():
        options = field.get("anyOf", [])
        kept = [option for option in options if option != {"type": "null"}]
        if len(kept) == 1 and len(options) == 2:
            del field["anyOf"]
            field.update(kept[0])
            if field.get("default", "") is None:
                del field["default"]
        if name in PERSON_FIELDS:
            field.pop("default", None)
            if name not in schema.required:
                schema.required.append(name)
    return deployment


_SERVED: tuple[tuple[Flow[..., Any], str, str], ...] = (
    (release, "release", "Train and release a new revision."),
    (
        import_adapter,
        "import",
        "Release a PEFT LoRA adapter trained elsewhere as the next revision of an adapter.",
    ),
    (promote, "promote", "Serve an existing revision as production."),
    (rollback, "rollback", "Return production to its previous revision (or the one named)."),
    (
        canary,
        "canary",
        "Give a revision a share of production's requests, then promote it or roll it back on "
        "the figures.",
    ),
    (retrain, "retrain", "Retrain an adapter on its data file as it is now."),
    (repair, "repair", "Export a revision again from its frozen files and re-admit it."),
    (approve, "approve", "Approve or reject a roll-out paused for approval."),
    (rl, "rl", "GRPO on a LoRA, sampling from the worker serving its rl alias."),
    (
        train_node,
        "train-node",
        "One more train host's processes of a release trained on several (started by it).",
    ),
    (catalog_snapshot, "catalog-snapshot", "Publish the catalog snapshot workers start from."),
    (
        usage_report,
        "usage-report",
        "Publish each revision's use over the last day (requests, tokens, errors, 429s, who "
        "used it) as the Artifacts page's `usage` table. Give it a schedule (hourly, say) to "
        "keep the table current.",
    ),
)
"""Each flow served, by deployment name, with the description the Prefect UI shows."""

POOLS: Mapping[str, Pool] = {
    "release": Pool.TRAIN,
    "import": Pool.TRAIN,
    "retrain": Pool.TRAIN,  # and each `retrain-<adapter>` on its schedule
    "rl": Pool.TRAIN,
    "train-node": Pool.TRAIN,
    "promote": Pool.CONTROL,
    "rollback": Pool.CONTROL,
    "canary": Pool.CONTROL,
    "repair": Pool.CONTROL,
    "approve": Pool.CONTROL,
    "catalog-snapshot": Pool.CONTROL,
    "usage-report": Pool.CONTROL,
}
"""Each served flow's pool, by flow name. Why repair is a control flow: it exports frozen
files again and admits them, which needs no accelerator; an approval waits in the run of the
roll-out it approves, wherever that runs (see `flows.pools`)."""


RUN_NAMES = (
    "MinT names each run after what it does (e.g. `release support-bot`), so runs read alike "
    "in the list and can be found by adapter: a name typed in the run form is not kept."
)
"""Said in every form of a flow MinT names the runs of. Why not keep a typed name: the form
comes filled with a name Prefect made up, which nothing tells apart from one a person typed, and
a list of runs named `bouncy-lemur` hides what each did."""


def _deployments(config: MintConfig) -> list[RunnerDeployment]:
    deployments = [
        flow.to_deployment(name=name, description=_described(flow, description), **_BY_MODULE)
        for flow, name, description in _SERVED
    ]
    for schedule in config.retrain:
        check_adapter_name(schedule.adapter)
        deployments.append(
            retrain.to_deployment(
                name=f"retrain-{schedule.adapter}",
                description=_described(
                    retrain, f"Retrain {schedule.adapter} on {schedule.data}, on schedule."
                ),
                cron=schedule.cron,
                parameters={"adapter": schedule.adapter, "data": schedule.data, "actor": SCHEDULED},
                **_BY_MODULE,
            )
        )
    return deployments


def _described(flow: Flow[..., Any], description: str) -> str:
    """`description`, and RUN_NAMES when MinT names `flow`'s runs."""
    return f"{description} {RUN_NAMES}" if flow.flow_run_name else description


def serve_deployments(config: MintConfig) -> None:
    """Register the deployments with the Prefect server and run their flow runs until stopped."""
    polled = "PREFECT_RUNNER_POLL_FREQUENCY" in os.environ  # a setting given explicitly wins
    runner = Runner(query_seconds=None if polled else RUN_POLL_S)
    flows = {flow.name: flow for flow, _, _ in _SERVED}
    for deployment in build_deployments(config):
        deployment_id = runner.add_deployment(deployment)
        # What `prefect.serve` leaves out and `Runner.add_flow` does: the runner keeps the flow
        # itself, so that its runs start as forks of the warm forkserver (`warm_runs`) rather
        # than as `python -m prefect.engine`, which imports everything again. `add_flow` would
        # build the deployment itself, without MinT's parameter forms (`_guided`).
        runner._deployment_registry.register_flow(deployment_id, flows[deployment.flow_name])
    warm_runs(pool_modules(Pool.CONTROL))
    with contextlib.suppress(KeyboardInterrupt, TerminationSignal):  # stopped, as asked
        asyncio.run(runner.start())


def start_flow_server(config: MintConfig, prefect_api_url: str) -> ManagedProcess:
    """`mint flows serve` in a child process; returns once its deployments are registered.
    It and the wait present this process's PREFECT_API_AUTH_STRING, if any, to the server."""
    env = config.to_env() | {"PREFECT_API_URL": prefect_api_url}
    # The very deployments the child serves, so none is left out of the wait.
    names = [f"{d.flow_name}/{d.name}" for d in _deployments(config)]
    # Explicit: `prefect_api_url` need not be this process's PREFECT_API_URL, whose auth string
    # `responds_ok` sends by default.
    auth = basic_auth(os.environ.get("PREFECT_API_AUTH_STRING", ""))
    return start_process(
        "flow server",
        [sys.executable, "-m", "mint_cli", "flows", "serve"],
        prefect_api_url,
        lambda: all(
            responds_ok(f"{prefect_api_url}/deployments/name/{name}", auth) for name in names
        ),
        config.home / "logs" / "flows.log",
        env,
    )
