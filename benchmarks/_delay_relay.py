"""A TCP relay that delays every byte by a fixed time in each direction: the 20 ms of a long
link, where the kernel has no ``netem`` qdisc (``tbf`` shapes the rate; this adds the delay).
With RATE_BITS_S it also paces each direction of each connection to that rate itself (for
links that need no root: a run's generator reaching its trainer through it).

Run: python benchmarks/_delay_relay.py UPSTREAM_HOST UPSTREAM_PORT DELAY_S [RATE_BITS_S]
Prints the port it listens on (127.0.0.1), then relays each connection to the upstream.

What it does not model: TCP's own round trip. The relay acknowledges what it reads at once,
so a sender's slow start sees the relay's round trip, not twice the delay; transfers of a few
round trips' worth of bytes come out faster than over a real link of the same delay.
"""

from __future__ import annotations

import asyncio
import socket
import sys


def delay_seconds(delay: str) -> float:
    """``20ms`` or ``0.02s`` (as ``tc`` writes them) in seconds."""
    return float(delay.removesuffix("ms")) / 1000 if delay.endswith("ms") else float(delay.removesuffix("s"))


async def pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, rate: float | None = None
) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    free_at = 0.0  # when the paced link has sent everything written so far

    async def feed() -> None:
        while data := await reader.read(1 << 16):
            queue.put_nowait((loop.time() + delay, data))
        queue.put_nowait((loop.time() + delay, b""))

    async def deliver() -> None:
        nonlocal free_at
        while True:
            due, data = await queue.get()
            if rate:  # the chunk leaves the link once the ones before it have, at the rate
                free_at = max(free_at, due) + 8 * len(data) / rate
                due = free_at
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    try:
        await asyncio.gather(feed(), deliver())
    except (ConnectionError, OSError):
        writer.close()


async def main(host: str, port: int, delay: float, rate: float | None = None) -> None:
    async def relay(down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(host, port)
        except OSError:
            down_w.close()
            return
        for w in (up_w, down_w):  # as the transport's own sockets: no Nagle wait on small frames
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pump(down_r, up_w, delay, rate), pump(up_r, down_w, delay, rate))

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]) if sys.argv[4:] else None))
