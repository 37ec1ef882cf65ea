"""read_capped: what `forge run CONFIG` reads a config with (a FIFO from `<(...)` too)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from forgerl.configuration.capped_read import read_capped


def test_a_regular_file_is_read_up_to_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"x" * 100)
    assert read_capped(path, 1000) == b"x" * 100
    assert read_capped(path, 10) == b"x" * 10


def test_a_fifo_is_read_to_its_end_across_writes_and_capped(tmp_path: Path) -> None:
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    parts = [b"loop:\n", b"  steps: 3\n"]

    def writer() -> None:
        try:
            with open(fifo, "wb", buffering=0) as w:  # blocks until the reader opens
                for part in parts:
                    w.write(part)
        except BrokenPipeError:  # the capped read stopped reading and closed
            pass

    t = threading.Thread(target=writer)
    t.start()
    assert read_capped(fifo, 1 << 20) == b"".join(parts)
    t.join(10)

    t = threading.Thread(target=writer)
    t.start()
    assert read_capped(fifo, 4) == b"loop"
    t.join(10)
