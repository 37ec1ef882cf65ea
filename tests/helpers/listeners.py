"""The TCP sockets this process listens on (the transports must listen on the run's
interface only: docs/security.md)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def own_listeners() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = fields[1].rsplit(":", 1)
            raw = bytes.fromhex(hex_address)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found
