"""How long `forge --help` and `forge plugins list` take, and that they import no torch.
`forge plugins list` is timed with its index of backend identities up to date (the usual
case: the first listing writes it), then with none.

Run: .venv/bin/python benchmarks/cli_startup.py [--repeat N] [--json]
Each command runs in a fresh interpreter N times; the median wall time is reported.
Goal: well under 0.5 s on a laptop-class CPU (docs/performance.md has the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "forge --help": ["--help"],
    "forge plugins list": ["plugins", "list"],
    "forge plugins list (no index)": ["plugins", "list"],
    "forge config show": ["config", "show"],
}
#: Listed with an empty cache folder each time (as after an upgrade): every backend class
#: is imported and the index of their identities written (forgerl.registry.backend_index).
COLD = "forge plugins list (no index)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    for label, argv in COMMANDS.items():
        times = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "XDG_CACHE_HOME": cache} if label == COLD else None
                t = time.perf_counter()
                subprocess.run([sys.executable, "-m", "forgerl.cli", *argv], capture_output=True, check=True, env=env)
                times.append(time.perf_counter() - t)
        probe = subprocess.run(
            [sys.executable, "-c",
             "import sys\nfrom forgerl.cli import main\ntry:\n"
             f"    main({argv!r})\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"],
            capture_output=True, text=True, check=True,
        )
        results[label] = {
            "median_s": round(statistics.median(times), 3),
            "min_s": round(min(times), 3),
            "imports_torch": probe.stdout.strip().splitlines()[-1] == "True",
        }
    baseline = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        baseline.append(time.perf_counter() - t)
    results["python -c pass"] = {"median_s": round(statistics.median(baseline), 3)}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for label, r in results.items():
        extra = "" if "imports_torch" not in r else f"  imports torch: {r['imports_torch']}"
        print(f"{label:<30} median {r['median_s']:.3f} s{extra}")


if __name__ == "__main__":
    main()
