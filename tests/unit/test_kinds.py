"""forgerl.configuration.kinds is the one table of backend kinds, their hooks, config fields and flags:
a kind or a flag added in one place and not in the others fails here."""

from __future__ import annotations

import click

from forgerl import hookspecs
from forgerl.backends import BACKEND_KINDS
from forgerl.commands.config import config_show
from forgerl.configuration.config import BackendChoice, RunConfig
from forgerl.configuration.kinds import FLAGS, KINDS, REGISTRATION_HOOKS, SINGLE_BACKEND_FIELDS


def test_every_kind_has_a_record_class_and_a_registration_hook():
    assert set(KINDS) == set(BACKEND_KINDS), (KINDS, sorted(BACKEND_KINDS))
    for kind, hook in REGISTRATION_HOOKS.items():
        spec = getattr(hookspecs, hook, None)
        assert spec is not None, f"{hook} (kind {kind!r}) is not a hook of forgerl.hookspecs"
        returned = str(spec.__annotations__["return"])
        assert BACKEND_KINDS[kind].__name__ in returned, (hook, returned)


def test_no_registration_hook_is_missing_from_the_table():
    registering = {
        name for name in dir(hookspecs)
        if name.startswith("forge_") and "Backend]" in str(getattr(hookspecs, name).__annotations__.get("return"))
    }
    assert registering == set(REGISTRATION_HOOKS.values())


def test_single_backend_fields_are_the_configs_backend_choices():
    choices = {
        name for name, field in RunConfig.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BackendChoice)
    }
    assert set(SINGLE_BACKEND_FIELDS) == choices
    assert set(SINGLE_BACKEND_FIELDS.values()) <= set(KINDS)


def test_flags_are_the_command_lines_named_flags():
    options = {p.name for p in config_show.params if isinstance(p, click.Option)} - {"sets"}
    assert options == set(FLAGS), (sorted(options), FLAGS)
