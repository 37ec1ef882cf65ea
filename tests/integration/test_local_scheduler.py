"""The local scheduler with real processes: no orphans, restarts, rendezvous, logs, cancel.

Jobs are tiny ``python -c`` scripts. "Gone" means no such process or a zombie: this
machine's init does not reap orphans, and a zombie runs nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from forgerl.types import JobSpec, JobState, RoleSpec
from forgerl_plugins.schedulers.local.scheduler import LocalScheduler
from tests.helpers.timing import scaled, wait_until

pytestmark = pytest.mark.integration

PY = sys.executable

# Starts a grandchild (`sleep 1000`), records "<own pid> <grandchild pid>" in
# <pid dir>/<role>-<replica>-<rank>, then sleeps. FORGE_IGNORE_TERM=1 makes it (and, by
# inheritance of SIG_IGN, the grandchild) ignore SIGTERM so only SIGKILL ends them.
SPAWNER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    if os.environ.get("FORGE_IGNORE_TERM") == "1" and os.environ["FORGE_REPLICA"] == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "1000"])
    tag = "-".join(os.environ[k] for k in ("FORGE_ROLE", "FORGE_REPLICA", "RANK"))
    tmp = os.path.join(sys.argv[1], "." + tag)
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(tmp, os.path.join(sys.argv[1], tag))
    time.sleep(1000)
    """
)

SLEEPER = "import time; print('sleeping', flush=True); time.sleep(1000)"


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


