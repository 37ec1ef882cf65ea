"""A weights-transport endpoint in its own process, driven by the transport kit
(:mod:`forgerl.testing.transport`) and forgerl's own transport tests.

Receiver (default)::

    python -m forgerl.testing.transport_receiver --transport nccl \\
        --worker-id r1 --versions 1,2,3 [--timeout 10] [--die-when-started 2]  < SPEC

reads the sender's ``receiver_spec()`` (JSON) from its first line on stdin, never from the
command line: the spec carries the transport secret, and ``ps`` shows every user every
process's command line. It builds the receiver the way a generator worker does
(``build_registry().require("transport", NAME).build(options, context=None).receiver(id, spec)``;
``--plugins a.b,c.d`` loads plugin modules that are not installed), receives each version
in turn and prints one JSON line per event on stdout: ``ready`` (with ``progress``: whether
the receiver reports a transfer's progress),
``started`` (a transfer began: the receiver's ``progress`` moved), ``received`` (with a
digest of every tensor), ``error`` (exception type, message, seconds, tensors yielded
before it), ``closed`` (memory registered with Mooncake before and after closing, rdma). ``--die-when-started V`` kills
the process with SIGKILL in the middle of receiving version V; ``--stop-when-started V``
instead prints ``stopping`` and stops it with SIGSTOP there (a stalled worker; the test
resumes it with SIGCONT); ``--rejoin V`` then builds
a new receiver under the same worker id (a restarted worker) and receives version V.

Sender (``--role sender``) makes the weights of ``--versions``, prints ``spec`` (the
transport's ``receiver_spec()``), then sends ``make_weights(V, big)`` for every ``send V`` line it reads on stdin and prints
``sent`` or ``send-error``; ``close`` closes it.

The test process imports :func:`make_weights` and :func:`digest` from here to know what
must arrive. A receiver that has a ``progress`` attribute, ``(version, bytes done, bytes
total)`` while it receives, is watched through it (``started``, and dying or stopping at the
start of a transfer); one without is stopped after its first tensor of the version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any

#: Floats of the one big tensor of a version (``big=True``): 64 MiB, so that a transfer
#: takes long enough on a busy machine to be interrupted half-way.
BIG_FLOATS = 16 * 2**20


def make_weights(version: int, big: bool = False) -> dict[str, Any]:
    """A version's tensors: every dtype a model ships, 0-d and empty tensors, dotted names;
    random bit patterns (NaN payloads included) so that only a bit-exact copy matches."""
    import torch

    g = torch.Generator().manual_seed(1000 + version)

    def raw(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        size = torch.empty((), dtype=dtype).element_size()
        bits = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
        return bits.view(dtype).reshape(shape)

    w = {
        "model.embed_tokens.weight": raw((64, 48), torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": raw((48, 48), torch.float16),
        "model.layers.0.mlp.up_proj.bias": raw((7,), torch.float32),
        "model.layers.0.attention_mask": torch.randint(0, 2, (13,), generator=g).bool(),
        "model.position_ids": torch.randint(-(2**62), 2**62, (5,), generator=g, dtype=torch.int64),
        "model.norm.step": torch.tensor(version * 7 + 3, dtype=torch.int64),
        "model.scale": raw((), torch.float32),
        "model.empty.weight": torch.empty(0, 5, dtype=torch.float32),
        "lm_head.weight": raw((BIG_FLOATS if big else 4096,), torch.float32),
    }
    return w


def digest(name: str, t: Any) -> str:
    import torch

    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    head = f"{name}|{t.dtype!s}|{tuple(t.shape)}|".encode()
    return hashlib.sha256(head + data).hexdigest()


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


def _stall(version: int) -> None:
    """Stop this whole process (every thread, the transport's included) in the middle of
    receiving ``version``, as a worker frozen by the OS or a debugger would be."""
    emit("stopping", version=version)
    os.kill(os.getpid(), signal.SIGSTOP)


def _watch(receiver: Any, die_version: int | None, stall_version: int | None, stop: threading.Event) -> None:
    """Report (and, when asked, die or stall at) the start of each transfer, seen through
    the receiver's ``progress`` (version, bytes done, bytes total) while it receives."""
    seen = None
    while not stop.is_set():
        p = getattr(receiver, "progress", None)
        if p is not None and p != seen and p[1] < p[2]:
            seen = p
            if die_version is not None and p[0] == die_version:
                os.kill(os.getpid(), signal.SIGKILL)
            emit("started", version=p[0], done=p[1], total=p[2])
            if stall_version is not None and p[0] == stall_version:
                stall_version = None  # once: after SIGCONT the transfer goes on
                _stall(p[0])
        time.sleep(0.0005)


def _build(args: argparse.Namespace) -> Any:
    from forgerl.testing.registry import registry_for

    plugins = [p for p in args.plugins.split(",") if p]
    backend = registry_for(plugins).require("transport", args.transport)
    return backend.build(json.loads(args.options), context=None)


def run_receiver(args: argparse.Namespace) -> int:
    line = sys.stdin.readline()
    if not line.strip():
        raise SystemExit("transport_receiver: the sender's receiver_spec() (JSON) must be the first line on stdin")
    spec = json.loads(line)
    transport = _build(args)
    receiver = transport.receiver(args.worker_id, spec)
    stop = threading.Event()
    if hasattr(receiver, "progress"):
        threading.Thread(target=_watch, args=(receiver, args.die_when_started, args.stop_when_started, stop), daemon=True).start()
    emit("ready", worker_id=args.worker_id, progress=hasattr(receiver, "progress"))
    if args.wait_go:
        sys.stdin.readline()  # the test says when the sender is up
    for version in [int(v) for v in args.versions.split(",") if v]:
        receive_one(receiver, version, args)
    stop.set()
    registered = getattr(receiver, "registered_bytes", 0)
    receiver.close()
    if args.rejoin is not None:
        # A restarted generator worker: a new receiver under the same worker id, asking
        # for the version that is current now.
        receiver = transport.receiver(args.worker_id, spec)
        receive_one(receiver, args.rejoin, args, rejoined=True)
        registered = getattr(receiver, "registered_bytes", 0)
        receiver.close()
    # Memory the receiver had registered (rdma) before closing, and what is left after.
    emit(
        "closed",
        registered_before_close=registered,
        registered_bytes=getattr(receiver, "registered_bytes", 0),
    )
    return 0


def receive_one(receiver: Any, version: int, args: argparse.Namespace, **extra: Any) -> None:
    from forgerl.errors import ForgeError

    start = time.monotonic()
    yielded = 0
    try:
        digests = {}
        for name, t in receiver.receive(version, timeout=args.timeout):
            yielded += 1
            if args.die_when_started == version:  # no progress to watch (shm): die half-way
                os.kill(os.getpid(), signal.SIGKILL)
            if args.stop_when_started == version and yielded == 1 and not hasattr(receiver, "progress"):
                _stall(version)  # shm: stopped half-way through reading the version
            digests[name] = digest(name, t)
    except ForgeError as exc:
        emit(
            "error",
            version=version,
            type=type(exc).__name__,
            message=str(exc),
            seconds=time.monotonic() - start,
            yielded=yielded,
            **extra,
        )
        return
    emit("received", version=version, digests=digests, seconds=time.monotonic() - start, **extra)


def run_sender(args: argparse.Namespace) -> int:
    from forgerl.errors import ForgeError
    from forgerl.types import WeightSet

    transport = _build(args)
    sender = transport.sender()
    # Made before anything is sent: generating 64 MiB must not eat the receivers' timeout.
    prepared = {v: make_weights(v, big=args.big) for v in [int(v) for v in args.versions.split(",") if v]}
    emit("spec", spec=transport.receiver_spec())
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "send":
            version = int(cmd[1])
            try:
                sender.send(
                    WeightSet(version, prepared.get(version) or make_weights(version, big=args.big)),
                    timeout=args.timeout,
                )
            except ForgeError as exc:
                emit("send-error", version=version, type=type(exc).__name__, message=str(exc))
                continue
            emit("sent", version=version)
        elif cmd[0] == "close":
            break
    sender.close()
    emit("closed")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["receiver", "sender"], default="receiver")
    p.add_argument("--transport", required=True)
    p.add_argument("--options", default="{}", help="the transport's options (JSON)")
    p.add_argument("--plugins", default="", help="plugin modules to load besides the installed ones (a,b)")
    p.add_argument("--worker-id", default="r0")
    p.add_argument("--versions", default="")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--die-when-started", type=int, default=None)
    p.add_argument("--stop-when-started", type=int, default=None, help="SIGSTOP itself mid-version V")
    p.add_argument("--wait-go", action="store_true", help="receiver: read a line from stdin before receiving")
    p.add_argument(
        "--rejoin",
        type=int,
        default=None,
        help="after --versions, receive this version again through a new receiver (a restart)",
    )
    p.add_argument("--big", action="store_true", help="sender: versions with a 64 MiB tensor")
    args = p.parse_args(argv)
    return run_sender(args) if args.role == "sender" else run_receiver(args)


if __name__ == "__main__":
    sys.exit(main())
