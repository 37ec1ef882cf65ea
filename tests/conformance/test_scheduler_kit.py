"""forgerl's schedulers pass the scheduler kit (forgerl.testing.SchedulerContract) with real
jobs: ``local`` always, ``slurm`` where a Slurm answers (scripts/slurm/start-local-slurm.sh;
skipped with the reason otherwise, failed under FORGE_REQUIRE_SLURM=1 as in CI)."""

from __future__ import annotations

import os

import pytest

from forgerl.testing import SchedulerContract

from ..helpers.requires import slurm_unavailable


class TestLocalSchedulerKit(SchedulerContract):
    backend = "local"
    options = {"stop_timeout": 10}


@pytest.mark.integration
@pytest.mark.slurm
class TestSlurmSchedulerKit(SchedulerContract):
    backend = "slurm"
    options = {"poll_interval": 0.5, "stop_timeout": 10}
    required = os.environ.get("FORGE_REQUIRE_SLURM") == "1"

    def unavailable(self) -> str | None:
        why = slurm_unavailable()
        return None if why is None else f"no Slurm running here ({why}); start one with scripts/slurm/start-local-slurm.sh"

    @pytest.fixture(autouse=True)
    def _own_job_index(self, tmp_path, monkeypatch):
        # The scheduler remembers job id -> run directory under $XDG_STATE_HOME; keep the
        # kit's entries out of the user's.
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
