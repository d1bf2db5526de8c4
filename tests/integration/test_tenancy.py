"""Teams sharing a worker (issue 38): a principal over its quota is refused 429 at once, on
every API, with Retry-After (and Retry-After-Ms) saying when its bucket lets the next request
in; real clients read it (the OpenAI client waits it out and succeeds, huggingface_hub shows
the 429 and the message); other principals are untouched; terms change by rewriting the
tenancy file, without a restart; and what each principal used comes back from the worker and
`mint usage` as exactly the requests sent."""

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import HfHubHTTPError, TextGenerationError
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort

from flows.usage import USAGE_KEY, usage_report
from mint_cli.main import main as mint
from mint_core.config import MintConfig
from mint_core.model.base import BaseModel
from mint_core.tenancy import RELOAD_S
from processes import ManagedProcess
from serving.gateway import start_gateway

pytestmark = pytest.mark.slow

QUIET, LOUD = "key-team-a", "key-team-q"
RATE = 0.25
"""team-q's requests per second in these tests: a refusal waits about 1/RATE = 4 s."""
PROMPT = "Say: cat"
USAGE_FIELDS = ("requests", "errors", "rate_limited", "prompt_tokens", "generated_tokens")


def write_terms(path: Path, terms: dict[str, object]) -> None:
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(terms))
    partial.replace(path)
    time.sleep(RELOAD_S * 1.5)  # the worker looks at the file at most every RELOAD_S


@pytest.fixture
def terms(config: MintConfig, worker: ManagedProcess) -> Iterator[Callable[[dict], None]]:
    """Sets the worker's tenancy file for a test; no quotas again after it."""
    path = Path(config.tenancy_file)
    yield lambda terms: write_terms(path, terms)
    write_terms(path, {})


