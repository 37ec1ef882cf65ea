"""The `python` environment's run_python tool against hostile programs, with real sandboxed
processes: each attack is contained, its end is the tool's answer (the model reads an
error), the trajectory goes on (the next program runs normally), the step returns within
the turn's time, no process of it is left and nothing was written outside; a whole batch
of attacking trajectories in the run's trajectory runner fails none of them."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import pytest

from forgerl.registry.plugins import build_registry
from forgerl.rollouts.trajectory import Limits, TrajectoryRunner
from forgerl.types import Problem, SamplingParams
from forgerl_plugins.rewards.sandbox import SandboxUnavailable

from ..helpers.leaks import finder, planted_answers
from ..helpers.sandbox_processes import sandbox_processes, sandbox_workdir
from ..helpers.timing import scaled, wait_until

pytestmark = pytest.mark.integration

PROBLEM = Problem(id="p", prompt="What is 17 * 23?", answer="391", metadata={"a": 17, "op": "*", "b": 23})
TIMEOUT = scaled(1.5)
TURN_SECONDS = scaled(6.0)


@pytest.fixture(scope="module")
def workdir():
    with sandbox_workdir("forge-python-env-test-") as path:
        yield path


@pytest.fixture(scope="module")
def make(workdir):
    """Instances as a run builds them, one per trajectory; at the namespace level (the
    levels themselves are the code reward's sandbox suite's: test_code_sandbox.py)."""
    backend = build_registry().require("environment", "python")
    options = {"isolation": "namespace", "timeout": TIMEOUT, "turn_seconds": TURN_SECONDS, "workdir": str(workdir)}
    try:
        validated = backend.validate_options(options)
        backend.check_before_run(validated)
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    return lambda: backend.build(validated)


def call(code: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'run_python', 'arguments': {'code': code}})}</tool_call>"


def attack(make, workdir, *programs: str) -> list[str]:
    """One turn calling run_python with each program, on a new instance; the answers. The
    step returns within the turn's time, a later turn runs a program normally, and no
    sandbox process nor directory is left."""
    env = make()
    env.reset(PROBLEM)
    start = time.monotonic()
    step = env.step("\n".join(call(p) for p in programs))
    took = time.monotonic() - start
    assert took < TURN_SECONDS + scaled(1.0), f"the turn took {took:.1f} s, past turn_seconds {TURN_SECONDS}"
    assert not step.done and [m["role"] for m in step.messages] == ["tool"] * len(programs), step
    answers = [m["content"] for m in step.messages]
    assert all(len(a) <= 4100 for a in answers), [len(a) for a in answers]
    after = env.step(call("print(6 * 7)"))
    assert after.messages[0]["content"] == "exit code 0\nstdout:\n42\n", "the trajectory does not go on normally"
    assert env.step("<answer>391</answer>").reward == 1.0
    env.close()
    wait_until(lambda: not sandbox_processes(workdir), 10, f"no sandbox process left ({sandbox_processes(workdir)})")
    assert os.listdir(workdir) == [], "a program's directory was not removed"
    return answers


def test_an_honest_program_answers(make, workdir):
    assert attack(make, workdir, "print(17 * 23)") == ["exit code 0\nstdout:\n391\n"]


def test_infinite_loop(make, workdir):
    assert attack(make, workdir, "while True:\n    pass\n") == ["the program was stopped: it ran out of time\n(no output)"]


def test_fork_bomb(make, workdir):
    [answer] = attack(make, workdir, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert answer.startswith("the program was stopped: it ran out of time"), answer


def test_memory_bomb(make, workdir):
    [answer] = attack(make, workdir, "hoard = []\nwhile True:\n    hoard.append(bytearray(50 * 2**20))\n")
    assert answer.startswith("exit code 1") and answer.rstrip().endswith("MemoryError"), answer


def test_huge_output(make, workdir):
    [answer] = attack(make, workdir, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    assert "stdout:\nxxx" in answer and "...(cut)" in answer, answer[:200]


def test_sleeping_grandchild_that_outlives_its_parent(make, workdir):
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(10000)\n"
        "    os._exit(0)\n"
        "os.wait()\nprint('left one behind')\n"
    )
    assert attack(make, workdir, program) == ["exit code 0\nstdout:\nleft one behind\n"]


def test_reads_and_writes_outside_its_directory(make, workdir, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o600)
    targets = [tmp_path / "escaped", workdir / "escaped", Path("/tmp/forge-python-env-escaped")]
    program = (
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except OSError as exc:\n        print('refused', type(exc).__name__)\n"
        f"print(open({str(secret)!r}).read())\n"
    )
    [answer] = attack(make, workdir, program)
    assert "s3cret" not in answer and "wrote" not in answer and "exit code 1" in answer, answer
    assert not [t for t in targets if t.exists()]


def test_a_program_cannot_find_the_problems_answer(make, workdir):
    """A tool program searching the file system for its problem's expected output (the
    run's data kept world-readable, as on a shared machine) finds nothing: its root holds
    the interpreter and its directory only (the code reward's sandbox, test_code_sandbox.py)."""
    with planted_answers() as planted:
        [answer] = attack(make, workdir, finder(planted, seconds=TIMEOUT / 2))
    assert planted.answer not in answer and answer == "exit code 0\nstdout:\nnothing\n", answer


def test_network(make, workdir):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        [answer] = attack(make, workdir, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n")
        assert answer.startswith("exit code 1") and "Error" in answer, answer
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing reached the backlog either
            server.accept()[0].close()
    finally:
        server.close()


def test_the_runs_process_is_out_of_reach(make, workdir):
    """The process running the environment (the run's trainer rank 0) can be neither
    signalled nor read: in its PID namespace the program sees only itself."""
    me = os.getpid()
    program = (
        "import os, signal\n"
        f"for act in (lambda: os.kill({me}, signal.SIGKILL), lambda: open('/proc/{me}/environ').read(),\n"
        "            lambda: os.kill(-1, signal.SIGKILL)):\n"
        "    try:\n        act()\n        print('reached')\n"
        "    except OSError as exc:\n        print('refused', type(exc).__name__)\n"
    )
    answer, own_group = attack(make, workdir, program, "import os, signal\nos.killpg(0, signal.SIGKILL)\n")
    assert "reached" not in answer and answer.count("refused") == 3, answer
    # As PID 1 of its namespace the program may not even be able to kill itself: either way
    # its end is an answer, and attack() saw the trajectory go on.
    assert own_group.startswith(("exit code 0", "the program was killed by signal 9")), own_group


def test_a_turn_of_endless_programs_ends_in_the_turns_time(make, workdir):
    """Eight infinite loops in one turn: the first ones run out of their time, the rest
    are told no time is left; the step returns within turn_seconds."""
    answers = attack(make, workdir, *["while True:\n    pass\n"] * 8)
    assert answers[0].startswith("the program was stopped"), answers
    assert answers[-1] == "error: no time left in this turn to run the program (it did not run)", answers


def test_attacking_trajectories_in_the_runs_runner_fail_none(make, workdir):
    """The kit's scripted generator plays the model: each trajectory attacks, then answers."""
    from forgerl.testing.environment_support import ScriptedGenerator, kit_tokenizer

    attacks = [
        "while True:\n    pass\n",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "x = []\nwhile True:\n    x.append(bytearray(50 * 2**20))\n",
        f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n",
    ]
    tokenizer = kit_tokenizer()
    scripts = {f"a{i}": [call(a), "<answer>391</answer>"] for i, a in enumerate(attacks)}
    env_class = build_registry().require("environment", "python").load_factory()
    runner = TrajectoryRunner(
        make, env_class, tokenizer,
        Limits(max_turns=3, max_total_tokens=100_000, max_turn_tokens=10_000, turn_timeout=TURN_SECONDS + scaled(4.0),
               concurrency=4),
        SamplingParams(max_tokens=10_000),
    )  # fmt: skip
    jobs = [(PROBLEM, job, 0) for job in scripts]
    trajectories, _ = asyncio.run(runner.run_many(ScriptedGenerator(tokenizer, scripts), jobs))
    assert [(t.failure, t.reward) for t in trajectories] == [(None, 1.0)] * len(attacks)
    wait_until(lambda: not sandbox_processes(workdir), 10, f"no sandbox process left ({sandbox_processes(workdir)})")
