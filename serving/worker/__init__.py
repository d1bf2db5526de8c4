"""The serving worker: readiness table, supervised prewarm, outcomes, metrics and its server.

Empty on purpose: importing `serving.worker.readiness` must not load the engine."""
