"""What the worker's HTTP API and the gateway share, without loading any engine: the header
names, a revision's own base URL, and how JSON bodies and stream events are written.

- JSON bodies and stream events go through `json_bytes`: JSON has no NaN or Infinity, so a
  non-finite float (the logprob of a damaged adapter's token) is written as null.
- Streams are server-sent events, one `data: <json>` each (`sse`).
"""

from fastapi.responses import JSONResponse
from pydantic_core import to_json

from mint_core.errors import ConfigurationError
from mint_core.revisions import RevisionRef

__all__ = [
    "ADAPTER_PREFIX",
    "BASE_NAMES",
    "REQUEST_ID_HEADER",
    "REVISION_HEADER",
    "MintJSONResponse",
    "adapter_of_url",
    "json_bytes",
    "sse",
]

REVISION_HEADER = "X-Mint-Revision"
"""What served a generation: the exact revision, or the base's model id."""
REQUEST_ID_HEADER = "X-Mint-Request-Id"
"""A generation's request id: what feedback names."""
BASE_NAMES = (None, "", "base")
"""What a request names to get the base without adapter (besides the base's model id)."""
ADAPTER_PREFIX = "/adapters/{ref}"
"""The base URL of one revision reference: the generation routes under it answer as `ref`."""
_UNNAMED = (None, "", "tgi")
"""What a body under an adapter's base URL may name instead of it: nothing, or the `model`
TGI's `text-generation` client sends in every chat."""


def json_bytes(payload: object) -> bytes:
    """Every JSON body and stream event of the API. JSON has no NaN or Infinity: a non-finite
    float is written as null, so strict clients can still read the rest."""
    return to_json(payload, inf_nan_mode="null")


def sse(payload: object) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json_bytes(payload).decode()}\n\n"


class MintJSONResponse(JSONResponse):
    """The API's JSON responses, written by `json_bytes`. (Routes that return a dict are written
    by FastAPI through pydantic, whose rule for non-finite floats is the same: null.)"""

    def render(self, content: object) -> bytes:
        return json_bytes(content)


def adapter_of_url(ref: str, named: str | None = None) -> str:
    """The revision reference an adapter's base URL serves, `ref` from its path, written in
    full (`name` becomes `name@production`, so no path can name the base). `named` is what the
    body names; naming another revision is refused: the caller meant one of the two."""
    full = RevisionRef.parse(ref)
    if named in _UNNAMED:
        return str(full)
    try:
        same = RevisionRef.parse(named) == full
    except ConfigurationError:
        same = False  # the base's model id, or no reference at all
    if not same:
        raise ConfigurationError(
            f"this URL serves {full}, but the body names {named!r}; leave the adapter out of the "
            "body (the URL names it), or send the request to the URL of the one you meant"
        )
    return str(full)
