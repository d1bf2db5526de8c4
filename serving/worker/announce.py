"""A worker announcing itself to the fleet (MINT_FLEET=registry): on a thread of its own, it
marks itself present in the registry (`mint_core.registry.members`), then bumps its heartbeat
every `heartbeat_s`; `leaving` marks it leaving (told to stop, finishing its requests), and
stopping marks it gone. The thread never holds a lock the worker's sync or
requests take: a slow or unreachable registry delays only the next beat. A beat that fails is
logged once per outage and tried again at the next one; readers judge silence on their own
clock (`mint_core.planning.roster`), so the worker does not have to."""

import logging
import threading
from dataclasses import replace

from mint_core.config import MintConfig
from mint_core.errors import RegistryError
from mint_core.membership import FleetSource
from mint_core.planning.roster import Member
from mint_core.registry import Registry
from mint_core.registry.members import Members, Membership

log = logging.getLogger(__name__)

LEAVE_WAIT_S = 5.0
"""How long stopping waits for a beat in flight before marking the worker gone."""


class Announcer:
    """Announces `member` in `members` every `heartbeat_s`, from `start` until `stop`."""

    def __init__(self, members: Members, member: Member, heartbeat_s: float) -> None:
        self.member = member
        self._members = members
        self._heartbeat_s = heartbeat_s
        self._membership: Membership | None = None
        self._problem: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="announce", daemon=True)

    def start(self) -> "Announcer":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._beat()
            except RegistryError as e:
                if self._problem is None:
                    log.warning("cannot announce %s to the fleet: %s", self.member.url, e)
                self._problem = str(e)
            else:
                if self._problem is not None:
                    log.info("announcing %s to the fleet again", self.member.url)
                self._problem = None
            self._stopped.wait(self._heartbeat_s)

    def _beat(self) -> None:
        if self._membership is None:
            self._membership = self._members.announce(self.member)
            log.info("announced %s to the fleet (run %s)", self.member.url, self._membership.run_id)
            return
        beat = replace(self._membership, seq=self._membership.seq + 1)
        self._members.beat(beat)
        self._membership = beat

    @property
    def problem(self) -> str | None:
        """Why the last beat failed; None if it was written."""
        return self._problem

    def leaving(self) -> None:
        """Mark the worker leaving now (readers leave it out of the fleet), beating on until
        `stop`; a registry that does not answer is logged, and readers drop the worker when it
        stops."""
        membership = self._membership
        if membership is None:
            return  # never announced: nobody reads it in the fleet
        try:
            self._members.leaving(membership)
        except RegistryError as e:
            log.warning("could not mark %s leaving the fleet: %s", self.member.url, e)
        else:
            log.info("leaving the fleet: %s", self.member.url)

    def stop(self) -> None:
        """Stop beating and mark the worker gone (readers drop it at their next read); a
        registry that does not answer is logged, and readers drop the worker once it is
        stale."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=LEAVE_WAIT_S)
        if self._membership is None:
            return
        try:
            self._members.leave(self._membership)
        except RegistryError as e:
            log.warning("could not mark %s gone from the fleet: %s", self.member.url, e)
        else:
            log.info("left the fleet: %s", self.member.url)


def announcer_for(config: MintConfig, me: str, base_digest: str) -> Announcer | None:
    """The announcer of worker `me` (its URL as the fleet names it) serving `base_digest`, when
    the fleet is read from the registry (MINT_FLEET=registry); None otherwise."""
    if config.fleet.source is not FleetSource.REGISTRY:
        return None
    member = Member(me.rstrip("/"), config.host_name, config.base.name, base_digest)
    members = Registry(config.tracking_uri).members
    return Announcer(members, member, config.fleet.heartbeat_s)
