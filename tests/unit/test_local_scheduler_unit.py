"""The local scheduler without starting processes: naming, environment, dry run, errors."""

from __future__ import annotations

import socket

import pytest

from forgerl.errors import JobNotFound, SchedulerError
from forgerl.registry.plugins import build_registry
from forgerl.types import JobSpec, RoleSpec
from forgerl_plugins.schedulers.local import jobfile, procs
from forgerl_plugins.schedulers.local.scheduler import LocalScheduler


def test_registry_builds_the_local_scheduler():
    backend = build_registry().require("scheduler", "local")
    scheduler = backend.build({"stop_timeout": 2.5, "master_addr": "127.0.0.1"})
    assert isinstance(scheduler, LocalScheduler) and scheduler.detached is False
    assert scheduler.options.stop_timeout == 2.5


def test_log_names_mark_ranks_only_for_multi_rank_replicas():
    assert jobfile.log_name("generator", 1, 0, 1) == "generator-1.log"
    assert jobfile.log_name("trainer", 0, 3, 4) == "trainer-0.rank3.log"


def test_forge_variables_win_over_job_and_role_env(tmp_path):
    job = JobSpec("j", str(tmp_path), (), env={"A": "job", "B": "job", "RANK": "9"})
    role = RoleSpec("trainer", ("x",), ranks_per_replica=2, env={"B": "role", "MASTER_PORT": "1"})
    env = jobfile.process_env(job, role, 1, 1, tmp_path, "127.0.0.1", 29511)
    assert (env["A"], env["B"]) == ("job", "role"), env
    assert env["RANK"] == "1" and env["MASTER_PORT"] == "29511", env
    assert (env["FORGE_ROLE"], env["FORGE_REPLICA"], env["WORLD_SIZE"]) == ("trainer", "1", "2"), env


def test_render_shows_every_process_with_its_variables_command_and_log(tmp_path):
    job = JobSpec(
        "demo",
        str(tmp_path / "run"),
        (
            RoleSpec("generator", ("python", "-m", "serve", "--port", "0"), replicas=2, max_restarts=3),
            RoleSpec(
                "trainer", ("python", "-m", "train"), ranks_per_replica=2, primary=True, env={"X": "a b"}
            ),
        ),
    )
    text = LocalScheduler().render(job)
    assert text.count("# role ") == 4, text
    assert "# role trainer, replica 0, rank 1 of 2, primary" in text, text
    assert "# role generator, replica 1, rank 0 of 1, restarted up to 3 times" in text, text
    assert f"# log: {(tmp_path / 'run').resolve()}/logs/trainer-0.rank1.log" in text, text
    assert "X='a b'" in text and "WORLD_SIZE=2" in text and "MASTER_ADDR=127.0.0.1" in text, text
    assert "python -m serve --port 0" in text, text
    assert not (tmp_path / "run").exists(), "a dry run must not create the run directory"


@pytest.mark.parametrize("call", ["status", "cancel", "logs"])
def test_unknown_job_id_is_a_one_line_job_not_found(tmp_path, call):
    scheduler = LocalScheduler()
    with pytest.raises(JobNotFound) as err:
        result = getattr(scheduler, call)(str(tmp_path / "nope"))
        list(result or ())
    assert "\n" not in str(err.value) and "run directory" in str(err.value), err.value


@pytest.mark.parametrize(
    "role",
    [
        RoleSpec("bad/name", ("x",)),
        RoleSpec("scheduler", ("x",)),
        RoleSpec("empty", ()),
        RoleSpec("zero", ("x",), replicas=0),
    ],
)
def test_malformed_jobs_are_refused_before_anything_starts(tmp_path, role):
    with pytest.raises(SchedulerError):
        LocalScheduler().submit(JobSpec("j", str(tmp_path / "run"), (role,)))
    assert not (tmp_path / "run").exists()


def test_free_ports_are_distinct_and_bindable():
    ports = procs.free_ports("127.0.0.1", 8) + procs.free_ports("127.0.0.1", 8)
    assert len(set(ports)) == 16, ports
    with socket.create_server(("127.0.0.1", ports[0])):
        pass


def test_exit_codes_follow_the_shell_convention():
    assert procs.exit_code(3) == 3 and procs.exit_code(-9) == 137
    assert procs.describe_exit(143) == "code 143 (killed by SIGTERM)"
