"""The one rule for tests that need an optional backend's package: skip with the install
line, unless the environment says the package must be there (CI sets FORGE_REQUIRE_RDMA=1
and FORGE_REQUIRE_TORCHTITAN=1, so a broken Mooncake or TorchTitan install fails the run
instead of quietly skipping its tests)."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_mooncake() -> None:
    """Skip (or, under FORGE_REQUIRE_RDMA=1, fail) a test that needs Mooncake."""
    if importlib.util.find_spec("mooncake") is not None:
        return
    reason = "rdma needs Mooncake: pip install 'forgerl[rdma]' (mooncake-transfer-engine-non-cuda)"
    if os.environ.get("FORGE_REQUIRE_RDMA") == "1":
        pytest.fail(f"FORGE_REQUIRE_RDMA=1 but {reason}")
    pytest.skip(reason)


def require_torchtitan() -> None:
    """Skip (or, under FORGE_REQUIRE_TORCHTITAN=1, fail) a test that needs TorchTitan."""
    if importlib.util.find_spec("torchtitan") is not None:
        return
    reason = "the torchtitan trainer needs TorchTitan: scripts/setup.sh installs it (see docs/trainers.md)"
    if os.environ.get("FORGE_REQUIRE_TORCHTITAN") == "1":
        pytest.fail(f"FORGE_REQUIRE_TORCHTITAN=1 but {reason}")
    pytest.skip(reason)
