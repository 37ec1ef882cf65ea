"""Documentation that must not drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

from forgerl import hookspecs

DOCS = Path(__file__).resolve().parents[2] / "docs"


def hook_names() -> set[str]:
    return {name for name in dir(hookspecs) if name.startswith("forge_")}


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


def test_config_reference_is_up_to_date():
    from forgerl.configdoc import render_markdown
    from forgerl.plugins import build_registry

    expected = render_markdown(build_registry(entry_points=True, disabled=set()), third_party=False)
    actual = (DOCS / "config.md").read_text()
    assert actual == expected, (
        "docs/config.md is stale: run `forge config schema --markdown --builtin-only > docs/config.md`"
    )
