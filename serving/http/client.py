"""HTTP client for serving workers: what the release pipeline and the CLI use to admit
revisions and read readiness, what an RL trainer samples with, and what a worker asks its peers
with. It loads no engine (no torch)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from mint_core.config import MAX_PROMPTS, READY_TIMEOUT_S
from mint_core.errors import ConfigurationError, NotReadyError, ServiceError
from mint_core.planning.canary_judge import RevisionOutcomes
from mint_core.revisions import RevisionId
from mint_core.states import Readiness
from mint_core.usage import UsageRow
from serving.http.wire import (
    AdapterStatus,
    AdmitPriority,
    AdmitRequest,
    RevisionReadiness,
    SyncAnswer,
)

if TYPE_CHECKING:  # mint_core.model.generate imports torch: `mint status` must not
    from mint_core.model.generate import Route

_ADMIN_KEY_HINT = (
    "; the pipeline presents MINT_WORKER_API_KEY, which must be a key of the worker whose "
    "principal is in its MINT_ADMIN_PRINCIPALS"
)


@dataclass(frozen=True)
class Sample:
    """One sampled completion, as an RL trainer scores it."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Each token's log-probability under the untempered model that sampled it (the sampling
    distribution itself at temperature 1)."""
    routes: tuple[Route, ...] | None
    """Per token, the experts each MoE layer routed the position that produced it to."""
    prompt_routes: tuple[Route, ...] | None
    """The prompt's positions but the last: `prompt_routes + routes` lines up with the prompt
    followed by all tokens but the last, the input that scores them (`replaying_routes`)."""
    revision: str
    """What sampled it (`X-Mint-Revision`): the exact revision, or the base's model id."""
    finish_reason: str
    text: str


