"""The default demo's step time with its generator behind a slow link, over the ``delta``
transport, against the same demo with the generator beside the trainer (``shm``).

Run: .venv/bin/python benchmarks/delta_demo_link.py [--steps 6] [--rounds 1]
        [--rate 100mbit] [--delay 20ms] [--set KEY=VALUE ...] [--json]

Each round runs ``forge run`` (the demo: SmolLM2-135M-Instruct on the ``vllm`` generator,
synchronous, as a user runs it) twice, alternating which goes first:

* ``local``: the default transport (``shm``), the generator on the same machine;
* ``link``: ``--transport delta``, the trainer's sender on a fixed port, and the vLLM
  worker's receiver told (``transport.options.advertise``) to connect through
  ``_delay_relay.py``, which paces each direction to ``--rate`` and delays it by
  ``--delay``: every weight update crosses that link. Needs no root.

What it does not model: the generation requests themselves (a few small HTTP requests a
step) stay on loopback; across a real link each would add a round trip.

Reported per run: the median over steps 2..N (step 1's update goes against the model's
files, and holds the run's first compilations) of ``time/step``, ``time/sync`` and
``sync/bytes``, and the whole wall time. The held-out evaluations are left out
(``loop.eval_at_start=false``; the last step's still runs and is in the wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _delay_relay import delay_seconds

ROOT = Path(__file__).resolve().parent.parent
FORGE = [sys.executable, "-m", "forgerl.cli"]


def _bits_per_s(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for suffix, scale in units.items():
        if rate.lower().endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    return float(rate)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(kind: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [*FORGE, "run", "--steps", str(args.steps), "--output", str(out),
               "--set", "loop.eval_at_start=false"]  # fmt: skip
    for item in args.sets:
        command += ["--set", item]
    relay = None
    if kind == "link":
        port = _free_port()
        relay = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "_delay_relay.py"), "127.0.0.1", str(port),
             str(delay_seconds(args.delay)), str(_bits_per_s(args.rate))],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert relay.stdout is not None
        told = int(relay.stdout.readline())
        command += ["--transport", "delta", "--set", f"transport.options.port={port}",
                    "--set", f"transport.options.advertise=127.0.0.1:{told}"]  # fmt: skip
    load = os.getloadavg()[0]
    start = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
    finally:
        if relay is not None:
            relay.kill()
            relay.wait()
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows

    def median(key: str) -> float | None:
        values = [r[key] for r in later if r.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    return {
        "run": kind, "wall_seconds": round(wall, 1), "load_before": round(load, 1),
        "load_after": round(os.getloadavg()[0], 1), "step_seconds": median("time/step"),
        "sync_seconds": median("time/sync"), "sync_bytes": median("sync/bytes"),
        "first_sync_seconds": rows[0].get("time/sync"), "first_sync_bytes": rows[0].get("sync/bytes"),
        "accuracy": rows[-1].get("eval/accuracy"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay", default="20ms")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="more --set for both runs")
    parser.add_argument("--output", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(args.output or tempfile.mkdtemp(prefix="forge-delta-demo-"))
    results = []
    for r in range(1, args.rounds + 1):
        order = ("local", "link") if r % 2 else ("link", "local")
        for kind in order:
            result = {"round": r, **run(kind, root / f"{kind}-{r}", args)}
            results.append(result)
            if not args.json:
                print(json.dumps(result), flush=True)
    report = {"steps": args.steps, "link": f"{args.rate}, {args.delay} each way (relay)", "runs": results}
    (root / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
