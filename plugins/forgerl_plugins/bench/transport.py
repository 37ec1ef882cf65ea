"""``forge bench transport``: a transport against the raw path it is built on.

A synthetic weight set of SIZE bytes (bf16 tensors of model-like sizes) is moved into N
receiver processes, version after version, through the transport (its sender here, its
receivers built as a generator worker builds them) and through the raw path:

* ``nccl``: one broadcast of the whole payload over a bare process group (gloo on CPU,
  NCCL on GPU) into a buffer reused across versions;
* ``rdma``: bare Mooncake ``batch_transfer_sync_read`` of the sender's registered buffer
  into the receiver's registered buffer, in the same chunk size;
* ``shm``: safetensors ``save_file`` into /dev/shm, then every receiver copies each tensor
  into tensors allocated once.

Rounds of the two paths alternate (so load changes on a shared machine hit both alike);
the first version of each is a warm-up. A version's time runs from the start of the send
to the last receiver holding all of it (``time.monotonic`` is one clock for every process
of the machine). Reported: the median round of each path, in GB/s (10^9 bytes) of payload
per receiver, and ``ratio = gbps / raw_gbps``.
"""

from __future__ import annotations

import json
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from forgerl.errors import ConfigError, ForgeError, TransportError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
#: Sizes of the synthetic tensors, cycled (bytes): big projections down to norms.
_PATTERN = (32 * 2**20, 8 * 2**20, 8 * 2**20, 2 * 2**20, 64 * 2**10, 4 * 2**10)


def parse_size(text: str) -> int:
    """``500MB`` → 500_000_000; ``64MiB`` → 67_108_864; ``1e9`` → 10**9."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"--bytes {text!r} is not a size; write e.g. 500MB, 1GB, 64MiB or 8000000")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 2:
        raise ConfigError(f"--bytes {text!r} is too small: at least 2 bytes (one bf16 value)")
    return n


def parse_options(pairs: Iterable[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option {pair!r} is not KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def validated_options(name: str, options: dict[str, Any]) -> Any:
    """The transport's options model, or a one-line ConfigError."""
    from pydantic import ValidationError

    from forgerl.registry.plugins import build_registry

    try:
        return build_registry().require("transport", name).validate_options(options)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"bad --option for transport {name!r}: {problems}") from None


