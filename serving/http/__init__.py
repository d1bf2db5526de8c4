"""The worker's HTTP API, one module per concern, and what the gateway shares with it.

- `common`, `errors`, `limits`: header names, the adapter base URL, how JSON and stream events
  are written, the one table from an error to its HTTP response, and the body size limit.
  They load no engine (no torch): the gateway imports them too.
- `wire`, `client`: the bodies the worker's admin and status routes send and read, written
  once, and the HTTP client the pipeline, the CLI and peer workers call a worker with. Light
  too.
- `context`: what every handler depends on: the worker (through the narrow `WorkerAPI`), the
  caller's principal, the admin guard, and routing a generation through the readiness gate.
- `tgi`, `openai`: the generation routes of each protocol, and the same under each revision's
  own base URL (`/adapters/{ref}`).
- `status` (`/health`, `/metrics`, `/v1/adapters/{name}`), `outcomes` (feedback and
  `/admin/outcomes`), `admin` (the rest of `/admin`).
- `app`: `create_app`, which puts the routers together over one worker.

This `__init__` imports nothing, so that importing a light module does not load the app.
"""
