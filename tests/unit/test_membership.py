"""The fleet's membership (`mint_core.membership`): a static roster is MINT_WORKER_URLS as
before; a registry roster adds the workers announcing themselves (`registry.members`, over an
in-memory MLflow here), freezes on a failed read, and feeds a worker's peers; a worker's
announcer beats, survives a registry outage, and marks itself gone."""

import dataclasses
import logging
import socket
from collections.abc import Iterator

import pytest
from mlflow.entities import Experiment, Run, RunData, RunInfo, RunTag, ViewType
from mlflow.store.entities.paged_list import PagedList

from mint_core.config import MintConfig
from mint_core.errors import RegistryError
from mint_core.membership import (
    FleetSource,
    FleetWatch,
    RegistryRoster,
    StaticRoster,
    current_fleet,
    open_roster,
    registry_seeds,
)
from mint_core.planning.roster import Beat, Member
from mint_core.registry._mlflow import MlflowStore
from mint_core.registry.members import LEAVING_TAG, SEQ_TAG, URL_TAG, Members
from mint_core.registry_accounts import FLEET
from mint_core.revisions import RevisionId
from serving.worker.announce import Announcer
from serving.worker.peers import Peers
from tests.helpers import wait_until

WATCH = FleetWatch(FleetSource.REGISTRY, heartbeat_s=0.05, stale_s=8.0, forget_s=60.0)
SEED = "http://seed:8000"


class MemoryRuns:
    """The `MlflowClient` calls `registry.members` makes, over runs kept in memory: an
    experiment by name, runs with tags and a status, searched by status or by a tag."""

    def __init__(self) -> None:
        self.experiments: dict[str, str] = {}
        self.runs: dict[str, tuple[dict[str, str], str]] = {}
        """run id -> (tags, status)."""
        self.down = False
        self.models_touched = 0

    def _check(self) -> None:
        if self.down:
            raise RegistryError("MLflow at memory did not answer")

    def get_experiment_by_name(self, name: str) -> Experiment | None:
        self._check()
        if name not in self.experiments:
            return None
        return Experiment(self.experiments[name], name, "", "active")

    def create_experiment(self, name: str) -> str:
        self._check()
        self.experiments[name] = str(len(self.experiments) + 1)
        return self.experiments[name]

    def create_run(self, experiment_id: str, tags: dict[str, str], run_name: str) -> Run:
        self._check()
        run_id = f"run{len(self.runs)}"
        self.runs[run_id] = (dict(tags), "RUNNING")
        return self._run(run_id)

    def _run(self, run_id: str) -> Run:
        tags, status = self.runs[run_id]
        info = RunInfo(run_id, "1", "worker", status, 0, None, "active")
        return Run(info, RunData(tags=[RunTag(k, v) for k, v in tags.items()]))

    def search_runs(
        self,
        experiment_ids: list[str],
        filter_string: str,
        run_view_type: int = ViewType.ACTIVE_ONLY,
        max_results: int = 1000,
        page_token: str | None = None,
    ) -> PagedList[Run]:
        self._check()
        if filter_string == "attributes.status = 'RUNNING'":
            found = [r for r, (_, status) in self.runs.items() if status == "RUNNING"]
        else:
            url = filter_string.split(" = ", 1)[1].strip("'")
            assert filter_string.startswith(f"tags.`{URL_TAG}`")
            found = [r for r, (tags, _) in self.runs.items() if tags.get(URL_TAG) == url]
        start = int(page_token or 0)
        page = found[start : start + max_results]
        token = str(start + max_results) if start + max_results < len(found) else None
        return PagedList([self._run(r) for r in page], token)

    def log_batch(self, run_id: str, tags: list[RunTag]) -> None:
        self._check()
        self.runs[run_id][0].update({tag.key: tag.value for tag in tags})

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self._check()
        self.runs[run_id][0][key] = value

    def end_run(self, run_id: str, status: str) -> None:
        self._check()
        self.runs[run_id] = (self.runs[run_id][0], status)

    def __getattr__(self, name: str) -> object:
        if "registered_model" in name or "model_version" in name:
            self.models_touched += 1
        raise AttributeError(name)


