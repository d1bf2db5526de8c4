"""Serving workers announcing themselves: one MLflow run per worker in experiment `FLEET`.

A worker's run carries its URL, host, base model and digest as tags; a heartbeat bumps the tag
`SEQ_TAG`; a worker told to stop sets `LEAVING_TAG` while it finishes its requests, and ends the
run FINISHED once it has stopped. A restarted worker takes its run back (found
by `URL_TAG`) rather than piling up runs. Readers list the RUNNING runs once per refresh and
judge them on their own clock (`mint_core.planning.roster`).

Runs only: registered models, which every worker's catalog syncs by their last change, are
never touched. The registry server creates `FLEET` at start and lets the worker account edit it
and nothing else (`mint_mlflow`).
"""

from dataclasses import dataclass, replace

from mlflow.entities import RunTag, ViewType

from mint_core.planning.roster import Beat, Member
from mint_core.registry._mlflow import RUN_NAME_TAG, MlflowStore
from mint_core.registry_accounts import FLEET
from mint_core.revisions import TAG_PREFIX

MEMBER_PREFIX = TAG_PREFIX + "member."
URL_TAG = MEMBER_PREFIX + "url"
SEQ_TAG = MEMBER_PREFIX + "seq"
"""The heartbeat: a number the worker bumps; readers only compare it with what they read."""
HOST_TAG = MEMBER_PREFIX + "host"
BASE_MODEL_TAG = MEMBER_PREFIX + "base_model"
BASE_DIGEST_TAG = MEMBER_PREFIX + "base_digest"
LEAVING_TAG = MEMBER_PREFIX + "leaving"
"""`true` from when the worker was told to stop until its run ends; `false` while it serves."""
PAGE = 1000
"""Runs per page of a read (MLflow's most)."""


@dataclass(frozen=True)
class Membership:
    """A worker's run in `FLEET`, and the heartbeat it goes on from."""

    run_id: str
    seq: int


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


class Members:
    """The registry's records of the serving workers."""

    def __init__(self, store: MlflowStore) -> None:
        self.store = store
        self._experiment_id: str | None = None

    def _fleet_id(self, create: bool) -> str | None:
        """`FLEET`'s id (remembered once known); None when it does not exist and `create` is
        False."""
        if self._experiment_id is None:
            experiment = self.store.client.get_experiment_by_name(FLEET)
            if experiment is not None:
                self._experiment_id = experiment.experiment_id
            elif create:
                self._experiment_id = self.store.client.create_experiment(FLEET)
        return self._experiment_id

    def beats(self) -> list[Beat]:
        """The record of every worker that has not stopped (its run RUNNING); RegistryError
        (`mint_core.errors`) if the registry cannot be read."""
        with self.store.failing(f"read the fleet's members (experiment {FLEET!r})"):
            experiment_id = self._fleet_id(create=False)
            if experiment_id is None:
                return []  # nobody has announced yet
            beats: list[Beat] = []
            token: str | None = None
            while True:
                page = self.store.client.search_runs(
                    [experiment_id],
                    "attributes.status = 'RUNNING'",
                    ViewType.ACTIVE_ONLY,
                    PAGE,
                    page_token=token,
                )
                beats += filter(None, map(_beat, (run.data.tags for run in page)))
                token = page.token
                if not token:
                    return beats

    def announce(self, member: Member) -> Membership:
        """Mark `member` present: its run (found by its URL) RUNNING again with its tags as
        they are now, or a new run. The heartbeat goes on from the run's."""
        member = replace(member, url=member.url.rstrip("/"))
        tags = {
            URL_TAG: member.url,
            HOST_TAG: member.host,
            BASE_MODEL_TAG: member.base_model,
            BASE_DIGEST_TAG: member.base_digest,
            LEAVING_TAG: "false",
        }
        action = f"announce worker {member.url} in experiment {FLEET!r}"
        with self.store.failing(action):
            experiment_id = self._fleet_id(create=True)
            assert experiment_id is not None
            found = self.store.client.search_runs(
                [experiment_id],
                f"tags.`{URL_TAG}` = {_quoted(member.url)}",
                ViewType.ACTIVE_ONLY,
                1,
            )
            if not found:
                run = self.store.client.create_run(
                    experiment_id, tags={**tags, SEQ_TAG: "0"}, run_name=member.url
                )
                return Membership(run.info.run_id, 0)
            run = found[0]
            seq = _seq(run.data.tags.get(SEQ_TAG, "")) or 0
            seq += 1
            batch = [RunTag(key, value) for key, value in {**tags, SEQ_TAG: str(seq)}.items()]
            batch.append(RunTag(RUN_NAME_TAG, member.url))
            self.store.client.log_batch(run.info.run_id, tags=batch)
            self.store.end_run(run.info.run_id, "RUNNING")
            return Membership(run.info.run_id, seq)

    def beat(self, membership: Membership) -> None:
        """One heartbeat: `membership.seq` written (one request)."""
        with self.store.failing(f"write the heartbeat of run {membership.run_id}"):
            self.store.client.set_tag(membership.run_id, SEQ_TAG, str(membership.seq))

    def leaving(self, membership: Membership) -> None:
        """Mark the worker leaving: readers leave it out of the fleet at their next read, while
        it finishes what it has (one request)."""
        with self.store.failing(f"mark run {membership.run_id} leaving"):
            self.store.client.set_tag(membership.run_id, LEAVING_TAG, "true")

    def leave(self, membership: Membership) -> None:
        """Mark the worker gone: its run FINISHED (readers drop it at their next read)."""
        with self.store.failing(f"end run {membership.run_id} in experiment {FLEET!r}"):
            self.store.end_run(membership.run_id, "FINISHED")


def _seq(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _beat(tags: dict[str, str]) -> Beat | None:
    """The beat a run's tags record; None for a run that is not a worker's (no URL, or no
    number as its heartbeat)."""
    url = tags.get(URL_TAG, "").rstrip("/")
    seq = _seq(tags.get(SEQ_TAG, ""))
    if not url or seq is None:
        return None
    member = Member(
        url, tags.get(HOST_TAG, ""), tags.get(BASE_MODEL_TAG, ""), tags.get(BASE_DIGEST_TAG, "")
    )
    return Beat(member, seq, leaving=tags.get(LEAVING_TAG) == "true")
