"""The cluster's delaying relay (tests/cluster/relay.py), in-process on loopback: it delays
what a client sends by D, keeps the order of chunks, passes answers back at once, and takes a
new D from its file while it runs."""

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

from tests.cluster.relay import Delay, Relay

LOOPBACK = "127.0.0.1"


async def _echo_server() -> tuple[asyncio.Server, int, list[tuple[float, bytes]]]:
    """A server that records when each chunk arrived and echoes it."""
    arrivals: list[tuple[float, bytes]] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            arrivals.append((time.monotonic(), chunk))
            writer.write(chunk)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, LOOPBACK, 0)
    return server, server.sockets[0].getsockname()[1], arrivals


async def _round_trips(
    delay_file: Path, sends: list[bytes], gap_s: float, between: Callable[[], None] = lambda: None
) -> dict[str, object]:
    """Send `sends` through a relay to an echo server, `gap_s` apart, calling `between` after
    each gap; what was sent when, what arrived when, and what came back."""
    server, port, arrivals = await _echo_server()
    relay = Relay((LOOPBACK, 0), (LOOPBACK, port), Delay(delay_file))
    _, relay_port = await relay.start()
    try:
        reader, writer = await asyncio.open_connection(LOOPBACK, relay_port)
        sent_at = []
        for data in sends:
            sent_at.append(time.monotonic())
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(gap_s)
            between()
        writer.write_eof()
        echoed = b""
        while chunk := await reader.read(65536):
            echoed += chunk
        writer.close()
        return {"sent_at": sent_at, "arrivals": arrivals, "echoed": echoed}
    finally:
        await relay.close()
        server.close()
        await server.wait_closed()


def test_chunks_arrive_delayed_and_in_order(tmp_path: Path) -> None:
    delay_file = tmp_path / "delay_ms"
    delay_file.write_text("80")
    sends = [f"chunk-{i};".encode() for i in range(5)]
    got = asyncio.run(_round_trips(delay_file, sends, gap_s=0.01))
    assert got["echoed"] == b"".join(sends)  # order kept, nothing lost
    first_arrival = got["arrivals"][0][0]  # type: ignore[index]
    assert first_arrival - got["sent_at"][0] >= 0.08  # type: ignore[index]


def test_a_shorter_delay_never_overtakes(tmp_path: Path) -> None:
    """As netem's queue: a chunk sent after the delay dropped still waits for the one before."""
    delay_file = tmp_path / "delay_ms"
    delay_file.write_text("150")

    def drop_delay() -> None:
        delay_file.write_text("0")
        os.utime(delay_file, ns=(time.time_ns(), time.time_ns() + 1_000_000))

    got = asyncio.run(_round_trips(delay_file, [b"first;", b"second;"], 0.05, drop_delay))
    assert got["echoed"] == b"first;second;"
    arrivals = [t for t, _ in got["arrivals"]]  # type: ignore[attr-defined]
    assert arrivals[0] - got["sent_at"][0] >= 0.15  # type: ignore[index]


def test_no_file_means_no_delay(tmp_path: Path) -> None:
    got = asyncio.run(_round_trips(tmp_path / "absent", [b"x"], gap_s=0.0))
    assert got["arrivals"][0][0] - got["sent_at"][0] < 0.05  # type: ignore[index]


def test_delay_changes_while_it_runs(tmp_path: Path) -> None:
    delay_file = tmp_path / "delay_ms"
    delay = Delay(delay_file)
    assert delay.seconds() == 0.0
    delay_file.write_text("20\n")
    assert delay.seconds() == 0.02
    time.sleep(0.01)  # a new modification time
    delay_file.write_text("")
    assert delay.seconds() == 0.0