def synthetic_weights(nbytes: int) -> dict[str, Any]:
    """bf16 tensors summing to ``nbytes`` (rounded down to an even count)."""
    import torch

    tensors: dict[str, Any] = {}
    left, i = nbytes - nbytes % 2, 0
    while left > 0:
        size = min(_PATTERN[i % len(_PATTERN)], left)
        t = torch.empty(size // 2, dtype=torch.bfloat16)
        t.view(torch.int16).random_()  # real bits in every page, not lazily zeroed memory
        tensors[f"model.layers.{i // len(_PATTERN)}.part{i % len(_PATTERN)}.weight"] = t
        left -= size
        i += 1
    return tensors


# ------------------------------------------------------------------------ workers


class _Worker:
    def __init__(self, mode: str, args: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forgerl_plugins.bench.worker", mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Its arguments go through the pipe, not the command line: a transport's spec
        # carries the run's secret, and ``ps`` shows every user every command line.
        self.tell(json.dumps(args))
        self.events: queue.Queue[dict] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()  # type: ignore[arg-type]

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith("{"):
                self.events.put(json.loads(line))

    def wait(self, event: str, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while True:
            try:
                ev = self.events.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise TransportError(
                    f"bench receiver (pid {self.proc.pid}) sent no {event!r} within {timeout:g} s; "
                    f"exit {self.proc.poll()}; stderr: {''.join(self.stderr[-5:]).strip()[-800:]}"
                ) from None
            if ev["event"] == "error":
                raise TransportError(f"bench receiver (pid {self.proc.pid}) failed: {ev['message']}")
            if ev["event"] == event:
                return ev

    def tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.tell("stop")
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait(timeout=30)


def _last_done(workers: list[_Worker], timeout: float) -> float:
    return max(w.wait("done", timeout)["t"] for w in workers)


# -------------------------------------------------------------------------- paths


class _TransportPath:
    def __init__(
        self,
        name: str,
        options: dict[str, Any],
        weights: dict[str, Any],
        receivers: int,
        versions: int,
        timeout: float,
    ) -> None:
        from forgerl.registry.plugins import build_registry

        backend = build_registry().require("transport", name)
        self.options = validated_options(name, options)
        self.transport = backend.build(self.options, context=None)
        self.sender = self.transport.sender()
        spec = self.transport.receiver_spec()
        self.weights, self.timeout = weights, timeout
        args = {
            "name": name,
            "options": self.options.model_dump(),
            "spec": spec,
            "versions": versions,
            "timeout": timeout,
        }
        self.workers = [_Worker("transport", {**args, "worker_id": f"bench.{i}"}) for i in range(receivers)]
        for w in self.workers:
            w.wait("ready", timeout)

    def round(self, version: int) -> float:
        from forgerl.types import WeightSet

        start = time.monotonic()
        for w in self.workers:  # as the loop starts the generator's update with the send
            w.tell(f"go {version}")
        self.sender.send(WeightSet(version, self.weights), timeout=self.timeout)
        return _last_done(self.workers, self.timeout) - start

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.sender.close()
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()


class _RawGroup:
    """The raw path of ``nccl``: one broadcast of a flat buffer over a bare group."""

    def __init__(self, options: Any, nbytes: int, receivers: int, versions: int, timeout: float) -> None:
        import torch
        from torch.distributed import PrefixStore

        from forgerl_plugins.transports.common import control
        from forgerl_plugins.transports.nccl import groups

        self.backend = groups.resolve_backend(options.backend)
        self.timeout = timeout
        self.server = control.start_server(0, timeout)
        args = {
            "host": "127.0.0.1",
            "port": self.server.port,
            "world": receivers + 1,
            "nbytes": nbytes,
            "versions": versions,
            "backend": self.backend,
            "timeout": timeout,
        }
        self.workers = [_Worker(f"raw-{self.backend}", {**args, "rank": r + 1}) for r in range(receivers)]
        store = PrefixStore("raw/", self.server)
        self.pg = groups.make_group(store, 0, receivers + 1, self.backend, timeout, "127.0.0.1")
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=groups.device_for(self.backend)).random_()
        for w in self.workers:
            w.wait("ready", timeout)

    def round(self, version: int) -> float:
        from forgerl_plugins.transports.nccl import groups

        start = time.monotonic()
        groups.broadcast(self.pg, self.buf, 0, self.timeout).wait()
        return _last_done(self.workers, self.timeout) - start

    def close(self) -> None:
        from forgerl_plugins.transports.nccl import groups

        for w in self.workers:
            w.stop()
        groups.destroy(self.pg)
        self.pg = self.server = None


class _RawMooncake:
    """The raw path of ``rdma``: bare reads of one registered buffer."""

    def __init__(self, options: Any, nbytes: int, receivers: int, timeout: float) -> None:
        import torch

        from forgerl_plugins.transports.common import control
        from forgerl_plugins.transports.rdma.engine import Engine

        self.timeout = timeout
        address = control.local_address(options.host)
        self.engine = Engine(address, options.protocol, options.device_name)
        self.buf = torch.empty(nbytes, dtype=torch.uint8).random_()
        self.engine.register(self.buf)
        args = {
            "address": address,
            "protocol": options.protocol,
            "device_name": options.device_name,
            "nbytes": nbytes,
            "chunk_bytes": options.chunk_mb * 2**20,
            "session": self.engine.session,
            "remote": self.buf.data_ptr(),
        }
        self.workers = [_Worker("raw-mooncake", args) for _ in range(receivers)]
        for w in self.workers:
            w.wait("ready", timeout)

    def round(self, version: int) -> float:
        start = time.monotonic()
        for w in self.workers:
            w.tell(f"go {version}")
        return _last_done(self.workers, self.timeout) - start

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.engine.close()


class _RawShm:
    """The raw path of ``shm``: safetensors written to /dev/shm, copied into tensors."""

    def __init__(self, weights: dict[str, Any], receivers: int, timeout: float) -> None:
        root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.dir = Path(tempfile.mkdtemp(prefix="forgerl-bench-", dir=root))
        self.weights, self.timeout = weights, timeout
        self.workers = [_Worker("raw-shm", {}) for _ in range(receivers)]
        for w in self.workers:
            w.wait("ready", timeout)

    def round(self, version: int) -> float:
        from safetensors.torch import save_file

        path = self.dir / f"v{version}.safetensors"
        start = time.monotonic()
        save_file(self.weights, str(path))
        for w in self.workers:
            w.tell(f"go {version} {path}")
        seconds = _last_done(self.workers, self.timeout) - start
        path.unlink()
        return seconds

    def close(self) -> None:
        import shutil

        for w in self.workers:
            w.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


RAW_PATHS = {
    "nccl": "one broadcast of the whole payload over a bare process group, buffer reused",
    "rdma": "bare Mooncake batch_transfer_sync_read into a registered buffer, same chunk size",
    "shm": "safetensors save_file to /dev/shm + copy into preallocated tensors",
}


def run(
    name: str,
    nbytes: int,
    *,
    receivers: int = 1,
    rounds: int = 3,
    options: dict[str, Any] | None = None,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Measure ``name`` and its raw path; the report ``format_report`` prints."""
    if name not in RAW_PATHS:
        raise ConfigError(
            f"forge bench transport knows the raw paths of {', '.join(RAW_PATHS)}, not {name!r}"
        )
    validated_options(name, dict(options or {}))  # before allocating SIZE bytes
    weights = synthetic_weights(nbytes)
    payload = sum(t.numel() * t.element_size() for t in weights.values())
    versions = rounds + 1
    tp = _TransportPath(name, dict(options or {}), weights, receivers, versions, timeout)
    raw: Any = None
    try:
        if name == "nccl":
            raw = _RawGroup(tp.options, payload, receivers, versions, timeout)
        elif name == "rdma":
            raw = _RawMooncake(tp.options, payload, receivers, timeout)
        else:
            raw = _RawShm(weights, receivers, timeout)
        seconds, raw_seconds = [], []
        for version in range(1, versions + 1):
            t = tp.round(version)
            r = raw.round(version)
            if version > 1:  # the first version forms groups, touches buffers: a warm-up
                seconds.append(t)
                raw_seconds.append(r)
    except ForgeError:
        raise
    except Exception as exc:
        raise TransportError(f"bench of {name!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        tp.close()
        if raw is not None:
            raw.close()
    gbps = payload / statistics.median(seconds) / 1e9
    raw_gbps = payload / statistics.median(raw_seconds) / 1e9
    return {
        "transport": name,
        "bytes": payload,
        "tensors": len(weights),
        "receivers": receivers,
        "rounds": rounds,
        "options": tp.options.model_dump(),
        "gbps": round(gbps, 4),
        "raw_gbps": round(raw_gbps, 4),
        "ratio": round(gbps / raw_gbps, 4),
        "seconds": [round(s, 5) for s in seconds],
        "raw_seconds": [round(s, 5) for s in raw_seconds],
        "raw": RAW_PATHS[name],
    }


def format_report(r: dict[str, Any]) -> str:
    return (
        f"transport {r['transport']}: {r['bytes'] / 1e6:.1f} MB ({r['tensors']} tensors) into "
        f"{r['receivers']} receiver(s), median of {r['rounds']} rounds\n"
        f"  {r['transport']:<10} {r['gbps']:8.3f} GB/s   rounds {', '.join(f'{s:.3f}' for s in r['seconds'])} s\n"
        f"  {'raw':<10} {r['raw_gbps']:8.3f} GB/s   rounds {', '.join(f'{s:.3f}' for s in r['raw_seconds'])} s"
        f"   ({r['raw']})\n"
        f"  ratio      {r['ratio']:8.3f}"
    )
