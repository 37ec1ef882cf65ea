"""The one rule for tests that need an optional backend's package: skip with the install
line, unless the environment says the package must be there (CI sets FORGE_REQUIRE_RDMA=1,
FORGE_REQUIRE_TORCHTITAN=1, FORGE_REQUIRE_TRACKERS=1 and FORGE_REQUIRE_VERIFIERS=1, so a broken
Mooncake, TorchTitan, tracker or verifiers install fails the run instead of quietly skipping
its tests)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest

from .timing import scaled


def require_mooncake() -> None:
    """Skip (or, under FORGE_REQUIRE_RDMA=1, fail) a test that needs Mooncake."""
    if importlib.util.find_spec("mooncake") is not None:
        return
    reason = "rdma needs Mooncake: pip install 'forgerl[rdma]' (mooncake-transfer-engine-non-cuda)"
    if os.environ.get("FORGE_REQUIRE_RDMA") == "1":
        pytest.fail(f"FORGE_REQUIRE_RDMA=1 but {reason}")
    pytest.skip(reason)


def slurm_unavailable() -> str | None:
    """None when a Slurm controller answers with a usable node, else why not (tests that
    need one skip with it, or fail under FORGE_REQUIRE_SLURM=1, as CI sets)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "no sinfo/sbatch on PATH"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=scaled(10))
    except subprocess.TimeoutExpired:
        return f"sinfo did not answer in {scaled(10):g} s"
    if proc.returncode != 0:
        return f"sinfo failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
    states = proc.stdout.split()
    if not any(s.rstrip("*~#!%$@^-") in ("idle", "mix", "alloc", "comp") for s in states):
        return f"no usable Slurm node (states: {states})"
    return None


def require_torchtitan() -> None:
    """Skip (or, under FORGE_REQUIRE_TORCHTITAN=1, fail) a test that needs TorchTitan."""
    if importlib.util.find_spec("torchtitan") is not None:
        return
    reason = "the torchtitan trainer needs TorchTitan: scripts/setup.sh installs it (see docs/trainers.md)"
    if os.environ.get("FORGE_REQUIRE_TORCHTITAN") == "1":
        pytest.fail(f"FORGE_REQUIRE_TORCHTITAN=1 but {reason}")
    pytest.skip(reason)


def require_tracker(module: str, install: str) -> None:
    """Skip (or, under FORGE_REQUIRE_TRACKERS=1, fail) a test that needs a tracker's library
    (tensorboard, wandb, mlflow: scripts/setup.sh installs all three)."""
    if importlib.util.find_spec(module) is not None:
        return
    reason = f"{module} is not installed ({install}; scripts/setup.sh installs it)"
    if os.environ.get("FORGE_REQUIRE_TRACKERS") == "1":
        pytest.fail(f"FORGE_REQUIRE_TRACKERS=1 but {reason}")
    pytest.skip(reason)


def require_verifiers() -> str:
    """The Python of .venv-verifiers (verifiers' own environment, which scripts/setup.sh
    builds); skip without it, or fail under FORGE_REQUIRE_VERIFIERS=1."""
    from forgerl_plugins.environments.verifiers_worker import DEFAULT_PYTHON

    if DEFAULT_PYTHON.is_file():
        return str(DEFAULT_PYTHON)
    reason = (f"the verifiers environment needs verifiers in {DEFAULT_PYTHON.parents[1]} "
              "(scripts/setup.sh builds it from scripts/verifiers-constraints.txt)")
    if os.environ.get("FORGE_REQUIRE_VERIFIERS") == "1":
        pytest.fail(f"FORGE_REQUIRE_VERIFIERS=1 but {reason}")
    pytest.skip(reason)
