"""The registry server's memory of account and grant reads (`RecentAccessReads`): a repeated
read within its bound costs no database query, a change made through the server is seen at
once, one made past it once the bound has passed; an error is never remembered."""

import pytest

from mint_core.registry_accounts import RecentAccessReads


class Store:
    """An auth store's shape: accounts by name, grants by user, a count of queries."""

    def __init__(self) -> None:
        self.users = {"mint-worker": "hash-1"}
        self.queries = 0

    def get_user(self, username: str) -> str:
        self.queries += 1
        if username not in self.users:
            raise LookupError(f"User with username={username} not found")
        return self.users[username]

    def list_grants(self, user_id: int, workspace: str, resource_types: set[str]) -> list[str]:
        self.queries += 1
        return [f"{user_id}/{workspace}/{t}" for t in sorted(resource_types)]

    def update_user(self, username: str, password_hash: str) -> None:
        self.users[username] = password_hash

    def has_user(self, username: str) -> bool:
        return username in self.users


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_read_repeated_within_the_bound_queries_once() -> None:
    store, clock = Store(), Clock()
    reads = RecentAccessReads(store, ttl_s=2.0, clock=clock)
    assert [reads.get_user("mint-worker") for _ in range(7)] == ["hash-1"] * 7
    for _ in range(4):
        assert reads.list_grants(1, "default", {"registered_model", "experiment"}) == [
            "1/default/experiment",
            "1/default/registered_model",
        ]
    assert store.queries == 2
    # Other arguments are other reads.
    reads.list_grants(2, "default", {"experiment"})
    assert store.queries == 3


def test_a_change_through_the_server_is_seen_at_once() -> None:
    store, clock = Store(), Clock()
    reads = RecentAccessReads(store, ttl_s=2.0, clock=clock)
    assert reads.get_user("mint-worker") == "hash-1"
    reads.update_user("mint-worker", "hash-2")
    assert reads.get_user("mint-worker") == "hash-2"


def test_a_change_past_the_server_is_seen_once_the_bound_has_passed() -> None:
    store, clock = Store(), Clock()
    reads = RecentAccessReads(store, ttl_s=2.0, clock=clock)
    assert reads.get_user("mint-worker") == "hash-1"
    del store.users["mint-worker"]  # another server on the same database removed it
    clock.now = 1.9
    assert reads.get_user("mint-worker") == "hash-1"
    clock.now = 2.0
    with pytest.raises(LookupError):
        reads.get_user("mint-worker")


def test_an_error_is_not_remembered_and_other_attributes_are_the_stores() -> None:
    store, clock = Store(), Clock()
    reads = RecentAccessReads(store, ttl_s=2.0, clock=clock)
    for _ in range(3):
        with pytest.raises(LookupError):
            reads.get_user("mallory")
    assert store.queries == 3
    store.users["mallory"] = "hash-m"
    assert reads.get_user("mallory") == "hash-m"
    assert reads.has_user("mint-worker") and reads.users is store.users
