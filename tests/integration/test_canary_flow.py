"""The canary flow end to end: while a client sends requests for `canary-flow-bot@production` and
scores each answer by whether it is right, a candidate as good as production is promoted and one
trained on another task is rolled back, with no request failing during either; the alias
history holds both decisions with their figures."""

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from flows.canary import canary
from mint_core.config import MintConfig
from mint_core.errors import RejectedError
from mint_core.gates import Gates
from mint_core.model.toy import RECIPE, Task, held_out_words, prompt_for
from mint_core.registry import Registry
from mint_core.revisions import CANARY, RevisionId, RevisionRef
from mint_core.states import Stage
from processes import ManagedProcess
from tests.integration.helpers import register_step_by_step
from tests.integration.helpers import toy_release as release

pytestmark = pytest.mark.slow

ADAPTER = "canary-flow-bot"
WORDS = held_out_words(32)
SETTINGS = {"percent": 25, "window_s": 5, "min_requests": 20}
"""Judged on requests, not seconds: a window is extended, up to three, until the candidate has
served `min_requests` (the scoring client's quarter reaching it: 119 to 128 in a 5 s window,
idle)."""


@dataclass
class ScoringClient:
    """Asks for `canary-flow-bot` (= production) over and over from a few threads and scores every
    answer: 1 if it is the word in upper case, else 0."""

    url: str
    served: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    @contextmanager
    def running(self, threads: int = 3) -> Iterator[None]:
        workers = [threading.Thread(target=self._ask, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        try:
            yield
        finally:
            self._stop.set()
            for worker in workers:
                worker.join()

    def _ask(self, offset: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as http:
            n = offset
            while not self._stop.is_set():
                word = WORDS[n % len(WORDS)]
                n += 1
                body = {
                    "inputs": prompt_for(word),
                    "parameters": {"adapter_id": ADAPTER, "max_new_tokens": len(word) + 2},
                }
                answer = http.post("/generate", json=body)
                if answer.status_code != 200:
                    self.failures.append(f"{answer.status_code} {answer.text}")
                    continue
                self.served[answer.headers["X-Mint-Revision"]] += 1
                score = float(answer.json()["generated_text"] == Task.UPPER.answer(word))
                request_id = answer.headers["X-Mint-Request-Id"]
                scored = http.post("/v1/feedback", json={"request_id": request_id, "score": score})
                if scored.status_code != 200:
                    self.failures.append(f"feedback {scored.status_code} {scored.text}")


@pytest.fixture(scope="module")
def revisions(fleet_config: MintConfig) -> dict[str, RevisionId]:
    """r1 in production and two registered candidates: r2 trained like it (another seed), r3
    trained on another task."""
    production = release(ADAPTER, "upper").revision
    # Margins with room for the recipe's spread between seeds (bench/results/recipe.json) and
    # a loaded machine's latency, far less than a revision of another task falls behind.
    Registry(fleet_config.tracking_uri).gates.set(
        ADAPTER, Gates(canary_max_score_drop=0.3, canary_max_p95_ratio=5.0)
    )
    good, _, _ = register_step_by_step(
        fleet_config, ADAPTER, "upper", rows=12_800, **RECIPE, steps=None, seed=1
    )
    bad, _, _ = register_step_by_step(fleet_config, ADAPTER, "reverse", steps=40)
    return {"production": RevisionId(ADAPTER, int(production.rsplit("r", 1)[1])), "good": good,
            "bad": bad}  # fmt: skip


def canary_under_traffic(
    worker: ManagedProcess, candidate: RevisionId
) -> tuple[bool, str, ScoringClient]:
    client = ScoringClient(worker.url)
    with client.running():
        report = canary(ADAPTER, candidate.number, **SETTINGS)
    return report.promoted, report.reason, client


def test_a_good_candidate_is_promoted_and_a_bad_one_rolled_back(
    revisions: dict[str, RevisionId], worker: ManagedProcess, fleet_config: MintConfig
) -> None:
    registry = Registry(fleet_config.tracking_uri)
    first, good, bad = revisions["production"], revisions["good"], revisions["bad"]

    promoted, reason, client = canary_under_traffic(worker, good)
    assert client.failures == []
    assert set(client.served) == {str(first), str(good)}
    print(reason)  # the figures, for `pytest -s`
    assert promoted, reason
    assert registry.revisions.resolve(RevisionRef(ADAPTER)).id == good
    assert registry.canary.current(ADAPTER) is None

    promoted, reason, client = canary_under_traffic(worker, bad)
    assert client.failures == []
    assert set(client.served) == {str(good), str(bad)}
    print(reason)
    assert not promoted
    assert reason.startswith("rolled back: mean feedback")
    assert registry.revisions.resolve(RevisionRef(ADAPTER)).id == good
    assert registry.revisions.get(bad).stage is Stage.REJECTED
    assert registry.canary.current(ADAPTER) is None

    canary_moves = [m for m in registry.aliases.history(ADAPTER) if m.alias == CANARY]
    assert [(m.to_revision, m.reason.split(":")[0]) for m in canary_moves] == [
        (good.number, "canary"),
        (good.number, "promoted"),  # the canary ends on production, now the candidate
        (bad.number, "canary"),
        (good.number, "rolled back"),
    ]
    for move in canary_moves[1], canary_moves[3]:
        assert f"canary {ADAPTER}:r" in move.reason and "mean feedback" in move.reason
    (promotion,) = [m for m in registry.aliases.history(ADAPTER) if m.to_revision == good.number
                    and m.alias == "production"]  # fmt: skip
    assert promotion.reason.startswith("canary promoted: within every margin")

    # A canary stopped on its way (here: promotion needs an approval that never comes) hands
    # its share back to production and leaves production where it was.
    registry.gates.set(ADAPTER, registry.gates.of(ADAPTER).changed(
        requires_approval=True, approvers=["alice"], approval_timeout_s=2))  # fmt: skip
    client = ScoringClient(worker.url)
    with client.running(), pytest.raises(RejectedError, match="no allowed answer within 2 s"):
        canary(ADAPTER, first.number, **SETTINGS)  # r1, as good as r2: promoted, pending approval
    assert client.failures == []
    assert registry.canary.current(ADAPTER) is None
    assert registry.revisions.resolve(RevisionRef(ADAPTER)).id == good
    assert registry.revisions.get(first).stage is Stage.REJECTED
    assert registry.aliases.history(ADAPTER)[-1].reason.startswith("stopped: RejectedError")
