"""Shared by the vLLM benchmarks: the plugin's servers for a config, on this machine.

``plugin_servers(config, run_dir)`` starts the ``vllm`` server role with the local
scheduler (exactly what ``forge run`` starts), connects a :class:`VLLMGenerator` with the
config's transport (built from the registry, as the trainer's rank 0 builds it), and
stops everything on exit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def plugin_servers(config: Any, run_dir: Path, model_dir: Path) -> Iterator[tuple[Any, Any]]:
    """Yields ``(generator, transport sender)`` for servers started from ``config``."""
    from forgerl.interfaces import RunContext
    from forgerl.registry.plugins import build_registry
    from forgerl.rundirs import runs
    from forgerl.types import JobSpec
    from forgerl_plugins.generators.vllm.generator import VLLMGenerator
    from forgerl_plugins.generators.vllm.server import roles
    from forgerl_plugins.schedulers.local.scheduler import LocalScheduler

    run_dir.mkdir(parents=True, exist_ok=True)
    runs.write_config(run_dir, config)
    options = VLLMGenerator.Options.model_validate(config.generator.options)
    job = JobSpec(
        "vllm-bench", str(run_dir), tuple(roles(options, context=RunContext.for_run(config, run_dir)))
    )
    scheduler = LocalScheduler(LocalScheduler.Options(stop_timeout=10))
    started = threading.Event()

    def supervise() -> None:  # children die with the thread that started them
        handle = scheduler.submit(job)
        started.set()
        scheduler.wait(handle)

    thread = threading.Thread(target=supervise, daemon=True)
    thread.start()
    started.wait(30)
    ctx = RunContext.for_run(config, run_dir, model_path=model_dir)
    transport = build_registry().require("transport", config.transport.name).build(
        config.transport.options, context=ctx
    )
    generator = sender = None
    try:
        generator = VLLMGenerator(options, context=ctx, transport=transport)
        sender = transport.sender()
        yield generator, sender
    finally:
        if generator is not None:
            generator.close()
        if sender is not None:
            sender.close()
        transport.close()
        scheduler.cancel(str(run_dir))
        thread.join(60)


def resolved_config(model: str, sets: list[str], transport: str = "shm") -> Any:
    from forgerl.configuration.config import build_config
    from forgerl.registry.plugins import build_registry
    from forgerl.registry.resolve import resolve

    flags = {"model": model, "generator": "vllm", "transport": transport}
    return resolve(build_config(flags=flags, sets=sets), build_registry())


def model_folder(config: Any) -> Path:
    from forgerl.models.resolve import resolve_model
    from forgerl.registry.plugins import build_registry

    return resolve_model(config.model, build_registry())
