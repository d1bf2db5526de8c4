"""Usage report: each revision's use over the last day (requests, errors, 429s, tokens, time in
queue, who used it), gathered from every worker of the fleet, as a table on the Prefect UI's
Artifacts page (key `usage`: the page keeps the latest, each run's stays in its run), where a
release manager already triggers and watches roll-outs. Not the registry's descriptions: those
are a revision's lasting record for an auditor, and rewriting a million of them every hour would
load MLflow for figures that are stale within the hour. `mint usage` gives any window on a
terminal."""

import time

from prefect import flow
from prefect.artifacts import create_table_artifact

from control.status import fleet_usage
from flows.ending import ends_on_mint_error
from mint_core.config import MintConfig
from mint_core.usage import adapter_table
from tasks.runs import label_run, run_log

USAGE_KEY = "usage"


@flow(name="usage-report", flow_run_name="usage report")
@ends_on_mint_error
def usage_report(hours: float = 24.0) -> int:
    """Publish each revision's use over the last `hours` as the Artifacts page's `usage`
    table; the number of revisions used.

    Args:
        hours: How far back the table reaches, in hours (workers keep 25).
    """
    label_run(None)
    since = time.time() - hours * 3600
    rows, kept_since, missing = fleet_usage(MintConfig.from_env(), since)
    table = adapter_table(rows)
    said = f"Use of each revision over the last {hours:g} h, from every worker of the fleet"
    if kept_since > since:
        said += f"; the workers know it only for the last {(time.time() - kept_since) / 3600:.1f} h"
    if missing:
        said += f"; not answering, so not counted: {', '.join(missing)}"
    create_table_artifact(table, key=USAGE_KEY, description=said)
    run_log().info("%s: %d revisions used", said, len(table))
    return len(table)
