"""MinT's MLflow server app (`mlflow server --app-name mint`, as `mint registry`, `mint up` and
the tests start it): MLflow's own app, guarded by MLflow's basic-auth app when AUTH_VARIABLE is
set, whose UI opens on model training and shows description tables with room in their cells.

Guarded, it differs from MLflow's basic-auth app in six ways:

- The auth store's reads of accounts and grants, repeated several times for every request,
  are answered from memory for up to two seconds and forgotten on any change made through
  the server (`RecentAccessReads`).
- Credentials are checked by `authenticate_request` (the auth app's `authorization_function`):
  the stored hash's slow key derivation runs once per password and hash, not on every request
  (MLflow's app runs it once per call of its own function, several times per request: about
  0.3 s a request on two cores). `VerifiedCredentials` says why that weakens nothing.
- MinT's accounts (`ACCOUNTS_VARIABLE`), and the experiment workers announce themselves in,
  are created before the server answers anything, `/health` included.
- A refusal (403) is MLflow's JSON error (`PERMISSION_DENIED` and a message), which MLflow's
  client and UI read, not a bare "Permission denied" the UI shows as INTERNAL_ERROR.
- Only the pipeline's account and admins create registered models and experiments. MLflow lets
  any signed-in account create one and gives its creator MANAGE on it: the workers' account
  (on every serve and gateway host) could create `support-bot` before its first release and
  move its aliases once the pipeline had registered into it (`_only_the_pipeline_creates`).
- `GRANTS_PATH` lists who may write a registered model, so the pipeline can refuse to register
  into one that others may change (`mint_core.registry.grants`).

MLflow 3.17's UI does not read an experiment's kind tag to choose between its GenAI and its
model-training views: it takes the choice the browser remembers (localStorage
`mlflow.workflowType_v1`), GenAI when there is none, and GenAI hides the model registry, the
page an auditor comes for. So the index page this app serves remembers model training for a
browser that has made no choice yet; a person's own toggle is kept and wins.
"""

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from flask import Flask, Response, g, request
from werkzeug.datastructures import Authorization
from werkzeug.security import check_password_hash

from mint_core.registry_accounts import (
    ACCOUNTS_VARIABLE,
    AUTH_VARIABLE,
    FLEET,
    GRANTS_PATH,
    RecentAccessReads,
    RegistryAccounts,
    VerifiedCredentials,
)

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

_SHOW_REFUSALS = (
    "<script>(function(){var send=window.fetch;"
    "function show(text){setTimeout(function(){"
    "if(document.body.innerText.indexOf(text)>=0)return;"
    "var box=document.createElement('div');box.setAttribute('role','alert');"
    "box.style.cssText='position:fixed;top:12px;left:50%;transform:translateX(-50%);"
    "z-index:10000;max-width:720px;padding:10px 16px;background:#fdecea;color:#611a15;"
    "border:1px solid #e0a3a0;border-radius:4px;font:14px sans-serif;"
    "box-shadow:0 2px 8px rgba(0,0,0,.2)';"
    "var words=document.createElement('span');words.textContent=text;box.appendChild(words);"
    "var close=document.createElement('button');close.textContent='Dismiss';"
    "close.style.marginLeft='12px';close.onclick=function(){box.remove()};"
    "box.appendChild(close);document.body.appendChild(box)},500)}"
    "window.fetch=function(input,init){return send.apply(this,arguments).then(function(r){"
    "var method=((init&&init.method)||(input&&input.method)||'GET').toUpperCase();"
    "if(r.status===403&&method!=='GET'){r.clone().json().then(function(body){"
    "if(body&&body.message)show(body.message)}).catch(function(){})}return r})}})()</script>"
)
"""A write the registry refused, shown to the person who tried: some of MLflow's pages (a
version's description editor) close on Save whatever the answer, so an auditor's edit
vanished with no word. Shown only where the page itself does not say it (half a second on)."""

