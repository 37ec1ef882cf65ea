"""Plugins of every test session in this repository, contrib's tests included: the vLLM
server they share (tests/helpers/shared_vllm.py), and the groups that keep tests sharing a
machine-wide resource on one worker when the suite runs on several (pytest-xdist,
``make test``: ``-n 2``)."""

from __future__ import annotations

import pytest

from tests.helpers.timing import scale

try:
    scale()
    _BAD_SCALE = ""
except ValueError as exc:
    _BAD_SCALE = str(exc)


def pytest_configure(config: pytest.Config) -> None:
    """A FORGE_TEST_TIMEOUT_SCALE that is no factor stops the session before the first test,
    with one line, instead of an error in every test that asks for a deadline."""
    if _BAD_SCALE:
        raise pytest.UsageError(_BAD_SCALE)


# The plugins scale deadlines as they are imported: with no factor to scale by, the session
# stops above, so they are not loaded.
pytest_plugins = [] if _BAD_SCALE else ["tests.helpers.shared_vllm"]


#: Tests that must not run beside each other on two workers, by group:
#: - ``vllm``: every test that starts a vLLM server (or uses the shared one): one server
#:   at a time keeps the two cores' share of each predictable, and the shared server is
#:   started once, on one worker;
#: - ``sandbox``: tests that run programs in the code sandbox, because some of them check
#:   that no process of the sandbox's users is left behind (tests/helpers/sandbox_processes.py),
#:   which a program of another worker's test would seem to be;
#: - ``slurm``: jobs of the one local Slurm node, which would queue behind each other.
_GROUP_MODULES = {
    "vllm": ("test_vllm.py", "test_wedged_engine.py", "test_generator_faults.py", "test_vllm_security.py",
             "test_shared_vllm.py", "test_generator_kit.py", "test_contrib_openai.py",
             "test_openai_conformance.py", "test_reward_model_served.py", "test_vllm_lora.py", "test_vllm_fleet.py",
             "test_overlap_vllm.py", "test_distill_served.py"),
    "sandbox": ("test_code_sandbox.py", "test_python_environment.py", "test_code_reward_attacks.py",
                "test_code_run.py", "test_code_reward.py", "test_sandbox_deadline.py",
                "test_kit_builtin_environments.py", "test_kit_builtin_rewards_tasks.py",
                "test_code_task_format.py"),
    "slurm": ("test_slurm.py", "test_slurm_faults.py", "test_run_dir_jobs.py"),
}


def worker_group(nodeid: str) -> str | None:
    """The group a test (by its pytest node id) runs in, or None where it may run anywhere."""
    path = nodeid.split("::", 1)[0]
    module = path.rsplit("/", 1)[-1]
    for group, modules in _GROUP_MODULES.items():
        if module in modules:
            return group
    name = nodeid.lower()
    unit = path.startswith("tests/unit/")
    if "vllm" in name and not unit:  # a run of the vllm generator elsewhere
        return "vllm"
    if "slurm" in name and not unit:
        return "slurm"
    return None


#: Modules of other tests that take a minute or more of one worker (measured with
#: ``--durations``), longest first: handed out right after the groups, so that what is
#: left for the end of a session is short modules that keep both workers busy to the end.
_LONG_MODULES = (
    "tests/integration/test_sglang_double.py",
    "tests/integration/test_run_e2e.py",
    "tests/unit/test_docs_examples.py",
    "tests/integration/test_environment_run.py",
    "tests/integration/test_sft_run.py",
    "tests/conformance/test_transport_runs.py",
    "contrib/units/tests/test_units_run.py",  # a forge run, collected last of all
)


def work_unit(nodeid: str) -> str:
    """What one worker takes as a whole: a test's group, else its module, so that a module's
    (or class's) expensive fixtures (servers, runs whose outputs several tests check) are
    set up once, not once on each worker that happens to take one of its tests."""
    return worker_group(nodeid) or nodeid.split("::", 1)[0]


def _hand_out_order(item: pytest.Item) -> tuple[int, int]:
    group = worker_group(item.nodeid)
    if group is not None:  # the vllm group (a third of the suite's time) first, then the others
        return (0, 0 if group == "vllm" else 1)
    module = item.nodeid.split("::", 1)[0]
    return (1, _LONG_MODULES.index(module)) if module in _LONG_MODULES else (2, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The longest units of work are handed out first: the vllm group runs on one worker
    # while the other takes everything else; a long module never starts last. (A stable
    # sort: each module's tests stay together and in their order.)
    items.sort(key=_hand_out_order)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scheduler, handing out each group, and each other module, as one unit, in
    the order of the collection (above). (Its own ``--dist loadgroup`` renames tests by
    their group, which pytest 9 no longer lets a plugin do: there, every test went
    anywhere; and ``loadscope`` orders units by their number of tests, not their length.)"""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return GroupScheduling(config, log)