def wait_for(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    wait_until(predicate, timeout, what)


def recorded_pids(pid_dir: Path, expected: int, timeout: float = 15.0) -> list[int]:
    """Pids of children and grandchildren once ``expected`` SPAWNER processes recorded them."""
    wait_for(
        lambda: len([p for p in pid_dir.iterdir() if not p.name.startswith(".")]) >= expected,
        timeout,
        f"{expected} pid files in {pid_dir}",
    )
    pids = []
    for path in pid_dir.iterdir():
        if not path.name.startswith("."):
            pids += [int(x) for x in path.read_text().split()]
    return pids


def job_pids(run_dir: Path) -> list[int]:
    record = json.loads((run_dir / "job.json").read_text())
    return [p["pid"] for p in record["processes"] if p["pid"]]


def spawner_role(name: str, pid_dir: Path, **kw) -> RoleSpec:
    return RoleSpec(name, (PY, "-c", SPAWNER, str(pid_dir)), **kw)


def kill_leftovers(pids) -> None:
    for pid in pids:
        if not gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def pid_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pids"
    d.mkdir()
    return d


@pytest.fixture
def scheduler() -> LocalScheduler:
    return LocalScheduler(LocalScheduler.Options(stop_timeout=1.0))


# ---------------------------------------------------------------------- no orphans


def test_failing_role_stops_every_process_and_grandchild(tmp_path, pid_dir, scheduler):
    # Replica 1 of the server (and its grandchild) ignores SIGTERM: only SIGKILL after
    # stop_timeout ends them.
    trainer = textwrap.dedent(
        f"""
        import os, sys, time
        while len([p for p in os.listdir({str(pid_dir)!r}) if not p.startswith(".")]) < 2:
            time.sleep(0.02)
        print("giving up", flush=True)
        sys.exit(3)
        """
    )
    job = JobSpec(
        "fail",
        str(tmp_path / "run"),
        (
            spawner_role("server", pid_dir, replicas=2),
            RoleSpec("trainer", (PY, "-c", trainer), primary=True),
        ),
        env={"FORGE_IGNORE_TERM": "1"},
    )
    handle = scheduler.submit(job)
    status = scheduler.wait(handle, timeout=scaled(30))
    pids = recorded_pids(pid_dir, 2, timeout=0) + job_pids(tmp_path / "run")
    try:
        assert status.state is JobState.FAILED, status
        assert status.exit_code == 3, status
        log = tmp_path / "run" / "logs" / "trainer-0.log"
        assert "role 'trainer' replica 0 rank 0" in status.detail and str(log) in status.detail, status.detail
        assert "giving up" in status.detail, status.detail  # the log's last line
        alive = [pid for pid in pids if not gone(pid)]
        assert not alive, f"processes left running after FAILED: {alive} of {pids}"
        assert json.loads((tmp_path / "run" / "job.json").read_text())["state"] == "failed"
    finally:
        kill_leftovers(pids)


DRIVER = textwrap.dedent(
    """
    import json, sys
    from forgerl.types import JobSpec, RoleSpec
    from forgerl_plugins.schedulers.local.scheduler import LocalScheduler
    run_dir, spawner, pid_dir = sys.argv[1:4]
    py = sys.executable
    job = JobSpec("driven", run_dir, (
        RoleSpec("server", (py, "-c", spawner, pid_dir)),
        RoleSpec("trainer", (py, "-c", spawner, pid_dir), ranks_per_replica=2, primary=True),
    ))
    scheduler = LocalScheduler(LocalScheduler.Options(stop_timeout=1.0))
    status = scheduler.wait(scheduler.submit(job))
    print(json.dumps({"state": status.state.value, "exit_code": status.exit_code}), flush=True)
    sys.exit(status.exit_code)
    """
)


def start_driver(run_dir: Path, spawner: str, pid_dir: Path) -> subprocess.Popen:
    # SIGINT may be ignored in the test's own process (a background job): give the driver
    # the default disposition, as an interactive `forge run` has.
    return subprocess.Popen(
        [PY, "-c", DRIVER, str(run_dir), spawner, str(pid_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_supervisor_stops_every_process_and_grandchild(tmp_path, pid_dir, sig, code):
    driver = start_driver(tmp_path / "run", SPAWNER, pid_dir)
    pids: list[int] = []
    try:
        pids = recorded_pids(pid_dir, 3)
        driver.send_signal(sig)
        out, err = driver.communicate(timeout=scaled(20))
        assert driver.returncode == code, (driver.returncode, out, err)
        assert json.loads(out.strip().splitlines()[-1]) == {"state": "cancelled", "exit_code": code}, (
            out,
            err,
        )
        alive = [pid for pid in pids if not gone(pid)]
        assert not alive, f"processes left running after {sig.name} to the supervisor: {alive} of {pids}"
        status = LocalScheduler().status(str(tmp_path / "run"))
        assert status.state is JobState.CANCELLED, status
    finally:
        driver.kill()
        driver.communicate()
        kill_leftovers(pids)


def test_sigkill_of_supervisor_kills_its_children(tmp_path, pid_dir):
    # Children record only their own pid (no grandchild): after a SIGKILL of the supervisor
    # only the kernel's parent-death signal can reach them, and it reaches direct children.
    writer = textwrap.dedent(
        """
        import os, sys, time
        tag = "-".join(os.environ[k] for k in ("FORGE_ROLE", "FORGE_REPLICA", "RANK"))
        open(os.path.join(sys.argv[1], "." + tag), "w").write(str(os.getpid()))
        os.replace(os.path.join(sys.argv[1], "." + tag), os.path.join(sys.argv[1], tag))
        time.sleep(1000)
        """
    )
    driver = start_driver(tmp_path / "run", writer, pid_dir)
    pids: list[int] = []
    try:
        pids = recorded_pids(pid_dir, 3)
        driver.kill()
        driver.communicate(timeout=scaled(10))
        wait_for(lambda: all(gone(pid) for pid in pids), 5, f"children {pids} to die with their supervisor")
        status = LocalScheduler().status(str(tmp_path / "run"))
        assert status.state is JobState.UNKNOWN and "without recording an outcome" in status.detail, status
    finally:
        kill_leftovers(pids)


# ---------------------------------------------------------------------- outcomes


def test_primary_success_stops_the_server_and_logs_every_role(tmp_path, scheduler):
    server = "import sys, time; print('server up', flush=True); print('server warns', file=sys.stderr, flush=True); time.sleep(1000)"
    # The trainer waits for the server's log line, found through FORGE_RUN_DIR and the
    # documented log name: so both roles have output before the server is stopped.
    trainer = textwrap.dedent(
        """
        import os, time
        log = os.path.join(os.environ["FORGE_RUN_DIR"], "logs", "server-0.log")
        while not (os.path.exists(log) and "server warns" in open(log).read()):
            time.sleep(0.02)
        print("trained", flush=True)
        """
    )
    job = JobSpec(
        "ok",
        str(tmp_path / "run"),
        (RoleSpec("server", (PY, "-c", server)), RoleSpec("trainer", (PY, "-c", trainer), primary=True)),
    )
    handle = scheduler.submit(job)
    assert handle.job_id == str((tmp_path / "run").resolve()), handle
    status = scheduler.wait(handle, timeout=scaled(30))
    pids = job_pids(tmp_path / "run")
    assert status.state is JobState.COMPLETED and status.exit_code == 0, status
    assert all(gone(pid) for pid in pids), f"server left running: {pids}"

    other = LocalScheduler()  # as `forge status|logs` in another process would
    assert other.status(handle.job_id).state is JobState.COMPLETED
    assert list(other.logs(handle.job_id, role="trainer")) == ["trained"]
    assert list(other.logs(handle.job_id, role="server")) == ["server up", "server warns"]
    everything = list(other.logs(handle.job_id))
    assert "[server-0] server up" in everything and "[trainer-0] trained" in everything, everything
    events = "\n".join(other.logs(handle.job_id, role="scheduler"))
    assert "stopping server-0" in events and "job completed" in events, events


def test_missing_executable_fails_cleanly_and_stops_started_roles(tmp_path, scheduler):
    job = JobSpec(
        "missing",
        str(tmp_path / "run"),
        (
            RoleSpec("server", (PY, "-c", SLEEPER)),
            RoleSpec("trainer", ("/nonexistent/forge-no-such-binary", "--train"), primary=True),
        ),
    )
    handle = scheduler.submit(job)  # no traceback: the failure is the job's status
    status = scheduler.wait(handle, timeout=scaled(10))
    assert status.state is JobState.FAILED and status.exit_code == 127, status
    assert "cannot start '/nonexistent/forge-no-such-binary'" in status.detail, status.detail
    assert all(gone(pid) for pid in job_pids(tmp_path / "run")), "server left running"
    assert LocalScheduler().status(handle.job_id).state is JobState.FAILED


# ---------------------------------------------------------------------- rendezvous


# Rank 0 listens on MASTER_ADDR:MASTER_PORT (so the port really is free), rank 1 connects
# and sends its variables; each rank also prints its own as JSON. argv[1]: seconds either
# waits for the other (the test's scaled patience).
RENDEZVOUS = textwrap.dedent(
    """
    import json, os, socket, sys, time
    patience = float(sys.argv[1])
    keys = ("FORGE_ROLE", "FORGE_REPLICA", "FORGE_RUN_DIR", "RANK", "LOCAL_RANK", "WORLD_SIZE",
            "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    mine = {k: os.environ[k] for k in keys}
    print(json.dumps(mine), flush=True)
    addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if os.environ["WORLD_SIZE"] == "1":
        pass
    elif os.environ["RANK"] == "0":
        server = socket.create_server(addr)
        server.settimeout(patience)
        conn, _ = server.accept()
        print("peer", conn.makefile().readline().strip(), flush=True)
    else:
        deadline = time.monotonic() + patience
        while True:  # until rank 0 listens
            try:
                conn = socket.create_connection(addr)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        conn.sendall((json.dumps(mine) + "\\n").encode())
    """
)


RENDEZVOUS_PATIENCE = str(scaled(10))


def rank_envs(run_dir: Path) -> dict[str, dict[str, str]]:
    """{log name: the variables that process printed}."""
    return {
        log.name: json.loads(log.read_text().splitlines()[0])
        for log in sorted((run_dir / "logs").glob("*.log"))
        if log.name != "scheduler.log"
    }


def test_rendezvous_variables_and_fresh_ports(tmp_path, scheduler):
    rendezvous = (PY, "-c", RENDEZVOUS, RENDEZVOUS_PATIENCE)
    a = JobSpec(
        "a",
        str(tmp_path / "a"),
        (
            RoleSpec("trainer", rendezvous, replicas=2, ranks_per_replica=2, primary=True),
            # Primary as well: the job ends when both roles are done. A role that is not
            # primary is a server, stopped once the primaries finish, and under load it
            # could be stopped before it printed anything (its log then held nothing).
            RoleSpec("solo", rendezvous, env={"RANK": "7"}, primary=True),  # forge's RANK wins
        ),
    )
    b = JobSpec("b", str(tmp_path / "b"), (RoleSpec("trainer", rendezvous, ranks_per_replica=2),))
    ha, hb = scheduler.submit(a), scheduler.submit(b)  # both run at once
    for handle in (ha, hb):
        status = scheduler.wait(handle, timeout=scaled(30))
        assert status.state is JobState.COMPLETED, status

    envs_a, envs_b = rank_envs(tmp_path / "a"), rank_envs(tmp_path / "b")
    assert sorted(envs_a) == [
        "solo-0.log",
        "trainer-0.rank0.log",
        "trainer-0.rank1.log",
        "trainer-1.rank0.log",
        "trainer-1.rank1.log",
    ], sorted(envs_a)
    run_a = str((tmp_path / "a").resolve())
    for replica in (0, 1):
        r0, r1 = envs_a[f"trainer-{replica}.rank0.log"], envs_a[f"trainer-{replica}.rank1.log"]
        for rank, env in ((0, r0), (1, r1)):
            assert env == {
                "FORGE_ROLE": "trainer",
                "FORGE_REPLICA": str(replica),
                "FORGE_RUN_DIR": run_a,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": r0["MASTER_PORT"],
            }, env
        peer = (tmp_path / "a" / "logs" / f"trainer-{replica}.rank0.log").read_text()
        assert f"peer {json.dumps(r1)}" in peer, peer
    solo = envs_a["solo-0.log"]
    assert (solo["RANK"], solo["LOCAL_RANK"], solo["WORLD_SIZE"], solo["LOCAL_WORLD_SIZE"]) == (
        "0",
        "0",
        "1",
        "1",
    ), solo

    ports = [envs_a[f"trainer-{r}.rank0.log"]["MASTER_PORT"] for r in (0, 1)]
    ports += [envs_b["trainer-0.rank0.log"]["MASTER_PORT"]]
    assert len(set(ports)) == 3, f"replicas and jobs must get their own MASTER_PORT: {ports}"


# ---------------------------------------------------------------------- restarts


def test_restartable_replica_is_restarted_with_all_its_ranks(tmp_path, scheduler):
    starts = tmp_path / "starts"
    # Every start appends "<rank> <pid> <port>". On the first attempt rank 1 dies (exit 5)
    # once rank 0 has recorded itself; after the restart both ranks serve.
    server = textwrap.dedent(
        f"""
        import os, sys, time
        starts, marker = {str(starts)!r}, {str(tmp_path / "died-once")!r}
        with open(starts, "a") as f:
            f.write(f"{{os.environ['RANK']}} {{os.getpid()}} {{os.environ['MASTER_PORT']}}\\n")
        if os.environ["RANK"] == "1" and not os.path.exists(marker):
            while not any(l.startswith("0 ") for l in open(starts)):
                time.sleep(0.02)
            open(marker, "w").close()
            sys.exit(5)
        time.sleep(1000)
        """
    )
    trainer = textwrap.dedent(
        f"""
        import os, time
        while not os.path.exists({str(starts)!r}) or len(open({str(starts)!r}).readlines()) < 4:
            time.sleep(0.02)
        """
    )
    job = JobSpec(
        "restart",
        str(tmp_path / "run"),
        (
            RoleSpec("server", (PY, "-c", server), ranks_per_replica=2, max_restarts=1),
            RoleSpec("trainer", (PY, "-c", trainer), primary=True),
        ),
    )
    status = scheduler.wait(scheduler.submit(job), timeout=scaled(30))
    assert status.state is JobState.COMPLETED, status

    lines = [line.split() for line in starts.read_text().splitlines()]
    assert len(lines) == 4, lines
    first, second = lines[:2], lines[2:]
    assert sorted(r for r, _, _ in first) == sorted(r for r, _, _ in second) == ["0", "1"], lines
    assert {p for _, p, _ in first}.isdisjoint(p for _, p, _ in second), f"every rank restarts: {lines}"
    assert first[0][2] != second[0][2], f"a restart gets a fresh MASTER_PORT: {lines}"
    assert all(gone(int(pid)) for _, pid, _ in lines), lines

    record = json.loads((tmp_path / "run" / "job.json").read_text())
    assert [p["restarts"] for p in record["processes"] if p["role"] == "server"] == [1, 1], record[
        "processes"
    ]
    events = (tmp_path / "run" / "logs" / "scheduler.log").read_text()
    assert "restarting server-0 (restart 1 of 1)" in events, events
    assert "started again" in (tmp_path / "run" / "logs" / "server-0.rank0.log").read_text()


def test_replica_that_keeps_dying_fails_the_job_after_max_restarts(tmp_path, scheduler):
    job = JobSpec(
        "crashloop",
        str(tmp_path / "run"),
        (
            RoleSpec("server", (PY, "-c", "print('boom'); raise SystemExit(4)"), max_restarts=1),
            RoleSpec("trainer", (PY, "-c", SLEEPER), primary=True),
        ),
    )
    status = scheduler.wait(scheduler.submit(job), timeout=scaled(30))
    assert status.state is JobState.FAILED and status.exit_code == 4, status
    assert "role 'server' replica 0 rank 0 exited with code 4 after 1 restart " in status.detail, (
        status.detail
    )
    assert all(gone(pid) for pid in job_pids(tmp_path / "run"))


# ---------------------------------------------------------------------- another instance


def test_status_and_cancel_from_another_scheduler_instance(tmp_path, pid_dir, scheduler):
    job = JobSpec("long", str(tmp_path / "run"), (spawner_role("server", pid_dir, replicas=2, primary=True),))
    handle = scheduler.submit(job)
    result = {}
    supervisor = threading.Thread(target=lambda: result.update(status=scheduler.wait(handle, timeout=scaled(60))))
    supervisor.start()
    pids: list[int] = []
    try:
        pids = recorded_pids(pid_dir, 2)
        other = LocalScheduler(LocalScheduler.Options(stop_timeout=1.0))
        assert other.status(handle.job_id).state is JobState.RUNNING
        other.cancel(handle.job_id)
        supervisor.join(timeout=scaled(20))
        assert not supervisor.is_alive(), "wait did not return after cancel"
        assert result["status"].state is JobState.CANCELLED, result
        assert other.status(handle.job_id).state is JobState.CANCELLED
        alive = [pid for pid in pids if not gone(pid)]
        assert not alive, f"processes left running after cancel: {alive} of {pids}"
    finally:
        scheduler.cancel(handle.job_id)
        supervisor.join(timeout=scaled(20))
        kill_leftovers(pids)
