"""MLflow as the registry sees it: the client, the tag names MinT writes, and the one place
MLflow's failures become MinT's errors.

Two kinds of failure, translated in two layers that every call goes through:

- a server that does not answer (refused, timed out, failing after MLflow's retries): the
  client (`_Answering`) raises RegistryError naming the server and its setting, whichever call
  it was, once the outage has lasted the process's bound (`mint_core.registry_outages`: a
  request that never reached the server is sent again meanwhile);
- a server that answers with a refusal: `MlflowStore.failing(action)` raises RegistryError
  naming what was being done. A lookup of something that does not exist is not a failure:
  `model` raises NotFoundError, `model_or_none` returns None.
"""

import functools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TypeVar

import requests
from mlflow.entities import RunStatus
from mlflow.entities.model_registry import RegisteredModel
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.rest_utils import http_request

from mint_core.errors import NotFoundError, RegistryError
from mint_core.registry_accounts import GRANTS_PATH
from mint_core.registry_outages import OUTAGES
from mint_core.revisions import TAG_PREFIX

T = TypeVar("T")

REVOKE_PATH = "/api/3.0/mlflow/users/permissions/revoke"
"""MLflow's per-user revoke of a grant."""

STAGE_TAG = TAG_PREFIX + "stage"
KIND_TAG = TAG_PREFIX + "kind"
BASE_DIGEST_TAG = TAG_PREFIX + "base_digest"
"""On a registered model: the base every revision of the adapter was trained on."""
ACTIVATED_AT_TAG = TAG_PREFIX + "activated_at"
STAGE_HISTORY_TAG = TAG_PREFIX + "stage_history"
"""A revision's stage moves, one JSON list in one model-version tag. Model-version tag values are
`Text` in MLflow's schema, and MLflow accepts up to 100,000 characters: with reasons cut to
`REASON_CHARS`, that is well over a hundred moves of one revision (a roll-out is four)."""
ALIAS_MOVE_TAG = TAG_PREFIX + "alias_move."
"""Prefix of the tags recording alias moves, one small tag per move on the version moved to:
`mint.alias_move.000042` is the adapter's 42nd move. History grows without bound and no tag
does; registered-model tags, which every worker sync reads, hold none of it."""
FAILURE_TAG = TAG_PREFIX + "failure_reason"
APPROVAL_RUN_TAG = TAG_PREFIX + "approval_run"
"""The Prefect flow run paused for a revision's approval: what `mint approve` resumes."""
CANARY_PERCENT_TAG = TAG_PREFIX + "canary_percent"
"""The share, in percent, of `name@production` requests that workers send to `name@canary`: a
registered-model tag, so that every worker reads the same share at the same sync as the alias."""
REVISION_RUN_TAG = TAG_PREFIX + "revision"
"""On a training (or import) run: the revision it made, e.g. `upper-bot:r2`."""
HOST_RUN_TAG = TAG_PREFIX + "host"
"""On a training run: the host it trained on (MINT_HOST, else the machine's hostname)."""
RUN_NAME_TAG = "mlflow.runName"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""The tag MLflow's UI reads to open an experiment as model training (runs, the model registry
in its sidebar) rather than as GenAI development (an empty traces page)."""
MODEL_DEVELOPMENT = "custom_model_development"
ADAPTER_KIND = "adapter"
"""The `KIND_TAG` of a registered model that is a MinT adapter."""
REASON_CHARS = 1000
"""Reasons are cut to this length in history records, keeping each one small."""


_UNCHECKED_WRITES = frozenset(
    {
        "set_model_version_tag",
        "delete_model_version_tag",
        "update_model_version",
        "set_registered_model_tag",
        "delete_registered_model_tag",
        "set_registered_model_alias",
        "delete_registered_model_alias",
        "update_registered_model",
    }
)
"""Writes that go to MLflow's registry client as they are. `MlflowClient` reads the registered
model back before each of them, to refuse writing to an MLflow prompt: a second round trip per
write, half of an activation's requests. MinT writes only to what it read first (a registered
model through `get_registered_model`, which answers "not found" for a prompt; a model version
whose tags make a policy record), so the check has been made by then."""


class _Answering:
    """MLflow's client, except that a call the server does not answer (refused, timed out,
    failing after MLflow's retries) raises RegistryError naming the server, the setting that
    names it and the cause, whichever call it was. Other failures stay MLflow's own."""

    def __init__(self, tracking_uri: str) -> None:
        self._uri = tracking_uri
        self._client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    def __getattr__(self, name: str) -> object:
        if name in _UNCHECKED_WRITES:
            method = getattr(self._client._get_registry_client(), name)
        else:
            method = getattr(self._client, name)
        if not callable(method):
            return method
        return self._answered(name, method)

    def _answered(self, name: str, method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def call(*args: object, **kwargs: object) -> T:
            while True:
                try:
                    answer = method(*args, **kwargs)
                except (MlflowException, requests.RequestException) as e:
                    cause = _unanswered(e)
                    if cause is None:
                        raise
                    # Only a request that never reached the server is sent again (see
                    # `registry_outages`): one cut off in flight may have been written.
                    pause = OUTAGES.failed(self._uri, cause) if _unsent(e) else None
                    if pause is None:
                        raise RegistryError(self._unanswered_message(name, cause)) from e
                    time.sleep(pause)
                else:
                    OUTAGES.answered(self._uri)
                    return answer

        return call

    def _unanswered_message(self, name: str, cause: str) -> str:
        waited = OUTAGES.waited_s(self._uri) if OUTAGES.wait_s > 0 else 0.0
        during = f" for {waited:.0f} s (MINT_REGISTRY_RETRY_S={OUTAGES.wait_s:g})" if waited else ""
        return (
            f"MLflow at {self._uri} (MLFLOW_TRACKING_URI) did not answer {name}{during}: "
            f"{cause}; check that it runs (`mint registry` starts one) and that "
            "MLFLOW_TRACKING_URI points at it"
        )

    @property
    def username(self) -> str:
        """The account this client signs in as ('' without authentication)."""
        return self._client._tracking_client.store.get_host_creds().username or ""

    def registered_model_writers(self, name: str) -> list[dict[str, object]] | None:
        """MinT's server's answer to who may write registered model `name` (`GRANTS_PATH`):
        one {account, permission, admin} each; None where the server has no such path (MLflow
        without MinT's guarded app: no authentication, no grants)."""
        answer = self._rest("registered_model_writers", "GET", GRANTS_PATH, params={"name": name})
        if answer.status_code == 404:
            return None
        return json.loads(answer.text)["grants"]

    def revoke_registered_model_grant(self, name: str, username: str) -> None:
        """MLflow's per-user revoke of `username`'s grant on registered model `name` (allowed
        to whoever may manage it)."""
        body = {"username": username, "resource_type": "registered_model", "resource_id": name}
        answer = self._rest("revoke_registered_model_grant", "POST", REVOKE_PATH, json=body)
        if answer.status_code != 200:
            raise MlflowException(f"{answer.status_code} {answer.text[:300]}")

    def _rest(self, name: str, method: str, path: str, **request: object) -> requests.Response:
        """A request to a path MLflow's client has no call for, signed in as the client is,
        waited out through an outage as every call is; a refusal (403) as MLflow's error."""
        creds = self._client._tracking_client.store.get_host_creds()

        def send() -> requests.Response:
            answer = http_request(creds, path, method, raise_on_status=False, **request)
            if answer.status_code == 403:
                raise MlflowException(answer.text[:300], error_code="PERMISSION_DENIED")
            return answer

        return self._answered(name, send)()

    def end_run(self, run_id: str, status: str) -> None:
        """End run `run_id` with `status` in one request.
        MLflow's `set_terminated` and `update_run` each read the run back first (the one to
        print a link to it, the other to keep its status): one round trip more for nothing."""
        store = self._client._tracking_client.store
        self._answered("update_run_info", store.update_run_info)(
            run_id, RunStatus.from_string(status), int(time.time() * 1000), None
        )


_UNANSWERED = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.RetryError,
)
"""requests' errors for a server that does not answer, or answers only with errors until
MLflow's retries give up."""


