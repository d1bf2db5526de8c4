"""What an auditor sees in MLflow's UI, opened in headless Chromium from the session's real
`mlflow server`: a released revision's model-version page without errors, showing its readable
history, its files served from MinT's store; MinT's experiment marked as model training, its
runs named after the revisions they made."""

import httpx
import pytest
from mlflow.tracking import MlflowClient

from mint_core.config import MintConfig
from mint_core.model.training import TrainingConfig
from mint_core.registry import EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT, REVISION_RUN_TAG, Registry
from mint_core.revisions import RevisionId
from mint_core.shipping import Shipment, ship
from tasks.training import load_data, train_adapter
from tests.integration.browser import UiPage, visible_span
from tests.integration.helpers import toy_data

pytestmark = pytest.mark.slow

ADAPTER = "ui-bot"


@pytest.fixture(scope="module")
def released(config: MintConfig) -> list[RevisionId]:
    """Two revisions of ADAPTER, trained briefly and shipped as a release ships them (each step,
    its artifact's URI and its files' digest among them, in the revision's history), the second
    approved by alice."""
    data, held_out = load_data.fn(config, *toy_data(config.home, "upper", rows=64), 0.1, ADAPTER)
    revisions = []
    for _ in range(2):
        trained = train_adapter.fn(config, ADAPTER, data, held_out, TrainingConfig(steps=5))
        revisions.append(ship(config, Shipment(ADAPTER, trained, "test", held_out=held_out)))
    Registry(config.tracking_uri).stages.note(
        revisions[-1], "alice", "approved: looks right", approver="alice"
    )
    return revisions


def version_page(config: MintConfig, revision: RevisionId) -> str:
    return f"{config.tracking_uri}/#/models/{revision.adapter}/versions/{revision.number}"


def test_training_runs_are_named_after_their_revisions(
    config: MintConfig, released: list[RevisionId]
) -> None:
    client = MlflowClient(config.tracking_uri)
    for revision in released:
        version = client.get_model_version(revision.adapter, str(revision.number))
        run = client.get_run(version.run_id)
        assert run.info.run_name == str(revision)  # e.g. ui-bot:r2
        assert run.data.tags[REVISION_RUN_TAG] == str(revision)
        experiment = client.get_experiment(run.info.experiment_id)
        assert experiment.tags[EXPERIMENT_KIND_TAG] == MODEL_DEVELOPMENT


def test_a_versions_files_are_served_from_mints_store(
    config: MintConfig, released: list[RevisionId]
) -> None:
    revision = released[-1]
    api = f"{config.tracking_uri}/model-versions/get-artifact"
    query = {"name": revision.adapter, "version": str(revision.number)}
    index = httpx.get(api, params=query | {"path": "index.json"}, timeout=60)
    assert index.status_code == 200, index.text
    assert "shards" in index.json()
    # What the version page asks for first: an MLflow model's MLmodel, which a PEFT adapter
    # has not. "No such file" (404), not a server error (500).
    mlmodel = httpx.get(api, params=query | {"path": "MLmodel"}, timeout=60)
    assert mlmodel.status_code == 404, mlmodel.text


def test_the_version_page_shows_the_history_and_no_error(
    config: MintConfig, released: list[RevisionId], ui: UiPage
) -> None:
    # A common laptop's window, where whole digests once pushed the approver column out of the
    # description's pane (issue 48, item 9).
    ui.page.set_viewport_size({"width": 1440, "height": 900})
    # The page's request for the version's files once got a hidden 500. (Not "network idle":
    # MLflow's UI keeps polling.)
    with ui.page.expect_response(lambda r: "/model-versions/get-artifact" in r.url) as files:
        page = ui.open(version_page(config, released[-1]))
    assert files.value.status < 500, files.value.url
    page.get_by_text(f"Version {released[-1].number}").first.wait_for()
    assert not ui.server_errors
    assert page.get_by_text("Could not find a registered artifact repository").count() == 0
    # The readable history: the version's description, a markdown table.
    history = page.locator("table").filter(has_text="approver").first
    history.wait_for()
    header = [cell.strip().lower() for cell in history.locator("th").all_inner_texts()]
    assert {"event", "actor", "approver"} <= set(header), header
    # Room in its cells: MLflow's UI gives a description's table none (columns ran together).
    for cell in (history.locator("th").first, history.locator("td").first):
        sides = cell.evaluate(
            "c => [getComputedStyle(c).paddingLeft, getComputedStyle(c).paddingRight]"
        )
        assert all(float(side.removesuffix("px")) > 0 for side in sides), sides
    # Every column in sight: the table within its pane, not cut off or behind a scroll. Its
    # rows are the whole history, the artifact's URI and the files' digest among them.
    assert "frozen" in history.inner_text() and "mint-local://sha256/" in history.inner_text()
    assert history.get_by_text("alice").count() >= 1
    left, right = visible_span(history)
    table = history.bounding_box()
    assert table is not None
    last = history.locator("th").last.bounding_box()
    assert last is not None
    assert left <= table["x"] and last["x"] + last["width"] <= right, (
        f"at a 1440 px window the history table is {table['width']:.0f} px wide and spans "
        f"{table['x']:.0f}..{table['x'] + table['width']:.0f} px; its pane shows "
        f"{left:.0f}..{right:.0f} px"
    )
    overflow = history.evaluate("t => [t.parentElement.scrollWidth, t.parentElement.clientWidth]")
    assert overflow[0] <= overflow[1], f"its container scrolls: {overflow}"


def test_the_ui_opens_on_model_training_with_the_registry_in_view(
    config: MintConfig, released: list[RevisionId], ui: UiPage
) -> None:
    """A first visit (no view remembered) opens on model training: the model registry is in the
    sidebar, and MinT's experiment opens on its runs, not on an empty GenAI traces page."""
    page = ui.open(config.tracking_uri + "/")
    page.get_by_role("link", name="Model registry").wait_for()
    remembered = page.evaluate("localStorage.getItem('mlflow.workflowType_v1')")
    assert remembered == '"machine_learning"'

    client = MlflowClient(config.tracking_uri)
    run = client.get_run(client.get_model_version(ADAPTER, str(released[-1].number)).run_id)
    page = ui.open(f"{config.tracking_uri}/#/experiments/{run.info.experiment_id}")
    page.get_by_text(str(released[-1])).first.wait_for()  # its runs, named after revisions
    assert "genai" not in page.url and "traces" not in page.url, page.url
    assert not ui.server_errors
