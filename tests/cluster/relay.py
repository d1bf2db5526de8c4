"""A TCP relay that delays what clients send, standing in for netem (this kernel has none).

It listens on one address and forwards each connection to a target. Every chunk a client sends
waits D ms before it goes on, in the order it came, as netem's delay on the sender's egress
would hold each packet; what the server answers goes back at once. D is read from a file
(milliseconds; missing or empty: 0) whenever it changes, so a test changes the delay of a
running relay by writing the file.

A serve host runs one in front of its worker and the worker advertises the relay's URL: the
gateway, the pipeline and the peers all reach it under that one name (placement needs one name
per worker) and all pay the delay, while a client can still measure the worker directly.

    python -m tests.cluster.relay --listen 10.1.2.3:8001 --target 10.1.2.3:8000 \\
        --delay-file /tmp/delay_ms
"""

import argparse
import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

CHUNK = 65536


class Delay:
    """D in seconds, from a file read again whenever its modification time changes."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._stamp: int | None = None
        self._seconds = 0.0

    def seconds(self) -> float:
        if self.path is None:
            return 0.0
        try:
            stamp = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return 0.0
        if stamp != self._stamp:
            text = self.path.read_text().strip()
            self._seconds = float(text) / 1000 if text else 0.0
            self._stamp = stamp
        return self._seconds


class Relay:
    """Listens on `listen`, forwards to `target`, delaying client-to-server chunks."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay: Delay) -> None:
        self.listen = listen
        self.target = target
        self.delay = delay
        self.server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        """Start listening; returns the bound address (the port, when 0 was asked)."""
        self.server = await asyncio.start_server(self._serve, *self.listen)
        return self.server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(self._delayed(client_r, server_w), _pipe(server_r, client_w))
        except OSError:
            pass
        finally:
            for writer in (client_w, server_w):
                writer.close()

    async def _delayed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read chunks as they come and send each D after it came, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, chunk = await queue.get()
                if wait_s := due - time.monotonic():
                    await asyncio.sleep(max(0.0, wait_s))
                if not chunk:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                chunk = await reader.read(CHUNK)
                queue.put_nowait((time.monotonic() + self.delay.seconds(), chunk))
                if not chunk:
                    break
            await sender
        finally:
            sender.cancel()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(CHUNK):
        writer.write(chunk)
        await writer.drain()
    with contextlib.suppress(OSError):
        writer.write_eof()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _main(args: argparse.Namespace) -> None:
    relay = Relay(args.listen, args.target, Delay(args.delay_file))
    bound = await relay.start()
    print(f"relay on {bound[0]}:{bound[1]} -> {args.target[0]}:{args.target[1]}", flush=True)
    assert relay.server is not None
    await relay.server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT")
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT")
    parser.add_argument("--delay-file", type=Path, help="a file holding D in milliseconds")
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
