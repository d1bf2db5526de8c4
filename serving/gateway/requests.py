"""What the gateway reads of a request, and how it describes the requests it takes.

The gateway reads one thing of a body, the model it names (`model_of`), and forwards the body
unchanged: its workers validate the rest, with the request models of `serving.protocols`, and
answer in the error table's shape. What the gateway reads it checks as they would, and refuses
in the same words (a RequestValidationError naming the field), so a client cannot tell which
of the two refused it.

Its OpenAPI document (`gateway_document`) is its workers' for the routes it forwards: the
request bodies and answers there are the worker's own pydantic models, which the gateway cannot
import without loading an engine (they build sampling parameters). Routes of its own (`/health`)
are described here.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from fastapi.exceptions import RequestValidationError
from starlette.routing import BaseRoute, Route

from mint_core.errors import ConfigurationError

__all__ = ["OWN_ROUTES", "gateway_document", "model_of"]

_OBJECT = ("dict_type", "Input should be a valid dictionary or object to extract fields from")
_STRING = ("string_type", "Input should be a valid string")
"""pydantic's words for these refusals, as the worker answers them."""

OWN_ROUTES: Mapping[str, Mapping[str, object]] = {
    "/health": {
        "get": {
            "summary": "The gateway's workers (up, base, ready revisions, load) and its registry",
            "operationId": "gateway_health",
            "responses": {"200": {"description": "`status` ok, or degraded"}},
        }
    },
}
"""The gateway's own operations, described here; every other route is a worker's."""


def model_of(path: str, body: bytes) -> str | None:
    """The model a request names: TGI's `parameters.adapter_id`, OpenAI's `model` (None: it
    names none). What the worker would refuse in these fields is refused here (422)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ConfigurationError(f"the body is not JSON in UTF-8: {e}") from None
    if not isinstance(payload, dict):
        raise _refused(("body",), _OBJECT, payload)
    if path.startswith("/v1/"):
        return _string(payload.get("model"), ("model",))
    parameters = payload.get("parameters")
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        raise _refused(("parameters",), _OBJECT, parameters)
    return _string(parameters.get("adapter_id"), ("parameters", "adapter_id"))


def _string(value: object, where: tuple[str, ...]) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _refused(where, _STRING, value)
    return value


def _refused(where: tuple[str, ...], why: tuple[str, str], value: object) -> RequestValidationError:
    kind, message = why
    return RequestValidationError(
        [{"type": kind, "loc": ("body", *where), "msg": message, "input": value}]
    )


def gateway_document(worker: Mapping[str, Any], routes: Sequence[BaseRoute]) -> dict[str, object]:
    """The gateway's OpenAPI document: each of its `routes` as `worker` (a worker's document)
    describes it, or as OWN_ROUTES does. Routes without methods (none) and the document's own
    route are left out."""
    theirs: Mapping[str, Mapping[str, object]] = worker.get("paths", {})
    paths: dict[str, dict[str, object]] = {}
    for route in routes:
        if not isinstance(route, Route) or not route.include_in_schema:
            continue
        described = OWN_ROUTES.get(route.path) or theirs.get(route.path, {})
        for method in sorted((route.methods or set()) - {"HEAD"}):
            operation = described.get(method.lower())
            if operation is None:
                operation = {"responses": {"default": {"description": "the worker's answer"}}}
            paths.setdefault(route.path, {})[method.lower()] = operation
    info = {
        "title": "MinT gateway",
        "version": worker.get("info", {}).get("version", "0"),
        "description": "Forwards each request to a worker of the base its model names; "
        "request bodies and answers are the workers'.",
    }
    return {
        "openapi": worker.get("openapi", "3.1.0"),
        "info": info,
        "paths": paths,
        "components": worker.get("components", {}),
    }
