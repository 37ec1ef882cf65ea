"""Test-only plugin: a reward that can hold a step in progress, for preemption tests.

Loaded with ``FORGE_PLUGINS=tests.helpers.step_gate`` and selected with ``--reward gate``.
It scores every sample 0 (so it changes no metric between two runs that both use it).
``FORGE_TEST_GATE`` names a folder the test controls:

* while ``<folder>/hold`` exists, every sample being scored waits for it to go (the step
  whose rollouts are being scored cannot finish), after touching ``<folder>/held``;
* ``<folder>/sigterm`` is touched when a SIGTERM reaches the reward worker process. Slurm
  signals every process of a step at once, so this says the trainer has had it too;
* ``<folder>/published-<step>`` is touched by ``forge_step_end`` on rank 0, once the step
  is checkpointed; the loop then goes straight on to the next step and waits for its
  rollouts. So "held" plus ``published-K`` with K rows in metrics.jsonl means: the trainer
  is inside step K+1, waiting for rollouts the gate holds.

Without ``FORGE_TEST_GATE`` the reward only scores 0 (the reference run).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Reward


class Gate(Reward):
    name = "gate"  # --reward gate
    description = "test-only: holds a step while a file exists"

    def __init__(self, options):  # noqa: ARG002 - no options
        where = os.environ.get("FORGE_TEST_GATE")
        self.folder = Path(where) if where else None
        main = getattr(sys.modules["__main__"], "__spec__", None)
        if self.folder is not None and main is not None and main.name == "forgerl.rewards.reward_workers":
            self._note_sigterm(signal.getsignal(signal.SIGTERM))

    def _note_sigterm(self, before) -> None:
        """Touch ``sigterm`` when one arrives, then do what the worker did before: ignore
        it (forgerl's workers do) or die of it, so the plugin changes nothing."""

        def noted(signum, frame):
            (self.folder / "sigterm").touch()
            if before is signal.SIG_IGN:
                return
            if callable(before):
                before(signum, frame)
                return
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, noted)

    def score(self, sample):  # noqa: ARG002 - scores every sample alike
        if self.folder is not None and (self.folder / "hold").exists():
            (self.folder / "held").touch()
            while (self.folder / "hold").exists():
                time.sleep(0.05)  # a file the test removes: nothing to wait on but polling
        return 0.0


@hookimpl
def forge_step_end(step, metrics, run_dir):  # noqa: ARG001 - hook signature
    where = os.environ.get("FORGE_TEST_GATE")
    if where:
        Path(where, f"published-{step}").touch()


@hookimpl
def forge_rewards():
    return [Gate]
