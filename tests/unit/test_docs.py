"""Documentation that must not drift from the code.

Each test collects one kind of name from the code (hooks, environment variables, metric
keys, `flags` keys, run-directory files, built-in backends) and checks it against the
place in docs/ that promises to list them all. Names are read from the source with `ast`
where importing would pull in torch, so these stay fast unit tests.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from forgerl import hookspecs

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def hook_names() -> set[str]:
    return {name for name in dir(hookspecs) if name.startswith("forge_")}


def section(doc: str, heading: str) -> str:
    """The text of ``heading`` (a whole markdown heading line) up to the next heading of
    the same or a higher level."""
    text = (DOCS / doc).read_text()
    level = len(heading) - len(heading.lstrip("#"))
    match = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^#{{1,{level}}} |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/{doc} has no section {heading!r}"
    return match.group(1)


def first_cells(markdown: str) -> list[str]:
    """The backticked names in the first cell of every table row (header rows excluded)."""
    names = []
    for line in markdown.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cell = line.split("|")[1]
            names += re.findall(r"`([^`]+)`", cell)
    return names


def string_of(node: ast.AST) -> str | None:
    """A string constant as is; an f-string with every replacement field as ``<>``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<>" for v in node.values)
    return None


def function(path: Path, name: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{path} has no function {name}")


def subscript_keys(func: ast.FunctionDef, target: str) -> set[str]:
    """Keys of ``target[KEY] = ...`` inside ``func``; a key computed otherwise than by an
    f-string (``components[named.name]``) is ``<>``."""
    keys = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == target:
                    key = string_of(t.slice)
                    keys.add("<>" if key is None else key)
    return keys


def dict_literal_keys(func: ast.FunctionDef) -> set[str]:
    """Keys of the dict displays in ``func``, comprehensions' f-string keys included."""
    dicts = [node for node in ast.walk(func) if isinstance(node, ast.Dict)]
    keys = {k for node in dicts for k in map(string_of, node.keys) if k}
    comprehensions = [node for node in ast.walk(func) if isinstance(node, ast.DictComp)]
    return keys | {k for node in comprehensions if (k := string_of(node.key))}


def placeholders(name: str) -> str:
    """``reward/<name>/<component>`` and ``reward/<>/<>`` compare equal."""
    return re.sub(r"<[^>]*>", "<>", name)


# ---------------------------------------------------------------------------- hooks


def test_every_hook_is_documented():
    documented = set(re.findall(r"^### `(forge_\w+)\(", (DOCS / "hooks.md").read_text(), flags=re.M))
    missing = hook_names() - documented
    assert not missing, f"hooks missing from docs/hooks.md: {sorted(missing)}"
    stale = documented - hook_names()
    assert not stale, f"docs/hooks.md documents hooks that do not exist: {sorted(stale)}"


def test_hook_signatures_in_docs_match_the_specs():
    import inspect

    text = (DOCS / "hooks.md").read_text()
    for name in hook_names():
        params = list(inspect.signature(getattr(hookspecs, name)).parameters)
        heading = re.search(rf"^### `{name}\((.*?)\)", text, flags=re.M).group(1)
        documented = re.findall(r"(?:^|,\s*)(\w+):", heading)
        assert documented == params, (name, documented, params)


def test_no_doc_names_a_hook_that_does_not_exist():
    """A hook name in prose or in an example (`forge_stepend`, `def forge_step_ends(`) sends
    a plugin author to write a function that forgerl rejects."""
    unknown = {}
    for path in [*DOCS.glob("*.md"), REPO / "README.md"]:
        text = path.read_text()
        named = re.findall(r"`(forge_\w+)[`(]", text) + re.findall(r"\bdef (forge_\w+)\(", text)
        for name in set(named) - hook_names():
            unknown.setdefault(path.name, []).append(name)
    assert not unknown, f"docs name hooks that do not exist: {unknown}"


def test_every_doc_link_to_a_heading_resolves():
    """Links such as `plugins.md#5-send-metrics-to-an-experiment-tracker` (the hook reference
    points at examples through them) must reach a heading that exists."""

    def anchors(path: Path) -> set[str]:
        out = set()
        for heading in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M):
            slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            out.add(slug)
        return out

    broken = []
    for path in DOCS.glob("*.md"):
        for target, anchor in re.findall(r"\]\(([\w.]*\.md|)#([\w\-]+)\)", path.read_text()):
            linked = DOCS / target if target else path
            if not linked.is_file() or anchor not in anchors(linked):
                broken.append(f"{path.name} -> {target}#{anchor}")
    assert not broken, f"links to headings that do not exist: {broken}"


