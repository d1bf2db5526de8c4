"""Which alias moves the pipeline made, and so which ones workers follow.

Anyone who may edit a registered model in MLflow (its UI, a script) can move an alias, past
prewarm, gates and approval. So the pipeline records each move it makes as an **intent**, one
registered-model tag per alias (`mint.alias_intent.production`), written before the alias
moves and marked done after. Workers serve what the intents say: an alias whose registry target
no intent accounts for is a **held move**; workers keep serving the target the pipeline last
set, report the held move (`/health`, `mint status`, an event) and take the alias only when the
pipeline moves it (promote, rollback), which writes a new intent.
"""

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from mint_core.revisions import TAG_PREFIX

INTENT_TAG = TAG_PREFIX + "alias_intent."
"""Prefix of the registered-model tags holding the pipeline's last move of each alias: small
(one per alias), so every worker sync reads them with the aliases at no extra request."""


@dataclass(frozen=True)
class AliasIntent:
    """The pipeline's last move of one alias."""

    revision: int | None
    """Where it moves the alias; None: it removes the alias."""
    previous: int | None
    """Where the alias pointed when the move began: where it still points while the move is
    under way (not `done`)."""
    actor: str
    at: str
    """ISO-8601 UTC time the move began."""
    done: bool

    def to_tag(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_tag(cls, value: str) -> "AliasIntent | None":
        """The intent a tag holds; None for a value the pipeline did not write (edited by
        hand), which then accounts for no alias."""
        try:
            fields = json.loads(value)
            return cls(**fields)
        except (ValueError, TypeError):
            return None


@dataclass(frozen=True)
class HeldMove:
    """An alias the registry points somewhere the pipeline did not move it."""

    adapter: str
    alias: str
    registry_revision: int | None
    """Where the registry's alias points (None: someone removed it)."""
    serving_revision: int | None
    """What workers serve for the alias instead: the pipeline's last target (None: nothing,
    the pipeline never set this alias)."""

    def describe(self) -> str:
        there = f"r{self.registry_revision}" if self.registry_revision else "nothing"
        kept = f"r{self.serving_revision}" if self.serving_revision else "nothing"
        return (
            f"{self.adapter}@{self.alias} was moved to {there} outside the pipeline; serving "
            f"{kept} until a promote or rollback moves it"
        )

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def intents_of(tags: Mapping[str, str]) -> dict[str, AliasIntent]:
    """Alias -> intent, from a registered model's tags."""
    found = {}
    for key, value in tags.items():
        if key.startswith(INTENT_TAG) and (intent := AliasIntent.from_tag(value)) is not None:
            found[key.removeprefix(INTENT_TAG)] = intent
    return found


def sanctioned(
    adapter: str, aliases: Mapping[str, int], intents: Mapping[str, AliasIntent]
) -> tuple[dict[str, int], list[HeldMove]]:
    """What workers serve for each alias of `adapter`, and the held moves. An alias is
    followed where its intent accounts for it: at the intent's target, or, while the move is
    under way, still at its start. Anything else is held: the intent's target is served (its
    start, if the pipeline stopped mid-move), or nothing where no intent exists. An adapter
    with no intent at all was last moved before MinT recorded intents: its aliases are
    followed as they are, so an upgrade serves what it served (until its next move)."""
    if not intents:
        return dict(aliases), []
    served: dict[str, int] = {}
    held = []
    for alias in sorted(set(aliases) | set(intents)):
        target = aliases.get(alias)
        intent = intents.get(alias)
        accounted = intent is not None and (
            target == intent.revision or (not intent.done and target == intent.previous)
        )
        if accounted:
            kept = target
        else:
            kept = None if intent is None else intent.revision if intent.done else intent.previous
            held.append(HeldMove(adapter, alias, target, kept))
        if kept is not None:
            served[alias] = kept
    return served, held
