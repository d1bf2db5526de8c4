"""A command passes on to its flow every option given, whichever group declared it, and none
that was left out (the flow's default holds)."""

from mint_cli.main import build_parser
from mint_cli.options import given


def test_release_passes_every_given_option_of_both_its_groups() -> None:
    argv = ["release", "--adapter", "ok-bot", "--data", __file__]
    more = ["--steps", "5000", "--rank", "4", "--nnodes", "2"]
    assert given(build_parser().parse_args(argv + more)) == {"steps": 5000, "rank": 4, "nnodes": 2}
    assert given(build_parser().parse_args(argv)) == {}
