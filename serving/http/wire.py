"""The worker's wire types, written once: what its admin and status routes answer and what
its clients (`serving.http.client`, the gateway) send and read. Light (pydantic, no engine):
the gateway imports it."""

ASK_INTERVAL_S = 2.0
"""A worker is asked to admit the same revision by demand (by a peer, or by the gateway) at
most this often."""