_TABLE_CELLS = (
    "<style>.note-view-outer-container :is(th,td),.note-editor-preview-content :is(th,td)"
    "{padding:4px 12px;border-bottom:1px solid rgba(128,128,128,.3);text-align:left}</style>"
)
"""Room in the cells of description tables (a version's and an adapter's history, MinT's
`history` module): MLflow's UI gives them none, so columns run together. The description
cannot carry it: the UI's sanitizer drops every style and class attribute of a table."""


def _open_on_model_training(response: Response) -> Response:
    """The UI's index page, with model training remembered as the view where none is,
    refused writes shown, and description tables given room in their cells."""
    if request.path != "/" or response.status_code != 200 or response.mimetype != "text/html":
        return response
    response.direct_passthrough = False  # a file sent as it is: read it to change it
    page = response.get_data(as_text=True)
    head = "<head>" + _REMEMBER + _SHOW_REFUSALS + _TABLE_CELLS
    response.set_data(page.replace("<head>", head, 1))
    return response


_verified = VerifiedCredentials(check_password_hash)
"""This server process's checks that passed (its HMAC key is drawn once per process)."""


def authenticate_request() -> Authorization | Response:
    """MinT's authorization function (`mint_core.registry_accounts.AUTHORIZATION_FUNCTION`):
    the request's basic credentials if they are an account's, else the auth app's 401. A
    password changed or an account removed through the server is refused from the next request
    on, one changed past it within `RecentAccessReads`' two seconds; the hash check passed is
    remembered for as long as the stored hash stays (`VerifiedCredentials`)."""
    from mlflow.exceptions import MlflowException
    from mlflow.server import auth

    # MLflow's auth app calls this several times for one request (the check, then each
    # permission lookup): once is enough.
    known = g.get("mint_authorization")
    if known is not None:
        return known
    credentials = request.authorization
    if credentials is None or not credentials.username or credentials.password is None:
        return auth.make_basic_auth_response()
    username, password = credentials.username, credentials.password
    try:
        user = auth.store.get_user(username)
    except MlflowException:  # no such account (any more)
        return auth.make_basic_auth_response()
    # The account may hold MLflow's old default password, which MLflow refuses (its own check).
    if not _verified.verify(username, password, user.password_hash) or (
        auth._is_disabled_legacy_admin_login(username, password, user)
    ):
        return auth.make_basic_auth_response()
    g.mint_authorization = credentials
    return credentials


def _permission_denied_as_json(response: Response) -> Response:
    """A 403 of the auth app (text "Permission denied") as MLflow's JSON error, which its
    client and UI read; with who was refused what, and what to do."""
    if response.status_code != 403 or response.is_json:
        return response
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, ErrorCode

    who = request.authorization.username if request.authorization else "anonymous"
    message = (
        f"Permission denied: {who} may not {request.method} {request.path}. In MinT only the "
        "pipeline's account changes the registry: register, promote or roll back with `mint` "
        "or its Prefect deployments"
    )
    body = {"error_code": ErrorCode.Name(PERMISSION_DENIED), "message": message}
    response.set_data(json.dumps(body))
    response.mimetype = "application/json"
    return response


