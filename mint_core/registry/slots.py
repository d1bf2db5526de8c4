"""An adapter's roll-out slot as a value: what every move of one of its aliases needs.

Each alias move takes the next number in its adapter's alias history from the records it reads
(`Aliases.move`), so two moves of one adapter at once can write one number twice. The
slot that keeps them apart is a lock outside the domain (a Prefect global concurrency limit,
`tasks.pipeline.rollout_lock`, held across processes); the domain sees the `RolloutSlot` that
lock hands its holder. Every alias move (`Aliases.move`, `activate`, a canary's start and end)
takes one as a required argument and refuses one that is another adapter's or no longer held,
so a move outside the lock fails at the call instead of racing."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from mint_core.errors import SlotNotHeldError


class RolloutSlot:
    """Proof that its holder holds `adapter`'s roll-out slot, for as long as it does. Only a
    roll-out lock makes one (`held_slot`); it stops being held when the lock is let go."""

    __slots__ = ("_released", "adapter", "lock")

    def __init__(self, adapter: str, lock: str, _key: object = None) -> None:
        if _key is not _LOCKS_ONLY:
            raise SlotNotHeldError(
                f"a roll-out slot of {adapter!r} can only come from its roll-out lock: move "
                f"aliases inside `with rollout_lock({adapter!r}) as slot:` and pass that slot"
            )
        self.adapter = adapter
        self.lock = lock  # the lock's name, for messages
        # A plain class with an Event, not a frozen dataclass: Prefect rebuilds dataclasses
        # passed to tasks, and a rebuilt copy would not see the lock let go.
        self._released = threading.Event()

    @property
    def held(self) -> bool:
        return not self._released.is_set()

    def check(self, adapter: str) -> None:
        """SlotNotHeldError unless this is `adapter`'s slot and is still held."""
        if adapter != self.adapter:
            raise SlotNotHeldError(
                f"the roll-out slot of {self.adapter!r} cannot move aliases of {adapter!r}: "
                f"take {adapter!r}'s own (`rollout_lock({adapter!r})`)"
            )
        if not self.held:
            raise SlotNotHeldError(
                f"the roll-out slot of {adapter!r} ({self.lock}) was let go before this alias "
                "move: move aliases inside the `with rollout_lock(...)` block that took it"
            )

    def __repr__(self) -> str:
        return f"RolloutSlot({self.adapter!r}, {'held' if self.held else 'released'})"


_LOCKS_ONLY = object()


@contextmanager
def held_slot(adapter: str, lock: str) -> Iterator[RolloutSlot]:
    """The slot of `adapter`, for a roll-out lock to yield once it holds `lock` (and for no one
    else): released when the block ends, however it ends."""
    slot = RolloutSlot(adapter, lock, _LOCKS_ONLY)
    try:
        yield slot
    finally:
        slot._released.set()