def generate(worker: ManagedProcess, key: str, path: str = "/generate", **body: object):
    payload = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}} | body
    return httpx.post(
        worker.url + path, json=payload, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


def test_over_its_quota_a_principal_is_refused_429_on_every_api_and_others_are_not(
    worker: ManagedProcess, terms: Callable[[dict], None], base: BaseModel
) -> None:
    terms({"principals": {"team-q": {"requests_per_s": RATE}}})
    assert generate(worker, LOUD).status_code == 200  # its bucket's one request
    bearer = {"Authorization": f"Bearer {LOUD}"}
    completion = {"model": base.model_id, "prompt": PROMPT, "max_tokens": 4}
    chat = {"model": base.model_id, "messages": [{"role": "user", "content": PROMPT}]}
    refused = {
        "tgi": generate(worker, LOUD),
        "tgi stream": generate(worker, LOUD, "/generate_stream"),
        "completions": httpx.post(worker.url + "/v1/completions", json=completion, headers=bearer),
        "completions stream": httpx.post(
            worker.url + "/v1/completions", json=completion | {"stream": True}, headers=bearer
        ),
        "chat": httpx.post(worker.url + "/v1/chat/completions", json=chat, headers=bearer),
    }
    for api, answer in refused.items():
        assert answer.status_code == 429, (api, answer.text)
        body = answer.json()
        assert body["error_type"] == "rate_limited" and body["limit"] == "requests_per_s", api
        assert "team-q" in body["error"] and "requests_per_s" in body["error"], api
        wait_s = int(answer.headers["Retry-After-Ms"]) / 1000
        assert 0 < wait_s <= 1 / RATE + 0.1, (api, wait_s)
        assert int(answer.headers["Retry-After"]) == max(1, -(-wait_s // 1)), api
    # Another team is untouched, and team-q is let in again once it has waited.
    assert generate(worker, QUIET).status_code == 200
    time.sleep(int(refused["chat"].headers["Retry-After-Ms"]) / 1000)
    assert generate(worker, LOUD).status_code == 200


def test_real_clients_honour_the_429(
    worker: ManagedProcess, terms: Callable[[dict], None], base: BaseModel
) -> None:
    terms({"principals": {"team-q": {"requests_per_s": RATE}}})
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key=LOUD, max_retries=2)
    client.completions.create(model=base.model_id, prompt=PROMPT, max_tokens=4)
    started = time.monotonic()
    # Refused at first; the client reads Retry-After-Ms, waits, asks again and is answered.
    answer = client.completions.create(model=base.model_id, prompt=PROMPT, max_tokens=4)
    waited = time.monotonic() - started
    assert answer.choices[0].finish_reason and 1 / RATE * 0.8 < waited < 1 / RATE * 2.5, waited

    # huggingface_hub does not retry a generation: it raises, with MinT's message, the 429
    # and its Retry-After on the response it came from.
    hf = InferenceClient(base_url=worker.url, token=LOUD)
    with pytest.raises(TextGenerationError, match="over its requests_per_s quota") as refused:
        hf.text_generation(PROMPT, max_new_tokens=4)
    http_error = refused.value.__cause__
    assert isinstance(http_error, HfHubHTTPError) and http_error.response is not None
    assert http_error.response.status_code == 429 and http_error.response.headers["Retry-After"]


def test_a_concurrency_quota_and_a_token_quota_refuse_naming_their_limit(
    worker: ManagedProcess, terms: Callable[[dict], None]
) -> None:
    terms({"principals": {"team-q": {"prompt_tokens_per_min": 6}}})
    assert generate(worker, LOUD).status_code == 200  # it goes into debt by its prompt
    answer = generate(worker, LOUD)
    assert answer.status_code == 429 and answer.json()["limit"] == "prompt_tokens_per_min"
    assert float(answer.headers["Retry-After-Ms"]) > 1000  # its debt, paid at 0.1 token/s


def test_usage_counts_exactly_the_requests_sent(
    worker: ManagedProcess,
    terms: Callable[[dict], None],
    fleet_config: MintConfig,
    base: BaseModel,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = {"Authorization": "Bearer key-admin"}

    def used() -> dict[str, int]:
        """team-q's usage of the base so far (earlier tests' included: rows are by minute)."""
        rows = httpx.get(worker.url + "/admin/usage", headers=admin).json()["rows"]
        mine = [r for r in rows if (r["principal"], r["revision"]) == ("team-q", base.model_id)]
        return {key: sum(r[key] for r in mine) for key in USAGE_FIELDS}

    terms({"principals": {"team-q": {"requests_per_s": RATE}}})
    before = used()
    answers = [
        generate(worker, LOUD, parameters={"max_new_tokens": n, "details": True}) for n in (3, 5, 7)
    ]
    assert [a.status_code for a in answers] == [200, 429, 429]
    after = used()
    sent = {key: after[key] - before[key] for key in USAGE_FIELDS}
    generated = answers[0].json()["details"]["generated_tokens"]
    prompt_tokens = len(base.text.codec.encode(PROMPT))  # the answered request's only
    assert sent == {
        "requests": 1, "errors": 0, "rate_limited": 2, "generated_tokens": generated,
        "prompt_tokens": prompt_tokens,
    }  # fmt: skip
    denied = httpx.get(worker.url + "/admin/usage", headers={"Authorization": f"Bearer {LOUD}"})
    assert denied.status_code == 403

    for name, value in fleet_config.to_env().items():
        monkeypatch.setenv(name, value)
    # The same from the command, over the fleet (one worker here), by principal: team-q has
    # used only the base.
    assert mint(["usage", "--since", "7d", "--by", "principal", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)["rows"]["team-q"]
    assert {key: report[key] for key in USAGE_FIELDS} == after

    # And where a release manager looks: the usage-report flow's table on the Artifacts page.
    assert usage_report() >= 1
    with get_client(sync_client=True) as client:
        (latest, *_) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[USAGE_KEY])),
            sort=ArtifactSort.CREATED_DESC,
            limit=1,
        )
    assert latest.type == "table" and "over the last 24 h" in str(latest.description)
    (base_row,) = [row for row in json.loads(str(latest.data)) if row["revision"] == base.model_id]
    assert "team-q" in base_row["used by"].split(", ")
    assert base_row["429s"] >= after["rate_limited"]


def test_a_gateway_enforces_its_share_and_passes_a_workers_429_on(
    worker: ManagedProcess,
    terms: Callable[[dict], None],
    config: MintConfig,
    fleet_config: MintConfig,
    tmp_path: Path,
) -> None:
    """Two gateways behind one balancer would each enforce half (MINT_TENANCY_SHARES=2): this
    one lets team-q in at RATE, half its quota; token quotas are the workers'."""
    path = tmp_path / "tenancy.json"
    path.write_text(json.dumps({"principals": {"team-q": {"requests_per_s": 2 * RATE}}}))
    gateway_config = dataclasses.replace(
        fleet_config, api_keys=config.api_keys, tenancy_file=str(path), tenancy_shares=2
    )
    gateway = start_gateway(gateway_config)
    try:
        assert generate(gateway, LOUD).status_code == 200
        refused = generate(gateway, LOUD)  # the worker has no quota: this is the gateway's
        assert refused.status_code == 429 and refused.json()["limit"] == "requests_per_s"
        assert 0 < int(refused.headers["Retry-After-Ms"]) <= 1000 / RATE + 100
        assert "x-mint-worker" not in {name.lower() for name in refused.headers}
        assert generate(gateway, QUIET).status_code == 200

        terms({"principals": {"team-a": {"prompt_tokens_per_min": 6}}})
        assert generate(gateway, QUIET).status_code == 200
        passed_on = generate(gateway, QUIET)  # the worker's own refusal, through the gateway
        assert passed_on.status_code == 429, passed_on.text
        assert passed_on.json()["limit"] == "prompt_tokens_per_min"
        assert int(passed_on.headers["Retry-After"]) >= 1 and "Retry-After-Ms" in passed_on.headers
    finally:
        gateway.stop()
