"""The evaluation gate: before a revision becomes `production`, it and the revision serving now
are scored on the same rows, and a candidate that falls behind by more than the adapter's
`max_regression` on any set is rejected with both scores as the reason.

A row's score is training's exact match: the greedy answer, ending by itself, is exactly the
row's answer. Generating is not done here: the caller passes how a revision answers (in the
pipeline, a serving worker over HTTP), so the gate scores what users would be served.
"""

import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from mint_core.artifacts.digests import sha256_bytes
from mint_core.errors import NotFoundError
from mint_core.gates import Gates
from mint_core.model.datasets import Row, parse_jsonl
from mint_core.model.text import Message
from mint_core.revisions import RevisionId

if TYPE_CHECKING:  # boto3, for a type only
    from mint_core.artifacts.stores import ArtifactStore

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


Rows = tuple[Row, ...]
EvalSets = dict[EvalSet, tuple[Rows, str]]
"""Each set's rows and where they come from ("of eval.jsonl")."""


def choose_eval_sets(
    gates: Gates,
    revision: RevisionId,
    production: RevisionId,
    read: Callable[[str], Rows],
    stored: Callable[[RevisionId], Rows | None],
    limit: int,
) -> EvalSets:
    """The rows `revision` and `production` are scored on, at most `limit` per set (each row is
    a generation per revision): the gates' `eval_data` and `regression_data` files (`read`),
    and, without `eval_data`, the held-out rows production was trained with, else the
    candidate's own (`stored`; None where a revision has none)."""
    files = {EvalSet.EVAL: gates.eval_data, EvalSet.REGRESSION: gates.regression_data}
    sets = {
        name: (read(where), f"of {where.rstrip('/').rsplit('/', 1)[-1]}")
        for name, where in files.items()
        if where
    }
    if EvalSet.EVAL not in sets:
        # Production's rows first: a candidate trained on another task would pass on its own.
        for holder in (production, revision):
            rows = stored(holder)
            if rows is not None:
                sets[EvalSet.EVAL] = (rows, f"{holder} was evaluated on in training")
                break
    return {name: (sets[name][0][:limit], sets[name][1]) for name in EvalSet if name in sets}


@contextmanager
def _staging(folder: Path) -> Iterator[Path]:
    """A file name of its own under `folder` for the block, removed after it: the artifact
    store puts and gets files, not bytes."""
    staging = folder / f".{uuid.uuid4().hex}.jsonl"
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield staging
    finally:
        staging.unlink(missing_ok=True)


def store_rows(store: "ArtifactStore", staging: Path, rows: Sequence[Row]) -> str:
    """Keep `rows` in the artifact store, named by their content (`rows_name`); the name.
    `staging`: a folder for the file on its way."""
    jsonl = to_jsonl(rows)
    name = rows_name(jsonl)
    with _staging(staging) as file:
        file.write_bytes(jsonl)
        store.put_file(name, file)
    return name


def load_rows(store: "ArtifactStore", staging: Path, name: str, revision: RevisionId) -> Rows:
    """The rows `store_rows` kept as `name` for `revision`; NotFoundError if they are gone."""
    with _staging(staging) as file:
        if not store.get_file(name, file):
            raise NotFoundError(
                f"the eval rows of {revision} ({name}) are gone from the artifact store; name "
                f"the eval rows of {revision.adapter!r} in its gates (eval_data)"
            )
        return parse_jsonl(file.read_bytes(), f"{revision}'s eval rows ({name})").rows


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