def _unanswered(error: BaseException) -> str | None:
    """The innermost cause, as text, when `error` means the server did not answer; else None.
    MLflow's client turns requests' network errors into MlflowException, keeping the original
    as its context."""
    network = error if isinstance(error, requests.RequestException) else error.__context__
    if not isinstance(network, _UNANSWERED):
        return None
    cause: BaseException = network
    while (inner := cause.__cause__ or cause.__context__) is not None:
        cause = inner
    return str(cause) or type(cause).__name__


def _unsent(error: BaseException) -> bool:
    """Whether `error` says the request never reached the server: no connection was made
    (refused, or none within the connect timeout), or the server answered only with errors
    MLflow retries (429, 5xx: its database rolled back). Not a connection cut while a request
    was in flight."""
    unsent = (
        ConnectionRefusedError,
        requests.exceptions.ConnectTimeout,
        requests.exceptions.RetryError,
    )
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, unsent):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def missing(error: MlflowException) -> bool:
    """Whether MLflow refused because what was asked for does not exist."""
    return error.error_code == "RESOURCE_DOES_NOT_EXIST"


def now() -> str:
    """The time of a record, ISO-8601 UTC."""
    return datetime.now(UTC).isoformat()


class MlflowStore:
    """The connection every part of the registry works through: the client and its lookups.
    One per `Registry`, shared by its parts, each of which reads `client` at every call: a
    test that swaps the client (to inject faults) swaps it for all of them."""

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri
        self._answering = _Answering(tracking_uri)
        # Typed as the client it stands in for: every call goes through it unchanged.
        self.client: MlflowClient = self._answering  # type: ignore[assignment]

    def end_run(self, run_id: str, status: str) -> None:
        """End run `run_id` with `status` in one request (`_Answering.end_run`)."""
        self._answering.end_run(run_id, status)

    @contextmanager
    def failing(self, action: str) -> Iterator[None]:
        """MLflow's refusals inside the block as RegistryError naming `action` (a server that
        does not answer raises RegistryError already, in the client)."""
        try:
            yield
        except (MlflowException, requests.RequestException) as e:
            raise RegistryError(f"MLflow at {self.tracking_uri} failed to {action}: {e}") from e

    def model_or_none(self, adapter: str) -> RegisteredModel | None:
        """The registered model of `adapter`; None if it is not registered."""
        with self.failing(f"look up adapter {adapter!r}"):
            try:
                return self.client.get_registered_model(adapter)
            except MlflowException as e:
                if missing(e):
                    return None
                raise

    def model(self, adapter: str, hint: str = "") -> RegisteredModel:
        """The registered model of `adapter`; NotFoundError, with `hint` (what to do), if it is
        not registered."""
        model = self.model_or_none(adapter)
        if model is None:
            # The whole story, even when a caller asks while handling MLflow's refusal of a
            # version of it (with authentication on, MLflow answers 403, not 404, for a version
            # of a model that does not exist): no MLflow error chained behind it.
            raise NotFoundError(f"adapter {adapter!r} is not registered{hint}") from None
        return model
