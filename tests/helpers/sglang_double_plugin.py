"""A plugin for tests: the sglang generator, unchanged, registered as ``sglang_double``
without its requirement on the ``sglang`` package, with its servers started from the
test double (tests/helpers/sglang_double.py) instead of ``sglang.launch_server``.

Tests pass ``generator.options.launch_command = DOUBLE_COMMAND``; everything else (the
role, the launcher, the client, the weight updates) is the real plugin's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from forgerl.backends import GeneratorBackend
from forgerl.hookspecs import hookimpl

DOUBLE_COMMAND = [sys.executable, str(Path(__file__).with_name("sglang_double.py"))]


@hookimpl
def forge_generators():
    return [
        GeneratorBackend(
            name="sglang_double",
            factory="forgerl_plugins.generators.sglang.generator:SGLangGenerator",
            roles="forgerl_plugins.generators.sglang.server:roles",
            serve="forgerl_plugins.generators.sglang.server:serve",
            options="forgerl_plugins.generators.sglang.generator:SGLangGenerator.Options",
            description="the sglang generator against the SGLang test double (tests only)",
        )
    ]
