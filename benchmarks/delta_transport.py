"""What the ``delta`` transport moves per weight update, over real training updates, and how
long an update takes over a slow link.

Run (as root for the shaped link; without root, or with --no-link, it runs on loopback):
(the rate is a ``tbf`` qdisc on each end of a veth pair into a network namespace; the delay is
``_delay_relay.py`` in that namespace, which the receivers connect through: this kernel has no
``netem``. The relay acknowledges at once, so TCP's slow start does not see the 40 ms round
trip: the times of small transfers are a few round trips optimistic.)
    .venv/bin/python benchmarks/delta_transport.py [--model smollm2-135m-instruct|tiny|DIR]
        [--steps 20] [--lr 1e-5] [--rate 100mbit] [--delay 20ms] [--json]

The ``fsdp`` trainer (one rank, the demo's options: AdamW, lr 1e-5, fp32 parameters) takes
``--steps`` optimiser steps on GRPO batches (trainer_floor.py's: the demo's prompts, random
completions and rewards; what an update changes depends on AdamW's step size, not on what
the tokens say). After each step its exported weights are cast to bf16 *at the sender* (the
trainer keeps fp32 masters, as the demo does; a generator serves bf16) and sent through the
``delta`` transport to one receiver in another process, behind a veth pair in a network
namespace shaped to ``--rate`` and ``--delay`` each way. Version 0 is the weights
before training: the receiver starts with nothing, so it goes whole.

Reported per update: bytes on the wire (the sender's count, frames and tags included)
against the full version's; the sender's CPU seconds to snapshot, checksum and encode, the
receiver's to decode, apply and check; the send's wall time over the link; whether the
receiver's bytes equal the trainer's bit for bit (xxh3-128 of every tensor, compared in
the benchmark, beside the transport's own check). Then the full version's time over the
same link (a second receiver that joins late and holds nothing), and what the encoding
gives for the fp32 weights themselves (xor + zstd against the previous fp32 version,
computed in the benchmark's process: fp32 changes in almost every element).

The link is removed in a ``finally`` (namespace, veth pair, qdiscs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_floor import grpo_batch, make_trainer, model_folder

NS = f"fdl{os.getpid() % 100000}"
HOST_IF, PEER_IF = f"{NS}a", f"{NS}b"
HOST_IP, PEER_IP = "10.213.77.1", "10.213.77.2"

RECEIVER = r"""
import json, sys, time
import torch  # before "ready": a generator has it loaded, and it takes seconds to import
from forgerl_plugins.transports.delta import encoding
from forgerl_plugins.transports.delta.transport import DeltaTransport
spec = json.loads(sys.stdin.readline())
first, last, worker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
t = DeltaTransport(DeltaTransport.Options(**spec.pop("options")), context=None)
r = t.receiver(worker, spec)
print(json.dumps({"event": "ready"}), flush=True)
for v in range(first, last + 1):
    start, cpu = time.monotonic(), time.process_time()
    got = list(r.receive(v, timeout=600))
    took, cpu = time.monotonic() - start, time.process_time() - cpu
    sums = {n: encoding.checksum(encoding.tensor_bytes(x, copy=False)) for n, x in got}
    rec = r.last_received
    print(json.dumps({"event": "received", "version": v, "seconds": took, "cpu_seconds": cpu,
                      "decode_seconds": rec.decode_seconds, "wire_bytes": rec.wire_bytes, "base": rec.base,
                      "refused": rec.refused, "sums": sums}), flush=True)
