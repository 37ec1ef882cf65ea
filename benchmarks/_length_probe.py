"""A weight-0 reward that records every scored completion, for benchmarks/long_tail.py.

Loaded into a run's processes through FORGE_PLUGINS=_length_probe (benchmarks/ on
PYTHONPATH); each completion's text and finish reason go, one JSON line each, to the
file named by FORGERL_LENGTH_PROBE, so the benchmark can measure the length distribution
(metrics.jsonl has only the mean). It scores 0 and has weight 0: the run trains as without it.
"""

from __future__ import annotations

import json
import os

from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Reward
from forgerl.options import OptionsModel
from forgerl.types import RewardInput


class LengthProbe(Reward):
    name = "length_probe"
    description = "records each completion for benchmarks/long_tail.py; scores 0"

    class Options(OptionsModel):
        pass

    def __init__(self, options: Options):
        self.options = options

    def score(self, sample: RewardInput) -> float:
        path = os.environ.get("FORGERL_LENGTH_PROBE")
        if path:
            line = json.dumps({"text": sample.completion_text, "finish": sample.finish_reason,
                               "kind": sample.problem.metadata.get("kind")})
            with open(path, "a", encoding="utf-8") as f:  # one short append per line
                f.write(line + "\n")
        return 0.0


@hookimpl
def forge_rewards():
    return ["_length_probe:LengthProbe"]
