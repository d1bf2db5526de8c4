"""Readable histories in the MLflow UI: each model version's description ends with a table of
what happened to that revision (stage changes, notes, approvals, alias moves to it), and the
registered model's ends with the adapter's alias history. The tables are views: the
machine-readable tags (`mint.stage_history`, `mint.alias_move.*`) stay the record, and every
write renders a table again from them, so a table that missed a write heals at the next one.

MLflow keeps both descriptions in `String(5000)` columns, which PostgreSQL enforces: a table
keeps its newest rows that fit and says how many older ones only the tags hold.

A table shows sha256 digests shortened (`files sha256:0123456789ab…`): a whole one is 64
characters with nowhere to break, and a row holding one (an artifact URI, a frozen files
digest) pushed the approver column out of MLflow's description pane at a 1440 px window.
"""

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Protocol

DESCRIPTION_CHARS = 5000
"""MLflow 3's schema declares registered-model and model-version descriptions `String(5000)`
(mlflow/store/model_registry/dbmodels/models.py); PostgreSQL refuses a longer value."""
VERSION_HEADER = "| time | event | actor | reason | approver |"
ADAPTER_HEADER = "| time | alias | from | to | actor | approver | reason |"
VERSION_HEADING = "### Revision history"
ADAPTER_HEADING = "### Alias history"
ADAPTER_ROWS = 25
"""The most alias moves the registered model's table shows: workers read every changed
registered model, description included, at each sync, so it stays small (a few kB)."""
_INTRO_CHARS = 1000
"""The most of a description's own text (above its table) kept: the table gets the rest."""
_CELL_CHARS = 300
"""Reasons are cut to this in a table (the tags keep up to 1000 characters)."""
_SHA256 = re.compile(r"(?<![0-9a-f])([0-9a-f]{12})[0-9a-f]{52}(?![0-9a-f])")
"""A sha256 digest in hex, its first 12 characters the group a table shows (the tags keep all
64): as many as `git` shows of a commit, enough to tell an adapter's revisions apart and to
search for the whole one."""


class Move(Protocol):
    """An alias move as the tables show it (`mint_core.registry.AliasMove`)."""

    @property
    def at(self) -> str: ...
    @property
    def alias(self) -> str: ...
    @property
    def from_revision(self) -> int | None: ...
    @property
    def to_revision(self) -> int: ...
    @property
    def actor(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def approver(self) -> str: ...


def version_description(
    description: str, stage_history: Sequence[Mapping[str, str]], moves: Sequence[Move]
) -> str:
    """`description`'s own text, then the revision's history table: one row per entry of its
    stage history (a stage change, a note, an approval) and per alias move to it, oldest first."""
    rows = [(entry.get("at", ""), _stage_row(entry)) for entry in stage_history]
    for move in moves:
        before = f"r{move.from_revision} " if move.from_revision is not None else ""
        event = f"{move.alias} {before}→ r{move.to_revision}"
        rows.append((move.at, [_second(move.at), event, move.actor, move.reason, move.approver]))
    rows.sort(key=lambda row: row[0])  # stable: a note and a move at one time keep their order
    return _with_table(
        description,
        VERSION_HEADING,
        VERSION_HEADER,
        [cells for _, cells in rows],
        "older rows are only in the tags `mint.stage_history` and `mint.alias_move.*`",
    )


def adapter_description(description: str, moves: Sequence[Move]) -> str:
    """`description`'s own text, then the adapter's alias history table, oldest move first."""
    rows = [
        [
            _second(move.at),
            move.alias,
            f"r{move.from_revision}" if move.from_revision is not None else "",
            f"r{move.to_revision}",
            move.actor,
            move.approver,
            move.reason,
        ]
        for move in moves
    ]
    return _with_table(
        description,
        ADAPTER_HEADING,
        ADAPTER_HEADER,
        rows,
        "older moves are only in the versions' `mint.alias_move.*` tags (`mint history` lists "
        "them all)",
        ADAPTER_ROWS,
    )


def own_text(description: str | None) -> str:
    """The part of a description above MinT's table: what was written there at registration,
    or by someone in the MLflow UI."""
    text = description or ""
    for heading in (VERSION_HEADING, ADAPTER_HEADING):
        text = text.split(f"\n\n{heading}\n", 1)[0]
        if text.startswith(f"{heading}\n"):
            return ""
    return text


def _stage_row(entry: Mapping[str, str]) -> list[str]:
    approver = entry.get("approver", "")
    if approver:
        event = "approved"
    elif entry.get("from") == entry.get("to"):
        event = "note"
    elif not entry.get("from"):  # the first entry: the stage the revision started in
        event = entry.get("to", "")
    else:
        event = f"{entry.get('from', '')} → {entry.get('to', '')}"
    return [_second(entry.get("at", "")), event, entry.get("actor", ""), entry.get("reason", ""),
            approver]  # fmt: skip


def _with_table(
    description: str,
    heading: str,
    header: str,
    rows: list[list[str]],
    older: str,
    most: int | None = None,
) -> str:
    """The description with its own text first, then as many of the newest `rows` as fit in
    DESCRIPTION_CHARS (and `most` of them at most), and a line saying how many older ones were
    left out."""
    intro = own_text(description)[:_INTRO_CHARS]
    top = f"{intro}\n\n{heading}\n" if intro else f"{heading}\n"
    table = f"{header}\n{'|---' * header.count(' | ')}|---|\n"
    lines = ["| " + " | ".join(_cell(cell) for cell in row) + " |\n" for row in rows]
    kept: list[str] = []
    room = DESCRIPTION_CHARS - len(top) - len(table)
    for line in reversed(lines[-most:] if most else lines):
        note = _older_note(len(lines) - len(kept) - 1, older)
        if len(line) + len(note) > room:
            break
        kept.insert(0, line)
        room -= len(line)
    note = _older_note(len(lines) - len(kept), older)
    return top + note + table + "".join(kept)


def _older_note(count: int, older: str) -> str:
    return f"_{count} {older}._\n\n" if count else ""


def short_digests(text: str) -> str:
    """`text` with each sha256 digest in it (64 lowercase hex characters, bare, after
    `sha256:` or in a `mint-local://sha256/<hex>` URI) cut to its first 12 characters and
    "…"."""
    return _SHA256.sub(r"\1…", text)


def _cell(text: str) -> str:
    """`text` as one markdown table cell: one line, digests shortened, pipes escaped, cut to
    _CELL_CHARS."""
    flat = short_digests(" ".join(str(text).split()))
    if len(flat) > _CELL_CHARS:
        flat = flat[: _CELL_CHARS - 1] + "…"
    return flat.replace("|", "\\|")


def _second(at: str) -> str:
    """An ISO-8601 time as UTC to the second (`2026-12-01T13:09:47Z`); as given if it is not
    one."""
    try:
        moment = datetime.fromisoformat(at)
    except ValueError:
        return at
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