r.close()
"""


def sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, capture_output=True)


def make_link(rate: str, delay: str) -> None:
    sh("ip", "netns", "add", NS)
    sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", PEER_IF)
    sh("ip", "link", "set", PEER_IF, "netns", NS)
    sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
    sh("ip", "link", "set", HOST_IF, "up")
    sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{PEER_IP}/30", "dev", PEER_IF)
    sh("ip", "netns", "exec", NS, "ip", "link", "set", PEER_IF, "up")
    sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
    # The rate, each direction: tbf (this kernel has no netem; the delay is _delay_relay.py's).
    for prefix in ([], ["ip", "netns", "exec", NS]):
        dev = HOST_IF if not prefix else PEER_IF
        sh(
            *prefix,
            "tc",
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "32kb",
            "latency",
            "400ms",
        )


def remove_link() -> None:
    sh("tc", "qdisc", "del", "dev", HOST_IF, "root", check=False)
    sh("ip", "link", "del", HOST_IF, check=False)  # its peer goes with it
    sh("ip", "netns", "del", NS, check=False)


def start_receiver(
    spec: dict[str, Any], first: int, last: int, worker: str, shaped: bool
) -> subprocess.Popen:
    prefix = ["ip", "netns", "exec", NS] if shaped else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "core"), str(ROOT / "plugins")])}
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", RECEIVER, str(first), str(last), worker],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(spec) + "\n")
    proc.stdin.flush()
    line = json.loads(proc.stdout.readline() or "{}")
    assert line.get("event") == "ready", f"receiver did not start: {line}"
    return proc


def events(proc: subprocess.Popen) -> Any:
    assert proc.stdout is not None
    for line in proc.stdout:
        yield json.loads(line)


ROOT = Path(__file__).resolve().parent.parent


def bf16_weights(exported: Any) -> dict[str, Any]:
    import torch

    return {n: (t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in exported.tensors.items()}


def fp32_delta(prev: list[Any] | None, tensors: dict[str, Any]) -> tuple[list[Any], int, float]:
    """Bytes of the fp32 weights encoded against the previous fp32 version, and the time."""
    from forgerl_plugins.transports.delta import encoding

    data = [encoding.tensor_bytes(t, copy=True) for t in tensors.values()]
    if prev is None:
        return data, sum(d.size for d in data), 0.0
    comp = encoding.compressor(1)
    start = time.process_time()
    size = sum(b.wire_len for n, p in zip(data, prev) for b in encoding.delta_blocks(n, p, 4 * 2**20, comp))
    return data, size, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay", default="20ms")
    parser.add_argument("--no-link", action="store_true", help="loopback, unshaped")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from forgerl.types import WeightSet
    from forgerl_plugins.transports.delta import encoding
    from forgerl_plugins.transports.delta.transport import DeltaTransport

    shaped = not args.no_link and os.geteuid() == 0
    tmp = Path(tempfile.mkdtemp(prefix="forge-delta-bench-"))
    model_dir = model_folder(args.model, tmp)
    trainer = make_trainer(model_dir, tmp / "run", {"lr": args.lr, "autocast_bf16": False})
    options = {"host": HOST_IP if shaped else "127.0.0.1", "timeout": 600, "stall_timeout": 120}
    rows: list[dict[str, Any]] = []
    late: dict[str, Any] = {}
    transport = DeltaTransport(DeltaTransport.Options(**options), context=None)
    procs: list[subprocess.Popen] = []
    try:
        if shaped:
            make_link(args.rate, args.delay)
        sender = transport.sender()
        spec = {**transport.receiver_spec(), "options": options}
        if shaped:  # receivers reach the sender through the delay relay, in the namespace
            relay = subprocess.Popen(
                ["ip", "netns", "exec", NS, sys.executable, str(ROOT / "benchmarks" / "_delay_relay.py"), HOST_IP,
                 str(sender.port), str(_seconds(args.delay))], stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            procs.append(relay)
            assert relay.stdout is not None
            spec.update(host="127.0.0.1", port=int(relay.stdout.readline()))
        proc = start_receiver(spec, 0, args.steps, "gen.0", shaped)
        procs.append(proc)
        got = events(proc)
        prev32 = None
        for step in range(args.steps + 1):
            if step:
                trainer.train_step(grpo_batch(model_dir, seed=step))
            exported = trainer.export_weights(step)
            weights = bf16_weights(exported)
            prev32, fp32_bytes, fp32_cpu = fp32_delta(prev32, {n: t.float() if t.is_floating_point() else t
                                                              for n, t in exported.tensors.items()})  # fmt: skip
            full = sum(t.numel() * t.element_size() for t in weights.values())
            cpu = time.process_time()
            sender.send(WeightSet(step, weights), timeout=600)
            send_cpu = time.process_time() - cpu
            rec = next(got)
            want = {n: encoding.checksum(encoding.tensor_bytes(t, copy=False)) for n, t in weights.items()}
            rows.append({
                "version": step, "full_bytes": full, "wire_bytes": sender.last_send_bytes,
                "ratio": round(full / max(1, sender.last_send_bytes), 1), "base": rec["base"],
                "send_seconds": round(sender.last_send_seconds or 0.0, 3),
                "sender_encode_seconds": round(sender.encode_seconds.get(step, 0.0), 3),
                "sender_cpu_seconds": round(send_cpu, 3),
                "receiver_decode_seconds": round(rec["decode_seconds"], 3),
                "receiver_cpu_seconds": round(rec["cpu_seconds"], 3),
                "bit_exact": rec["sums"] == want, "refused": rec["refused"],
                "fp32_full_bytes": full * 2 if step else None, "fp32_delta_bytes": fp32_bytes if step else None,
                "fp32_encode_cpu_seconds": round(fp32_cpu, 3),
            })  # fmt: skip
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
        proc.wait(timeout=60)
        # A receiver that joins late holds nothing: the current version goes whole, over the same link.
        joiner = start_receiver(spec, args.steps, args.steps, "gen.late", shaped)
        procs.append(joiner)
        late = next(events(joiner))
        late = {"seconds": round(late["seconds"], 3), "wire_bytes": late["wire_bytes"], "base": late["base"]}
        joiner.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        transport.close()
        trainer.close()
        if shaped:
            remove_link()
        shutil.rmtree(tmp, ignore_errors=True)
    deltas = rows[1:]
    total_full = sum(r["full_bytes"] for r in rows)
    total_wire = sum(r["wire_bytes"] for r in rows)
    summary = {
        "model": args.model, "steps": args.steps, "lr": args.lr,
        "link": f"{args.rate} (tbf) + {args.delay} each way (relay), veth into a netns" if shaped else "loopback, unshaped",
        "cpu": _cpu(), "full_version_bytes": rows[0]["full_bytes"],
        "delta_bytes_median": sorted(r["wire_bytes"] for r in deltas)[len(deltas) // 2] if deltas else None,
        "per_step_ratio_min": min((r["ratio"] for r in deltas), default=None),
        "total_bytes_full": total_full, "total_bytes_delta": total_wire,
        "total_ratio_with_first_full": round(total_full / max(1, total_wire), 1),
        "total_ratio_updates_only": round(sum(r["full_bytes"] for r in deltas) / max(1, sum(r["wire_bytes"] for r in deltas)), 1),
        "bit_exact": all(r["bit_exact"] for r in rows),
        "full_sync_seconds_first": rows[0]["send_seconds"], "full_sync_seconds_late_joiner": late.get("seconds"),
        "delta_sync_seconds_median": sorted(r["send_seconds"] for r in deltas)[len(deltas) // 2] if deltas else None,
        "fp32_ratio_median": (sorted(r["fp32_full_bytes"] / r["fp32_delta_bytes"] for r in deltas)[len(deltas) // 2]
                              if deltas else None),
    }  # fmt: skip
    print(
        json.dumps(
            {"summary": summary, "rows": rows} if args.json else summary, indent=None if args.json else 1
        )
    )


def _seconds(delay: str) -> float:
    return float(delay.removesuffix("ms")) / 1000 if delay.endswith("ms") else float(delay.removesuffix("s"))


def _cpu() -> str:
    model = ""
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
    flags = Path("/proc/cpuinfo").read_text()
    return f"{model}, {os.cpu_count()} cores, avx512_bf16: {'yes' if 'avx512_bf16' in flags else 'no'}"


if __name__ == "__main__":
    main()
