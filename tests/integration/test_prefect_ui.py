"""What a release manager sees in Prefect's UI: a gated roll-out paused for approval, opened in
headless Chromium from a real `prefect server start` (API and UI, as `mint up` runs it); its
resume form shows the evaluation table (candidate against production, and the threshold); the
Artifacts page shows each revision's usage of the last day."""

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from uuid import UUID

import httpx
import pytest
from playwright.sync_api import Locator
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort
from prefect.settings import PREFECT_API_URL, temporary_settings

from control.services import start_prefect
from flows.approval import Verdict, answer_approval
from flows.promote import promote
from flows.usage import USAGE_KEY, usage_report
from mint_core.config import MintConfig
from mint_core.errors import NotFoundError, RejectedError
from mint_core.gates import Gates
from mint_core.model.base import BaseModel
from mint_core.registry import APPROVAL_RUN_TAG, Registry
from mint_core.revisions import RevisionId
from processes import ManagedProcess
from tests.integration.browser import UiPage, screenshot, visible_span
from tests.integration.helpers import register_random_adapter

pytestmark = pytest.mark.slow

RELEASER = "carol"
GATES = Gates(requires_approval=True, approvers=("alice", RELEASER), approval_timeout_s=600)
"""Long enough for a browser on a busy machine; the test rejects the roll-out when done."""


@pytest.fixture(scope="module")
def prefect_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """`prefect server start`: its API and its UI, on one port (Prefect's test harness serves
    no UI)."""
    server = start_prefect(tmp_path_factory.mktemp("prefect-ui"))
    yield server
    server.stop()


def in_prefect(
    server: ManagedProcess, function: Callable[..., object], *args: object, **kwargs: object
) -> object:
    """`function(*args, **kwargs)` with flows reporting to `server` (in this thread only)."""
    with temporary_settings(updates={PREFECT_API_URL: server.url + "/api"}):
        return function(*args, **kwargs)


