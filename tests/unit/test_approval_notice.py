"""The notice atop the Resume form shown again after a refused answer: whose answer, as they
gave it (decision and comment), and why it was not taken (issue 48, item 10: the comment was
left out). The integration lane reads it from a real paused run (tests/integration/
test_approval.py)."""

import pytest

from flows.approval import Decision, Verdict, refused_notice

REFUSED = "'mallory' is not an approver of this adapter; its approvers: alice, carol"


@pytest.mark.parametrize(
    ("comment", "shown"),
    [
        ("not sure", "(reject; comment: not sure)"),
        ("", "(reject)"),
        ("   ", "(reject)"),
        # One line, and read as typed rather than as markup.
        ("line one\n\n# two", "(reject; comment: line one # two)"),
        (
            "v2_final is *worse* | see [log]",
            r"(reject; comment: v2\_final is \*worse\* \| see \[log\])",
        ),
    ],
)
def test_the_refused_notice_shows_the_answers_comment(comment: str, shown: str) -> None:
    answer = Decision(decision=Verdict.REJECT, reviewer="mallory", comment=comment)
    assert refused_notice(answer, REFUSED) == (
        f"**Refused**: the answer of 'mallory' {shown} was not taken: {REFUSED}. Waiting for an "
        "allowed approver."
    )
