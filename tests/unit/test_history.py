"""The history tables MinT writes into MLflow descriptions show sha256 digests shortened: a
whole one has nowhere to break and pushed the approver column out of the description pane
(issue 48, item 9). The tags keep the whole digests."""

import pytest

from mint_core.history import VERSION_HEADER, short_digests, version_description

HEX = "0123456789abcdef" * 4
"""A sha256 digest's 64 hex characters."""


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"files sha256:{HEX}", "files sha256:0123456789ab…"),
        (f"mint-local://sha256/{HEX}", "mint-local://sha256/0123456789ab…"),
        (f"s3://mint/revisions/sha256/{HEX}", "s3://mint/revisions/sha256/0123456789ab…"),
        (f"from {HEX} to sha256:{HEX[::-1]}", "from 0123456789ab… to sha256:fedcba987654…"),
        # Not a sha256 digest: as written.
        (f"run {HEX[:32]}", f"run {HEX[:32]}"),
        (f"{HEX}0", f"{HEX}0"),
        (HEX.upper(), HEX.upper()),
        ("5 steps on upper-train.jsonl", "5 steps on upper-train.jsonl"),
    ],
)
def test_digests_are_shortened(text: str, shown: str) -> None:
    assert short_digests(text) == shown


def test_a_version_table_shows_digests_shortened() -> None:
    at = "2026-12-01T10:00:0{}+00:00"
    history = [
        {"at": at.format(1), "from": "", "to": "frozen", "actor": "carol",
         "reason": f"files sha256:{HEX}"},
        {"at": at.format(2), "from": "frozen", "to": "exported", "actor": "carol",
         "reason": f"mint-local://sha256/{HEX}"},
    ]  # fmt: skip
    table = version_description("", history, []).split(VERSION_HEADER + "\n", 1)[1]
    assert HEX not in table
    assert [row.split(" | ")[1:4] for row in table.splitlines()[1:]] == [
        ["frozen", "carol", "files sha256:0123456789ab…"],
        ["frozen → exported", "carol", "mint-local://sha256/0123456789ab…"],
    ]
