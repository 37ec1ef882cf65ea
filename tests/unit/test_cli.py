"""The `forge` command as a user runs it: a real subprocess, exit codes, one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.helpers.timing import scaled

FORGE = [sys.executable, "-m", "forgerl.cli"]


def forge(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("FORGE_DEBUG", None)
    return subprocess.run([*FORGE, *args], capture_output=True, text=True, cwd=cwd, env=full_env, timeout=scaled(60))


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("forge: error: "), lines
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_help_and_plugins_list_do_not_import_torch():
    """Nor does importing every backend class (with no extra installed: sglang, vllm, the
    kubernetes client), which `config schema` does and the listing does too when its index
    is out of date (tests/unit/test_backend_index.py shows it importing none)."""
    code = (
        "import sys\n"
        "from forgerl.cli import main\n"
        "from forgerl.registry.plugins import build_registry\n"
        "for args in (['--help'], ['plugins', 'list'], ['config', 'schema']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "classes = [b.factory for i in build_registry().plugins.values() for b in i.backends]\n"
        "assert len(classes) >= 23 and all(isinstance(c, type) for c in classes), classes\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60))
    assert "HEAVY []" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]


def test_unknown_key_in_file(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("loop:\n  stepz: 3\n")
    assert_one_line_error(forge("config", "validate", str(cfg)), "loop.stepz", "unknown key")


def test_wrong_type_in_file(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("loop:\n  group_size: many\n")
    assert_one_line_error(forge("config", "validate", str(cfg)), "loop.group_size", "'many'")


def test_out_of_range_flag():
    assert_one_line_error(forge("config", "show", "--set", "loop.max_staleness=-1"), "loop.max_staleness", "-1")


def test_backend_options_are_validated_by_the_backend():
    proc = forge("config", "show", "--set", "trainer.options.lr=-3")
    assert_one_line_error(proc, "trainer.options.lr")
    proc = forge("config", "show", "--set", "transport.options.bogus=1")
    assert_one_line_error(proc, "transport.options.bogus", "unknown key")


def test_lora_is_set_by_dotted_keys_and_validated_by_the_trainer():
    proc = forge("config", "show", "--set", "trainer.options.lora.rank=16", "--set", "trainer.options.lora.alpha=32")
    assert proc.returncode == 0, proc.stderr
    assert "rank: 16" in proc.stdout and "alpha: 32" in proc.stdout and "- q_proj" in proc.stdout, proc.stdout
    assert_one_line_error(forge("config", "show", "--set", "trainer.options.lora.rank=0"), "trainer.options.lora.rank")
    assert_one_line_error(forge("config", "show", "--set", "trainer.options.lora.dropout=1"), "lora.dropout")
    proc = forge("config", "show", "--set", "trainer.options.lora.ranks=8")
    assert_one_line_error(proc, "trainer.options.lora.ranks", "unknown key")


def test_unreadable_file_and_bad_yaml(tmp_path):
    assert_one_line_error(forge("config", "validate", str(tmp_path / "missing.yaml")), "cannot read config file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("loop: [unclosed\n")
    assert_one_line_error(forge("config", "validate", str(bad)), "not valid YAML")


def test_unknown_backend_lists_installed():
    assert_one_line_error(forge("run", "--trainer", "nope", "--dry-run"), "no trainer 'nope'", "fsdp", "forge plugins list")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_a_backend_missing_its_package_says_how_to_install_it():
    assert_one_line_error(
        forge("run", "--generator", "sglang", "--dry-run"), "sglang", "pip install 'forgerl[sglang]'"
    )


def test_debug_shows_the_traceback():
    proc = forge("--debug", "run", "--trainer", "nope", "--dry-run")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_precedence_defaults_file_flags_set(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("loop:\n  steps: 7\n  group_size: 6\nmodel:\n  name: tiny\n")
    proc = forge("config", "show", str(cfg), "--steps", "11", "--set", "loop.prompts_per_step=3", "--model", "tiny",
                 "--reward", "format", "--set", "rewards.0.options.pattern=x+")
    assert proc.returncode == 0, proc.stderr
    import yaml

    shown = yaml.safe_load(proc.stdout)
    assert shown["loop"]["steps"] == 11  # flag beats file
    assert shown["loop"]["group_size"] == 6  # file beats default
    assert shown["loop"]["prompts_per_step"] == 3  # --set beats default
    # --set refines what a flag selected
    assert shown["rewards"] == [{"name": "format", "options": {"pattern": "x+", "mode": "search"}, "weight": 1.0}]
    assert shown["loop"]["max_staleness"] == 0  # default
    assert shown["trainer"]["options"]["lr"] > 0  # backend defaults filled in
    assert shown["generator"]["name"] in ("hf", "vllm")  # `auto` resolved


def test_shown_config_validates_and_reproduces(tmp_path):
    proc = forge("config", "show", "--model", "tiny", "--reward", "format", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    cfg = tmp_path / "shown.yaml"
    cfg.write_text(proc.stdout)
    assert forge("config", "validate", str(cfg)).returncode == 0
    assert forge("config", "show", str(cfg)).stdout == proc.stdout


def test_schema_is_json_schema():
    proc = forge("config", "schema")
    schema = json.loads(proc.stdout)
    assert {"model", "task", "generator", "trainer", "transport", "scheduler", "rewards", "algorithm", "loop",
            "checkpoint", "logging"} <= set(schema["properties"])


def test_plugins_list_json_reports_availability():
    rows = json.loads(forge("plugins", "list", "--json").stdout)
    by_name = {r["name"]: r for r in rows}
    assert by_name["hf"]["distribution"] == "forgerl"
    sglang = by_name["sglang"]["backends"][0]
    if importlib.util.find_spec("sglang") is None:
        assert sglang["available"] is False and "pip install 'forgerl[sglang]'" in sglang["reason"]
    assert by_name["local"]["backends"][0]["available"] is True


def test_plugin_can_add_a_command(tmp_path):
    from .fakedist import COMMAND, make_dist

    site = make_dist(tmp_path / "site", "fake-cmd", "1.0", {"cmd": COMMAND})
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = forge("hello", env=env)
    assert proc.returncode == 0 and "hello from a plugin" in proc.stdout
    assert "Say hello" in forge("--help", env=env).stdout


def _site_env(tmp_path: Path, dist: str, version: str, plugins: dict[str, str]) -> dict[str, str]:
    """The environment of a user who has pip-installed a fake third-party distribution."""
    from .fakedist import make_dist

    site = make_dist(tmp_path / "site", dist, version, plugins)
    return {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_a_backend_name_clash_breaks_only_what_needs_the_name(tmp_path):
    from .fakedist import CLASHING_REWARD

    env = _site_env(tmp_path, "fake-clash", "2.0", {"aaa": CLASHING_REWARD})
    listed = forge("plugins", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    mine = {b["name"]: b for b in rows["aaa"]["backends"]}
    builtin = {b["name"]: b for b in rows["rewards"]["backends"]}
    clash = mine["math_answer"]["clash"]
    assert f"plugin 'rewards' (forgerl {metadata.version('forgerl')})" in clash and "FORGE_DISABLE_PLUGINS=aaa" in clash
    assert "FORGE_DISABLE_PLUGINS=rewards" not in clash
    assert builtin["math_answer"]["clash"] == clash
    assert mine["math_answer"]["available"] is False and builtin["math_answer"]["available"] is False
    assert builtin["format"]["clash"] is None and builtin["format"]["available"] is True
    assert mine["own_task"]["available"] is True
    text = forge("plugins", "list", env=env)
    assert text.returncode == 0 and "FORGE_DISABLE_PLUGINS=aaa" in text.stdout, text.stderr

    assert forge("config", "show", "--reward", "format", env=env).returncode == 0
    proc = forge("config", "show", "--reward", "math_answer", env=env)
    assert_one_line_error(
        proc, "reward 'math_answer' is provided twice", "fake-clash 2.0", "FORGE_DISABLE_PLUGINS=aaa"
    )
    assert "FORGE_DISABLE_PLUGINS=rewards" not in proc.stderr
    fixed = forge("config", "show", "--reward", "math_answer", env={**env, "FORGE_DISABLE_PLUGINS": "aaa"})
    assert fixed.returncode == 0 and fixed.stderr == "", fixed.stderr


def test_strict_plugins_error_is_one_line(tmp_path):
    from .fakedist import BROKEN

    env = _site_env(tmp_path, "fake-broken", "2.0", {"broken": BROKEN})
    relaxed = forge("plugins", "list", env=env)
    assert relaxed.returncode == 0 and "forge: warning: plugin 'broken' (fake-broken 2.0)" in relaxed.stderr
    strict = {**env, "FORGE_STRICT_PLUGINS": "1"}
    assert_one_line_error(
        forge("plugins", "list", env=strict),
        "plugin 'broken' (fake-broken 2.0) failed to load",
        "definitely_not_a_module_xyz",
    )
    assert forge("--help", env=strict).returncode == 0


def test_config_schema_has_the_options_of_installed_backends(tmp_path):
    from .fakedist import ECHO_GENERATOR

    jsonschema = pytest.importorskip("jsonschema")
    env = _site_env(tmp_path, "fake-plugin", "1.2.3", {"echo": ECHO_GENERATOR})
    proc = forge("config", "schema", env=env)
    assert proc.returncode == 0, proc.stderr
    validator = jsonschema.Draft202012Validator(json.loads(proc.stdout))

    def errors(config: dict) -> list[str]:
        return [e.message for e in validator.iter_errors(config)]

    assert errors({"generator": {"name": "echo", "options": {"copies": 2, "loud": True}}}) == []
    assert errors({"generator": {"name": "echo", "options": {"copies": 0}}})  # ge=1 in EchoOptions
    assert errors({"generator": {"name": "echo", "options": {"bogus": 1}}})  # unknown key
    assert errors({"trainer": {"name": "fsdp", "options": {"lr": "fast"}}})  # built-in ones too
    assert errors({"rewards": [{"name": "always_one", "options": {}}]}) == []

    markdown = forge("config", "schema", "--markdown", env=env).stdout
    echo = markdown.split("### generator `echo` (fake-plugin 1.2.3)")[1]
    assert "`copies`" in echo and "`loud`" in echo
    builtin_only = forge("config", "schema", "--markdown", "--builtin-only", env=env).stdout
    assert "fake-plugin" not in builtin_only
    assert builtin_only == (Path(__file__).parents[2] / "docs" / "config.md").read_text()


def test_status_of_something_that_is_not_a_job(tmp_path):
    assert_one_line_error(forge("status", str(tmp_path)), "never submitted")
    assert_one_line_error(forge("status", "12345"), "--scheduler")


def _submitted_local_run(run_dir: Path, config_text: str) -> Path:
    """A run directory as a finished local run leaves it, with ``config_text`` as its config."""
    run_dir.mkdir()
    submission = {"scheduler": "local", "job_id": str(run_dir), "run_dir": str(run_dir)}
    (run_dir / "submission.json").write_text(json.dumps(submission))
    (run_dir / "job.json").write_text(json.dumps({"state": "completed", "exit_code": 0}))
    (run_dir / "config.yaml").write_text(config_text)
    return run_dir


@pytest.mark.parametrize(
    "config_text, problem",
    [
        ("loop: [steps\n", "not valid YAML"),
        ("loop:\n  steps: -1\n", "loop.steps"),
        ("- a list\n", "top level must be a mapping"),
    ],
)
def test_status_refuses_a_corrupt_run_config(tmp_path, config_text, problem):
    # Its scheduler options say where the job lives; defaults would ask the wrong place.
    run_dir = _submitted_local_run(tmp_path / "run", config_text)
    assert_one_line_error(forge("status", str(run_dir)), str(run_dir / "config.yaml"), problem)


def test_status_of_a_run_directory(tmp_path):
    run_dir = _submitted_local_run(tmp_path / "run", "loop:\n  steps: 3\n")
    proc = forge("status", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{run_dir}: completed (exit 0)"


NO_LOGS_SCHEDULER = """
from forgerl.backends import SchedulerBackend
from forgerl.hookspecs import hookimpl
from forgerl.interfaces import Scheduler
from forgerl.types import JobState, JobStatus