@pytest.fixture
def runs() -> MemoryRuns:
    return MemoryRuns()


@pytest.fixture
def members(runs: MemoryRuns) -> Members:
    store = MlflowStore("http://memory:5000")
    store.client = runs  # type: ignore[assignment]
    store.end_run = runs.end_run  # type: ignore[method-assign]
    return Members(store)


def member(url: str) -> Member:
    return Member(url, "host-1", "tiny", "sha256:x")


def test_a_static_roster_is_worker_urls_as_before() -> None:
    config = MintConfig(worker_urls=("http://b:8000/", "http://a:8000"))
    roster = open_roster(config)
    assert isinstance(roster, StaticRoster)
    roster.refresh()
    assert roster.fleet() == ("http://a:8000", "http://b:8000")
    assert roster.members() == ()
    assert current_fleet(config) == ("http://a:8000", "http://b:8000")


def test_a_registry_roster_is_chosen_by_the_setting(members: Members) -> None:
    config = MintConfig(worker_urls=(SEED,), fleet=WATCH)

    class Parts:
        pass

    registry = Parts()
    registry.members = members  # type: ignore[attr-defined]
    roster = open_roster(config, registry)  # type: ignore[arg-type]
    assert isinstance(roster, RegistryRoster)
    assert roster.fleet() == (SEED,)  # nothing read yet: the seeds


def test_workers_announce_beat_and_leave(members: Members, runs: MemoryRuns) -> None:
    clock = [0.0]
    roster = RegistryRoster((SEED,), members, WATCH, clock=lambda: clock[0])
    roster.refresh()  # no experiment yet: nobody announced
    assert roster.fleet() == (SEED,)

    joined = members.announce(member("http://c:8000/"))
    roster.refresh()
    assert roster.fleet() == ("http://c:8000", SEED)
    assert roster.members() == (member("http://c:8000"),)
    assert list(runs.experiments) == [FLEET]

    clock[0] = 7.0
    members.beat(dataclasses.replace(joined, seq=1))
    roster.refresh()
    clock[0] = 14.0
    roster.refresh()
    assert roster.fleet() == ("http://c:8000", SEED)  # beat at 7: live until 15
    clock[0] = 15.0
    roster.refresh()
    assert roster.fleet() == (SEED,)

    members.leave(joined)
    again = members.announce(member("http://c:8000"))  # a restart takes its run back
    assert again.run_id == joined.run_id and again.seq == 2
    assert len(runs.runs) == 1 and runs.runs[joined.run_id][0][SEQ_TAG] == "2"
    roster.refresh()
    assert roster.fleet() == ("http://c:8000", SEED)

    members.leave(again)
    roster.refresh()
    assert roster.fleet() == (SEED,)  # finished: gone at the next read
    assert runs.models_touched == 0


def test_a_failed_read_keeps_the_fleet(
    members: Members, runs: MemoryRuns, caplog: pytest.LogCaptureFixture
) -> None:
    clock = [0.0]
    roster = RegistryRoster((SEED,), members, WATCH, clock=lambda: clock[0])
    members.announce(member("http://c:8000"))
    roster.refresh()
    runs.down = True
    with caplog.at_level(logging.WARNING, "mint_core.membership"):
        for clock[0] in (10.0, 20.0, 100.0):
            roster.refresh()  # never raises
    assert roster.fleet() == ("http://c:8000", SEED)
    assert roster.problem is not None and "did not answer" in roster.problem
    assert len([r for r in caplog.records if "keeping the fleet" in r.message]) == 1
    runs.down = False
    clock[0] = 101.0
    roster.refresh()
    assert roster.fleet() == ("http://c:8000", SEED) and roster.problem is None


