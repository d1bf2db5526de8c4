"""The evaluation gate: before a revision becomes `production`, it and the revision serving now
are scored on the same rows, and a candidate that falls behind by more than the adapter's
`max_regression` on any set is rejected with both scores as the reason.

A row's score is training's exact match: the greedy answer, ending by itself, is exactly the
row's answer. Generating is not done here: the caller passes how a revision answers (in the
pipeline, a serving worker over HTTP), so the gate scores what users would be served.
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from mint_core.digests import sha256_bytes
from mint_core.model.datasets import Row
from mint_core.model.text import Message
from mint_core.revisions import RevisionId

EVAL_ROWS_TAG = "mint.eval_data"
"""Model-version tag: the artifact-store name of the held-out rows a trained revision was
evaluated on (none for an imported one)."""
PRODUCTION_REVISION_TAG = "mint.eval.production_revision"

Prompt = str | tuple[Message, ...]
"""What a revision is asked: a prompt, or a conversation up to its last assistant turn."""
Generate = Callable[[Sequence[Prompt], int], Sequence[str | None]]
"""How a revision answers `prompts` greedily within a number of new tokens: each answer's
text, or None where it did not end by itself."""


class EvalSet(StrEnum):
    EVAL = "eval"
    """The adapter's eval rows: what it must do."""
    REGRESSION = "regression"
    """Optional further rows: what it must not forget."""


def rows_name(jsonl: bytes) -> str:
    """Where held-out rows are kept in the artifact store: named by their content, so the
    same rows are stored once."""
    return f"eval-rows/{sha256_bytes(jsonl).replace(':', '/')}.jsonl"


def to_jsonl(rows: Sequence[Row]) -> bytes:
    """`rows` as a JSONL file `parse_jsonl` reads back."""
    lines = []
    for row in rows:
        if row.messages is not None:
            value: dict[str, object] = {"messages": [dict(m) for m in row.messages]}
        else:
            value = {"prompt": row.prompt, "completion": row.completion}
        lines.append(json.dumps(value, ensure_ascii=False) + "\n")
    return "".join(lines).encode()


def exact_match(rows: Sequence[Row], generate: Generate) -> float:
    """Share of `rows` whose greedy answer, ending by itself, is exactly the row's answer."""
    if not rows:
        return 0.0
    asked, expected = zip(*(row.prompt_and_answer() for row in rows), strict=True)
    # Room for the longest answer at one token per UTF-8 byte (the most a byte-level
    # tokenizer spends), its end of sequence and one more: a longer answer cannot be right.
    budget = max(len(answer.encode()) for answer in expected) + 2
    answers = generate(asked, budget)
    return sum(got == want for got, want in zip(answers, expected, strict=True)) / len(rows)


@dataclass(frozen=True)
class SetScore:
    """Both revisions' exact match on one set of rows."""

    name: EvalSet
    rows: int
    candidate: float
    production: float
    source: str = ""
    """Where the rows come from, as the reason says it: "of eval.jsonl"."""

    def regression(self) -> float:
        """How far the candidate falls below production (negative: it does better)."""
        return self.production - self.candidate


@dataclass(frozen=True)
class Evaluation:
    """The gate's verdict on `candidate` against `production` over each set."""

    candidate: RevisionId
    production: RevisionId
    scores: tuple[SetScore, ...]
    max_regression: float

    @property
    def passed(self) -> bool:
        # A hair of slack: 0.92 - 0.87 is 0.05000000000000004 in floating point.
        return all(s.regression() <= self.max_regression + 1e-9 for s in self.scores)

    def reason(self) -> str:
        """Both revisions' scores per set and the verdict, for the stage history."""
        parts = [
            f"{self.candidate} exact {s.candidate:.2f} vs production {self.production} "
            f"{s.production:.2f} on {s.rows} {s.name} rows" + (f" {s.source}" if s.source else "")
            for s in self.scores
        ]
        verdict = "passed" if self.passed else "rejected"
        return f"evaluation {verdict}: {'; '.join(parts)} (max regression {self.max_regression})"

    def tags(self) -> dict[str, str]:
        """Model-version tags of both revisions' scores."""
        tags = {PRODUCTION_REVISION_TAG: str(self.production)}
        for s in self.scores:
            tags[metric_tag("candidate", s.name)] = f"{s.candidate:.4f}"
            tags[metric_tag("production", s.name)] = f"{s.production:.4f}"
        return tags

    def table(self) -> list[dict[str, object]]:
        """One row per set and revision: what the Prefect UI's table shows."""
        return [
            {"set": str(s.name), "rows": s.rows, "role": role, "revision": str(revision),
             "exact_match": round(score, 4)}
            for s in self.scores
            for role, revision, score in (
                ("candidate", self.candidate, s.candidate),
                ("production", self.production, s.production),
            )
        ]  # fmt: skip


def metric_tag(role: str, name: EvalSet) -> str:
    """`mint.eval.<role>.exact_match` for the eval set, `...<set>_exact_match` for others."""
    prefix = "" if name is EvalSet.EVAL else f"{name}_"
    return f"mint.eval.{role}.{prefix}exact_match"
