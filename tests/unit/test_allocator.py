"""The trainer role's malloc settings: set where the user chose nothing, never over a choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgerl.rundirs.allocator import TRAINER_MALLOC_ENV, trainer_allocator_env


def test_the_trainer_gets_mmap_off_and_no_trimming_by_default() -> None:
    assert trainer_allocator_env({"PATH": "/usr/bin", "OMP_NUM_THREADS": "2"}) == {
        "MALLOC_MMAP_MAX_": "0",
        "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    }


@pytest.mark.parametrize(
    "chosen",
    [
        {"MALLOC_ARENA_MAX": "2"},
        {"MALLOC_MMAP_MAX_": "65536"},
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
        {"LD_PRELOAD": "libtcmalloc_minimal.so.4"},
    ],
)
def test_an_allocator_the_user_chose_is_kept(chosen: dict[str, str]) -> None:
    assert trainer_allocator_env(chosen) == {}


@pytest.fixture
def no_allocator_choice(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This process's environment without any allocator choice (whatever the machine sets)."""
    import os

    for name in [n for n in os.environ if n.startswith("MALLOC_")] + ["GLIBC_TUNABLES", "LD_PRELOAD"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _roles(tmp_path: Path, flags: dict[str, str], sets: list[str] | None = None) -> dict:
    from forgerl.configuration.config import build_config
    from forgerl.registry.plugins import build_registry
    from forgerl.registry.resolve import resolve
    from forgerl.rundirs.runs import build_job

    registry = build_registry()
    config = resolve(build_config(flags={"model": "tiny", **flags}, sets=sets or []), registry)
    return {role.name: role for role in build_job(config, registry, tmp_path).roles}


def test_the_run_job_gives_only_the_trainer_role_the_settings(
    tmp_path: Path, no_allocator_choice: pytest.MonkeyPatch
) -> None:
    roles = _roles(tmp_path, {"generator": "vllm"})
    assert roles["trainer"].env == TRAINER_MALLOC_ENV
    assert all("MALLOC_MMAP_MAX_" not in role.env for name, role in roles.items() if name != "trainer")

    no_allocator_choice.setenv("MALLOC_MMAP_MAX_", "65536")  # the user's own: forge adds nothing over it
    assert _roles(tmp_path, {"generator": "vllm"})["trainer"].env == {}


def test_an_allocator_chosen_in_the_scheduler_env_option_is_kept(
    tmp_path: Path, no_allocator_choice: pytest.MonkeyPatch
) -> None:
    """Slurm and Kubernetes export their ``env`` option before each role's env, so a choice
    made there must stop forge's settings, or they would override it."""
    sets = ["scheduler.options.env.LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"]
    assert _roles(tmp_path, {"scheduler": "slurm"}, sets)["trainer"].env == {}
