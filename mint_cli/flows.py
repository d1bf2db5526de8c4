"""`mint flows`: MinT's flows as Prefect deployments. `serve` runs them on this machine (their
runs are its subprocesses: the one-machine way, and `mint up`'s); `deploy` puts them in work
pools, where the workers of other hosts take their runs (`flows.pools`); `work` is the control
pool's worker, whose runs start warm (`flows.warm_runs`)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from mint_core.config import PREFECT_PORT
from mint_core.errors import ConfigurationError

if TYPE_CHECKING:
    from mint_cli.options import Commands
    from mint_core.config import MintConfig


def _check_prefect_api() -> None:
    if not os.environ.get("PREFECT_API_URL"):
        raise ConfigurationError(
            "PREFECT_API_URL is not set: point it at the Prefect server the deployments belong "
            f"to (e.g. http://127.0.0.1:{PREFECT_PORT}/api), or run `mint up`, which starts one"
        )


def cmd_flows_serve(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.deployments import serve_deployments

    _check_prefect_api()
    serve_deployments(config)


def cmd_flows_work(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.deployments import Pool, pool_modules
    from flows.warm_runs import work

    _check_prefect_api()
    pools = {pool.work_pool(config): pool for pool in Pool}
    if args.pool not in pools:
        raise ConfigurationError(
            f"work pool {args.pool!r} is none of MinT's: give {' or '.join(sorted(pools))} "
            "(MINT_CONTROL_POOL, MINT_TRAIN_POOL)"
        )
    name = args.name or config.host_name
    work(args.pool, name, pool_modules(pools[args.pool]), args.limit, args.work_queue)


def cmd_flows_deploy(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.pools import CrashWatch, deploy_to_pools

    given = {"heartbeat_s": args.heartbeat_s, "crash_after_s": args.crash_after_s}
    watch = CrashWatch(**{name: value for name, value in given.items() if value is not None})
    _check_prefect_api()
    deployed = deploy_to_pools(config, watch)
    for pool, names in deployed.deployments.items():
        print(f"work pool {pool}: {', '.join(sorted(names))}")
    if deployed.removed:
        print(f"removed, no longer deployed: {', '.join(deployed.removed)}")
    print(
        f"a run whose heartbeats (every {watch.heartbeat_s} s) stop for {watch.crash_after_s} "
        "s is marked Crashed; runs wait for a worker of their pool: `mint up --role train` "
        f"runs one of {config.train_pool} on a train host, `mint up --role control` one of "
        f"{config.control_pool}",
        flush=True,
    )


def _seconds(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None


def add_commands(commands: Commands) -> None:
    flows = commands.add_parser("flows", help="Prefect deployments of MinT's flows")
    flow_commands = flows.add_subparsers(dest="flows_command", required=True)
    flows_serve = flow_commands.add_parser(
        "serve",
        help="serve release, promote, rollback and retrain (+ MINT_RETRAIN schedules) to the "
        "Prefect server at PREFECT_API_URL, running their flow runs until stopped",
    )
    flows_serve.set_defaults(run=cmd_flows_serve, service=True, runs_pipeline=True)

    flows_work = flow_commands.add_parser(
        "work",
        help="run a work pool's flow runs on this host until stopped, each starting as a fork "
        "of a process that imported its flow once (what `mint up --role control` runs)",
    )
    flows_work.add_argument("--pool", required=True, help="the work pool (MINT_CONTROL_POOL)")
    flows_work.add_argument("--name", help="the worker's name (default: MINT_HOST)")
    flows_work.add_argument("--limit", type=int, help="at most this many runs at once")
    flows_work.add_argument(
        "--work-queue",
        action="append",
        default=[],
        help="a queue of the pool to poll (repeatable; default: all of them)",
    )
    flows_work.set_defaults(run=cmd_flows_work, service=True, runs_pipeline=True)

    deploy = flow_commands.add_parser(
        "deploy",
        help="put the deployments in work pools on the Prefect server at PREFECT_API_URL: the "
        "flows that train in MINT_TRAIN_POOL, the others in MINT_CONTROL_POOL (creating "
        "missing process pools), where workers on other hosts run them; and mark Crashed a "
        "run whose host dies",
    )
    deploy.add_argument(
        "--heartbeat-s",
        type=_seconds,
        help="how often a run says it is alive (seconds, 30 at least; default 30)",
    )
    deploy.add_argument(
        "--crash-after-s",
        type=_seconds,
        help="mark a run Crashed after this long without a heartbeat (seconds; default 90)",
    )
    deploy.set_defaults(run=cmd_flows_deploy)
