"""Pure plans, tested exactly: admission order, residency tiers, evaluation sets and scores,
canary judging."""