# ------------------------------------------------------------ environment variables


_ENV_NAME = re.compile(r"FORGE_[A-Z0-9_]+")


def _env_names_in_python(path: Path) -> set[str]:
    """FORGE_* names the module reads or sets: string constants that are exactly a name
    (``os.environ.get("FORGE_X")``, ``{"name": "FORGE_X"}``), keyword arguments
    (``env.update(FORGE_X=...)``), and reads with a default inside generated shell
    (``${NAME:-1}``). Shell-local variables of a generated script are none of these."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _ENV_NAME.fullmatch(node.value):
                names.add(node.value)
            # ``{{`` in a str.format template of a script.
            names.update(re.findall(r"\$\{\{?(FORGE_[A-Z0-9_]+):-", node.value))
        elif isinstance(node, ast.keyword) and node.arg and _ENV_NAME.fullmatch(node.arg):
            names.add(node.arg)
    return names


def _env_reads_in_python(path: Path) -> set[str]:
    """FORGE_* names the module reads from its environment: ``os.environ.get("X")``,
    ``os.getenv("X")``, ``os.environ["X"]``, ``"X" in os.environ``. (Tests also set
    variables of their own for the processes they start; those are not knobs.)"""

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ"
        )

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "get" and is_environ(f.value)) or (
                isinstance(f, ast.Attribute) and f.attr == "getenv"
            ):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and _ENV_NAME.fullmatch(key.value):
            names.add(key.value)
    return names


def env_names_in_code() -> dict[str, set[str]]:
    """Variable -> the files that use it: what the packages read or set for a run's
    processes, and what the tests, scripts and CI read."""
    found: dict[str, set[str]] = {}
    packages = [p for d in ("core", "plugins") for p in (REPO / d).rglob("*.py")]
    tests = [p for p in (REPO / "tests").rglob("*.py") if p != Path(__file__).resolve()]
    for paths, collect in ((packages, _env_names_in_python), (tests, _env_reads_in_python)):
        for path in paths:
            for name in collect(path):
                found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    shell = [*(REPO / "scripts").rglob("*.sh"), REPO / ".ci" / "run"]
    for path in shell:
        for name in _ENV_NAME.findall(path.read_text()):
            found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def env_names_in_table(doc: str, heading: str) -> set[str]:
    """``FORGE_X`` of every ``FORGE_X=value`` or ``FORGE_X`` in the tables' first cells."""
    return {m.group(0) for cell in first_cells(section(doc, heading)) if (m := _ENV_NAME.match(cell))}


def documented_env_names() -> set[str]:
    return env_names_in_table("concepts.md", "## Environment variables")


def test_every_environment_variable_is_documented():
    in_code = env_names_in_code()
    known = {"FORGE_PLUGINS", "FORGE_DEBUG", "FORGE_REPLICA", "FORGE_RESTART_DELAY",
             "FORGE_TEST_TIMEOUT_SCALE"}
    assert known <= set(in_code), (
        "the collection missed variables the code is known to read; fix env_names_in_code"
    )
    documented = documented_env_names()
    missing = {name: sorted(files) for name, files in in_code.items() if name not in documented}
    assert not missing, f"FORGE_* variables missing from the table in docs/concepts.md: {missing}"


def test_documented_environment_variables_exist():
    everything = "\n".join(
        p.read_text(errors="replace")
        for d in ("core", "plugins", "tests", "scripts", ".ci")
        for p in (REPO / d).rglob("*")
        if p.is_file() and p.suffix in ("", ".py", ".sh") and p != Path(__file__).resolve()
    )
    stale = {name for name in documented_env_names() if not re.search(rf"\b{name}\b", everything)}
    assert not stale, f"docs/concepts.md documents variables no code reads or sets: {sorted(stale)}"


def test_plugin_switches_are_in_the_hook_reference():
    # The plugin manager's modules (core/forgerl/registry/plugins.py, and any it is split into).
    registry = REPO / "core" / "forgerl" / "registry"
    switches = set().union(*(_env_names_in_python(p) for p in registry.glob("*plugin*.py")))
    assert "FORGE_PLUGINS" in switches
    missing = switches - env_names_in_table("hooks.md", "## Environment switches")
    assert not missing, f"plugin switches missing from docs/hooks.md: {sorted(missing)}"


# ---------------------------------------------------------------------- metric keys


