"""How a flow run tells, in the Prefect UI, what it did: a name that says it (`release
upper-bot`, `rollback upper-bot r2→r1`), an `adapter:<name>` tag to filter the runs list by,
the key events in its log (through Prefect's run logger, which the UI shows), and a summary
markdown artifact at its end.
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


def label_run(adapter: str, name: str | None = None) -> None:
    """Tag the current flow run `adapter:<adapter>`, and rename it to `name` when what it
    does became known only while it ran (a rollback finds its target)."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    run = context.flow_run
    tags = sorted({*run.tags, ADAPTER_TAG.format(adapter)})
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
