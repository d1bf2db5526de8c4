import itertools

import pytest

from mint_core.errors import ConfigurationError, TransitionError
from mint_core.revisions import MAX_REVISION, PolicyRecord, RevisionRef, check_adapter_name
from mint_core.states import Readiness, Stage, transition
from tests.helpers import make_policy


@pytest.mark.parametrize(
    ("text", "adapter", "revision", "alias", "spelled"),
    [
        ("support-bot", "support-bot", None, "production", "support-bot@production"),
        ("support-bot@candidate", "support-bot", None, "candidate", "support-bot@candidate"),
        ("support-bot:r3", "support-bot", 3, None, "support-bot:r3"),
        (" a_1:r12 ", "a_1", 12, None, "a_1:r12"),
    ],
)
def test_revision_refs_parse(
    text: str, adapter: str, revision: int | None, alias: str | None, spelled: str
) -> None:
    ref = RevisionRef.parse(text)
    assert (ref.adapter, ref.revision, ref.alias) == (adapter, revision, alias)
    assert str(ref) == spelled


@pytest.mark.parametrize("text", ["", "Support", "bot:3", "bot:r0", "bot@", "bot:r1@x", "a/b"])
def test_bad_revision_refs_name_the_value(text: str) -> None:
    with pytest.raises(ConfigurationError, match=r"not valid|r1 or later"):
        RevisionRef.parse(text)


def test_the_largest_revision_a_registry_holds_parses() -> None:
    assert RevisionRef.parse(f"bot:r{MAX_REVISION}").revision == 2**63 - 1
    assert RevisionRef.parse("bot:r007").revision == 7


@pytest.mark.parametrize(
    ("text", "named"),
    [
        # One past SQLite's int64: it overflowed the registry's query.
        ("bot:r9223372036854775808", "'bot:r9223372036854775808'"),
        # Past Python's limit on converting digit strings (4,300): refused by its length.
        ("bot:r" + "1" * 4301, "'bot:r1111111111"),
        ("bot:r" + "0" * 30 + "9223372036854775808", "'bot:r000000000"),
    ],
)
def test_revisions_past_what_a_registry_holds_are_refused(text: str, named: str) -> None:
    with pytest.raises(ConfigurationError, match="larger than any revision") as refused:
        RevisionRef.parse(text)
    message = str(refused.value)
    assert named in message and len(message) < 400  # the value named, cut short


@pytest.mark.parametrize(
    "text",
    [
        "bot\n@production",  # `$` let a newline before the end through
        "bot\n:r3",
        "bot@production\nx",
        "bot:r\u0663",  # ARABIC-INDIC DIGIT THREE: `\\d` read it as r3
        "bot:r\uff13",  # FULLWIDTH DIGIT THREE
        "bot@\u0661",
        "b\u00f6t",
        "bot\ud800",  # a lone surrogate (JSON's "\\ud800")
        "bot@Production",
    ],
)
def test_names_match_whole_and_in_ascii(text: str) -> None:
    with pytest.raises(ConfigurationError, match="not valid"):
        RevisionRef.parse(text)


def test_adapter_names_match_whole() -> None:
    with pytest.raises(ConfigurationError, match="not valid"):
        check_adapter_name("bot\n")
    with pytest.raises(ConfigurationError, match="not valid") as refused:
        check_adapter_name("a" * 5000)
    assert len(str(refused.value)) < 400


def test_policy_record_round_trips_through_json_and_tags() -> None:
    policy = make_policy()
    assert PolicyRecord.from_json(policy.to_json()) == policy
    tags = policy.to_tags()
    assert all(isinstance(v, str) for v in tags.values())
    assert tags["mint.adapter"] == "support-bot"
    assert PolicyRecord.from_tags(tags) == policy
    assert (
        PolicyRecord.from_tags(make_policy(parent_revision=None).to_tags()).parent_revision is None
    )
    assert PolicyRecord.from_tags(make_policy(frozen_digest=None).to_tags()).frozen_digest is None


def test_unknown_policy_schema_version_is_refused() -> None:
    tags = make_policy().to_tags()
    tags["mint.schema_version"] = "7"
    with pytest.raises(ConfigurationError, match="schema version 7"):
        PolicyRecord.from_tags(tags)


def test_policy_record_missing_fields_are_named() -> None:
    tags = make_policy().to_tags()
    del tags["mint.base_digest"]
    with pytest.raises(ConfigurationError, match="base_digest"):
        PolicyRecord.from_tags(tags)


def test_stage_table_allows_the_pipeline_and_refuses_skips() -> None:
    stages = list(Stage)
    pipeline = stages[: stages.index(Stage.ACTIVE) + 1]
    for current, target in itertools.pairwise(pipeline):
        assert transition(current, target) is target
    with pytest.raises(TransitionError, match="from registered to active"):
        transition(Stage.REGISTERED, Stage.ACTIVE)
    with pytest.raises(TransitionError, match="from active to failed"):
        transition(Stage.ACTIVE, Stage.FAILED)


def test_readiness_table() -> None:
    assert transition(Readiness.NOT_ADMITTED, Readiness.QUEUED) is Readiness.QUEUED
    assert transition(Readiness.FAILED, Readiness.QUEUED) is Readiness.QUEUED
    with pytest.raises(TransitionError, match="from queued to ready"):
        transition(Readiness.QUEUED, Readiness.READY)


def test_text_fields_are_plain_tags_and_old_json_quoted_ones_still_read() -> None:
    policy = make_policy()
    tags = policy.to_tags()
    assert tags["mint.frozen_digest"] == policy.frozen_digest  # as plain as mint.content_digest
    assert tags["mint.content_digest"] == policy.content_digest
    assert "mint.frozen_digest" not in make_policy(frozen_digest=None).to_tags()
    # Registries written by earlier MinT hold it JSON-quoted, or null.
    quoted = tags | {"mint.frozen_digest": f'"{policy.frozen_digest}"'}
    assert PolicyRecord.from_tags(quoted) == policy
    null = tags | {"mint.frozen_digest": "null"}
    assert PolicyRecord.from_tags(null).frozen_digest is None