def loop_metric_keys() -> set[str]:
    """Every key core/forgerl/runloop/loop.py puts in a metrics.jsonl row (``<>`` for a computed part),
    with the eval row of core/forgerl/runloop/evaluation.py and the reward component names of
    core/forgerl/rewards/rewarding.py filled into ``reward/<>``."""
    loop = REPO / "core" / "forgerl" / "runloop" / "loop.py"
    train_one, evaluate = function(loop, "train_one"), function(REPO / "core" / "forgerl" / "runloop" / "evaluation.py", "_row")
    keys = dict_literal_keys(train_one) | subscript_keys(train_one, "row") | dict_literal_keys(evaluate)
    keys |= distill_metric_keys()  # the row's objective part (prepared.metrics) under objective: distill
    # the breakdown by mixture source (row.update(per_source_metrics(...)))
    keys |= subscript_keys(function(REPO / "core" / "forgerl" / "runloop" / "reward_metrics.py", "per_source_metrics"), "row")
    components = subscript_keys(function(REPO / "core" / "forgerl" / "rewards" / "rewarding.py", "_combine"), "components")
    assert components, "core/forgerl/rewards/rewarding.py: no reward component keys found"
    if any(k.startswith("reward/") and "<>" in k for k in keys):
        keys |= {"reward/" + c for c in components}
    return keys | sft_loop_metric_keys()


