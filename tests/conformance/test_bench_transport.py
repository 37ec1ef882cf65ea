"""`forge bench transport` as a user runs it: a small synthetic weight set through the
transport and its raw path, machine-readable output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers.requires import require_mooncake
from ..helpers.timing import scaled

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", ["shm", "nccl", "rdma"])
def test_bench_transport_json(name: str) -> None:
    if name == "rdma":
        require_mooncake()
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "bench", "transport", name, "--bytes", "8MB",
         "--rounds", "2", "--json"],
        check=False, capture_output=True, text=True, timeout=scaled(240),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert {"gbps", "raw_gbps", "ratio"} <= set(report), report
    assert report["transport"] == name and report["bytes"] == 8_000_000 and report["receivers"] == 1
    assert report["gbps"] > 0 and report["raw_gbps"] > 0
    assert abs(report["ratio"] - report["gbps"] / report["raw_gbps"]) < 0.01, report
    assert len(report["seconds"]) == len(report["raw_seconds"]) == 2


def test_bench_transport_rejects_a_bad_size() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "bench", "transport", "shm", "--bytes", "lots"],
        check=False, capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "500MB" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_receivers_are_not_given_the_secret_on_their_command_line() -> None:
    """`ps` shows every user each process's command line: the transport secret a bench
    receiver needs (in the sender's receiver_spec()) must reach it another way, and does."""
    from forgerl_plugins.bench.transport import _TransportPath, synthetic_weights

    path = _TransportPath("nccl", {}, synthetic_weights(4096), receivers=1, versions=1, timeout=scaled(60))
    try:
        secret = path.transport.secret().encode()
        for worker in path.workers:
            cmdline = Path(f"/proc/{worker.proc.pid}/cmdline").read_bytes()
            assert secret not in cmdline, f"the transport secret is on a command line: {cmdline[:300]!r}"
        assert path.round(1) > 0  # and the receiver, which got it, took version 1
    finally:
        path.close()
