"""The registry server's memory of password checks that passed (`VerifiedCredentials`): the
slow hash check runs once per password and stored hash; a wrong password, a changed hash or
another account gets the full check; nothing it keeps is a password or usable without its
per-process key."""

from werkzeug.security import check_password_hash, generate_password_hash

from mint_core.registry_accounts import VerifiedCredentials

PASSWORD = "correct horse battery staple"


class CountedCheck:
    """werkzeug's real check, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, stored_hash: str, password: str) -> bool:
        self.calls += 1
        return check_password_hash(stored_hash, password)


def test_a_passed_check_is_remembered_and_a_wrong_password_is_always_checked() -> None:
    check = CountedCheck()
    verified = VerifiedCredentials(check)
    stored = generate_password_hash(PASSWORD)
    assert all(verified.verify("mint-worker", PASSWORD, stored) for _ in range(5))
    assert check.calls == 1
    for _ in range(3):
        assert not verified.verify("mint-worker", PASSWORD + "!", stored)
    assert check.calls == 4  # every wrong try pays the full check
    # Another account with the same password and hash is a check of its own.
    assert verified.verify("mint-pipeline", PASSWORD, stored)
    assert check.calls == 5


def test_a_changed_password_is_refused_at_once() -> None:
    check = CountedCheck()
    verified = VerifiedCredentials(check)
    old_hash = generate_password_hash(PASSWORD)
    assert verified.verify("mint-worker", PASSWORD, old_hash)
    new_hash = generate_password_hash("a new one")
    assert not verified.verify("mint-worker", PASSWORD, new_hash)
    assert verified.verify("mint-worker", "a new one", new_hash)


def test_it_keeps_no_password_and_no_digest_another_process_could_compute() -> None:
    stored = generate_password_hash(PASSWORD)
    first, second = (
        VerifiedCredentials(check_password_hash),
        VerifiedCredentials(check_password_hash),
    )
    assert first.verify("mint-worker", PASSWORD, stored)
    assert second.verify("mint-worker", PASSWORD, stored)
    (kept,) = first.entries()
    assert PASSWORD.encode() not in kept and PASSWORD.encode().hex().encode() not in kept
    assert len(kept) == 32  # an HMAC-SHA256, nothing else
    assert vars(first).keys().isdisjoint({"password", "passwords"})
    assert PASSWORD not in repr(vars(first))
    # Keyed per process (per object): the same credentials give another digest elsewhere.
    assert second.entries() != first.entries()


def test_it_holds_at_most_its_capacity() -> None:
    verified = VerifiedCredentials(lambda stored_hash, password: True, capacity=3)
    for n in range(10):
        verified.verify(f"user-{n}", PASSWORD, "hash")
    assert len(verified) == 3