def sft_loop_metric_keys() -> set[str]:
    """Every key a supervised run's loop (core/forgerl/runloop/sft_loop.py) puts in a row, with
    where it is in its data (core/forgerl/sft/data.py)."""
    sft = REPO / "core" / "forgerl" / "sft"
    keys = dict_literal_keys(function(REPO / "core" / "forgerl" / "runloop" / "sft_loop.py", "train_one"))
    for node in ast.walk(ast.parse((sft / "data.py").read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "progress":  # each source's
            keys |= dict_literal_keys(node)
    return keys


def distill_metric_keys() -> set[str]:
    """``METRIC_KEYS`` of core/forgerl/runloop/distill_batch.py, read without importing torch."""
    for node in ast.parse((REPO / "core" / "forgerl" / "runloop" / "distill_batch.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "METRIC_KEYS":
            return set(ast.literal_eval(node.value))
    raise AssertionError("core/forgerl/runloop/distill_batch.py has no METRIC_KEYS")


def algorithm_metric_keys() -> set[str]:
    """``METRIC_KEYS`` of core/forgerl/algorithms/loss.py, read without importing torch."""
    for node in ast.parse((REPO / "core" / "forgerl" / "algorithms" / "loss.py").read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "METRIC_KEYS":
            return set(ast.literal_eval(node.value))
    raise AssertionError("core/forgerl/algorithms/loss.py has no METRIC_KEYS")


def sft_metric_keys() -> set[str]:
    """``METRIC_KEYS`` of core/forgerl/sft/loss.py, read without importing torch."""
    for node in ast.parse((REPO / "core" / "forgerl" / "sft" / "loss.py").read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "METRIC_KEYS":
            return set(ast.literal_eval(node.value))
    raise AssertionError("core/forgerl/sft/loss.py has no METRIC_KEYS")


def fsdp_metric_keys() -> set[str]:
    # The trainers' shared steps (fsdp and torchtitan alike): RL, SFT, and their common end.
    trainer = REPO / "plugins" / "forgerl_plugins" / "trainers" / "shared" / "base.py"
    steps = ("train_step", "_sft_step", "_optimizer_step")
    return set().union(*(subscript_keys(function(trainer, name), "metrics") for name in steps)) | sft_metric_keys()


def documented_metric_keys() -> set[str]:
    return {placeholders(k) for k in re.findall(r"`([^`\s]+)`", section("concepts.md", "## Metrics"))}


def test_every_metric_key_the_loop_writes_is_documented():
    keys = {placeholders(k) for k in loop_metric_keys()}
    assert {"reward/failed", "eval/samples", "reward/<>/<>"} <= keys, keys
    missing = keys - documented_metric_keys()
    assert not missing, f"metric keys missing from the Metrics section of docs/concepts.md: {sorted(missing)}"


def test_every_trainer_metric_key_is_documented():
    algorithm, fsdp = algorithm_metric_keys(), fsdp_metric_keys()
    assert "grad_norm" in fsdp and "loss/policy" in algorithm
    missing = (algorithm | fsdp) - documented_metric_keys()
    assert not missing, f"trainer metric keys missing from docs/concepts.md: {sorted(missing)}"
    in_algorithms_md = set(first_cells(section("algorithms.md", "## 9. Metrics")))
    missing = algorithm - in_algorithms_md
    assert not missing, f"algorithm metric keys missing from docs/algorithms.md §9: {sorted(missing)}"


def test_documented_metric_keys_exist():
    produced = {placeholders(k) for k in loop_metric_keys() | algorithm_metric_keys() | fsdp_metric_keys()}
    tables = section("concepts.md", "## Metrics")
    stale = {placeholders(k) for k in first_cells(tables)} - produced
    assert not stale, f"docs/concepts.md documents metric keys nothing writes: {sorted(stale)}"


# -------------------------------------------------------------------------- flags


def flag_keys_accepted() -> set[str]:
    """The keys ``build_config(flags=...)`` accepts, found by trying every name a flag
    could plausibly have: each config section, each field of a section, each option of
    ``forge run``, and the singular ``reward``."""
    import click
    from pydantic import BaseModel

    from forgerl.cli import run
    from forgerl.configuration.config import RunConfig, build_config
    from forgerl.errors import ConfigError

    candidates = {"reward"} | {p.name for p in run.params if isinstance(p, click.Option)}
    for name, field in RunConfig.model_fields.items():
        candidates.add(name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            candidates |= set(field.annotation.model_fields)
    accepted = set()
    for key in sorted(candidates):
        try:
            build_config(flags={key: "1"})
        except ConfigError as exc:
            if str(exc).startswith(f"unknown flag {key!r}:"):
                continue
        accepted.add(key)
    return accepted


def test_every_flags_key_is_documented():
    accepted = flag_keys_accepted()
    assert {"generator", "rewards", "steps"} <= accepted and "reward" not in accepted, accepted
    documented = set(first_cells(section("embedding.md", "### `flags`")))
    assert documented == accepted, (
        f"docs/embedding.md's flags table: missing {sorted(accepted - documented)}, "
        f"not accepted {sorted(documented - accepted)}"
    )


# ------------------------------------------------------------- run directory, backends


def test_run_directory_files_are_documented():
    from forgerl.checkpoints import checkpoint, checkpoint_format
    from forgerl.rundirs import runs
    from forgerl.runloop import metrics
    from forgerl_plugins.schedulers.local import jobfile
    from forgerl_plugins.serving import launcher
    from forgerl_plugins.transports.common import auth

    files = {
        runs.CONFIG_FILE, runs.SUBMISSION_FILE, runs.METRICS_FILE, runs.SUMMARY_FILE,
        checkpoint_format.LOOP_FILE, checkpoint_format.ARRAYS_FILE, checkpoint.MANIFEST, checkpoint.LATEST,
        jobfile.JOB_FILE, f"logs/{jobfile.EVENT_LOG}", jobfile.CANCEL_FILE,
        auth.SECRET_FILE, f"{launcher.ENDPOINT_DIR}/",
        metrics.DAMAGED_FILE, metrics.RESTART_FILE.format(n="N"),
    }
    text = section("concepts.md", "## Run directories, checkpoints and resume")
    missing = {f for f in files if f not in text}
    assert not missing, f"run-directory files missing from docs/concepts.md: {sorted(missing)}"


def test_builtin_backends_table_matches_the_registry():
    """The table of concepts.md lists every first-party backend, and says which are
    registered without an implementation (selecting one fails)."""
    from forgerl.registry.plugins import build_registry

    registry = build_registry(entry_points=True, disabled=set())
    rows = {}
    for line in section("concepts.md", "## The pieces").splitlines():
        cells = line.split("|")
        if line.startswith("| ") and len(cells) > 3 and not line.startswith("| interface"):
            rows[cells[1].strip().lower()] = cells[3]
    for kind in registry.kinds:
        ours = {n: b for n, b in registry.backends(kind).items() if registry.owner(kind, n).first_party}
        listed = set(re.findall(r"`([\w.-]+)`", rows.get(kind, "")))
        assert listed == set(ours), (kind, sorted(listed), sorted(ours))
        for name, backend in ours.items():
            marked = f"`{name}` (not built yet)" in rows[kind]
            assert marked == (not backend.implemented), f"{kind} {name!r}: implemented={backend.implemented}"


def test_config_reference_is_up_to_date():
    from forgerl.registry.configdoc import render_markdown
    from forgerl.registry.plugins import build_registry

    expected = render_markdown(build_registry(entry_points=True, disabled=set()), third_party=False)
    actual = (DOCS / "config.md").read_text()
    assert actual == expected, (
        "docs/config.md is stale: run `forge config schema --markdown --builtin-only > docs/config.md`"
    )
