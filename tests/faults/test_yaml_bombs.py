"""A YAML alias bomb ("billion laughs") is refused at once, wherever forge reads a user's YAML.

A document of a few hundred bytes whose aliases refer to lists of aliases expands to 10**9
values. PyYAML composes it as shared nodes, but merging, validation and config.yaml walk it
as the tree it stands for: before the alias bound, `forge config validate` on one ran for
minutes and past 8 GB. Each case runs the real `forge` in a subprocess under an address-space
limit and a deadline, so that the old behaviour fails the test (killed at the deadline, or a
MemoryError traceback) instead of taking the machine with it. Nothing here measures speed:
the deadline only says when to give up.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.timing import scaled

_SCRIPT = Path(sys.executable).with_name("forge")
FORGE = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "forgerl.cli"]
#: Address space of the forge process: several times what refusing (or validating a real
#: config) needs, far below what expanding a bomb needs.
MEMORY_LIMIT = 2 * 2**30
#: When to give up. Generous: under the memory limit the old code failed anyway (a
#: MemoryError after ~48 s), and `forge report` (matplotlib) once needed over 60 s at load 18.
DEADLINE = scaled(240)


def laughs(levels: int = 9, flow: bool = False) -> str:
    """The classic bomb: level i is a list of nine aliases of level i-1 (9**levels leaves)."""
    items = [f'&a0 [{",".join(["lol"] * 9)}]']
    items += [f'&a{i} [{",".join([f"*a{i - 1}"] * 9)}]' for i in range(1, levels)]
    if flow:  # one value, as given to --set
        return "[" + ", ".join(items) + "]"
    return "".join(f"a{i}: {item}\n" for i, item in enumerate(items)) + f"loop: {{steps: *a{levels - 1}}}\n"


BOMB = laughs()


def forge(*argv: str, cwd: Path) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FORGE_DEBUG"}
    env["FORGE_CACHE_DIR"] = str(cwd / "model-cache")

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    proc = subprocess.Popen([*FORGE, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=limit_memory)  # noqa: PLW1509 - only setrlimit
    try:
        out, err = proc.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"forge {' '.join(argv)} was still running after {DEADLINE:g} s (expanding the aliases?)\n"
                    f"{err[-2000:]}")
    return proc.returncode, out, err


def assert_one_line(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, f"exit {code}\nstdout: {out[-1000:]}\nstderr: {err[-3000:]}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("forge: error: "), err[-3000:]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


def test_the_bomb_is_small() -> None:
    assert len(BOMB) < 600, len(BOMB)


@pytest.mark.parametrize("command", [["config", "validate"], ["config", "show"], ["run"]])
def test_a_config_file_bomb_is_refused(command: list[str], tmp_path: Path) -> None:
    (tmp_path / "bomb.yaml").write_text(BOMB)
    code, out, err = forge(*command, "bomb.yaml", cwd=tmp_path)
    assert_one_line(code, out, err, "bomb.yaml", "aliases")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.yaml"], "forge created something"


def test_a_set_value_bomb_is_refused(tmp_path: Path) -> None:
    code, out, err = forge("config", "show", "--set", f"loop.steps={laughs(flow=True)}", cwd=tmp_path)
    assert_one_line(code, out, err, "--set loop.steps", "aliases")


def test_a_bomb_in_a_run_directory_is_refused_on_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(BOMB)
    code, out, err = forge("run", "--resume", "run", cwd=tmp_path)
    assert_one_line(code, out, err, "config.yaml", "aliases")


def test_a_bomb_in_a_copied_run_costs_the_report_only_its_config_table(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    shutil.copytree(Path(__file__).parents[1] / "unit" / "data" / "report_run", tmp_path / "run")
    (tmp_path / "run" / "config.yaml").write_text(BOMB)
    code, _out, err = forge("report", "run", "--output", "report.html", cwd=tmp_path)
    assert code == 0, err[-3000:]
    assert "reward/mean" in (tmp_path / "report.html").read_text()


def test_a_recursive_alias_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "loop.yaml").write_text("model: {name: tiny}\nloop: &l {steps: 2, again: *l}\n")
    code, out, err = forge("config", "validate", "loop.yaml", cwd=tmp_path)
    assert_one_line(code, out, err, "loop.yaml", "line 2", "recursive")


def test_anchors_and_merge_keys_of_a_real_config_still_work(tmp_path: Path) -> None:
    (tmp_path / "anchors.yaml").write_text(
        "model: {name: tiny}\n"
        "generator: {name: hf}\n"
        "rewards:\n"
        "  - &format {name: format, weight: 0.5}\n"
        "  - {<<: *format, weight: 0.25}\n"
        "loop: {steps: 3, sampling: {max_tokens: 8}}\n"
    )
    code, out, err = forge("config", "show", "anchors.yaml", cwd=tmp_path)
    assert code == 0, err
    assert out.count("name: format") == 2 and "weight: 0.25" in out, out
