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
namespace shaped to ``--rate`` and ``--delay`` each way. Version 0 is the model's files,
which the receiver reads as a generator does (``seed_from``), so update 1 goes as a delta
against them; ``--no-seed`` sends version 0 whole first instead.

Reported per update: bytes on the wire (the sender's count, frames and tags included)
against the full version's; the sender's CPU seconds to snapshot, checksum and encode, the
receiver's to decode, apply and check; the send's wall time over the link; whether the
receiver's bytes equal the trainer's bit for bit (xxh3-128 of every tensor, compared in
the benchmark, beside the transport's own check). Then the full version's time over the
same link (a receiver that joins late and holds nothing; and one that joins late with the
model's files, which gets the last version against them), and what the encoding gives for
the fp32 weights themselves (against the previous fp32 version, computed in the
benchmark's process: fp32 changes in almost every element).

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

from _delay_relay import delay_seconds
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
first, last, worker, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
t = DeltaTransport(DeltaTransport.Options(**spec.pop("options")), context=None)
r = t.receiver(worker, spec)
if folder:
    r.seed_from(folder)  # as a generator does with the folder it loaded
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
    spec: dict[str, Any], first: int, last: int, worker: str, shaped: bool, folder: Path | None = None
) -> subprocess.Popen:
    prefix = ["ip", "netns", "exec", NS] if shaped else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "core"), str(ROOT / "plugins")])}
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", RECEIVER, str(first), str(last), worker, str(folder or "")],
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
    parser.add_argument(
        "--no-seed", action="store_true",
        help="the receiver does not start from the model's files: version 0 goes whole first",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from forgerl.interfaces import RunContext
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
    # The sender reads the folder the trainer started from (the run's model), as in a run.
    context = RunContext(run_dir=tmp / "run", model_path=model_dir)
    transport = DeltaTransport(DeltaTransport.Options(**options, seed=not args.no_seed), context=context)
    seed = None if args.no_seed else model_dir
    first = 0 if args.no_seed else 1
    procs: list[subprocess.Popen] = []
    try:
        if shaped:
            make_link(args.rate, args.delay)
        sender = transport.sender()
        spec = {**transport.receiver_spec(), "options": options}
        if shaped:  # receivers reach the sender through the delay relay, in the namespace
            relay = subprocess.Popen(
                ["ip", "netns", "exec", NS, sys.executable, str(ROOT / "benchmarks" / "_delay_relay.py"), HOST_IP,
                 str(sender.port), str(delay_seconds(args.delay))], stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            procs.append(relay)
            assert relay.stdout is not None
            spec.update(host="127.0.0.1", port=int(relay.stdout.readline()))
        proc = start_receiver(spec, first, args.steps, "gen.0", shaped, seed)
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
            if step < first:
                continue  # a run never sends version 0: the generator loaded it from the files
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
        # Receivers that join late: one without the model's files gets the current version
        # whole, one with them gets it against the files; over the same link.
        for name, folder in (("whole", None), ("seeded", seed)):
            if name == "seeded" and folder is None:
                continue
            joiner = start_receiver(spec, args.steps, args.steps, f"gen.late-{name}", shaped, folder)
            procs.append(joiner)
            got_late = next(events(joiner))
            late[name] = {"seconds": round(got_late["seconds"], 3), "wire_bytes": got_late["wire_bytes"],
                          "base": got_late["base"]}  # fmt: skip
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
    deltas = rows[1:] if args.no_seed else rows
    total_full = sum(r["full_bytes"] for r in rows)
    total_wire = sum(r["wire_bytes"] for r in rows)
    summary = {
        "model": args.model, "steps": args.steps, "lr": args.lr,
        "link": f"{args.rate} (tbf) + {args.delay} each way (relay), veth into a netns" if shaped else "loopback, unshaped",
        "cpu": _cpu(), "full_version_bytes": rows[0]["full_bytes"],
        "delta_bytes_median": sorted(r["wire_bytes"] for r in deltas)[len(deltas) // 2] if deltas else None,
        "per_step_ratio_min": min((r["ratio"] for r in deltas), default=None),
        "total_bytes_full": total_full, "total_bytes_delta": total_wire,
        "seeded_from_files": not args.no_seed,
        "total_ratio": round(total_full / max(1, total_wire), 1),
        "total_ratio_updates_only": round(sum(r["full_bytes"] for r in deltas) / max(1, sum(r["wire_bytes"] for r in deltas)), 1),
        "bit_exact": all(r["bit_exact"] for r in rows),
        "first_sync_seconds": rows[0]["send_seconds"], "late_joiners": late,
        "delta_sync_seconds_median": sorted(r["send_seconds"] for r in deltas)[len(deltas) // 2] if deltas else None,
        "fp32_ratio_median": (sorted(r["fp32_full_bytes"] / r["fp32_delta_bytes"] for r in deltas)[len(deltas) // 2]
                              if deltas else None),
    }  # fmt: skip
    print(
        json.dumps(
            {"summary": summary, "rows": rows} if args.json else summary, indent=None if args.json else 1
        )
    )


def _cpu() -> str:
    model = ""
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
    flags = Path("/proc/cpuinfo").read_text()
    return f"{model}, {os.cpu_count()} cores, avx512_bf16: {'yes' if 'avx512_bf16' in flags else 'no'}"


if __name__ == "__main__":
    main()
