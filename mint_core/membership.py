"""Which serving workers make up the fleet: the static list (MINT_WORKER_URLS) or workers that
announce themselves with a heartbeat in the registry (MINT_FLEET=registry), so that a serve host
joins or leaves without anyone editing another host's environment. `FleetWatch` is the setting."""

from dataclasses import dataclass
from enum import StrEnum

from mint_core.errors import ConfigurationError
from mint_core.settings import milliseconds, show_milliseconds

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
