"""Finding reward worker processes (forgerl.rewards.reward_workers) from tests."""

from __future__ import annotations

from pathlib import Path


def reward_workers_of(parent: int) -> list[int]:
    """Live reward worker processes started by ``parent``. A worker's command line ends
    with its parent's pid, so orphans (re-parented elsewhere) are found too."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if b"forgerl.rewards.reward_workers" in argv and argv[-2:-1] == [str(parent).encode()] and state != "Z":
            found.append(int(entry.name))
    return found
