"""Client load for the test cluster: run inside the client host, one JSON line per request.

`--concurrency` lanes each send requests one after another (`--interval` apart) until
`--requests` were sent in all, `--duration` seconds passed or `--stop-file` exists. Each line,
written and flushed as its request ends, says what a test or `bench/cluster.py` needs to time
a scenario from outside:

    {"i": 3, "lane": 0, "url": "...", "status": 200, "error": null,
     "t_start": 1764000000.12, "t_end": 1764000000.15, "headers": {"X-Mint-Revision": "..."}}

`t_start`/`t_end` are wall-clock seconds (every namespace shares the machine's clock); a
request with no answer has `status` null and `error` "timeout", "connect_timeout",
"refused", "unreachable" or the exception's name and text. `attempts`: its tries (a 503 with
Retry-After is asked again, up to `--retries` times, as OpenAI's clients do).

    python -m tests.cluster.load --url http://10.1.2.5:8080/v1/completions \\
        --json '{"model": "m", "prompt": "hi"}' --concurrency 2 --duration 10 --out load.jsonl
"""

import argparse
import asyncio
import errno
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import aiohttp

KEPT_HEADERS = ("X-Mint-Revision", "X-Mint-Worker", "X-Mint-Base", "Retry-After")


def classify(error: BaseException) -> str:
    """A short name for why a request got no answer."""
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return "connect_timeout"
    if isinstance(error, TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    cause = getattr(error, "os_error", None) or error
    if isinstance(cause, ConnectionRefusedError):
        return "refused"
    if isinstance(cause, OSError) and cause.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    return f"{type(error).__name__}: {error}"


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds a 503 asks the client to wait (Retry-After-Ms, else Retry-After), if it says."""
    for name, scale in (("Retry-After-Ms", 1000.0), ("Retry-After", 1.0)):
        try:
            return float(headers[name]) / scale
        except (KeyError, ValueError):
            continue
    return None


def _said(content: bytes) -> str:
    """An error answer's `error_type` and the start of its message (MinT's error shape), or
    the start of its body."""
    try:
        body = json.loads(content)
        return f"{body['error_type']}: {str(body.get('error', ''))[:160]}"
    except (ValueError, TypeError, KeyError):
        return content[:160].decode(errors="replace")


async def _lane(
    lane: int, session: aiohttp.ClientSession, args: argparse.Namespace, state: dict[str, int],
    out: IO[str],
) -> None:  # fmt: skip
    deadline = time.monotonic() + args.duration if args.duration else None
    while True:
        if deadline is not None and time.monotonic() >= deadline:
            return
        if args.stop_file is not None and args.stop_file.exists():
            return
        if args.requests and state["sent"] >= args.requests:
            return
        index = state["sent"]
        state["sent"] += 1
        record: dict[str, object] = {"i": index, "lane": lane, "url": args.url}
        start, attempts = time.time(), 0
        wait: float | None = 0.0
        while wait is not None:  # a 503's Retry-After is honoured --retries times
            await asyncio.sleep(wait)
            attempts, wait = attempts + 1, None
            try:
                async with session.request(
                    args.method, args.url, data=args.json, headers=args.headers
                ) as response:
                    content = await response.read()
                    record.update(status=response.status, error=None)
                    if response.status != 200:  # what the failure said, for the figures' notes
                        record["said"] = _said(content)
                    kept = {h: response.headers[h] for h in args.keep if h in response.headers}
                    record["headers"] = kept
                    if response.status == 503 and attempts <= args.retries:
                        wait = retry_after(response.headers)
            except (TimeoutError, aiohttp.ClientError, OSError) as error:
                record.update(status=None, error=classify(error), headers={})
        record.update(t_start=start, t_end=time.time(), attempts=attempts)
        out.write(json.dumps(record) + "\n")
        out.flush()
        if args.interval:
            await asyncio.sleep(args.interval)


async def run(args: argparse.Namespace, out: IO[str]) -> None:
    timeout = aiohttp.ClientTimeout(total=args.timeout, sock_connect=args.connect_timeout)
    connector = aiohttp.TCPConnector(force_close=args.no_keepalive)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        state = {"sent": 0}
        lanes = (_lane(i, session, args, state, out) for i in range(args.concurrency))
        await asyncio.gather(*lanes)


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"a header is NAME: VALUE, got {text!r}")
    return name.strip(), value.strip()


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--method", default=None, help="default: POST with --json, else GET")
    parser.add_argument("--json", default=None, help="the request body (sent as JSON)")
    parser.add_argument("--header", type=_header, action="append", default=[], dest="header")
    kept = "an answer header to record (X-Mint-Revision, ... by default)"
    parser.add_argument("--keep", action="append", default=list(KEPT_HEADERS), help=kept)
    parser.add_argument("--requests", type=int, default=0, help="in all; 0: no limit")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds; 0: no limit")
    parser.add_argument("--stop-file", type=Path, default=None)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.0, help="seconds between a lane's")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--connect-timeout", type=float, default=2.0)
    retries = "ask again after a 503's Retry-After, up to this many times (as OpenAI's clients do)"
    parser.add_argument("--retries", type=int, default=0, help=retries)
    parser.add_argument("--no-keepalive", action="store_true", help="a connection per request")
    parser.add_argument("--out", type=Path, default=None, help="default: standard output")
    args = parser.parse_args(argv)
    if not (args.requests or args.duration or args.stop_file):
        parser.error("give --requests, --duration or --stop-file: the load must end")
    args.method = args.method or ("POST" if args.json is not None else "GET")
    args.headers = dict(args.header)
    if args.json is not None:
        args.headers.setdefault("Content-Type", "application/json")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if args.out is None:
        asyncio.run(run(args, sys.stdout))
        return
    with args.out.open("a") as out:
        asyncio.run(run(args, out))


if __name__ == "__main__":
    main()
