"""The shm transport removes what a killed sender left in /dev/shm, and nothing else.

A trainer killed by SIGKILL or the OOM killer never closes its sender, and its folder of
versions stays in memory until reboot (a day of killed runs left 4 GB here). A new
sender sweeps the folders whose recorded owner is gone; a live owner's folder, a folder
without a record, or one recorded in another pid namespace is kept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.timing import scaled

leftovers = pytest.importorskip("forgerl_plugins.transports.shm.leftovers")
pytestmark = pytest.mark.skipif(leftovers.identity() is None, reason="needs Linux /proc")

# A child that claims a folder, says so, and waits to be killed.
_CLAIM = """
import sys
from pathlib import Path
from forgerl_plugins.transports.shm import leftovers
folder = Path(sys.argv[1])
folder.mkdir()
(folder / "v00000001.safetensors").write_bytes(b"x" * 4096)
leftovers.claim(folder)
print("claimed", flush=True)
sys.stdin.read()
"""


def _owner_process(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _CLAIM, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_a_killed_owners_folder_is_swept_and_a_live_owners_is_kept(tmp_path: Path) -> None:
    dead, live = tmp_path / "forgerl-dead", tmp_path / "forgerl-live"
    killed, running = _owner_process(dead), _owner_process(live)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(scaled(30))
        assert leftovers.sweep(tmp_path) == [dead]
        assert not dead.exists()
        assert (live / "v00000001.safetensors").is_file()
    finally:
        running.kill()
        running.wait(scaled(30))
    assert leftovers.sweep(tmp_path) == [live]  # once its owner is gone too


def test_folders_without_a_sure_owner_are_kept(tmp_path: Path) -> None:
    me = leftovers.identity()
    assert me is not None
    cases = {
        "forgerl-no-record": None,
        "forgerl-other-namespace": {**me, "pid": 999_999, "pidns": me["pidns"] + 1},
        "forgerl-other-boot": {**me, "pid": 999_999, "boot": "another-boot"},
        "forgerl-garbled": "not json {",
        "forgerl-bool-pid": {**me, "pid": True, "start": 0},
    }
    for name, record in cases.items():
        (tmp_path / name).mkdir()
        if record is not None:
            text = record if isinstance(record, str) else json.dumps(record)
            (tmp_path / name / leftovers.OWNER).write_text(text)
    (tmp_path / "forgerl-not-a-folder").write_text("x")
    (tmp_path / "other-tool").mkdir()
    assert leftovers.sweep(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*cases, "forgerl-not-a-folder", "other-tool"])


def test_a_reused_pid_does_not_keep_a_dead_owners_folder(tmp_path: Path) -> None:
    # Our own pid, alive, but another start time: the process that wrote it is gone.
    me = leftovers.identity()
    assert me is not None
    folder = tmp_path / "forgerl-reused"
    folder.mkdir()
    (folder / leftovers.OWNER).write_text(json.dumps({**me, "start": me["start"] - 1}))
    assert leftovers.sweep(tmp_path) == [folder]


def test_a_new_shm_sender_sweeps_before_it_counts_free_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from forgerl_plugins.transports.shm import transport as shm

    monkeypatch.setattr(shm, "SHM_ROOT", tmp_path)
    dead = tmp_path / "forgerl-dead"
    killed = _owner_process(dead)
    killed.send_signal(signal.SIGKILL)
    killed.wait(scaled(30))
    t = shm.ShmTransport(shm.ShmTransport.Options())
    sender = t.sender()
    try:
        assert not dead.exists()
        assert t.directory.parent == tmp_path
        record = json.loads((t.directory / leftovers.OWNER).read_text())
        assert record["pid"] == os.getpid()  # its own folder is claimed, so it is swept only once we are gone
    finally:
        sender.close()
    assert not t.directory.exists()
