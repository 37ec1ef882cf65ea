"""What every server role runs: ``python -m forgerl.server_role --run-dir DIR --role NAME``.

A generator or reward that needs servers beside the trainer (vLLM replicas, a served
reward model) declares them as roles (``roles(options, *, context)``, each command made by
:func:`forgerl.rundirs.runs.server_role_command`). The scheduler starts every replica of a role
with this command and ``FORGE_REPLICA`` set. It loads the run's config once
(:func:`forgerl.rundirs.runs.load_config`: every backend's options validated into its model),
finds the backend whose ``roles`` declares ``NAME`` (the generator, or one of the rewards;
rewards that share a server share its role), builds the run's :class:`RunContext` and
calls the backend's ``serve(options, *, context, role, replica)``, whose return value is
the exit status (the scheduler restarts a replica that fails, up to its ``max_restarts``).

A generator's servers serve the policy: they get its local folder as ``context.model_path``,
prepared here as the trainer prepares it. A reward's server serves a model of its own
options (``context.model_path`` is None). Exit status 2 with one line on stderr: a mistake
the user can fix (no backend of the run declares the role, a config that does not load).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from forgerl.configuration.env import debug_enabled
from forgerl.errors import ConfigError, ForgeError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forgerl.server_role")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--role", required=True, help="the role's name, as the backend's roles() gives it")
    parser.add_argument(
        "--replica", type=int, default=None, help="replica index (default: $FORGE_REPLICA, else 0)"
    )
    args = parser.parse_args(argv)
    replica = args.replica if args.replica is not None else int(os.environ.get("FORGE_REPLICA", "0"))
    try:
        return serve_role(args.run_dir.resolve(), args.role, replica)
    except ForgeError as exc:
        if not exc.user_fixable or debug_enabled():
            raise
        print(f"forge {args.role}: error: {exc}", file=sys.stderr, flush=True)
        return 2


def serve_role(run_dir: Path, role: str, replica: int) -> int:
    """Run replica ``replica`` of server role ``role`` of the run in ``run_dir``; its exit status."""
    from forgerl import events
    from forgerl.deprecation import ForgeDeprecationWarning
    from forgerl.interfaces import RunContext
    from forgerl.models.resolve import resolve_model
    from forgerl.registry.plugins import build_registry
    from forgerl.rundirs import runs

    # A plugin's use of a deprecated name goes to this replica's log: say it where the user looks.
    events.forward_warnings(ForgeDeprecationWarning, run_dir=run_dir)
    registry = build_registry()
    config = runs.load_config(run_dir, registry)
    context = RunContext.for_run(config, run_dir)
    owners = [(backend, choice) for spec, backend, choice, _ in runs.server_roles(config, registry, context)
              if spec.name == role]  # fmt: skip
    if not owners:
        raise ConfigError(
            f"no backend of the run in {run_dir} declares a server role {role!r} "
            f"(its {runs.CONFIG_FILE} changed since the job was made?)"
        )
    # Rewards that share a role declare it alike (runs.build_job checks): the first serves it.
    backend, choice = owners[0]
    if backend.kind == "generator":
        # Events say who they come from (<role>-<replica>): the message need not.
        with events.phase(f"preparing model {config.model.name}", stage="model",
                          key=f"model:{config.model.name}", run_dir=run_dir):  # fmt: skip
            model_path = resolve_model(config.model, registry)
        context = RunContext.for_run(config, run_dir, model_path=model_path)
    return backend.serve_role(choice.options, context=context, role=role, replica=replica)


if __name__ == "__main__":
    sys.exit(main())
