"""Every user mistake in a config or on the command line: one line, exit status 2, nothing created.

Cases are generated: each section and each scalar key given the wrong type, unknown keys,
bad enums, negative and absurd sizes, NaN and infinities, missing, empty, binary or
garbage files, unknown backends and conflicting flags. Most run in-process through
``forgerl.cli.main`` (the real error handling, a few ms each); a handful run ``forge`` as a
subprocess to prove the real entry point, including SIGTERM/SIGINT during start-up.

Each case asserts: exit status 2, exactly one line on stderr (``forge: error: ...``, no
traceback), the line names what is wrong, and the working directory (where runs/ would
appear), the named output directory and the model cache are exactly as before.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.timing import scaled, wait_until

# The console script a user runs (as installed by `make setup`), else the module.
_SCRIPT = Path(sys.executable).with_name("forge")
FORGE = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "forgerl.cli"]

#: What a run case writes before the mistake is merged in: a config that would run.
BASELINE: dict[str, Any] = {
    "model": {"name": "tiny"},
    "generator": {"name": "hf"},
    "rewards": [{"name": "format", "weight": 1.0}],
    "loop": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "sampling": {"max_tokens": 8}},
    "logging": {"progress": False},
}


# ------------------------------------------------------------------------- harness


@dataclass
class Case:
    id: str
    argv: list[str]
    #: Files written (relative to the working directory) before forge runs.
    files: dict[str, bytes | str] = field(default_factory=dict)
    #: Substrings the one error line must contain (what is wrong, where).
    needles: tuple[str, ...] = ()
    #: Extra set-up in the working directory (a FIFO, a prepared run directory).
    setup: Callable[[Path], None] | None = None
    #: Environment for the case ("{root}" is the working directory; None unsets).
    env: dict[str, str | None] = field(default_factory=dict)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time."""
    out = {}
    for path in sorted(root.rglob("*")):
        st_ = path.lstat()
        out[str(path.relative_to(root))] = (st_.st_size, st_.st_mtime_ns)
    return out


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    from forgerl.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code
    return (code if isinstance(code, int) else 1), out.getvalue(), err.getvalue()


def assert_refused(code: int, stdout: str, stderr: str, needles: tuple[str, ...], what: str) -> str:
    assert code == 2, f"{what}: exit {code}\nstdout: {stdout[-1000:]}\nstderr: {stderr[-3000:]}"
    assert "Traceback" not in stderr, f"{what}: {stderr[-3000:]}"
    lines = stderr.splitlines()
    assert len(lines) == 1, f"{what}: expected one line on stderr, got {len(lines)}:\n{stderr[-3000:]}"
    assert lines[0].startswith("forge: error: "), f"{what}: {lines[0]}"
    for needle in needles:
        assert needle in lines[0], f"{what}: {needle!r} not in {lines[0]!r}"
    return lines[0]