def _create_accounts(accounts: RegistryAccounts) -> None:
    """The accounts that do not exist yet in the auth app's store, and the pipeline's MANAGE
    on every registered model and experiment, present and future. Idempotent: a restarted
    server keeps what exists (a password changed since is not reset)."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
    from mlflow.server import auth

    for account in (accounts.pipeline, accounts.worker, *accounts.auditors):
        if not auth.store.has_user(account.username, use_primary=True):
            auth.store.create_user(account.username, account.password)
    for resource_type in ("registered_model", "experiment"):
        try:
            auth.store.grant_user_resource_permission(
                accounts.pipeline.username, resource_type, "*", "MANAGE"
            )
        except MlflowException as e:
            if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
    _open_fleet(accounts)


def _open_fleet(accounts: RegistryAccounts) -> None:
    """The experiment serving workers announce themselves in (`FLEET`), and the worker
    account's EDIT on it: the one thing that account may write (runs and their tags there; no
    registered model, no alias, no other experiment). Idempotent."""
    from mlflow.entities import ExperimentTag
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
    from mlflow.server import auth
    from mlflow.server.handlers import _get_tracking_store

    from mint_core.registry._mlflow import EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT

    store = _get_tracking_store()
    experiment = store.get_experiment_by_name(FLEET)
    if experiment is None:
        experiment_id = store.create_experiment(
            FLEET, tags=[ExperimentTag(EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT)]
        )
    else:
        experiment_id = experiment.experiment_id
    try:
        auth.store.create_experiment_permission(experiment_id, accounts.worker.username, "EDIT")
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise


def _only_the_pipeline_creates(pipeline: str) -> None:
    """MLflow's checks on creating a registered model or an experiment (every path and version
    of each), with the sender required to be `pipeline` or an admin first. Experiments too: an
    account that created `mint-releases` first would manage the runs policy records are kept in.
    The fleet's experiment is created by the server itself (`_open_fleet`)."""
    from mlflow.server import auth

    creating = (auth.validate_can_create_registered_model, auth.validate_can_create_experiment)

    def by_the_pipeline(check: Callable[[], bool]) -> Callable[[], bool]:
        def validate() -> bool:
            username = auth.authenticate_request().username
            return (username == pipeline or auth.store.get_user(username).is_admin) and check()

        return validate

    validators = auth.BEFORE_REQUEST_VALIDATORS
    for route, check in list(validators.items()):
        if check in creating:
            validators[route] = by_the_pipeline(check)


def _grants() -> Response:
    """Every account that may write registered model `name` (EDIT or MANAGE), as MLflow's own
    checks resolve it: a grant on the model, on every model, through a role, or as an admin."""
    from mlflow.server import auth

    name = request.args.get("name", "")
    writers = []
    for user in auth.store.list_users():
        permission = auth._resolve_user_permission_for_resource(
            user.username, "registered_model", name
        )
        if permission.can_update:
            writers.append(
                {"account": user.username, "permission": permission.name, "admin": user.is_admin}
            )
    return Response(json.dumps({"grants": writers}), mimetype="application/json")


def _serve_grants(app: Flask) -> None:
    """`GRANTS_PATH`, for accounts that may manage the model it names (MLflow's own check)."""
    from mlflow.server import auth

    app.add_url_rule(GRANTS_PATH, "mint_grants", _grants, methods=["GET"])
    auth.BEFORE_REQUEST_VALIDATORS[(GRANTS_PATH, "GET")] = auth.validate_can_manage_registered_model


def _guarded(app: Flask) -> "FastAPI":
    """`app` behind MLflow's basic-auth app, as the module's docstring says."""
    from mlflow.server import auth

    # Before the auth app's own hooks: Flask runs them in reverse order, so this one sees
    # their refusals too (and those of its before-request check, which Flask passes on).
    app.after_request(_permission_denied_as_json)
    served = auth.create_app(app)
    # Its checks look the store up as a module global on each call.
    auth.store = RecentAccessReads(auth.store)
    _serve_grants(app)
    accounts = os.environ.get(ACCOUNTS_VARIABLE)
    if accounts:
        mint_accounts = RegistryAccounts.from_json(accounts)
        _create_accounts(mint_accounts)
        _only_the_pipeline_creates(mint_accounts.pipeline.username)
    return served


def create_app() -> "FastAPI":
    """MLflow's app factory for `--app-name mint` (entry point group `mlflow.app`): MLflow's
    app, served by uvicorn, as `mlflow server` runs it by default."""
    from mlflow.server import app

    app.after_request(_open_on_model_training)
    if os.environ.get(AUTH_VARIABLE):
        return _guarded(app)
    from mlflow.server.fastapi_app import create_fastapi_app

    return create_fastapi_app(app)
