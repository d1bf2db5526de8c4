"""The evaluation gate: before a revision becomes `production`, it and the revision serving now
are scored on the same rows, and a candidate that falls behind by more than the adapter's
`max_regression` on any set is rejected with both scores as the reason.

A row's score is training's exact match: the greedy answer, ending by itself, is exactly the
row's answer. Generating is not done here: the caller passes how a revision answers (in the
pipeline, a serving worker over HTTP), so the gate scores what users would be served.
"""

import json
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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

EVAL_GENERATION_ROWS = 256
"""Most held-out rows scored by exact match (each is a greedy generation): by training's own
evaluation and by the gate; training's loss covers all."""
EVAL_ROWS_TAG = "mint.eval_data"
"""Model-version tag: the artifact-store name of the held-out rows a trained revision was
evaluated on (none for an imported one)."""
TRAIN_ROWS_TAG = "mint.train_rows"
"""Model-version tag: the artifact-store name of the content digests (`Row.digest`) of the rows
a trained revision was trained on (none for an imported one): no gate scores it on them."""
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
    return "".join(json.dumps(row.content(), ensure_ascii=False) + "\n" for row in rows).encode()


Rows = tuple[Row, ...]
Trained = Mapping[RevisionId, frozenset[str] | None]
"""The digests of the rows each revision was trained on; None (or absent) where not recorded."""


@dataclass(frozen=True)
class Exclusion:
    """Rows of a set that were not scored, and why."""

    count: int
    why: str
    """E.g. "trained on by support-bot:r2"."""

    def __str__(self) -> str:
        return f"{self.count} {self.why}"


@dataclass(frozen=True)
class EvalRows:
    """One set's rows to score both revisions on, where they come from, and the rows left out."""

    rows: Rows
    source: str
    """Where the rows come from, as the reason says it: "of eval.jsonl"."""
    excluded: tuple[Exclusion, ...] = ()


EvalSets = dict[EvalSet, EvalRows]


def choose_eval_sets(
    gates: Gates,
    revision: RevisionId,
    production: RevisionId,
    read: Callable[[str], Rows],
    stored: Callable[[RevisionId], Rows | None],
    trained: Trained,
    limit: int,
) -> EvalSets:
    """The rows `revision` and `production` are scored on, at most `limit` per set (each row is
    a generation per revision): the gates' `eval_data` and `regression_data` files (`read`),
    and, without `eval_data`, the held-out rows production was trained with, else the
    candidate's own (`stored`; None where a revision has none). A row either revision was
    `trained` on is left out of every set and counted: a revision scored on a row it learned
    shows its memory, not what users will get on new rows."""

    def screened(rows: Rows, source: str) -> EvalRows:
        kept, excluded = rows, []
        for holder in (revision, production):
            digests = trained.get(holder)
            if not digests:
                continue
            left = tuple(row for row in kept if row.digest() not in digests)
            if len(left) < len(kept):
                excluded.append(Exclusion(len(kept) - len(left), f"trained on by {holder}"))
            kept = left
        return EvalRows(kept[:limit], source, tuple(excluded))

    files = {EvalSet.EVAL: gates.eval_data, EvalSet.REGRESSION: gates.regression_data}
    sets = {
        name: screened(read(where), f"of {where.rstrip('/').rsplit('/', 1)[-1]}")
        for name, where in files.items()
        if where
    }
    if EvalSet.EVAL not in sets:
        sets.update(_held_out_rows(production, revision, stored, screened))
    return {name: sets[name] for name in EvalSet if name in sets}


def _held_out_rows(
    production: RevisionId,
    revision: RevisionId,
    stored: Callable[[RevisionId], Rows | None],
    screened: Callable[[Rows, str], EvalRows],
) -> EvalSets:
    """The eval set without the gates' `eval_data`: production's held-out rows first (a
    candidate trained on another task would pass on its own), the candidate's own where it
    trained on every one of production's."""
    first: EvalRows | None = None
    for holder in (production, revision):
        rows = stored(holder)
        if rows is None:
            continue
        chosen = screened(rows, f"{holder} was evaluated on in training")
        if first is not None:  # production's rows were all left out: say so with these
            every = f", all of {production}'s held-out rows"
            gone = tuple(Exclusion(e.count, e.why + every) for e in first.excluded)
            chosen = EvalRows(chosen.rows, chosen.source, gone + chosen.excluded)
        if chosen.rows:
            return {EvalSet.EVAL: chosen}
        first = first or chosen
    return {EvalSet.EVAL: first} if first is not None else {}


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
    return _put(store, staging, rows_name(jsonl), jsonl)


def load_rows(store: "ArtifactStore", staging: Path, name: str, revision: RevisionId) -> Rows:
    """The rows `store_rows` kept as `name` for `revision`; NotFoundError if they are gone."""
    todo = f"name the eval rows of {revision.adapter!r} in its gates (eval_data)"
    data = _get(store, staging, name, f"the eval rows of {revision} ({name})", todo)
    return parse_jsonl(data, f"{revision}'s eval rows ({name})").rows