class WorkerClient:
    """One worker, by base URL."""

    def __init__(
        self, url: str, api_key: str = "", timeout_s: float = 30.0, http: httpx.Client | None = None
    ) -> None:
        """`http` sends the calls instead of a client of its own (a test's in-process app)."""
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http or httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)
        self._http.headers.update(headers)

    def _call(self, method: str, path: str, key_hint: str = "", **kwargs: object) -> httpx.Response:
        """The worker's answer (503 included, which callers read); ServiceError for any other
        error, with `key_hint` added when the key was refused."""
        try:
            response = self._http.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as e:
            raise ServiceError(
                f"serving worker at {self.url} (MINT_WORKER_URLS) did not answer {method} "
                f"{path}: {e}"
            ) from e
        if response.status_code >= 400 and response.status_code != 503:
            hint = key_hint if response.status_code in (401, 403) else ""
            raise ServiceError(
                f"serving worker at {self.url} (MINT_WORKER_URLS) refused {method} {path}: "
                f"{response.status_code} {_message(response)}{hint}"
            )
        return response

    def health(self) -> dict[str, object]:
        return self._call("GET", "/health").json()

    def admit(self, revision: RevisionId, priority: AdmitPriority = "normal") -> Readiness:
        """Queue `revision` for prewarm (`priority` "rollback" goes first)."""
        body = AdmitRequest.of(revision, priority).model_dump()
        answer = self._call("POST", "/admin/admit", _ADMIN_KEY_HINT, json=body).json()
        return RevisionReadiness.model_validate(answer).state

    def sync(self) -> list[str]:
        """Have the worker catch up with the registry now; the revisions it admitted."""
        response = self._call("POST", "/admin/sync", _ADMIN_KEY_HINT)
        if response.status_code == 503:
            raise ServiceError(f"worker {self.url} cannot sync: {response.json()['error']}")
        return SyncAnswer.model_validate(response.json()).admitted

    def outcomes(self, since: float = 0.0) -> dict[str, RevisionOutcomes]:
        """Per revision, what happened to the requests this worker answered at or after `since`
        (Unix time): what a canary is watched by (`mint_core.planning.canary_judge.merge` adds
        up workers)."""
        path = "/admin/outcomes"
        payload = self._call("GET", path, _ADMIN_KEY_HINT, params={"since": since}).json()
        return {
            name: RevisionOutcomes.from_json(values)
            for name, values in payload["revisions"].items()
        }

    def usage(self, since: float = 0.0) -> tuple[list[UsageRow], float]:
        """Each principal's usage of each revision on this worker from the minute of `since`
        (Unix time) on, and from when the worker still knows it (`GET /admin/usage`)."""
        payload = self._call("GET", "/admin/usage", _ADMIN_KEY_HINT, params={"since": since}).json()
        return [UsageRow.from_json(row) for row in payload["rows"]], payload["kept_since"]

    def feedback(self, request_id: str, score: float) -> str:
        """Score the answer `request_id` (its X-Mint-Request-Id) from 0 to 1; the revision that
        served it."""
        body = {"request_id": request_id, "score": score}
        return self._call("POST", "/v1/feedback", json=body).json()["revision"]

    def readiness(self, revision: RevisionId) -> tuple[Readiness, str | None]:
        """This worker's state for `revision`, and the reason when it failed."""
        path = f"/v1/adapters/{revision.adapter}"
        status = AdapterStatus.model_validate(self._call("GET", path, _ADMIN_KEY_HINT).json())
        for entry in status.revisions:
            if entry.revision == revision.number:
                return entry.state, entry.reason
        return Readiness.NOT_ADMITTED, None

    def wait_ready(self, revision: RevisionId, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Block until the worker reports `revision` ready; NotReadyError if it fails or the
        time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            state, reason = self.readiness(revision)
            if state is Readiness.READY:
                return
            if state is Readiness.FAILED:
                raise NotReadyError(f"worker {self.url} failed to prewarm {revision}: {reason}")
            if state is Readiness.NOT_ADMITTED:
                raise NotReadyError(f"worker {self.url} reports {revision} {state}: admit it first")
            if time.monotonic() > deadline:
                raise NotReadyError(
                    f"worker {self.url} still reports {revision} {state} after {timeout_s:.0f} s"
                )
            time.sleep(0.1)

    def generate(
        self, prompt: str, adapter_id: str | None = None, max_new_tokens: int = 20
    ) -> tuple[str, str]:
        """TGI `/generate`: the generated text and the revision that served it."""
        body = {
            "inputs": prompt,
            "parameters": {"adapter_id": adapter_id, "max_new_tokens": max_new_tokens},
        }
        response = self._call("POST", "/generate", json=body)
        if response.status_code == 503:
            raise NotReadyError(f"worker {self.url}: {response.json()['error']}")
        return response.json()["generated_text"], response.headers["X-Mint-Revision"]

    def sample(
        self,
        prompt: str,
        adapter_id: str | None,
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        routes: bool = True,
    ) -> list[Sample]:
        """`n` completions of `prompt` sampled at `temperature` by `adapter_id` (`name@alias`,
        `name:rN`, None for the base), with per-token log-probabilities and, with `routes`, the
        experts each token was routed to (an MoE base on an embedded worker). They are sent at
        once, so the worker batches them; each names the revision that sampled it. With `seed`,
        sample i is seeded `seed + i`."""
        if n < 1 or temperature <= 0:
            raise ConfigurationError(
                f"n={n}, temperature={temperature}: sampling needs n >= 1 and temperature > 0"
            )

        def one(i: int) -> Sample:
            parameters = {
                "adapter_id": adapter_id,
                "max_new_tokens": max_new_tokens,
                "do_sample": True,
                "temperature": temperature,
                "seed": None if seed is None else seed + i,
                "details": True,
                "return_routes": routes,
            }
            response = self._call(
                "POST", "/generate", json={"inputs": prompt, "parameters": parameters}
            )
            if response.status_code == 503:
                raise NotReadyError(f"worker {self.url}: {response.json()['error']}")
            payload = response.json()
            details = payload["details"]
            return Sample(
                token_ids=tuple(t["id"] for t in details["tokens"]),
                logprobs=tuple(t["logprob"] for t in details["tokens"]),
                routes=_routes(details.get("routed_experts")),
                prompt_routes=_routes(details.get("prompt_routed_experts")),
                revision=response.headers["X-Mint-Revision"],
                finish_reason=details["finish_reason"],
                text=payload["generated_text"],
            )

        with ThreadPoolExecutor(max_workers=min(n, 16)) as pool:
            return list(pool.map(one, range(n)))

    def greedy_texts(
        self, model: str, prompts: Sequence[str | Sequence[Mapping[str, str]]], max_tokens: int
    ) -> list[str | None]:
        """The greedy texts `model` (an exact revision, `name:rN`) generates for `prompts`, in
        order: each text, or None where it stopped at `max_tokens` instead of ending by
        itself. Plain prompts go to `/v1/completions` a batch at a time, conversations to
        `/v1/chat/completions`; the requests are sent at once, so the worker batches them."""
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0}

        def batch(start: int) -> list[str | None]:
            chunk = prompts[start : start + MAX_PROMPTS]
            if all(isinstance(p, str) for p in chunk):
                choices = self._answer(model, "/v1/completions", body | {"prompt": chunk})
                return [c["text"] if c["finish_reason"] == "stop" else None for c in choices]
            return [self._answer_one(model, body, prompt) for prompt in chunk]

        starts = range(0, len(prompts), MAX_PROMPTS)
        with ThreadPoolExecutor(max_workers=8) as pool:
            return [text for texts in pool.map(batch, starts) for text in texts]

    def _answer_one(
        self, model: str, body: dict[str, object], prompt: str | Sequence[Mapping[str, str]]
    ) -> str | None:
        if isinstance(prompt, str):
            (choice,) = self._answer(model, "/v1/completions", body | {"prompt": prompt})
            text = choice["text"]
        else:
            chat = body | {"messages": list(prompt)}
            (choice,) = self._answer(model, "/v1/chat/completions", chat)
            text = choice["message"]["content"]
        return text if choice["finish_reason"] == "stop" else None

    def _answer(self, model: str, path: str, body: dict[str, object]) -> list[dict[str, object]]:
        """The choices of an OpenAI-style answer, checked to come from `model`."""
        response = self._call("POST", path, json=body)
        if response.status_code == 503:
            raise NotReadyError(f"worker {self.url}: {response.json()['error']}")
        payload = response.json()
        if payload["model"] != model:
            raise ServiceError(
                f"worker {self.url} answered {path} for {model} with {payload['model']}; "
                "ask for an exact revision (name:rN)"
            )
        return payload["choices"]

    def close(self) -> None:
        self._http.close()


def _message(response: httpx.Response) -> str:
    """The worker's error message (its body is `{"error", "error_type"}`), or the body as sent
    by something else on the way."""
    try:
        return str(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


def _routes(rows: list[list[list[int]]] | None) -> tuple[Route, ...] | None:
    return None if rows is None else tuple(tuple(map(tuple, layers)) for layers in rows)
