"""``objective: distill`` in the config: what is refused (one line), what the run's job
holds (the teacher's server role only when it is served and distillation is on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgerl.configuration.config import build_config
from forgerl.errors import ConfigError, UserError
from forgerl.registry.plugins import build_registry
from forgerl.registry.resolve import resolve

TEACHER = ["objective=distill", "distill.teacher.options.model=tiny"]


def config(*sets: str):
    return resolve(build_config(flags={"model": "tiny", "generator": "hf"}, sets=sets), build_registry())


def roles(cfg) -> list[str]:
    from forgerl.rundirs import runs

    return [r.name for r in runs.build_job(cfg, build_registry(), Path("/nonexistent/run")).roles]


def test_a_distillation_run_validates_its_teacher_and_defaults_to_the_teacher_alone():
    cfg = config(*TEACHER)
    assert cfg.objective == "distill"
    assert (cfg.distill.kl_weight, cfg.distill.reward_weight, cfg.distill.kl_clip) == (1.0, 0.0, None)
    assert cfg.distill.teacher.name == "model" and cfg.distill.teacher.options.model == "tiny"


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["objective=distill"], "distill.teacher.options.model: Field required"),
        ([*TEACHER, "distill.kl_weight=0"], "nothing would be learned"),
        ([*TEACHER, "distill.kl_weight=-1"], "distill.kl_weight"),
        ([*TEACHER, "distill.kl_clip=0"], "distill.kl_clip"),
        ([*TEACHER, "distill.teacher.options.server=sglang"], "distill.teacher.options.server"),
        ([*TEACHER, "distill.teacher.options.url=http://x", "distill.teacher.options.server=vllm"], "either url"),
        ([*TEACHER, "distill.teacher.name=nope"], "no teacher 'nope'"),
        (["objective=sft"], "objective"),
    ],
)
def test_mistakes_are_one_line(sets, needle):
    with pytest.raises(UserError) as refused:  # ConfigError, or UnknownBackend for a name
        config(*sets)
    assert needle in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_distillation_alone_needs_no_groups_but_a_mix_with_rewards_does():
    assert config(*TEACHER, "loop.group_size=1").loop.group_size == 1
    with pytest.raises(ConfigError, match="group_size must be at least 2"):
        config(*TEACHER, "loop.group_size=1", "distill.reward_weight=0.5")
    with pytest.raises(ConfigError, match="group_size must be at least 2"):
        config("loop.group_size=1")


def test_the_teachers_server_is_a_role_of_the_run_only_when_served_and_distilling():
    assert roles(config(*TEACHER)) == ["trainer"], "an in-process teacher has no server"
    served = roles(config(*TEACHER, "distill.teacher.options.server=vllm"))
    assert served[0] == "trainer" and len(served) == 2 and served[1].startswith("teacher-"), served
    off = roles(config("distill.teacher.options.model=tiny", "distill.teacher.options.server=vllm"))
    assert off == ["trainer"], "objective grpo starts no teacher"
