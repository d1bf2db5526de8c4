"""Which serving workers make up the fleet: the static list (MINT_WORKER_URLS) or workers that
announce themselves with a heartbeat in the registry (MINT_FLEET=registry), so that a serve host
joins or leaves without anyone editing another host's environment. `FleetWatch` is the setting.

Every reader (a worker's peers, the gateway, the pipeline, `mint status`) holds a `Roster`
(`open_roster`): `refresh()` reads the source once, `fleet()` names the workers known and not
gone, MINT_WORKER_URLS included. Placement is over those names, so readers agree on it as long
as they read the same records; who of the fleet answers right now is each reader's own check.
Announcing is the worker's side (`serving.worker.announce`); how a reader judges what it read is
`mint_core.planning.roster`.
"""

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from mint_core.errors import ConfigurationError, RegistryError
from mint_core.planning import roster
from mint_core.planning.roster import Beat, Member, Sightings
from mint_core.settings import milliseconds, show_milliseconds

if TYPE_CHECKING:
    from mint_core.config import MintConfig
    from mint_core.registry import Registry

log = logging.getLogger(__name__)

_TIMES = ("MINT_HEARTBEAT_MS", "MINT_FLEET_STALE_MS", "MINT_FLEET_FORGET_MS")


class FleetSource(StrEnum):
    """Where the fleet's members are read from (MINT_FLEET)."""

    STATIC = "static"
    """MINT_WORKER_URLS, the same list on every host."""
    REGISTRY = "registry"
    """MINT_WORKER_URLS, and every worker whose heartbeat the registry (MLflow) holds."""


@dataclass(frozen=True)
class FleetWatch:
    """Where members come from and how fast a silent one is dropped."""

    source: FleetSource = FleetSource.STATIC
    heartbeat_s: float = 2.0
    """How often a worker announces itself (MINT_FLEET=registry)."""
    stale_s: float = 8.0
    """A member whose heartbeat has not changed for this long is left out of placement: three
    beats missed and two seconds for a slow registry."""
    forget_s: float = 60.0
    """A stale member is forgotten after this long (its run in the registry stays)."""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.stale_s <= self.forget_s:
            raise ValueError(
                f"has heartbeat {self.heartbeat_s:g} s, stale after {self.stale_s:g} s and "
                f"forgotten after {self.forget_s:g} s; they must grow in that order, each positive"
            )

    @classmethod
    def parse(cls, source: str, heartbeat_ms: str, stale_ms: str, forget_ms: str) -> "FleetWatch":
        """The watch MINT_FLEET and its three times (ms) set; ConfigurationError naming a bad
        one."""
        try:
            kind = FleetSource(source.strip().lower())
        except ValueError:
            raise ValueError(f"is not one of {', '.join(FleetSource)}") from None
        times = []
        for name, text in zip(_TIMES, (heartbeat_ms, stale_ms, forget_ms), strict=True):
            try:
                times.append(milliseconds(text))
            except ValueError as e:
                raise ConfigurationError(f"{name}={text!r} {e}") from None
        try:
            return cls(kind, *times)
        except ValueError as e:
            raise ConfigurationError(f"{', '.join(_TIMES)} {e}") from None

    def texts(self) -> tuple[str, str, str, str]:
        """The variables' texts `parse` gives this watch back from."""
        times = (self.heartbeat_s, self.stale_s, self.forget_s)
        return (str(self.source), *map(show_milliseconds, times))  # type: ignore[return-value]


class Roster(Protocol):
    """The fleet as one reader knows it."""

    def refresh(self) -> None:
        """Read the source once (blocking I/O). A failed read changes nothing and raises
        nothing: the reader keeps the fleet it had."""

    def fleet(self) -> tuple[str, ...]:
        """The workers known and not gone: MINT_WORKER_URLS and the live members, sorted, each
        URL without a trailing '/'."""

    def members(self) -> tuple[Member, ...]:
        """The announced workers now live (none for a static roster)."""


class MemberRecords(Protocol):
    """Where announced workers are read (the registry's `members` part)."""

    def beats(self) -> list[Beat]:
        """The record of every worker that has not stopped; RegistryError if unreadable."""


def _seeds(urls: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted({url.rstrip("/") for url in urls}))


class StaticRoster:
    """MINT_WORKER_URLS and nothing else: what every host had before MINT_FLEET."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._fleet = _seeds(urls)

    def refresh(self) -> None:
        pass

    def fleet(self) -> tuple[str, ...]:
        return self._fleet

    def members(self) -> tuple[Member, ...]:
        return ()


class RegistryRoster:
    """MINT_WORKER_URLS and every worker whose heartbeat the registry shows live; thread-safe
    (one thread refreshes while others read)."""

    def __init__(
        self,
        seeds: Sequence[str],
        records: MemberRecords,
        watch: FleetWatch,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._seeds = _seeds(seeds)
        self._records = records
        self._watch = watch
        self._clock = clock
        self._sightings = Sightings()
        self._fleet = self._seeds
        self._problem: str | None = None
        self._lock = threading.Lock()

    def refresh(self) -> None:
        with self._lock:
            try:
                beats = self._records.beats()
            except RegistryError as e:
                if self._problem is None:
                    log.warning("cannot read the fleet's members; keeping the fleet: %s", e)
                self._problem = str(e)
                self._sightings = roster.missed(self._sightings)
                return
            if self._problem is not None:
                log.info("reading the fleet's members again")
                self._problem = None
            self._sightings = roster.seen(self._sightings, beats, self._clock(), self._watch)
            fleet = tuple(sorted({*self._seeds, *roster.fleet(self._sightings, self._watch)}))
            if fleet != self._fleet:
                log.info("fleet: %s", ", ".join(fleet))
            self._fleet = fleet

    def fleet(self) -> tuple[str, ...]:
        return self._fleet

    def members(self) -> tuple[Member, ...]:
        return roster.members(self._sightings, self._watch)

    @property
    def problem(self) -> str | None:
        """Why the last read failed; None if it succeeded."""
        return self._problem


def open_roster(config: "MintConfig", registry: "Registry | None" = None) -> Roster:
    """The roster `config.fleet` names: static (`config.worker_urls`), or read from `registry`
    (a client of `config.tracking_uri` when not given) and seeded with `registry_seeds`."""
    if config.fleet.source is FleetSource.STATIC:
        return StaticRoster(config.worker_urls)
    if registry is None:
        from mint_core.registry import Registry  # MLflow's client only where it is read

        registry = Registry(config.tracking_uri)
    return RegistryRoster(registry_seeds(config), registry.members, config.fleet)


def registry_seeds(config: "MintConfig") -> tuple[str, ...]:
    """The workers a registry roster counts whatever the registry says: MINT_WORKER_URLS if
    set. Left at its default (this host's loopback) it names nothing: on another host it is
    nobody, or this host's own worker under a second name, and placement must see one name per
    worker; a worker there announces itself anyway."""
    from mint_core.config import MintConfig

    return () if config.worker_urls == MintConfig.worker_urls else config.worker_urls


def current_fleet(config: "MintConfig", registry: "Registry | None" = None) -> tuple[str, ...]:
    """The fleet as one read finds it now, for a caller that reads it once (a roll-out, `mint
    status`): every worker announcing itself counts, since there is no earlier read to judge
    its heartbeat against; those that do not answer are the caller's to leave out."""
    fleet = open_roster(config, registry)
    fleet.refresh()
    return fleet.fleet()
