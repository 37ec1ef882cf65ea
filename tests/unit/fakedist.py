"""Build a fake installed distribution (a dist-info folder plus a module) in a folder,
so plugin discovery is tested through real entry points without installing anything."""

from __future__ import annotations

import textwrap
from pathlib import Path


def make_dist(root: Path, dist: str, version: str, plugins: dict[str, str]) -> Path:
    """``plugins`` maps entry-point name → module source. Returns ``root`` (put it on sys.path)."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[forgerl]"]
    for ep_name, source in plugins.items():
        module = f"{dist.replace('-', '_')}_{ep_name}"
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        lines.append(f"{ep_name} = {module}")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


ECHO_GENERATOR = """
from pydantic import BaseModel, ConfigDict, Field
from forgerl.backends import GeneratorBackend, RewardBackend
from forgerl.hookspecs import hookimpl

class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    loud: bool = False
    copies: int = Field(1, ge=1)

@hookimpl
def forge_generators():
    return [GeneratorBackend(name="echo", factory=None, options=EchoOptions, description="test echo")]

@hookimpl
def forge_rewards():
    return [RewardBackend(name="always_one", factory="builtins:dict", description="test reward")]
"""

DUPLICATE_HF = """
from forgerl.backends import GeneratorBackend
from forgerl.hookspecs import hookimpl

@hookimpl
def forge_generators():
    return [GeneratorBackend(name="hf", factory=None)]
"""

BROKEN = """
import definitely_not_a_module_xyz
"""

TYPO_HOOK = """
from forgerl.hookspecs import hookimpl

@hookimpl
def forge_generatorz():
    return []
"""

COMMAND = """
import click
from forgerl.hookspecs import hookimpl

@hookimpl
def forge_commands(cli):
    @cli.command("hello")
    def hello():
        "Say hello (from a plugin)."
        click.echo("hello from a plugin")
"""

# A third-party reward named like a built-in one (forgerl's `rewards` plugin provides
# math_answer), plus a backend of its own that must stay usable.
CLASHING_REWARD = """
from forgerl.backends import RewardBackend, TaskBackend
from forgerl.hookspecs import hookimpl

@hookimpl
def forge_rewards():
    return [RewardBackend(name="math_answer", factory="builtins:dict", description="a look-alike")]

@hookimpl
def forge_tasks():
    return [TaskBackend(name="own_task", factory="builtins:dict", description="its own")]
"""

STEP_END_TYPO = """
from forgerl.hookspecs import hookimpl

@hookimpl
def forge_step_ends(step, metrics, run_dir):
    pass
"""

RAISING_REGISTRATION = """
from forgerl.hookspecs import hookimpl

@hookimpl
def forge_generators():
    raise RuntimeError("cannot find my config")

@hookimpl
def forge_run_end(summary, run_dir):
    raise AssertionError("a dropped plugin's event hooks must not run")
"""

# Registration imports fine; the implementation module (written next to it by the test)
# imports a dependency that is not installed.
LAZY_BROKEN_IMPL = """
from forgerl.backends import GeneratorBackend
from forgerl.hookspecs import hookimpl

@hookimpl
def forge_generators():
    return [
        GeneratorBackend(name="lazy", factory="fake_lazy_impl:LazyGenerator"),
        GeneratorBackend(name="lazy_opts", factory=None, options="fake_lazy_impl:Options"),
    ]
"""

LAZY_IMPL_MODULE = """
import os
import no_such_dependency_q
"""

WRONG_RECORD = """
from forgerl.backends import TaskBackend
from forgerl.hookspecs import hookimpl

@hookimpl
def forge_generators():
    return [TaskBackend(name="x", factory=None)]
"""
