"""The trainer role's malloc settings: set where the user chose nothing, never over a choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgerl.allocator import TRAINER_MALLOC_ENV, trainer_allocator_env


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


def test_the_run_job_gives_only_the_trainer_role_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forgerl.config import build_config, resolve
    from forgerl.plugins import build_registry
    from forgerl.runs import build_job

    for name in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    registry = build_registry()
    config = resolve(build_config(flags={"model": "tiny", "generator": "vllm"}, sets=[]), registry)
    roles = {role.name: role for role in build_job(config, registry, tmp_path).roles}
    assert roles["trainer"].env == TRAINER_MALLOC_ENV
    assert all("MALLOC_MMAP_MAX_" not in role.env for name, role in roles.items() if name != "trainer")

    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")  # the user's own: forge adds nothing over it
    job = build_job(config, registry, tmp_path)
    assert next(role for role in job.roles if role.name == "trainer").env == {}


def test_an_allocator_chosen_in_the_scheduler_env_option_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm and Kubernetes export their ``env`` option before each role's env, so a choice
    made there must stop forge's settings, or they would override it."""
    from forgerl.config import build_config, resolve
    from forgerl.plugins import build_registry
    from forgerl.runs import build_job

    for name in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    registry = build_registry()
    sets = ["scheduler.options.env.LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"]
    config = resolve(build_config(flags={"model": "tiny", "scheduler": "slurm"}, sets=sets), registry)
    assert next(role for role in build_job(config, registry, tmp_path).roles if role.name == "trainer").env == {}