class Quiet(Scheduler):
    def __init__(self, options):
        pass

    def submit(self, job):
        raise AssertionError("not submitted in this test")

    def status(self, job_id):
        return JobStatus(JobState.RUNNING)

    def wait(self, handle, timeout=None):
        return self.status(handle.job_id)

    def cancel(self, job_id):
        pass


@hookimpl
def forge_schedulers():
    return [SchedulerBackend(name="quiet", factory=Quiet)]
"""


def test_logs_of_a_scheduler_that_cannot_show_them_is_one_line(tmp_path):
    env = _site_env(tmp_path, "fake-quiet", "1.0", {"quiet": NO_LOGS_SCHEDULER})
    assert forge("status", "job-7", "--scheduler", "quiet", env=env).stdout.strip() == "job-7: running"
    proc = forge("logs", "job-7", "--scheduler", "quiet", env=env)
    assert_one_line_error(proc, "scheduler 'quiet' cannot show logs", "logs/")


def test_resume_of_a_non_run_directory(tmp_path):
    assert_one_line_error(forge("run", "--resume", str(tmp_path)), "not a run directory")


def test_scheduler_that_cannot_submit_creates_nothing(tmp_path):
    out = tmp_path / "run"
    env = {"KUBECONFIG": str(tmp_path / "missing-kubeconfig"), "HOME": str(tmp_path)}
    proc = forge("run", "--model", "tiny", "--generator", "hf", "--scheduler", "kubernetes", "--output", str(out), env=env)
    assert_one_line_error(proc, "kubeconfig")
    assert not out.exists()
    proc = forge("run", "--model", "tiny", "--generator", "hf", "--scheduler", "slurm", "--output", str(out),
                 env={"PATH": str(Path(sys.executable).parent)})
    assert_one_line_error(proc, "sbatch not found")
    assert not out.exists()


def test_presets_fit_the_completion_length():
    import yaml

    sets = ("--set", "algorithm.overlong=soft_penalty", "--set", "loop.sampling.max_tokens=64")
    shown = yaml.safe_load(forge("config", "show", *sets).stdout)
    assert shown["algorithm"]["overlong"] == "soft_penalty" and shown["algorithm"]["overlong_buffer"] == 16
    # DAPO's own 4096-token ramp does not fit 64 tokens: one line that names both fixes.
    proc = forge("config", "show", "--set", "algorithm.preset=dapo", "--set", "loop.sampling.max_tokens=64")
    assert_one_line_error(proc, "overlong_buffer (4096, the dapo preset's)", "max_tokens (64)")
    shown = yaml.safe_load(forge("config", "show", "--set", "algorithm.preset=dr_grpo").stdout)
    assert shown["algorithm"]["loss_norm_constant"] == shown["loop"]["sampling"]["max_tokens"]
    proc = forge("config", "show", "--set", "algorithm.preset=dapo", "--set", "algorithm.overlong_buffer=100")
    assert_one_line_error(proc, "overlong_buffer", "max_tokens")