class Records:
    """Member records set by the test."""

    def __init__(self, *urls: str) -> None:
        self.urls = list(urls)

    def beats(self) -> list[Beat]:
        return [Beat(member(url), 1) for url in self.urls]


def test_peers_follow_the_roster() -> None:
    me, other = "http://me:8000", "http://other:8000"
    records = Records(me)
    peers = Peers(me, RegistryRoster((), records, WATCH), "sha256:x")
    try:
        assert peers.fleet == (me,)
        peers.refresh()
        assert peers.fleet == (me,) and peers.members == (me,)
        records.urls.append(other)
        peers.refresh()  # the joiner is in the fleet at once, a member once it answers
        assert peers.fleet == (me, other) and peers.members == (me,)
        records.urls.remove(other)
        peers.refresh()
        assert peers.fleet == (me,)
    finally:
        peers.close()


def test_a_worker_outside_a_static_fleet_has_no_peers() -> None:
    peers = Peers("http://me:8000", StaticRoster(("http://a:8000",)), "sha256:x")
    try:
        assert peers.fleet == ("http://me:8000",)
    finally:
        peers.close()


def test_a_peer_that_failed_an_ask_is_not_answering_until_it_answers_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A placed peer that cannot take an admit (cut off: here, a closed loopback port) stops
    counting as answering at once, though it stays a member for MISSES_TO_LEAVE health checks;
    the worker then admits what requests want itself (`Worker._demand`)."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{probe.getsockname()[1]}"
    me = "http://me:8000"
    peers = Peers(me, StaticRoster((me, gone)), "sha256:x")
    try:
        assert peers.answering(gone)
        peers.ask_admit(gone, RevisionId("support-bot", 1))
        wait_until(lambda: not peers.answering(gone))
        monkeypatch.setattr(Peers, "_serves_base", lambda self, client: True)  # back
        peers.refresh()
        assert peers.answering(gone)
    finally:
        peers.close()


@pytest.fixture
def announcer(members: Members) -> Iterator[Announcer]:
    announcer = Announcer(members, member("http://c:8000"), WATCH.heartbeat_s)
    yield announcer
    announcer.stop()


def test_the_announcer_beats_rides_out_an_outage_and_leaves(
    announcer: Announcer, runs: MemoryRuns
) -> None:
    def seq() -> int:
        (tags, _status), *_ = runs.runs.values()
        return int(tags[SEQ_TAG])

    announcer.start()
    wait_until(lambda: runs.runs and seq() >= 2)
    runs.down = True
    wait_until(lambda: announcer.problem is not None)
    runs.down = False
    before = seq()
    wait_until(lambda: seq() > before and announcer.problem is None)
    announcer.stop()
    assert [status for _tags, status in runs.runs.values()] == ["FINISHED"]


def test_a_registry_roster_seeds_only_worker_urls_that_are_set() -> None:
    """The default (this host's loopback) would be nobody on another host, or this host's own
    worker under a second name."""
    assert registry_seeds(MintConfig(fleet=WATCH)) == ()
    assert registry_seeds(MintConfig(worker_urls=(SEED,), fleet=WATCH)) == (SEED,)


def test_a_leaving_worker_is_left_out_at_once_and_back_when_it_restarts(
    members: Members, runs: MemoryRuns, announcer: Announcer
) -> None:
    """Told to stop, a worker marks its record leaving: readers leave it out at their next
    read, though it still beats; a restart announces it serving again."""
    roster = RegistryRoster((), members, WATCH)
    announcer.start()
    wait_until(lambda: bool(runs.runs))
    roster.refresh()
    url = announcer.member.url
    assert roster.fleet() == (url,)
    announcer.leaving()
    roster.refresh()
    assert roster.fleet() == () and roster.members() == ()
    (tags, status), *_ = runs.runs.values()
    assert tags[LEAVING_TAG] == "true" and status == "RUNNING"  # still beating, finishing
    announcer.stop()
    members.announce(announcer.member)  # started again: serving
    roster.refresh()
    assert roster.fleet() == (url,)
