"""What workers can serve: the catalog of registered revisions, its sqlite index and the
snapshots workers start from."""
