"""MinT's MLflow server app (`mlflow server --app-name mint`, as `mint registry`, `mint up` and
the tests start it): MLflow's own app, guarded by MLflow's basic-auth app when AUTH_VARIABLE is
set, whose UI opens on model training.

MLflow 3.17's UI does not read an experiment's kind tag to choose between its GenAI and its
model-training views: it takes the choice the browser remembers (localStorage
`mlflow.workflowType_v1`), GenAI when there is none, and GenAI hides the model registry, the
page an auditor comes for. So the index page this app serves remembers model training for a
browser that has made no choice yet; a person's own toggle is kept and wins.
"""

import json
import os
from typing import TYPE_CHECKING

from flask import Response, request

from mint_core.registry_accounts import AUTH_VARIABLE

if TYPE_CHECKING:
    from fastapi import FastAPI

WORKFLOW_KEY = "mlflow.workflowType_v1"
"""Where MLflow's UI keeps a browser's choice of view (its useLocalStorage key, version 1)."""
MODEL_TRAINING = "machine_learning"
"""The UI's name for its model-training view (the other is "genai")."""

_REMEMBER = (
    "<script>try{{if(!localStorage.getItem({key}))localStorage.setItem({key},{value})}}"
    "catch(e){{}}</script>"
).format(key=json.dumps(WORKFLOW_KEY), value=json.dumps(json.dumps(MODEL_TRAINING)))


def _open_on_model_training(response: Response) -> Response:
    """The UI's index page, with model training remembered as the view where none is."""
    if request.path != "/" or response.status_code != 200 or response.mimetype != "text/html":
        return response
    response.direct_passthrough = False  # a file sent as it is: read it to change it
    page = response.get_data(as_text=True)
    response.set_data(page.replace("<head>", "<head>" + _REMEMBER, 1))
    return response


def create_app() -> "FastAPI":
    """MLflow's app factory for `--app-name mint` (entry point group `mlflow.app`): MLflow's
    app, served by uvicorn, as `mlflow server` runs it by default."""
    from mlflow.server import app

    app.after_request(_open_on_model_training)
    if os.environ.get(AUTH_VARIABLE):
        from mlflow.server.auth import create_app as guarded

        return guarded(app)
    from mlflow.server.fastapi_app import create_fastapi_app

    return create_fastapi_app(app)
