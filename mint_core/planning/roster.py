"""Which announced workers count as members, from the heartbeats one reader has seen.

A serving worker announces itself by bumping a number (`seq`) in the registry every heartbeat.
A reader cannot compare the writer's clock with its own, so it judges on its own: it keeps, per
worker, the last `seq` it read and when (on its clock) it last saw it change. A worker whose
`seq` has not changed for `stale_s` is left out of the fleet; after `forget_s` it is forgotten
(and stays forgotten until its `seq` moves again: a crashed worker's record stays in the
registry, unchanged). A worker whose record the read no longer holds (it stopped gracefully,
or its record was deleted) is gone at once, and one whose record says it is leaving is left out
at once (`Standing.LEAVING`). The first sighting counts as a beat: a reader that
has just started trusts what it reads for `stale_s`.

Only time spent reading successfully counts: the span up to a failed read, and from it to the
next good one, ages nobody. A reader cut off from the registry keeps the fleet it had, and when
it can read again every member gets a full `stale_s` to show a new beat (its own heartbeats may
have failed during the same outage).

Pure: `seen` and `missed` return the next `Sightings`; `fleet` and `standing` read one.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # membership reads its roster through this module
    from mint_core.membership import FleetWatch


@dataclass(frozen=True)
class Member:
    """A serving worker as it announces itself."""

    url: str
    """Its name in placement: the URL every caller reaches it at."""
    host: str = ""
    base_model: str = ""
    base_digest: str = ""


@dataclass(frozen=True)
class Beat:
    """One worker's record as one read of the registry found it."""

    member: Member
    seq: int
    leaving: bool = False
    """The worker said it is leaving (told to stop, finishing what it has)."""


class Standing(StrEnum):
    """A known worker's place in one reader's roster."""

    LIVE = "live"
    """Its `seq` moved within `stale_s` of watching: in the fleet."""
    STALE = "stale"
    """Silent for `stale_s`: left out of the fleet, still remembered."""
    LEAVING = "leaving"
    """It said it is leaving: out of the fleet (placement, routing) while it finishes what it
    has; its record ends when it has stopped."""
    FORGOTTEN = "forgotten"
    """Silent for `forget_s`, or never seen: not in the fleet; back only if its `seq` moves."""


@dataclass(frozen=True)
class Sighting:
    member: Member
    seq: int
    changed_at: float
    """The roster's `watched` when this `seq` was first read."""
    leaving: bool = False


def _frozen(entries: Mapping[str, Sighting] | None = None) -> Mapping[str, Sighting]:
    return MappingProxyType(dict(entries or {}))


@dataclass(frozen=True)
class Sightings:
    """What one reader knows of the announced workers, by URL."""

    known: Mapping[str, Sighting] = field(default_factory=_frozen)
    """Workers live or stale."""
    forgotten: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Forgotten workers whose record the registry still holds, with the `seq` it held."""
    watched: float = 0.0
    """Seconds of watching that count: between successful reads only."""
    read_at: float | None = None
    """The reader's clock (monotonic) at the last read, if it succeeded; None after a failed
    one, or before the first."""


def seen(state: Sightings, beats: Iterable[Beat], now: float, watch: "FleetWatch") -> Sightings:
    """`state` after a read at `now` (the reader's monotonic clock) that found `beats`: the
    registry's records of the workers that have not stopped, all of them."""
    watched = state.watched + (0.0 if state.read_at is None else max(0.0, now - state.read_at))
    known: dict[str, Sighting] = {}
    forgotten: dict[str, int] = {}
    for beat in beats:
        url = beat.member.url
        before = state.known.get(url)
        if before is not None and before.seq == beat.seq:
            sighting = replace(before, member=beat.member, leaving=beat.leaving)
        elif state.forgotten.get(url) == beat.seq:
            forgotten[url] = beat.seq
            continue
        else:
            sighting = Sighting(beat.member, beat.seq, watched, beat.leaving)
        if watched - sighting.changed_at >= watch.forget_s:
            forgotten[url] = beat.seq
        else:
            known[url] = sighting
    return Sightings(_frozen(known), MappingProxyType(forgotten), watched, now)


def missed(state: Sightings) -> Sightings:
    """`state` after a read that failed: the same members; the time until the next good read
    does not count."""
    return replace(state, read_at=None)


def standing(state: Sightings, url: str, watch: "FleetWatch") -> Standing:
    """Where worker `url` stands as of the last good read."""
    sighting = state.known.get(url)
    if sighting is None:
        return Standing.FORGOTTEN
    if sighting.leaving:
        return Standing.LEAVING
    if state.watched - sighting.changed_at >= watch.stale_s:
        return Standing.STALE
    return Standing.LIVE


def members(state: Sightings, watch: "FleetWatch") -> tuple[Member, ...]:
    """The live members, by URL."""
    return tuple(
        state.known[url].member
        for url in sorted(state.known)
        if standing(state, url, watch) is Standing.LIVE
    )


def fleet(state: Sightings, watch: "FleetWatch") -> tuple[str, ...]:
    """The live members' URLs, sorted."""
    return tuple(member.url for member in members(state, watch))
