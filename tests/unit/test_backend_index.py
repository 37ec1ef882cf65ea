"""`forge plugins list` reads backend identities from an index instead of importing the
backend classes' modules, and shows exactly what it would show without the index: after
a change to a class, to a module it imports or to what is installed, for a plugin that
breaks after being indexed, and whatever the index file holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgerl.registry.backend_index import MAX_BYTES, BackendIndex, index_path
from forgerl.registry.plugins import build_registry
from forgerl.types import Problem, RewardInput
from tests.helpers.timing import scaled

from .fakedist import make_dist

PLUGIN_SWITCHES = ("FORGE_DISABLE_PLUGINS", "FORGE_STRICT_PLUGINS", "FORGE_TRACE_HOOKS", "FORGE_PLUGINS", "FORGE_DEBUG")

# What the listing process imported, once it has listed: the modules of the backend
# classes it shows (each record names its class as "module:Class" when it came from the
# index; it holds the class itself when the class was imported).
PROBE = """
import json, sys
from forgerl import cli
try:
    cli.main(["plugins", "list"])
except SystemExit:
    pass
records = [b for info in cli._State.registry.listing().values() for b in info.backends]
named = [b.factory for b in records if isinstance(b.factory, str)]
modules = sorted({ref.partition(":")[0] for ref in named})
print(json.dumps({"records": len(records), "named": len(named), "modules": modules,
                  "imported": [m for m in modules if m in sys.modules], "pydantic": "pydantic" in sys.modules}))
"""


def forge_env(cache: Path, site: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_SWITCHES}
    env["XDG_CACHE_HOME"] = str(cache)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return env


def list_plugins(
    cache: Path, *args: str, site: Path | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`forge plugins list` as `python -m` runs it: with its working folder on sys.path,
    which the index depends on (``cwd``: one nothing else writes in, where that matters)."""
    return subprocess.run(
        [sys.executable, "-m", "forgerl.cli", "plugins", "list", *args],
        capture_output=True, text=True, env=forge_env(cache, site), timeout=scaled(60), cwd=cwd,
    )


def quiet_folder(parent: Path) -> Path:
    folder = parent / "work"
    folder.mkdir()
    return folder


def index_file(cache: Path) -> Path:
    [path] = (cache / "forgerl").glob("backend-index-*.json")
    return path


@pytest.fixture(scope="module")
def unindexed(tmp_path_factory) -> dict[str, str]:
    """The listing, text and JSON, as collecting every class gives it (an empty cache),
    and the index the first listing wrote."""
    cache = tmp_path_factory.mktemp("cache")
    cwd = quiet_folder(cache)
    shown = {args: list_plugins(cache, *args.split(), cwd=cwd).stdout for args in ("", "--json")}
    return {**shown, "index": index_file(cache).read_text(), "cwd": str(cwd)}


def test_once_indexed_listing_imports_no_backend_module_and_shows_the_same(tmp_path, unindexed):
    cwd = quiet_folder(tmp_path)
    first = list_plugins(tmp_path, cwd=cwd)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    assert index_file(tmp_path).parent == tmp_path / "forgerl"  # under XDG_CACHE_HOME
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=forge_env(tmp_path), timeout=scaled(60),
        cwd=cwd,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen["records"] >= 23 and seen["named"] == seen["records"], seen
    assert "forgerl_plugins.generators.hf.generator" in seen["modules"], seen
    assert seen["imported"] == [] and seen["pydantic"] is False, seen
    assert probe.stdout.rsplit("\n", 2)[0] + "\n" == unindexed[""]
    for args in ("", "--json"):
        expected = unindexed[args]
        again = list_plugins(tmp_path, *args.split(), cwd=cwd)
        assert (again.returncode, again.stdout, again.stderr) == (0, expected, ""), again.stderr


REWARD_CLASS = """
from forgerl.interfaces import Reward
import fake_idx_dep

class ShortReward(Reward):
    name = "short"
    description = "ONE"
    requires = ("json",)

    def __init__(self, options):
        pass

    def score(self, sample):
        return 1.0
"""

REGISTRATION = """
from forgerl.hookspecs import hookimpl

@hookimpl
def forge_rewards():
    return ["fake_idx_cls:ShortReward"]
"""


def third_party(tmp_path: Path) -> Path:
    site = make_dist(tmp_path / "site", "fake-idx", "1.0", {"idx": REGISTRATION})
    (site / "fake_idx_cls.py").write_text(REWARD_CLASS)
    (site / "fake_idx_dep.py").write_text("")
    return site


def shown(proc: subprocess.CompletedProcess) -> dict[str, dict]:
    assert proc.returncode == 0, proc.stderr
    return {row["name"]: row for row in json.loads(proc.stdout)}


def test_a_changed_class_is_read_again(tmp_path):
    site, cache, cwd = third_party(tmp_path), tmp_path / "cache", quiet_folder(tmp_path)
    assert shown(list_plugins(cache, "--json", site=site, cwd=cwd))["idx"]["backends"][0]["description"] == "ONE"
    (site / "fake_idx_cls.py").write_text(REWARD_CLASS.replace('"ONE"', '"the second one"'))
    row = shown(list_plugins(cache, "--json", site=site, cwd=cwd))["idx"]
    assert [b["description"] for b in row["backends"]] == ["the second one"], row