def store_digests(store: "ArtifactStore", staging: Path, digests: Iterable[str]) -> str:
    """Keep the digests of a revision's training rows in the artifact store, one per line,
    sorted and named by their content (a retry stores the same file); the name."""
    text = "".join(f"{digest}\n" for digest in sorted(set(digests))).encode()
    return _put(store, staging, f"train-rows/{sha256_bytes(text).replace(':', '/')}.txt", text)


def load_digests(
    store: "ArtifactStore", staging: Path, name: str, revision: RevisionId
) -> frozenset[str]:
    """The training-row digests `store_digests` kept as `name` for `revision`; NotFoundError
    if they are gone."""
    what = f"the training rows of {revision} ({name})"
    todo = f"the gate cannot leave them out; release {revision.adapter!r} again from its data"
    return frozenset(_get(store, staging, name, what, todo).decode().split())


def _put(store: "ArtifactStore", staging: Path, name: str, data: bytes) -> str:
    with _staging(staging) as file:
        file.write_bytes(data)
        store.put_file(name, file)
    return name


def _get(store: "ArtifactStore", staging: Path, name: str, what: str, todo: str) -> bytes:
    with _staging(staging) as file:
        if not store.get_file(name, file):
            raise NotFoundError(f"{what} are gone from the artifact store; {todo}")
        return file.read_bytes()


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
    """How many rows both were scored on."""
    candidate: float
    production: float
    source: str = ""
    """Where the rows come from, as the reason says it: "of eval.jsonl"."""
    excluded: tuple[Exclusion, ...] = ()
    """The set's rows left out, and why."""

    def regression(self) -> float:
        """How far the candidate falls below production (negative: it does better)."""
        return self.production - self.candidate

    @property
    def left_out(self) -> int:
        return sum(e.count for e in self.excluded)

    def why_left_out(self) -> str:
        """E.g. "360 trained on by a:r2, 3 trained on by a:r1"; empty when none was."""
        return ", ".join(str(e) for e in self.excluded)

    def describe_rows(self) -> str:
        """E.g. "40 eval rows of eval.jsonl, 360 left out (360 trained on by a:r2)"."""
        rows = f"{self.rows} {self.name} rows" + (f" {self.source}" if self.source else "")
        if not self.excluded:
            return f"{rows}, none left out"
        return f"{rows}, {self.left_out} left out ({self.why_left_out()})"


@dataclass(frozen=True)
class Evaluation:
    """The gate's verdict on `candidate` against `production` over each set."""

    candidate: RevisionId
    production: RevisionId
    scores: tuple[SetScore, ...]
    max_regression: float
    unrecorded: tuple[RevisionId, ...] = ()
    """Of the two, those that record no training rows (imported, or released before they were
    recorded): rows they trained on could not be left out."""

    @property
    def passed(self) -> bool:
        # A hair of slack: 0.92 - 0.87 is 0.05000000000000004 in floating point.
        return all(s.regression() <= self.max_regression + 1e-9 for s in self.scores)

    def reason(self) -> str:
        """Both revisions' scores per set, the rows they are on, and the verdict, for the stage
        history."""
        parts = [
            f"{self.candidate} exact {s.candidate:.2f} vs production {self.production} "
            f"{s.production:.2f} on {s.describe_rows()}"
            if s.rows
            # Nothing scored, so nothing to compare: said as such, never as two scores of 0.
            else f"no {s.name} rows left to score: {s.describe_rows()}"
            for s in self.scores
        ]
        verdict = "passed" if self.passed else "rejected"
        unchecked = "".join(
            f"; {revision} records no training rows, so rows it trained on could not be left out"
            for revision in self.unrecorded
        )
        return (
            f"evaluation {verdict}: {'; '.join(parts)} "
            f"(max regression {self.max_regression}{unchecked})"
        )

    def tags(self) -> dict[str, str]:
        """Model-version tags of both revisions' scores and of the rows they are on."""
        tags = {PRODUCTION_REVISION_TAG: str(self.production)}
        for s in self.scores:
            if s.rows:
                tags[metric_tag("candidate", s.name)] = f"{s.candidate:.4f}"
                tags[metric_tag("production", s.name)] = f"{s.production:.4f}"
            prefix = _set_prefix(s.name)
            tags[f"mint.eval.{prefix}rows_scored"] = str(s.rows)
            why = f" ({s.why_left_out()})" if s.excluded else ""
            tags[f"mint.eval.{prefix}rows_left_out"] = f"{s.left_out}{why}"
        return tags

    def table(self) -> list[dict[str, object]]:
        """One row per set and revision: what the Prefect UI's table shows."""
        return [
            {"set": str(s.name), "role": role, "revision": str(revision),
             "exact_match": round(score, 4), "rows_scored": s.rows,
             "rows_left_out": s.left_out, "why_left_out": s.why_left_out()}
            for s in self.scores
            for role, revision, score in (
                ("candidate", self.candidate, s.candidate),
                ("production", self.production, s.production),
            )
        ]  # fmt: skip


def metric_tag(role: str, name: EvalSet) -> str:
    """`mint.eval.<role>.exact_match` for the eval set, `...<set>_exact_match` for others."""
    return f"mint.eval.{role}.{_set_prefix(name)}exact_match"


def _set_prefix(name: EvalSet) -> str:
    """How a set's tags are told apart: none for the eval set, `<set>_` for others."""
    return "" if name is EvalSet.EVAL else f"{name}_"
