"""A command's flow run handed to the runner that serves its deployment.

`mint promote` and `mint rollback` (issue 48: 4.9 s each, against 0.3 s for the alias move)
spent 3.3 s importing Prefect and MLflow before their run began. Where a flow server or the
control pool's worker serves the flow (`mint up`), they instead create a run of its deployment,
as the Prefect UI's Submit does, and wait for it: the run starts warm there (`flows.warm_runs`),
shows in the UI like any other, and the command imports neither. This speaks Prefect's REST API
with the standard library for the same reason.

A deployment nobody polls (Prefect marks it NOT_READY a minute after its last poll) is not
handed off; and a run nobody takes within `TAKEN_WITHIN_S` is cancelled before it starts, so
the command runs the flow itself, as it does with no Prefect server at all.
"""

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mint_core.errors import MintError, ServiceError
from processes.managed import basic_auth

TAKEN_WITHIN_S = 10.0
"""How long a handed-off run may wait for its runner before the command runs it itself: a
runner polls every second (`flows.deployments.RUN_POLL_S`)."""
POLL_S = 0.1
"""How often the command reads its run's state: the run takes a second or two."""
FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})
"""Prefect's final state types."""
BUSY = frozenset({429, 502, 503, 504})
"""Answers that mean "not now": tried again, as Prefect's own client does."""
RETRIES = 5
"""How many more times a busy answer is tried (Prefect's client: PREFECT_CLIENT_MAX_RETRIES)."""
BACKOFF_S = 0.5
"""The first pause before trying again, doubled each time (15.5 s in all) unless the answer
says how long (Retry-After)."""


@dataclass(frozen=True)
class HandedRun:
    """A run that ran where its deployment is served, and completed."""

    name: str
    """The run's name, as the flow renamed it (`rollback support-bot r2→r1`)."""
    url: str
    """The run's page in the Prefect UI."""
    summary: str
    """What it did: its summary's title (`rolled back support-bot@production to ...`)."""


class _PrefectApi:
    """The few calls of Prefect's REST API a handoff needs, with its auth string."""

    def __init__(self, url: str, auth: str) -> None:
        self.url = url.rstrip("/")
        self._headers = basic_auth(auth) | {"Content-Type": "application/json"}

    def call(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """The JSON answer to GET `path` (POST `body`, when given); None for a 404. An answer
        that says "busy, try again" is tried again, up to RETRIES more times, as Prefect's own
        client does: its server answers 503 when its database is locked a moment too long
        (seen under a full test run), and nothing was written then."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data, self._headers)
        for attempt in range(RETRIES + 1):
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return json.load(response)
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code not in BUSY or attempt == RETRIES:
                    raise self._refused(path, e) from e
                time.sleep(float(e.headers.get("Retry-After") or BACKOFF_S * 2**attempt))
            except (urllib.error.URLError, OSError) as e:
                raise ServiceError(
                    f"Prefect at {self.url} (PREFECT_API_URL) did not answer: {e}; start it "
                    "(`mint up`) or unset PREFECT_API_URL to run the flow here"
                ) from e
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _refused(self, path: str, e: urllib.error.HTTPError) -> ServiceError:
        return ServiceError(
            f"Prefect at {self.url} (PREFECT_API_URL) answered {e.code} to {path}: "
            f"{e.read()[:300].decode(errors='replace')}"
        )

    def ui_page(self, run_id: str) -> str:
        return f"{self.url.removesuffix('/api')}/runs/flow-run/{run_id}"


def run_where_served(deployment: str, parameters: Mapping[str, object]) -> HandedRun | None:
    """Run `deployment` (`flow/name`) with `parameters` where it is served and wait for it to
    end; None when nothing serves it (no PREFECT_API_URL, no such deployment, nobody polls
    it, or nobody took the run in time: cancelled), for the caller to run the flow itself.
    A run that fails raises its message; Ctrl-C cancels it."""
    url = os.environ.get("PREFECT_API_URL", "")
    if not url:
        return None
    api = _PrefectApi(url, os.environ.get("PREFECT_API_AUTH_STRING", ""))
    found = api.call(f"/deployments/name/{urllib.parse.quote(deployment)}")
    if found is None or found.get("status") != "READY":
        return None
    # The key makes a retried create (its first answer lost) return the run it made.
    body = {"parameters": parameters, "idempotency_key": str(uuid.uuid4())}
    run = api.call(f"/deployments/{found['id']}/create_flow_run", body)
    try:
        ended = _wait(api, run["id"])
    except KeyboardInterrupt:
        _propose(api, run["id"], "CANCELLING", "its command was stopped")
        raise
    if ended is None:
        return None
    run, state = ended, ended["state"]
    page = api.ui_page(run["id"])
    if state["type"] != "COMPLETED":
        raise MintError(
            f"{deployment.partition('/')[0]} run {run['name']!r} ended {state['name']}: "
            f"{state.get('message') or 'no reason given'} (its log: {page})"
        )
    artifacts = api.call("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    titles = [a["description"] for a in artifacts or () if a.get("description")]
    return HandedRun(run["name"], page, titles[-1] if titles else state["name"])


def _wait(api: _PrefectApi, run_id: str) -> dict[str, Any] | None:
    """The run as it ended (its name as the flow left it, its final state); None when no
    runner took it within TAKEN_WITHIN_S (it is then cancelled before it started)."""
    deadline = time.monotonic() + TAKEN_WITHIN_S
    while True:
        run = api.call(f"/flow_runs/{run_id}")
        state = run["state"]
        if state["type"] in FINAL:
            return run
        # Proposed, not forced: a runner that took it meanwhile wins, and the run goes on.
        if (
            state["type"] == "SCHEDULED"
            and time.monotonic() > deadline
            and _propose(api, run_id, "CANCELLED", "no runner took it: its command ran the flow")
        ):
            return None
        time.sleep(POLL_S)


def _propose(api: _PrefectApi, run_id: str, state: str, message: str) -> bool:
    """Propose `state` for the run; whether Prefect accepted it."""
    answer = api.call(
        f"/flow_runs/{run_id}/set_state", {"state": {"type": state, "message": message}}
    )
    return bool(answer) and answer.get("status") == "ACCEPT"
