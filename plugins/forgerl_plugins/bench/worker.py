"""Receiver processes of ``forge bench transport``: one per generator worker.

    python -m forgerl_plugins.bench.worker MODE  < JSON-ARGS

The arguments (JSON) come as the first line on stdin, never on the command line: ``ps``
shows those to every user, and a transport's spec carries the run's secret. Every mode
prints JSON lines: ``ready``, then ``done`` with ``time.monotonic()`` when a version is
fully in memory (the clock is shared by processes on one machine), and ``closed``. Modes:

* ``transport``: the real receiver, built as a generator worker builds it, receiving
  version V on each ``go V`` line (a version counts as done once its iterator is
  exhausted). The line comes as the send starts: the training loop, too, starts the
  generator's update and the send together (``Loop.sync_weights``).
* ``raw-gloo`` / ``raw-nccl``: a bare process group of every receiver plus the sender;
  each round is one broadcast of the whole payload into a buffer reused across rounds.
* ``raw-mooncake``: a bare TransferEngine reading the sender's registered buffer into its
  own registered buffer, in chunks, on each ``go`` line.
* ``raw-shm``: on each ``go PATH`` line, open the safetensors file and copy every tensor
  into tensors allocated once (safetensors' own lazy mapping would measure nothing).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


def _transport(a: dict[str, Any]) -> None:
    from forgerl.registry.plugins import build_registry

    transport = build_registry().require("transport", a["name"]).build(a["options"], context=None)
    receiver = transport.receiver(a["worker_id"], a["spec"])
    emit("ready")
    for line in sys.stdin:
        if not line.startswith("go"):
            break
        version = int(line.split()[1])
        n = 0
        for _, t in receiver.receive(version, timeout=a["timeout"]):
            n += t.numel() * t.element_size()
        emit("done", version=version, bytes=n)
    receiver.close()
    emit("closed")


def _raw_group(a: dict[str, Any]) -> None:
    import torch
    from torch.distributed import PrefixStore

    from forgerl_plugins.transports.common import control
    from forgerl_plugins.transports.nccl import groups

    backend = a["backend"]
    store = PrefixStore("raw/", control.connect(a["host"], a["port"], a["timeout"]))
    pg = groups.make_group(
        store, a["rank"], a["world"], backend, a["timeout"], control.local_address(a["host"])
    )
    buf = torch.zeros(a["nbytes"], dtype=torch.uint8, device=groups.device_for(backend))
    emit("ready")
    for version in range(1, a["versions"] + 1):
        groups.broadcast(pg, buf, 0, a["timeout"]).wait()
        if buf.is_cuda:
            torch.cuda.synchronize()
        emit("done", version=version, bytes=buf.numel())
    groups.destroy(pg)
    emit("closed")


def _raw_mooncake(a: dict[str, Any]) -> None:
    import torch

    from forgerl_plugins.transports.rdma.engine import Engine

    engine = Engine(a["address"], a["protocol"], a["device_name"])
    buf = torch.zeros(a["nbytes"], dtype=torch.uint8)
    engine.register(buf)
    chunk, n = a["chunk_bytes"], a["nbytes"]
    starts = list(range(0, n, chunk))
    local = [buf.data_ptr() + s for s in starts]
    remote = [a["remote"] + s for s in starts]
    lengths = [min(chunk, n - s) for s in starts]
    emit("ready")
    for line in sys.stdin:
        if not line.startswith("go"):
            break
        version = int(line.split()[1])
        rc = engine.read(a["session"], local, remote, lengths)
        if rc != 0:
            emit("error", message=f"Mooncake read failed: {rc}")
            return
        emit("done", version=version, bytes=n)
    engine.close()
    emit("closed")


def _raw_shm(a: dict[str, Any]) -> None:
    import torch
    from safetensors import safe_open

    dst: dict[str, torch.Tensor] = {}
    emit("ready")
    for line in sys.stdin:
        if not line.startswith("go"):
            break
        _, version, path = line.split(maxsplit=2)
        n = 0
        with safe_open(path.strip(), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                src = f.get_tensor(key)
                if key not in dst:
                    dst[key] = torch.empty_like(src)
                dst[key].copy_(src)
                n += src.numel() * src.element_size()
        emit("done", version=int(version), bytes=n)
    emit("closed")


MODES = {
    "transport": _transport,
    "raw-gloo": _raw_group,
    "raw-nccl": _raw_group,
    "raw-mooncake": _raw_mooncake,
    "raw-shm": _raw_shm,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode, args = argv[0], json.loads(sys.stdin.readline())
    try:
        MODES[mode](args)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the bench
        emit("error", message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
