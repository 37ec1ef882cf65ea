"""Test-only plugin: breaks the checkpoint folder's disk right after a chosen step.

Loaded with ``FORGE_PLUGINS=tests.helpers.disk_faults``. ``forge_step_end`` runs on rank 0
after a step's metrics are written and before the next step starts, so the fault lands
deterministically between two checkpoints. ``FORGE_TEST_DISK_FAULT`` says what to do:

* ``fill:STEP``  fill the file system holding ``checkpoints/`` (a small tmpfs the test
  mounted) with ``checkpoints/filler`` until it reports ENOSPC;
* ``chmod:STEP`` make ``checkpoints/`` read-only (``chmod 555``; permissions bind only
  users other than root, so the test runs forge as such a user).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from forgerl.hookspecs import hookimpl


@hookimpl
def forge_step_end(step, metrics, run_dir):  # noqa: ARG001 - hook signature
    fault, _, at = os.environ.get("FORGE_TEST_DISK_FAULT", "").partition(":")
    if not fault or step != int(at):
        return
    folder = Path(run_dir) / "checkpoints"
    if fault == "chmod":
        folder.chmod(0o555)
    elif fault == "fill":
        with open(folder / "filler", "wb", buffering=0) as f:
            block = b"\0" * (1 << 16)
            try:
                while True:
                    f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