@contextlib.contextmanager
def workdir() -> Any:
    """A fresh working directory (runs/ would appear here) and model cache, for one case."""
    previous = os.getcwd()
    old_cache = os.environ.get("FORGE_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="forge-bad-input-") as tmp:
        root = Path(tmp)
        os.environ["FORGE_CACHE_DIR"] = str(root / "model-cache")
        os.chdir(root)
        try:
            yield root
        finally:
            os.chdir(previous)
            if old_cache is None:
                os.environ.pop("FORGE_CACHE_DIR", None)
            else:
                os.environ["FORGE_CACHE_DIR"] = old_cache


@contextlib.contextmanager
def environment(changes: dict[str, str | None], root: Path) -> Any:
    saved = {name: os.environ.get(name) for name in changes}
    try:
        for name, value in changes.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value.format(root=root)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_case(case: Case) -> str:
    with workdir() as root, environment(case.env, root):
        for name, content in case.files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
        if case.setup is not None:
            case.setup(root)
        before = snapshot(root)
        code, out, err = run_in_process(case.argv)
        line = assert_refused(code, out, err, case.needles, case.id)
        after = snapshot(root)
        assert after == before, f"{case.id}: created or changed {sorted(set(after.items()) ^ set(before.items()))}"
        return line


@pytest.fixture(autouse=True)
def _no_debug_and_no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORGE_DEBUG", raising=False)
    from forgerl_plugins.schedulers.local.scheduler import LocalScheduler

    def refuse(self: Any, job: Any) -> Any:
        raise AssertionError(f"a bad input reached submit: {job.name}")

    # Belt and braces: a case that wrongly passes must fail here, not start a run.
    monkeypatch.setattr(LocalScheduler, "submit", refuse)


# ----------------------------------------------------------------- the generated cases


def put(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``data`` with ``dotted`` (``rewards.0.weight``) set to ``value``."""
    data = yaml.safe_load(yaml.safe_dump(data))
    node: Any = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        if isinstance(node, list):
            node = node[int(part)]
        else:
            if not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]
    if isinstance(node, list):
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value
    return data


def yaml_cases(id: str, dotted: str, value: Any, needles: tuple[str, ...], *, validate: bool = True) -> list[Case]:
    """The mistake in a config file, through `forge run FILE` and (when it is a structural
    mistake, which validation alone finds) `forge config validate FILE`."""
    text = yaml.safe_dump(put(BASELINE, dotted, value), sort_keys=False)
    cases = [Case(f"run:{id}", ["run", "bad.yaml"], {"bad.yaml": text}, needles)]
    if validate:
        cases.append(Case(f"validate:{id}", ["config", "validate", "bad.yaml"], {"bad.yaml": text}, needles))
    return cases


SECTIONS = [
    "model", "task", "generator", "trainer", "transport", "scheduler", "algorithm", "loop",
    "loop.sampling", "checkpoint", "logging", "model.options", "trainer.options", "task.options",
    "rewards.0", "rewards.0.options",
]  # fmt: skip
NOT_A_MAPPING = {"int": 3, "str": "text", "list": [1, 2], "null": None, "bool": True}

INT_KEYS = [
    "loop.steps", "loop.prompts_per_step", "loop.group_size", "loop.max_staleness", "loop.eval_every",
    "loop.sampling.max_tokens", "loop.sampling.top_k", "loop.seed", "checkpoint.every", "checkpoint.keep",
    "trainer.ranks", "trainer.options.micro_batch_size",
]  # fmt: skip
FLOAT_KEYS = [
    "loop.sampling.temperature", "loop.sampling.top_p", "loop.reward_timeout", "loop.failed_reward",
    "loop.eval_temperature", "transport.timeout", "rewards.0.weight", "trainer.options.lr",
    "algorithm.clip_low", "algorithm.kl_coef",
]  # fmt: skip
#: Numbers where null means something (micro_batch_size: rows limited by micro_batch_tokens alone).
NULLABLE_KEYS = {"trainer.options.micro_batch_size"}
NOT_A_NUMBER = {"str": "many", "list": [1], "mapping": {"a": 1}, "bool": True, "null": None}
NOT_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
STR_KEYS = ["model.name", "trainer.name", "generator.name", "task.name", "rewards.0.name"]
NOT_A_STRING = {"int": 3, "list": ["a"], "mapping": {"a": 1}}

#: Sizes out of range: negative, zero where at least one is needed, absurd.
BAD_SIZES = [
    ("loop.steps", -1), ("loop.steps", 10**30), ("loop.group_size", 10**12), ("loop.group_size", 0),
    ("loop.prompts_per_step", 10**9), ("loop.prompts_per_step", -3), ("loop.sampling.max_tokens", 10**12),
    ("loop.sampling.max_tokens", 0), ("trainer.ranks", 100_000), ("trainer.ranks", 0), ("loop.seed", 2**70),
    ("loop.seed", -1), ("checkpoint.keep", 0), ("loop.eval_size", 0), ("loop.max_staleness", -1),
    ("transport.timeout", 0), ("transport.timeout", 1e300), ("loop.reward_timeout", -5),
    ("rewards.0.weight", 1e300), ("trainer.options.lr", -3), ("trainer.options.micro_batch_size", 10**15),
    ("model.options.hidden_size", 10**9),
]  # fmt: skip
BAD_ENUMS = [
    ("model.dtype", "float8"), ("logging.level", "loud"), ("algorithm.preset", "ppo"),
    ("algorithm.loss_agg", "median"), ("algorithm.kl_estimator", "k9"), ("trainer.options.backend", "carrier-pigeon"),
    ("rewards.0.options.mode", "sometimes"), ("scheduler.options.oversubscribe", "perhaps"),
]  # fmt: skip
UNKNOWN_KEYS = ["stepz", "loop.stepz", "loop.sampling.temprature", "trainer.options.learning_rate",
                "model.options.wat", "rewards.0.options.regex", "checkpoint.every_n", "transport.options.bogus"]


def structural_cases() -> list[Case]:
    cases: list[Case] = []
    for section in SECTIONS:
        for kind, value in NOT_A_MAPPING.items():
            cases += yaml_cases(f"{section}={kind}", section, value, (section,))
    for key in INT_KEYS + FLOAT_KEYS:
        for kind, value in NOT_A_NUMBER.items():
            if value is None and key in NULLABLE_KEYS:
                continue
            cases += yaml_cases(f"{key}={kind}", key, value, (key,))
    for key in FLOAT_KEYS:
        for kind, value in NOT_FINITE.items():
            cases += yaml_cases(f"{key}={kind}", key, value, (key, "finite"))
    for key in STR_KEYS:
        for kind, value in NOT_A_STRING.items():
            cases += yaml_cases(f"{key}={kind}", key, value, (key,))
    for key, value in BAD_SIZES:
        cases += yaml_cases(f"{key}={value}", key, value, (key,))
    for key, value in BAD_ENUMS:
        cases += yaml_cases(f"{key}={value}", key, value, (key,))
    for key in UNKNOWN_KEYS:
        cases += yaml_cases(f"unknown:{key}", key, 1, (key, "unknown key"))
    return cases


def _fifo(name: str) -> Callable[[Path], None]:
    return lambda root: os.mkfifo(root / name)


def _saved_run(name: str) -> Callable[[Path], None]:
    """A run directory as an earlier `forge run --output name` leaves it (its config.yaml)."""

    def make(root: Path) -> None:
        code, out, err = run_in_process(["config", "show", "--model", "tiny", "--generator", "hf"])
        assert code == 0, err
        (root / name / "logs").mkdir(parents=True)
        (root / name / "config.yaml").write_text(out)

    return make


def _saved_run_with_bad_checkpoints(name: str) -> Callable[[Path], None]:
    """A saved run whose every checkpoint is unusable: one never completed (no manifest),
    one with a manifest that is not JSON."""

    def make(root: Path) -> None:
        _saved_run(name)(root)
        checkpoints = root / name / "checkpoints"
        (checkpoints / "step-000002" / "trainer").mkdir(parents=True)
        (checkpoints / "step-000001").mkdir()
        (checkpoints / "step-000001" / "manifest.json").write_text("{torn")

    return make


@functools.cache
def _dist_backend_here(name: str) -> bool:
    """Whether torch.distributed ``name`` can run on this machine (NCCL: with a GPU);
    "cuda": whether trainer ranks run on a GPU here."""
    import torch
    import torch.distributed as dist

    if name == "cuda":
        return bool(torch.cuda.is_available())
    if not dist.is_available() or not dist.is_backend_available(name):
        return False
    return name != "nccl" or torch.cuda.is_available()


RUN = ["run", "--model", "tiny", "--generator", "hf", "--steps", "1", "--set", "logging.progress=false"]
REMOTE = ["--reward", "remote", "--set", "rewards.0.options.url=http://127.0.0.1:9/score"]
FILE_TASK = ["--task", "file", "--set", "task.options.path=problems.jsonl"]
GOOD_ROW = '{"prompt": "What is 2 + 2?", "answer": "4"}\n'


def file_and_flag_cases() -> list[Case]:
    cpus = len(os.sched_getaffinity(0))
    c = [
        # config files that are not configs
        Case("config-missing", ["config", "validate", "nope.yaml"], needles=("cannot read config file",)),
        Case("config-is-a-directory", ["run", "adir"], setup=lambda r: (r / "adir").mkdir(), needles=("adir",)),
        Case("config-binary", ["config", "validate", "b.yaml"], {"b.yaml": b"\xff\xfe\x00\x80bad"}, ("not UTF-8",)),
        Case("config-binary-run", ["run", "b.yaml"], {"b.yaml": b"loop:\n  steps: \xe9\n"}, ("not UTF-8",)),
        Case("config-latin1", ["run", "b.yaml"], {"b.yaml": "model:\n  name: caf\xe9\n".encode("latin-1")}, ("UTF-8",)),
        Case("config-top-level-list", ["run", "l.yaml"], {"l.yaml": "- 1\n- 2\n"}, ("top level",)),
        Case("config-top-level-scalar", ["config", "validate", "s.yaml"], {"s.yaml": "42\n"}, ("top level",)),
        Case("config-bad-yaml", ["run", "y.yaml"], {"y.yaml": "loop: [unclosed\n"}, ("not valid YAML",)),
        Case("config-tabs", ["run", "t.yaml"], {"t.yaml": "loop:\n\tsteps: 3\n"}, ("not valid YAML",)),
        Case("config-duplicate-key", ["run", "d.yaml"], {"d.yaml": "loop:\n  steps: 3\n  steps: 4\n"}, ("twice",)),
        Case("config-duplicate-section", ["config", "validate", "d.yaml"],
             {"d.yaml": "loop: {steps: 3}\nmodel: {name: tiny}\nloop: {group_size: 2}\n"}, ("'loop'", "twice")),
        Case("config-deep-nesting", ["run", "n.yaml"], {"n.yaml": "a: " + "[" * 5000 + "]" * 5000 + "\n"}),
        Case("config-python-tag", ["run", "p.yaml"], {"p.yaml": "loop: !!python/object/apply:os.system [true]\n"},
             ("not valid YAML",)),
        Case("config-nul-in-value", ["run", "z.yaml"], {"z.yaml": 'output: "ru\\0n"\nmodel: {name: tiny}\n'},
             ("output", "NUL")),
        # flags merged into a file section of the wrong type (tracebacks before)
        Case("flag-model-into-int", ["run", "m.yaml", "--model", "tiny"], {"m.yaml": "model: 3\n"}, ("model", "mapping")),
        Case("flag-steps-into-int", ["run", "m.yaml", "--steps", "2"], {"m.yaml": "loop: 3\n"}, ("loop",)),
        Case("flag-steps-into-null", ["run", "m.yaml", "--steps", "2"], {"m.yaml": "loop: null\n"}, ("loop",)),
        Case("flag-trainer-into-list", ["run", "m.yaml", "--trainer", "fsdp"], {"m.yaml": "trainer: [a]\n"}, ("trainer",)),
        Case("set-into-scalar", ["run", "m.yaml", "--set", "loop.steps.x=1"], {"m.yaml": "loop: {steps: 3}\n"},
             ("loop.steps",)),
        Case("set-into-int-section", ["config", "show", "m.yaml", "--set", "model.name=tiny"], {"m.yaml": "model: 3\n"},
             ("model",)),
        Case("set-no-equals", [*RUN, "--set", "loop.steps"], needles=("dotted.key=value",)),
        Case("set-empty-part", [*RUN, "--set", "loop..steps=3"], needles=("empty part",)),
        Case("set-bad-index", [*RUN, "--set", "rewards.7.weight=2"], needles=("rewards.7",)),
        Case("set-non-index", [*RUN, "--set", "rewards.first.weight=2"], needles=("rewards.first",)),
        Case("set-absurd-group", [*RUN, "--set", "loop.group_size=1000000000000"], needles=("loop.group_size",)),
        Case("set-batch-product", [*RUN, "--set", "loop.group_size=1024", "--set", "loop.prompts_per_step=2048"],
             needles=("prompts_per_step x group_size",)),
        Case("set-third-party-style-int64", [*RUN, "--set", "trainer.options.micro_batch_size=99999999999999999999999"],
             needles=("micro_batch_size",)),
        # unknown backends and flags
        Case("unknown-generator", [*RUN, "--generator", "nope"], needles=("no generator 'nope'",)),
        Case("unknown-trainer", [*RUN, "--trainer", "nope"], needles=("no trainer 'nope'",)),
        Case("unknown-transport", [*RUN, "--transport", "pigeon"], needles=("pigeon",)),
        Case("unknown-scheduler", [*RUN, "--scheduler", "cron"], needles=("cron",)),
        Case("unknown-task", [*RUN, "--task", "sudoku"], needles=("sudoku",)),
        Case("unknown-reward", [*RUN, "--reward", "vibes"], needles=("vibes",)),
        Case("unknown-model-options", [*RUN, "--model", "/no/such/model", "--set", "model.options.x=1"],
             needles=("model.options",)),
        # SGLang has no CPU build: where it is not installed, selecting it says how to get it.
        *([Case("uninstalled-generator", [*RUN, "--generator", "sglang"], needles=("pip install 'forgerl[sglang]'",))]
          if importlib.util.find_spec("sglang") is None else []),
        Case("unknown-flag", [*RUN, "--stepz", "3"], needles=("--stepz",)),
        Case("steps-negative", [*RUN, "--steps", "-1"], needles=("--steps",)),
        Case("steps-not-a-number", ["run", "--steps", "many"], needles=("--steps",)),
        Case("missing-flag-value", ["run", "--model"], needles=("--model",)),
        Case("unknown-command", ["rnu"], needles=("rnu",)),
        # the model
        Case("model-folder-missing", [*RUN, "--model", "./no-such-model"], needles=("no-such-model",)),
        Case("model-folder-without-config", [*RUN, "--model", "./empty-model"],
             setup=lambda r: (r / "empty-model").mkdir(), needles=("config.json",)),
        Case("model-is-a-file", [*RUN, "--model", "./weights.bin"], {"weights.bin": b"\0" * 16}, ("is a file",)),
        Case("model-config-garbage", [*RUN, "--model", "./m"], {"m/config.json": b"\xff{not json"}, ("config.json",)),
        Case("model-name-too-long", [*RUN, "--model", "./" + "x" * 5000], needles=("model",)),
        Case("max-tokens-over-context", [*RUN, "--set", "loop.sampling.max_tokens=5000"],
             needles=("max_tokens", "1024")),
        Case("max-tokens-over-folder-context", [*RUN, "--model", "./m", "--set", "loop.sampling.max_tokens=300"],
             {"m/config.json": '{"max_position_embeddings": 256}'}, ("max_tokens", "256")),
        # the file task
        Case("task-file-missing", [*RUN, *FILE_TASK], needles=("problems.jsonl", "does not exist")),
        Case("task-file-directory", [*RUN, *FILE_TASK], setup=lambda r: (r / "problems.jsonl").mkdir(),
             needles=("not a regular file",)),
        Case("task-file-fifo", [*RUN, *FILE_TASK], setup=_fifo("problems.jsonl"), needles=("not a regular file",)),
        Case("task-file-empty", [*RUN, *FILE_TASK], {"problems.jsonl": ""}, ("empty",)),
        Case("task-file-blank-lines", [*RUN, *FILE_TASK], {"problems.jsonl": "\n\n  \n"}, ("no rows",)),
        Case("task-file-garbage", [*RUN, *FILE_TASK], {"problems.jsonl": "this is not json\n"}, ("not valid JSON",)),
        Case("task-file-binary", [*RUN, *FILE_TASK], {"problems.jsonl": b"\x89PNG\r\n\x1a\n\xff\xfe"}, ("UTF-8",)),
        Case("task-file-not-objects", [*RUN, *FILE_TASK], {"problems.jsonl": "[1, 2]\n"}, ("JSON object",)),
        Case("task-file-no-prompt", [*RUN, *FILE_TASK], {"problems.jsonl": '{"question": "q", "answer": "1"}\n' * 20},
             ("prompt",)),
        Case("task-file-no-answer", [*RUN, *FILE_TASK], {"problems.jsonl": '{"prompt": "q"}\n' * 20}, ("answer",)),
        Case("task-file-bad-row-later", [*RUN, *FILE_TASK], {"problems.jsonl": GOOD_ROW * 30 + "{oops\n"},
             ("problems.jsonl:31",)),
        Case("task-file-too-small-to-split", [*RUN, *FILE_TASK], {"problems.jsonl": GOOD_ROW}, ("eval_fraction",)),
        Case("task-eval-path-missing", [*RUN, *FILE_TASK, "--set", "task.options.eval_path=held-out.jsonl"],
             {"problems.jsonl": GOOD_ROW * 20}, ("held-out.jsonl",)),
        Case("task-path-missing-key", [*RUN, "--task", "file"], needles=("task.options.path",)),
        Case("task-path-empty", [*RUN, "--task", "file", "--set", "task.options.path="], needles=("task.options.path",)),
        # where the run would go
        Case("output-empty", [*RUN, "--output", ""], needles=("--output",)),
        Case("output-blank", [*RUN, "--output", "   "], needles=("--output",)),
        Case("output-set-empty", [*RUN, "--set", "output="], needles=("output",)),
        Case("output-is-a-file", [*RUN, "--output", "taken"], {"taken": "x"}, ("is a file",)),
        Case("output-inside-a-file", [*RUN, "--output", "taken/run"], {"taken": "x"}, ("which is a file",)),
        Case("output-holds-a-run", [*RUN, "--output", "old"], setup=_saved_run("old"), needles=("already holds a run",)),
        # placement on the local scheduler
        Case("ranks-over-cores", [*RUN, "--set", f"trainer.ranks={cpus + 1}"], needles=("trainer", f"{cpus + 1} CPU")),
        Case("ranks-absurd", [*RUN, "--set", "trainer.ranks=100000"], needles=("trainer.ranks",)),
        # conflicting flags
        Case("file-and-resume", ["run", "c.yaml", "--resume", "old"], {"c.yaml": "loop: {steps: 3}\n"},
             setup=_saved_run("old"), needles=("--resume", "not both")),
        Case("resume-and-output", ["run", "--resume", "old", "--output", "other"], setup=_saved_run("old"),
             needles=("--output",)),
        Case("resume-and-empty-output", ["run", "--resume", "old", "--output", ""], setup=_saved_run("old"),
             needles=("--output",)),
        Case("resume-empty", ["run", "--resume", ""], needles=("--resume",)),
        Case("resume-not-a-run", ["run", "--resume", "."], needles=("not a run directory",)),
        Case("resume-missing", ["run", "--resume", "gone"], needles=("not a run directory",)),
        Case("resume-other-model", ["run", "--resume", "old", "--model", "smollm2-135m-instruct"],
             setup=_saved_run("old"), needles=("model.name",)),
        Case("resume-other-seed", ["run", "--resume", "old", "--set", "loop.seed=7"], setup=_saved_run("old"),
             needles=("loop.seed",)),
        Case("resume-other-task", ["run", "--resume", "old", "--task", "file"], setup=_saved_run("old"),
             needles=("task.name",)),
        Case("resume-set-output", ["run", "--resume", "old", "--set", "output=elsewhere"], setup=_saved_run("old"),
             needles=("output",)),
        Case("resume-garbage-config", ["run", "--resume", "old"], {"old/config.yaml": b"\xff\xfe"}, ("UTF-8",)),
        # Checked before launch although only the launched run would meet them: what the
        # machine, the environment or an engine must provide, a typo in a model name, a run
        # with nothing to resume from.
        Case("resume-every-checkpoint-unusable", ["run", "--resume", "old"], setup=_saved_run_with_bad_checkpoints("old"),
             needles=("no usable checkpoint", "step-000002", "step-000001")),
        Case("shm-directory-is-a-file", [*RUN, "--transport", "shm", "--set", "transport.options.directory=weights"],
             {"weights": "x"}, ("transport.options.directory", "is a file")),
        Case("shm-directory-inside-a-file", [*RUN, "--transport", "shm", "--set", "transport.options.directory=w/v"],
             {"w": "x"}, ("transport.options.directory", "'w' is a file")),
        Case("cache-dir-is-a-file", RUN, {"cache": "x"}, ("FORGE_CACHE_DIR", "is a file"),
             env={"FORGE_CACHE_DIR": "{root}/cache"}),
        Case("cache-dir-missing-parent", RUN, needles=("FORGE_CACHE_DIR", "no-such", "does not exist"),
             env={"FORGE_CACHE_DIR": "{root}/no-such/cache"}),
        Case("cache-dir-inside-a-file", RUN, {"cache": "x"}, ("FORGE_CACHE_DIR", "/cache' is a file"),
             env={"FORGE_CACHE_DIR": "{root}/cache/models"}),
        # Folders access(2) calls writable (to root) on file systems that refuse every mkdir.
        Case("cache-dir-under-proc", RUN, needles=("FORGE_CACHE_DIR", "'/proc/forge-cache'"),
             env={"FORGE_CACHE_DIR": "/proc/forge-cache"}),
        Case("cache-dir-under-sysfs", RUN, needles=("FORGE_CACHE_DIR", "'/sys/forge-cache'"),
             env={"FORGE_CACHE_DIR": "/sys/forge-cache"}),
        Case("remote-reward-auth-env-unset", [*RUN, *REMOTE, "--set", "rewards.0.options.auth_env=FORGE_TEST_NO_TOKEN"],
             needles=("'FORGE_TEST_NO_TOKEN'", "auth_env", "not set"), env={"FORGE_TEST_NO_TOKEN": None}),
        Case("remote-reward-auth-env-empty", [*RUN, *REMOTE, "--set", "rewards.0.options.auth_env=FORGE_TEST_NO_TOKEN"],
             needles=("'FORGE_TEST_NO_TOKEN'", "empty"), env={"FORGE_TEST_NO_TOKEN": ""}),
        Case("reward-model-auth-env-unset",
             [*RUN, "--reward", "reward_model", "--set", "rewards.0.options.model=./rm", "--set",
              "rewards.0.options.url=http://127.0.0.1:9", "--set", "rewards.0.options.auth_env=FORGE_TEST_NO_TOKEN"],
             needles=("'FORGE_TEST_NO_TOKEN'", "auth_env"), env={"FORGE_TEST_NO_TOKEN": None}),
        Case("model-name-typo", [*RUN, "--model", "tiyn"], needles=("'tiyn'", "did you mean 'tiny'")),
        Case("model-name-typo-smollm2", [*RUN, "--model", "smollm2-135m-instuct"],
             needles=("did you mean 'smollm2-135m-instruct'",)),
        Case("model-bare-unknown-name", [*RUN, "--model", "no-such-model"], needles=("'no-such-model'", "owner/name")),
        *([Case("transport-nccl-without-nccl", [*RUN, "--transport", "nccl", "--set", "transport.options.backend=nccl"],
                needles=("transport.options.backend", "NCCL"))] if not _dist_backend_here("nccl") else []),
        *[Case(f"trainer-backend-{name}-unavailable", [*RUN, "--set", f"trainer.options.backend={name}"],
               needles=("trainer.options.backend", name.upper()))
          for name in ("nccl", "mpi", "ucc") if not _dist_backend_here(name)],
        *([Case("trainer-backend-per-device-without-cpu", [*RUN, "--set", "trainer.options.backend=cuda:gloo"],
                needles=("trainer.options.backend", "'cpu'"))] if not _dist_backend_here("cuda") else []),
    ]
    return c


ALL_CASES = structural_cases() + file_and_flag_cases()


def test_there_are_more_than_a_hundred_cases() -> None:
    assert len(ALL_CASES) > 100, len(ALL_CASES)
    assert len({c.id for c in ALL_CASES}) == len(ALL_CASES), "case ids must be unique"


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_bad_input_is_one_line_exit_2_nothing_created(case: Case) -> None:
    check_case(case)


def test_machine_checks_are_left_to_the_machine_that_runs_the_job() -> None:
    """A login node submitting to Slurm lacks the GPU (NCCL) and maybe the token its nodes
    have: the same config that is refused for the local scheduler passes Slurm's pre-flight."""
    machine_bound = ["--set", "trainer.options.backend=nccl", *REMOTE, "--set",
                     "rewards.0.options.auth_env=FORGE_TEST_NO_TOKEN", "--dry-run"]
    with workdir() as root, environment({"FORGE_TEST_NO_TOKEN": None}, root):
        code, _out, err = run_in_process([*RUN, *machine_bound, "--scheduler", "slurm"])
        assert code == 0, err
        if not _dist_backend_here("nccl"):
            code, out, err = run_in_process([*RUN, *machine_bound])
            assert_refused(code, out, err, ("trainer.options.backend",), "local scheduler")


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Any:
    """A directory on a read-only filesystem: a tmpfs mounted read-only where this user may
    mount (root, whom permission bits do not stop), else a directory without write permission."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "forge-test-ro", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"root, but cannot mount a read-only tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("where", ["itself", "its-parent"])
def test_read_only_cache_dir_is_one_line(read_only_dir: Path, where: str) -> None:
    cache = read_only_dir if where == "itself" else read_only_dir / "cache"
    check_case(Case(f"cache-dir-read-only-{where}", RUN, needles=("FORGE_CACHE_DIR", "not writable"),
                    env={"FORGE_CACHE_DIR": str(cache)}))


def test_read_only_shm_directory_is_one_line(read_only_dir: Path) -> None:
    check_case(Case("shm-directory-read-only",
                    [*RUN, "--transport", "shm", "--set", f"transport.options.directory={read_only_dir / 'w'}"],
                    needles=("transport.options.directory", "not writable")))


# ------------------------------------------------------------------ property-based


LEAVES = INT_KEYS + FLOAT_KEYS
wrong_scalar = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r"), min_size=1, max_size=12).filter(
        lambda s: not _parses_as_number(s)
    ),
    st.lists(st.integers(), min_size=1, max_size=3),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(), min_size=1, max_size=2),
    st.booleans(),
)


def _parses_as_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(key=st.sampled_from(LEAVES), value=wrong_scalar)
def test_any_numeric_key_given_a_non_number(key: str, value: Any) -> None:
    [case] = yaml_cases(f"hyp:{key}", key, value, (key,), validate=False)
    check_case(case)


#: (key, smallest allowed, largest allowed) of integer keys.
INT_BOUNDS = [
    ("loop.steps", 0, 10_000_000), ("loop.group_size", 1, 1024), ("loop.prompts_per_step", 1, 65_536),
    ("loop.sampling.max_tokens", 1, 1_048_576), ("trainer.ranks", 1, 65_536), ("loop.seed", 0, 2**32 - 1),
    ("checkpoint.keep", 1, 1000),
]  # fmt: skip


@st.composite
def out_of_range(draw: st.DrawFn) -> tuple[str, int]:
    key, low, high = draw(st.sampled_from(INT_BOUNDS))
    value = draw(st.one_of(st.integers(max_value=low - 1, min_value=-(2**80)), st.integers(min_value=high + 1, max_value=2**80)))
    return key, value


@SETTINGS
@given(item=out_of_range(), through=st.sampled_from(["file", "set"]))
def test_any_size_out_of_range(item: tuple[str, int], through: str) -> None:
    key, value = item
    if through == "file":
        [case] = yaml_cases(f"hyp:{key}", key, value, (key,), validate=False)
    else:
        case = Case(f"hyp-set:{key}", [*RUN, "--set", f"{key}={value}"], needles=(key,))
    check_case(case)


@SETTINGS
@given(key=st.sampled_from(FLOAT_KEYS), value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
       through=st.sampled_from(["file", "set"]))
def test_any_float_not_finite(key: str, value: float, through: str) -> None:
    if through == "file":
        [case] = yaml_cases(f"hyp:{key}", key, value, (key, "finite"), validate=False)
    else:
        spelled = {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}[repr(value)]
        case = Case(f"hyp-set:{key}", [*RUN, "--set", f"{key}={spelled}"], needles=(key, "finite"))
    check_case(case)


@SETTINGS
@given(prefix=st.binary(max_size=40), bad=st.sampled_from([b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80"]),
       suffix=st.binary(max_size=40), command=st.sampled_from(["run", "validate"]))
def test_any_non_utf8_config(prefix: bytes, bad: bytes, suffix: bytes, command: str) -> None:
    content = prefix + bad + suffix
    try:
        content.decode("utf-8")
        return  # hypothesis completed the sequence into valid UTF-8: not this test's input
    except UnicodeDecodeError:
        pass
    argv = ["run", "c.yaml"] if command == "run" else ["config", "validate", "c.yaml"]
    check_case(Case("hyp:binary", argv, {"c.yaml": content}, ("UTF-8",)))


@SETTINGS
@given(section=st.sampled_from(["", "loop.", "loop.sampling.", "model.", "checkpoint.", "logging.", "algorithm.",
                                "trainer.options.", "scheduler.options."]),
       name=st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True))
def test_any_unknown_key(section: str, name: str) -> None:
    from forgerl.configuration.config import RunConfig

    known = set(RunConfig.model_json_schema(mode="validation")["$defs"].keys()) | _known_keys()
    if name in known:
        return
    [case] = yaml_cases(f"hyp:{section}{name}", f"{section}{name}", 1, (f"{section}{name}", "unknown key"),
                        validate=False)
    check_case(case)


@functools.lru_cache(maxsize=1)
def _known_keys() -> frozenset[str]:
    """Every key name any section or first-party options block accepts."""
    from forgerl.registry.plugins import build_registry

    names: set[str] = set()
    registry = build_registry()
    for kind in registry.kinds:
        for backend in registry.backends(kind).values():
            names |= set(backend.options_model.model_fields)
    from forgerl.configuration.config import RunConfig

    stack: list[Any] = [RunConfig]
    while stack:
        model = stack.pop()
        for name, info in model.model_fields.items():
            names.add(name)
            annotation = info.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                stack.append(annotation)
    return frozenset(names)


# ------------------------------------------------------------- through the real entry point


def forge(*args: str, cwd: Path, env_changes: dict[str, str | None] | None = None, **kw: Any) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FORGE_DEBUG"}
    env["FORGE_CACHE_DIR"] = str(cwd / "model-cache")
    for name, value in (env_changes or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value.format(root=cwd)
    return subprocess.run([*FORGE, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=scaled(120), **kw)


SUBPROCESS_CASES = [
    Case("binary-config", ["config", "validate", "b.yaml"], {"b.yaml": b"\xff\xfe\x00bad\x80"}, ("not UTF-8",)),
    Case("model-3-with-model-flag", ["run", "m.yaml", "--model", "tiny"], {"m.yaml": "model: 3\n"}, ("model",)),
    Case("nan-weight", ["run", "w.yaml"], {"w.yaml": yaml.safe_dump(put(BASELINE, "rewards.0.weight", float("nan")))},
         ("rewards.0.weight", "finite")),
    Case("ranks-100000", [*RUN, "--set", "trainer.ranks=100000"], needles=("trainer.ranks",)),
    Case("task-file-missing", [*RUN, *FILE_TASK], needles=("does not exist",)),
    Case("usage-error", ["run", "--stepz", "3"], needles=("--stepz",)),
    # The CLI builds its plugin registry once per process: a FORGE_DISABLE_PLUGINS case runs apart.
    Case("model-plugin-disabled", RUN, needles=("'tiny'", "'models'", "disabled by FORGE_DISABLE_PLUGINS"),
         env={"FORGE_DISABLE_PLUGINS": "models"}),
    # vLLM's own argument parser judges engine_args (importing vLLM: in a process of its own).
    *([Case("vllm-engine-args-unknown", [*RUN, "--generator", "vllm", "--set", "generator.options.engine_args.max_num_seq=3"],
            needles=("engine_args", "'max_num_seq'", "did you mean 'max_num_seqs'")),
       Case("vllm-engine-args-bad-value", [*RUN, "--generator", "vllm", "--set",
                                            "generator.options.engine_args.max_num_seqs=many"],
            needles=("engine_args", "max-num-seqs", "invalid int value"))]
      if importlib.util.find_spec("vllm") is not None else []),
]


@pytest.mark.parametrize("case", SUBPROCESS_CASES, ids=[c.id for c in SUBPROCESS_CASES])
def test_real_entry_point(case: Case, tmp_path: Path) -> None:
    for name, content in case.files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    before = snapshot(tmp_path)
    proc = forge(*case.argv, cwd=tmp_path, env_changes=case.env)
    assert_refused(proc.returncode, proc.stdout, proc.stderr, case.needles, case.id)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(("sig", "code", "word"), [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "interrupted")])
def test_signal_during_start_up_stops_forge_at_once(tmp_path: Path, sig: int, code: int, word: str) -> None:
    """`forge run` blocked reading its config (a FIFO nobody writes yet) stops on SIGTERM or
    SIGINT with one line, leaving nothing behind."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    env = {k: v for k, v in os.environ.items() if k != "FORGE_DEBUG"}
    env["FORGE_CACHE_DIR"] = str(tmp_path / "model-cache")
    # As from a terminal: SIGINT not ignored. (A test run started in the background by a
    # non-interactive shell ignores SIGINT, and forge leaves an ignored signal alone.)
    proc = subprocess.Popen([*FORGE, "run", str(fifo)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    writer = None
    try:
        def reader_is_waiting() -> int | None:
            # Opening the write end without blocking succeeds only once forge has the read end open.
            assert proc.poll() is None, proc.communicate()
            try:
                return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                return None

        writer = wait_until(reader_is_waiting, 60, "forge to open its config for reading")
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=scaled(10))
    finally:
        if writer is not None:
            os.close(writer)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, (proc.returncode, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("forge: error: ") and word in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


# ------------------------------------------------------------------ local placement


def _job(*roles: Any) -> Any:
    from forgerl.types import JobSpec

    return JobSpec("j", "/nonexistent/run", tuple(roles))


def _role(name: str, replicas: int = 1, ranks: int = 1, cpus: int = 1, gpus: int = 0) -> Any:
    from forgerl.types import Resources, RoleSpec

    return RoleSpec(name, ("true",), replicas=replicas, ranks_per_replica=ranks,
                    resources=Resources(cpus=cpus, gpus=gpus))


def test_local_placement_names_the_role_and_the_numbers() -> None:
    from forgerl.errors import ConfigError
    from forgerl_plugins.schedulers.local.placement import check_placement

    trainer, servers = _role("trainer", ranks=2), _role("vllm", replicas=3)
    with pytest.raises(ConfigError, match=r"role 'vllm': it needs 3 CPU cores \(3 replicas\).* use 2"):
        check_placement(_job(trainer, servers), cpus=2, gpus=0)
    check_placement(_job(trainer, servers), cpus=3, gpus=0)  # each fits; 5 together <= 2 x 3
    with pytest.raises(ConfigError, match=r"need 9 CPU cores together \(trainer 3, vllm 3, judge 3\)"):
        check_placement(_job(_role("trainer", ranks=3), _role("vllm", replicas=3), _role("judge", cpus=3)),
                        cpus=4, gpus=0)
    with pytest.raises(ConfigError, match=r"needs 4 GPUs \(vllm 4\).*shows 2"):
        check_placement(_job(trainer, _role("vllm", replicas=2, gpus=2)), cpus=8, gpus=2)


def test_visible_gpus_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    from forgerl_plugins.schedulers.local import placement

    monkeypatch.setattr(placement, "_physical_gpus", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,-1,1")  # CUDA stops at the first invalid entry
    assert placement.visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert placement.visible_gpus() == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert placement.visible_gpus() == 4


def test_oversubscribe_lets_a_run_past_the_core_count(tmp_path: Path) -> None:
    """The escape hatch works: the same config with oversubscribe passes pre-flight (dry run)."""
    cpus = len(os.sched_getaffinity(0))
    with workdir():
        code, out, err = run_in_process([*RUN, "--set", f"trainer.ranks={cpus + 1}", "--dry-run",
                                         "--set", "scheduler.options.oversubscribe=true"])
        assert code == 0, err
        assert f"rank {cpus} of {cpus + 1}" in out
