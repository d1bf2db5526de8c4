"""How a flow run tells, in the Prefect UI, what it did: a name that says it (`release
upper-bot`, `rollback upper-bot r2→r1`), an `adapter:<name>` tag to filter the runs list by, a
`host:<name>` tag saying where it ran, the key events in its log (through Prefect's run logger,
which the UI shows), and a summary markdown artifact at its end.
"""

import logging
from collections.abc import Callable, Mapping

import prefect.runtime
from prefect import get_client, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext, TaskRunContext

from mint_core.config import MintConfig
from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION

ADAPTER_TAG = "adapter:{}"
"""The tag of every flow run that acts on an adapter: the runs list filters on it."""

HOST_TAG = "host:{}"
"""The tag of every flow run MinT labels: the host it ran on (MINT_HOST, else the machine's
hostname). Prefect records only the process id of a run a worker started, and the hosts of a
test cluster (network namespaces) share one hostname."""


def run_name(describe: Callable[[Mapping[str, object]], str]) -> Callable[[], str]:
    """A `flow_run_name` for `@flow`: `describe` of the run's parameters (Prefect calls a
    callable without arguments; a template string cannot leave out a parameter that is None)."""
    return lambda: describe(prefect.runtime.flow_run.parameters)


def run_log() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The current flow or task run's logger (its lines are the run's log in the Prefect UI);
    this module's logger when called outside any run (a step called as a plain function)."""
    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return logging.getLogger(__name__)
    return get_run_logger()


def label_run(adapter: str | None, name: str | None = None) -> None:
    """Tag the current flow run `adapter:<adapter>` (unless None: a run that acts on no
    adapter) and `host:<this host>`, and rename it to `name` when what it does became known
    only while it ran (a rollback finds its target)."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    run = context.flow_run
    # Read here, at the start of a flow run (an entry point), like the flows' configuration.
    labels = {HOST_TAG.format(MintConfig.from_env().host_name)}
    if adapter is not None:
        labels.add(ADAPTER_TAG.format(adapter))
    tags = sorted({*run.tags, *labels})
    with get_client(sync_client=True) as client:
        client.update_flow_run(run.id, tags=tags, name=name)
    run.tags = tags
    if name is not None:
        run.name = name


def summarize(adapter: str, title: str, facts: Mapping[str, object]) -> None:
    """End the run with `title` and `facts` as a markdown table in its artifacts (key
    `<flow>-<adapter>`, so the Artifacts page keeps each adapter's latest) and in its log."""
    lines = [f"### {title}", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in facts.items()]
    flow = str(prefect.runtime.flow_run.flow_name or "run")
    key = f"{flow}-{adapter}".lower().replace("_", "-")
    create_markdown_artifact("\n".join(lines), key=key, description=title)
    run_log().info("%s: %s", title, "; ".join(f"{k} {_cell(v)}" for k, v in facts.items()))


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def production_move(config: MintConfig, adapter: str) -> str:
    """The last move of `adapter@production` as `r1 → r2` (`none → r1` for its first)."""
    history = Registry(config.tracking_uri).aliases.history(adapter)
    moves = [move for move in history if move.alias == PRODUCTION]
    if not moves:
        return "not moved"
    before = f"r{moves[-1].from_revision}" if moves[-1].from_revision is not None else "none"
    return f"{before} → r{moves[-1].to_revision}"