def paused_run_id(server: ManagedProcess, registry: Registry, revision: RevisionId) -> UUID:
    """The flow run paused for `revision`'s approval, once it is paused."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        run_id = None
        with suppress(NotFoundError):
            run_id = registry.revisions.get(revision).tags.get(APPROVAL_RUN_TAG)
        if run_id is not None:
            run = httpx.get(f"{server.url}/api/flow_runs/{run_id}").json()
            if run["state"]["type"] == "PAUSED":
                return UUID(run_id)
        time.sleep(1)
    raise AssertionError(f"{revision}'s roll-out never paused for approval")


def assert_figures_inside(form: Locator, table: Locator, width: int) -> None:
    """Every cell of `table`'s figure columns (all but the first) lies inside the modal `form`
    and inside every box that would clip it, so a reader sees them without scrolling."""
    box = form.bounding_box()
    assert box is not None
    left, right = visible_span(table)
    left, right = max(left, box["x"]), min(right, box["x"] + box["width"])
    rows = table.locator("tr")
    for row in range(rows.count()):
        cells = rows.nth(row).locator("th, td")
        for column in range(1, cells.count()):
            cell = cells.nth(column).bounding_box()
            assert cell is not None
            span = f"{cell['x']:.0f}..{cell['x'] + cell['width']:.0f} px"
            assert left <= cell["x"] and cell["x"] + cell["width"] <= right, (
                f"at a {width} px window, cell {cells.nth(column).inner_text()!r} spans {span}, "
                f"outside the form's visible {left:.0f}..{right:.0f} px"
            )


def test_the_paused_roll_out_shows_its_evaluation_in_the_form(
    prefect_ui: ManagedProcess,
    fleet_config: MintConfig,
    base: BaseModel,
    tmp_path: Path,
    ui: UiPage,
) -> None:
    registry = Registry(fleet_config.tracking_uri)
    first = register_random_adapter(fleet_config, base, "ui-form-bot", tmp_path / "r1", seed=1)
    in_prefect(prefect_ui, promote, "ui-form-bot", first.number)
    registry.gates.set("ui-form-bot", GATES)
    second = register_random_adapter(fleet_config, base, "ui-form-bot", tmp_path / "r2", seed=2)
    # Prefect's sync calls run from threads of their own: the browser's (Playwright's sync API)
    # leaves an event loop in this one, and `resume_flow_run` called under it only makes a
    # coroutine that never runs (the roll-out would stay paused).
    with ThreadPoolExecutor(max_workers=2) as background:
        promoting = background.submit(
            in_prefect, prefect_ui, promote, "ui-form-bot", second.number, actor=RELEASER
        )
        try:
            run_id = paused_run_id(prefect_ui, registry, second)
            page = ui.open(f"{prefect_ui.url}/runs/flow-run/{run_id}")
            page.get_by_text("Paused").first.wait_for()
            assert page.get_by_text("Can't connect to Server API").count() == 0
            page.get_by_role("button", name="Resume").first.click()
            form = page.get_by_role("dialog")
            form.get_by_text("Resume Flow Run").wait_for()
            # The description is markdown: its table is rendered as one.
            table = form.locator("table").first
            table.wait_for()
            header = " ".join(table.locator("th").all_inner_texts()).lower()
            assert "candidate" in header, header
            assert "production" in header, header
            assert "threshold" in form.inner_text().lower()
            # Both figure columns are in sight, not behind a horizontal scroll, at common widths.
            for width in (1440, 1920):
                page.set_viewport_size({"width": width, "height": 900})
                assert_figures_inside(form, table, width)
            screenshot(page, "approval-form")  # for a person to look at; ignored by git
            assert not ui.server_errors
        finally:
            # Ends the paused roll-out whatever happened above.
            rejecting = background.submit(
                in_prefect, prefect_ui, answer_approval, fleet_config, second,
                Verdict.REJECT, "alice", "browser test done",
            )  # fmt: skip
            rejecting.result(timeout=120)
        with pytest.raises(RejectedError):
            promoting.result(timeout=300)


def latest_artifact(key: str) -> UUID:
    with get_client(sync_client=True) as client:
        (latest, *_) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            sort=ArtifactSort.CREATED_DESC,
            limit=1,
        )
    return latest.id


def test_the_artifacts_page_shows_each_revisions_usage_of_the_last_day(
    prefect_ui: ManagedProcess,
    worker: ManagedProcess,
    fleet_config: MintConfig,
    base: BaseModel,
    ui: UiPage,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The usage-report deployment's table, as a release manager opens it: the Artifacts
    page's `usage` key, one row per revision, with who used it."""
    answered = httpx.post(
        worker.url + "/generate",
        json={"inputs": "usage", "parameters": {"max_new_tokens": 2}},
        headers={"Authorization": "Bearer key-team-b"},
        timeout=60,
    )
    assert answered.status_code == 200, answered.text
    for name, value in fleet_config.to_env().items():
        monkeypatch.setenv(name, value)
    with ThreadPoolExecutor(max_workers=1) as background:  # away from Playwright's event loop
        assert background.submit(in_prefect, prefect_ui, usage_report).result(timeout=120)
        latest = background.submit(in_prefect, prefect_ui, latest_artifact, USAGE_KEY).result()

    # The Artifacts page lists the key's versions, newest first; each opens as its table.
    page = ui.open(f"{prefect_ui.url}/artifacts/key/{USAGE_KEY}")
    page.get_by_text("over the last 24 h").first.wait_for()
    page.get_by_text(str(latest)[:8]).first.click()
    table = page.locator("table").first
    table.wait_for()
    header = " ".join(table.locator("th").all_inner_texts()).lower()
    for column in ("revision", "used by", "requests", "tokens out", "429s", "queue ms"):
        assert column in header, header
    row = table.locator("tr", has_text=base.model_id).first
    row.wait_for()
    assert "team-b" in row.inner_text()
    # Every column in sight, none behind a horizontal scroll, from 1600 px (at 1440 px the last
    # column was 20 px behind it in CI's Chromium: the base's long model id is the widest cell).
    for width in (1600, 1920):
        page.set_viewport_size({"width": width, "height": 900})
        assert_figures_inside(table, table, width)
    screenshot(page, "usage-artifact")  # for a person to look at; ignored by git
    assert not ui.server_errors
