"""An adapter's alias history as records: each move is one model-version tag, written as an
intent before the alias moves and marked done after (`Aliases.move`), and which moves
happened follows from the records and where the aliases point now. Pure: no MLflow calls."""

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Self

from mint_core.registry._mlflow import ALIAS_MOVE_TAG


@dataclass(frozen=True)
class AliasMove:
    """One move of an alias, as `mint history` lists it."""

    number: int
    """Its place among every alias move of the adapter, from 1."""
    at: str
    """ISO-8601 UTC time of the move."""
    alias: str
    from_revision: int | None
    to_revision: int
    actor: str
    reason: str
    approver: str = ""
    """Who approved the roll-out this move made, when its adapter's gates asked for one."""

    @property
    def tag(self) -> str:
        return f"{ALIAS_MOVE_TAG}{self.number:06d}"


@dataclass(frozen=True)
class MoveRecord:
    """An alias move as its history tag holds it: written as an intent before the alias moves,
    marked done after."""

    move: AliasMove
    done: bool

    def to_tag(self) -> str:
        return json.dumps({**asdict(self.move), "done": self.done})

    @classmethod
    def from_tag(cls, value: str) -> Self:
        fields = json.loads(value)
        done = fields.pop("done")
        return cls(AliasMove(**fields), done)


def records_in(tags: Mapping[str, str]) -> list[MoveRecord]:
    """The alias-move records among one model version's tags, in no particular order."""
    return [
        MoveRecord.from_tag(value) for key, value in tags.items() if key.startswith(ALIAS_MOVE_TAG)
    ]


def done_moves(records: Iterable[MoveRecord]) -> list[AliasMove]:
    """The moves marked done, in order: what a version's history table shows."""
    return sorted((r.move for r in records if r.done), key=lambda move: move.number)


def moves_made(records: Sequence[MoveRecord], aliases: Mapping[str, int]) -> list[AliasMove]:
    """The moves that happened, in order, from every history record (in order) and where the
    aliases point now. A record marked done happened, whatever moved the alias since (the MLflow
    UI can). One still an intent happened if its alias was next seen at its target: the next
    move of that alias started from there or, if none came after, the alias points there now.
    Otherwise its mover stopped before moving the alias."""
    made = []
    for position, record in enumerate(records):
        move = record.move
        if not record.done:
            later = (r.move for r in records[position + 1 :] if r.move.alias == move.alias)
            next_move = next(later, None)
            seen = next_move.from_revision if next_move else aliases.get(move.alias)
            if seen != move.to_revision:
                continue
        made.append(move)
    return made
