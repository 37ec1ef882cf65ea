"""The `code` reward's sandbox against hostile programs, with real processes.

Each program attacks in its module body (or in ``ok()``, the one test: ``assert ok()``,
true only when the attack worked). Every attack must be contained: the sample scores 0,
no process of it is left, nothing was written outside its directory, and the reward
scores the next program normally.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import sysconfig

import pytest

from forgerl.registry.plugins import build_registry
from forgerl.types import Problem, RewardInput
from forgerl_plugins.rewards.sandbox import SandboxUnavailable

from ..helpers.leaks import REPOSITORY, finder, planted_answers, visible
from ..helpers.sandbox_processes import sandbox_processes, sandbox_workdir
from ..helpers.timing import scaled, wait_until

pytestmark = pytest.mark.integration

GOOD = "def ok():\n    return True\n"


@pytest.fixture(scope="module")
def workdir():
    with sandbox_workdir("forge-sandbox-test-") as path:
        yield path


@pytest.fixture(scope="module", params=["namespace", "bwrap", "process"])
def reward(request, workdir):
    """The reward at each isolation level; a level this machine lacks (bwrap not on PATH,
    no user namespaces) skips its tests, saying why."""
    options = {"isolation": request.param, "timeout": scaled(3.0), "workdir": str(workdir), "processes": 16}
    if request.param in ("process", "bwrap") and os.geteuid() == 0 and os.path.exists("/usr/bin/python3"):
        options["python"] = "/usr/bin/python3"  # root's own interpreter may be out of the sandbox uid's reach
    try:
        return build_registry().require("reward", "code").build({**options, "memory_mb": 512})
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))


def score(reward, program: str) -> dict[str, float]:
    problem = Problem(id="attack", prompt="", metadata={"tests": ["assert ok()"]})
    result = reward.score(RewardInput(problem, program))
    return {"value": result.value, **result.components}


def contained(reward, workdir, program: str) -> dict[str, float]:
    """Score ``program``, check it was contained, return its score."""
    got = score(reward, program)
    assert got["value"] == 0.0, got
    wait_until(
        lambda: not sandbox_processes(workdir), 10, f"no sandbox process left ({sandbox_processes(workdir)})"
    )
    assert os.listdir(workdir) == [], "a program's directory was not removed"
    assert score(reward, GOOD)["value"] == 1.0, "the reward does not score normally after the attack"
    return got


def test_a_good_program_passes(reward):
    assert score(reward, GOOD) == {
        "value": 1.0,
        "pass_rate": 1.0,
        "all_passed": 1.0,
        "timeout": 0.0,
        "error": 0.0,
    }


def test_fork_bomb(reward, workdir):
    got = contained(
        reward,
        workdir,
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    )
    assert got["timeout"] == 1.0


def test_memory_bomb(reward, workdir):
    got = contained(reward, workdir, "hoard = []\nwhile True:\n    hoard.append(bytearray(50 * 2**20))\n")
    assert got["error"] == 1.0


def test_infinite_loop(reward, workdir):
    assert contained(reward, workdir, "while True:\n    pass\n")["timeout"] == 1.0


@pytest.mark.parametrize("ignores_sigxcpu", [False, True], ids=["sigxcpu", "ignores-sigxcpu"])
def test_running_out_of_cpu_time_is_a_timeout(reward, workdir, ignores_sigxcpu):
    """With a wall clock far away, the CPU limit stops the loop (SIGXCPU, or SIGKILL at the
    hard limit when the program ignores it): its time ran out, as much as on the wall clock."""
    options = {**reward.options.model_dump(), "timeout": scaled(60.0), "cpu_seconds": 1}
    cpu_limited = build_registry().require("reward", "code").build(options)
    prelude = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n" if ignores_sigxcpu else ""
    got = contained(cpu_limited, workdir, prelude + "while True:\n    pass\n")
    assert (got["timeout"], got["error"]) == (1.0, 0.0)


def test_sleeping_grandchild_that_outlives_its_parent(reward, workdir):
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(10000)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "def ok():\n    return False\n"
    )
    contained(reward, workdir, program)


def test_network_connection(reward, workdir):
    if reward.sandbox.level == "process":
        pytest.skip("the process level has no network isolation (docs/rewards.md)")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    program = (
        "import socket\n"
        "def ok():\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
        "    return True\n"
    )
    try:
        contained(reward, workdir, program)
        # A connection completes into the listen backlog without accept(): none may be there.
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()[0].close()
    finally:
        server.close()


def test_writes_outside_its_directory(reward, workdir, tmp_path):
    targets = [tmp_path / "escaped", workdir / "escaped", os.path.expanduser("~/forge-sandbox-escaped")]
    if reward.sandbox.level == "process":
        if os.geteuid() != 0:
            pytest.skip(
                "process isolation as the same user cannot protect the user's files (docs/rewards.md)"
            )
        # As root it runs as a uid of its own: what only root may write stays safe, but
        # world-writable places like /tmp do not (docs/rewards.md).
    else:
        targets.append("/tmp/forge-escaped")
    program = (
        "def ok():\n"
        "    wrote = False\n"
        f"    for path in {[str(t) for t in targets]!r}:\n"
        "        try:\n"
        "            open(path, 'w').write('x')\n"
        "            wrote = True\n"
        "        except OSError:\n"
        "            pass\n"
        "    return wrote\n"
    )
    contained(reward, workdir, program)
    assert not [t for t in targets if os.path.exists(t)]


def test_reads_outside_its_directory(reward, workdir, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o600)
    if os.geteuid() != 0 and reward.sandbox.level == "process":
        pytest.skip("process isolation as the same user cannot hide the user's files (docs/rewards.md)")
    program = f"def ok():\n    return open({str(secret)!r}).read() == 's3cret'\n"
    contained(reward, workdir, program)


# --------------------------------------------- what the program can read (reward hacking)


@pytest.fixture(scope="module")
def planted():
    with planted_answers() as answers:
        yield answers


def test_a_program_cannot_find_its_problems_answers(reward, workdir, planted):
    """The cheapest way to a full reward is to read the expected output, which a run's
    dataset and run directory hold in world-readable files. At the namespace and bwrap
    levels the program's root holds none of them: it scores 0. At the process level (no
    filesystem isolation, as documented) the same program finds them: the attack is real."""
    problem = Problem(id="leak", prompt="", metadata={"stdio": [{"input": planted.probe + "\n", "output": planted.answer}]})
    result = reward.score(RewardInput(problem, finder(planted, seconds=scaled(1.0))))
    if reward.sandbox.level == "process":
        assert result.value == 1.0, f"the attack found nothing even without isolation: {result}"
    else:
        assert result.value == 0.0 and result.components["timeout"] == 0.0, result
    wait_until(lambda: not sandbox_processes(workdir), 10, "no sandbox process left")


def test_the_program_sees_the_interpreter_and_its_directory_only(reward, planted):
    if reward.sandbox.level == "process":
        pytest.skip("the process level has no filesystem isolation (docs/rewards.md)")
    python = reward.sandbox.python
    # The interpreter's own installed packages (a package may ship a benchmark's solutions).
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    packages = [sysconfig.get_path("purelib", vars=base)] if python == os.path.realpath(sys.executable) else []
    hidden = [
        *map(str, planted.files), *(str(f.parent) for f in planted.files), str(REPOSITORY), os.getcwd(),
        os.path.expanduser("~") + "/.bashrc", "/etc/passwd", "/etc/shadow", "/var", "/opt", "/home/", "/srv",
        *(os.path.join(p, os.listdir(p)[0]) for p in packages if os.path.isdir(p) and os.listdir(p)),
    ]  # fmt: skip
    outcome = reward.sandbox.run({"main.py": visible(hidden)})
    assert outcome.ok, outcome
    seen = json.loads(outcome.stdout)
    assert seen["seen"] == [], f"the program can see {seen['seen']}"
    top = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "tmp", "usr", python.split("/")[1]}
    assert set(seen["/"]) <= top, seen["/"]
    assert set(seen["/etc"]) <= {"ld.so.cache", "localtime"}, seen["/etc"]
    if reward.sandbox.level == "namespace":
        assert seen["/tmp"] == ["sandbox"], seen["/tmp"]


def test_the_standard_library_still_works(reward):
    """What a program may use: the standard library, its C extensions and the libraries
    they load, the time zone database, /dev/urandom, a subprocess."""
    program = (
        "import asyncio, bz2, ctypes, decimal, hashlib, json, lzma, math, sqlite3, ssl, subprocess, zlib, zoneinfo\n"
        "def ok():\n"
        "    db = sqlite3.connect(':memory:')\n"
        "    assert db.execute('select 6 * 7').fetchone() == (42,)\n"
        "    assert str(zoneinfo.ZoneInfo('Europe/Paris')) == 'Europe/Paris'\n"
        "    assert len(open('/dev/urandom', 'rb').read(8)) == 8\n"
        "    assert bz2.decompress(bz2.compress(b'x')) == b'x' and lzma.decompress(lzma.compress(b'y')) == b'y'\n"
        "    assert ctypes.CDLL(None).abs(-3) == 3 and ssl.OPENSSL_VERSION\n"
        "    assert subprocess.run(['true']).returncode == 0\n"
        "    return asyncio.run(asyncio.sleep(0, 'done')) == 'done'\n"
    )
    assert score(reward, program)["value"] == 1.0


def test_killing_the_parent_and_the_process_group(reward, workdir):
    program = "import os, signal\nos.killpg(0, signal.SIGKILL)\n"
    contained(reward, workdir, program)
    contained(
        reward,
        workdir,
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef ok():\n    return False\n",
    )
    if os.geteuid() == 0 or reward.sandbox.level in ("namespace", "bwrap"):
        # As root the program has a uid of its own; in a PID namespace it sees only itself.
        contained(
            reward, workdir, "import os, signal\nos.kill(-1, signal.SIGKILL)\ndef ok():\n    return False\n"
        )


def test_huge_output(reward, workdir):
    program = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    contained(reward, workdir, program)


def test_exit_before_the_tests(reward, workdir):
    assert contained(reward, workdir, "import os\nos._exit(0)\n")["error"] == 1.0
    assert contained(reward, workdir, "import sys\nsys.exit(0)\n")["error"] == 1.0


def test_fake_results(reward, workdir):
    program = "for i in range(5):\n    print('pass', i)\nprint('done')\nimport os\nos._exit(0)\n"
    contained(reward, workdir, program)


def test_recursion_bomb(reward, workdir):
    contained(reward, workdir, "def f(n):\n    return f(n + 1)\nf(0)\n")
    program = "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)\n"
    contained(reward, workdir, program)


def test_no_stray_processes_after_the_suite(reward, workdir):
    """Last in the file: whatever ran before, nothing of it is left."""
    wait_until(lambda: not sandbox_processes(workdir), 10, "no sandbox process left")
    assert os.listdir(workdir) == []
