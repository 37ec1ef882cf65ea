"""forgerl's schedulers pass the scheduler kit (forgerl.testing.SchedulerContract) with real
jobs: ``local`` always, ``slurm`` where a Slurm answers (scripts/slurm/start-local-slurm.sh;
skipped with the reason otherwise, failed under FORGE_REQUIRE_SLURM=1 as in CI), and
``kubernetes`` against the kmock API emulator, with a fake kubelet that runs each pod's
container command here (tests/helpers/kmock_cluster.py)."""

from __future__ import annotations

import os
import sys

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


@pytest.mark.integration
class TestKubernetesSchedulerKit(SchedulerContract):
    """The JobSet mode (the default). Indexed-Job mode differs in what the scheduler
    creates and how it stops the servers, which tests/integration/test_kubernetes.py checks
    with hand-played controllers."""

    backend = "kubernetes"

    @pytest.fixture(autouse=True)
    def _cluster(self, tmp_path):
        pytest.importorskip("kmock")
        pytest.importorskip("kubernetes")
        from ..helpers.kmock_cluster import FakeKubelet, KMockServer, write_kubeconfig

        with KMockServer() as server, FakeKubelet(server, "rl", tmp_path / "pods") as kubelet:
            self.options = {
                "namespace": "rl",
                "image": "ghcr.io/example/forgerl:0.1",
                "kubeconfig": str(write_kubeconfig(tmp_path / "kubeconfig", server.url)),
                "python": sys.executable,  # the fake kubelet runs the container's command here
                "poll_interval": 0.5,
                # The run directories (under tmp_path) on a volume, as the scheduler requires;
                # the fake kubelet's processes see them at the same path.
                "volumes": [{"name": "runs", "host_path": str(tmp_path), "mount_path": str(tmp_path)}],
            }
            yield
        assert not kubelet.errors, f"the fake kubelet failed: {kubelet.errors}"