@pytest.mark.parametrize(
    "breakage",
    ["the class module raises", "a module it imports is removed", "the class is no reward any more"],
)
def test_a_plugin_broken_after_it_was_indexed_is_reported_as_without_the_index(tmp_path, breakage):
    site, cache, cwd = third_party(tmp_path), tmp_path / "cache", quiet_folder(tmp_path)
    assert shown(list_plugins(cache, "--json", site=site, cwd=cwd))["idx"]["status"] == "loaded"
    if breakage == "the class module raises":
        (site / "fake_idx_cls.py").write_text(REWARD_CLASS + "\nraise RuntimeError('broken on purpose')\n")
    elif breakage == "a module it imports is removed":
        (site / "fake_idx_dep.py").unlink()
    else:
        # Of another size: Python's own bytecode cache would not notice an edit of the same
        # size within the second (the index would, but the listing without it must too).
        (site / "fake_idx_cls.py").write_text(REWARD_CLASS.replace("(Reward):", "(object):  # no Reward"))
    indexed = list_plugins(cache, "--json", site=site, cwd=cwd)
    fresh = list_plugins(tmp_path / "empty-cache", "--json", site=site, cwd=cwd)
    assert "plugin 'idx' (fake-idx 1.0) registers something wrong" in fresh.stderr, fresh.stderr
    assert (indexed.returncode, indexed.stdout, indexed.stderr) == (0, fresh.stdout, fresh.stderr)
    assert shown(indexed)["idx"]["status"] == "broken"
    # Broken stays broken: what failed is never indexed, so it is imported again.
    again = list_plugins(cache, "--json", site=site, cwd=cwd)
    assert (again.stdout, again.stderr) == (fresh.stdout, fresh.stderr)


def _escape_sequences(path: Path, index: str) -> None:
    """The index of this environment, up to date, with descriptions that would retitle
    the terminal."""
    data = json.loads(index)
    for entry in data["backends"]:
        entry["description"] = "\x1b]0;owned\x07" + entry["description"]
    path.write_text(json.dumps(data))


HOSTILE = {
    "not json": lambda p, _: p.write_bytes(b"\x00\xff{not json"),
    "another shape": lambda p, _: p.write_text(json.dumps([1, 2, 3])),
    "nested too deep": lambda p, _: p.write_text("[" * 200_000),
    "too large": lambda p, _: p.write_bytes(b" " * (MAX_BYTES + 1)),
    "escape sequences": _escape_sequences,
    "a fifo": lambda p, _: os.mkfifo(p),
    "a folder": lambda p, _: p.mkdir(),
    "a link": lambda p, _: p.symlink_to("/dev/zero"),
}


@pytest.mark.parametrize("spoil", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_corrupt_or_hostile_index_is_ignored(tmp_path, monkeypatch, unindexed, spoil):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = index_path()  # the listing's: the same interpreter
    path.parent.mkdir(parents=True)
    spoil(path, unindexed["index"])
    # In the folder the index was written from: the escape sequences reach an index that
    # is up to date. A fifo would block forever if it were opened as a file.
    listed = list_plugins(tmp_path, cwd=Path(unindexed["cwd"]))
    assert (listed.returncode, listed.stdout, listed.stderr) == (0, unindexed[""], "")


def test_a_cache_folder_that_cannot_be_written_only_costs_time(tmp_path, unindexed):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for _ in range(2):
        listed = list_plugins(blocker)  # XDG_CACHE_HOME names a file: nothing can be made in it
        assert (listed.returncode, listed.stdout, listed.stderr) == (0, unindexed[""], "")


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert index_path().parent == tmp_path / ".cache" / "forgerl"


def test_a_record_from_the_index_is_the_record_from_the_class(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for var in PLUGIN_SWITCHES:
        monkeypatch.delenv(var, raising=False)
    build_registry(collect=False).listing()  # imports the classes and writes the index
    assert len(BackendIndex.load()) >= 23
    listed = build_registry(collect=False).listing()
    collected = build_registry().plugins
    assert listed.keys() == collected.keys()
    compared = 0
    for name, info in collected.items():
        assert len(listed[name].backends) == len(info.backends), name
        for light, real in zip(listed[name].backends, info.backends):
            assert isinstance(light.factory, str) and light.load_factory() is real.factory, (light, real)
            assert light.options_model is real.options_model
            for part in ("preflight", "local_preflight", "roles"):
                mine, theirs = getattr(light, part, None), getattr(real, part, None)
                assert (mine is None) == (theirs is None), (name, part)
                if mine is not None:
                    assert light.load_part(mine, part) is theirs, (name, part)
            for field in ("kind", "name", "description", "requires", "extra", "extra_of", "install_hint",
                          "implemented", "info", "provider"):
                assert getattr(light, field) == getattr(real, field), (name, field)
            assert light.unavailable_reason() == real.unavailable_reason()
            compared += 1
    assert compared >= 23
    [reward] = [b for b in build_registry(collect=False).listing()["rewards"].backends if b.name == "format"]
    assert reward.name == "format" and isinstance(reward.factory, str)
    scorer = reward.build({"pattern": "^ok$"})
    assert scorer.score(RewardInput(Problem(id="p", prompt=""), "ok")) == 1.0
