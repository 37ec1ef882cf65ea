"""A shared generator fleet: vLLM servers started once, serving the LoRA adapters of
several runs on one base model (multi-LoRA).

A fleet lives in a directory of its own, laid out as a run directory is (so the servers
are the ``vllm`` generator's own server role, started by the local scheduler, with
launcher, liveness and restarts unchanged): its ``config.yaml`` (the base model, the
``vllm`` options, the largest adapter rank as ``trainer.options.lora.rank``, which becomes
``--max-lora-rank``), :data:`FLEET_FILE` (what an attaching run checks) and the servers'
endpoint files ``generators/vllm-<replica>.json``.

Start one with ``forge fleet`` (:mod:`forgerl.fleet`, which calls :func:`start` through
the generator class's ``fleet``), and leave it running (Ctrl-C or SIGTERM stops it)::

    forge fleet --dir FLEET --model M --max-adapters 4 --max-rank 16 \\
        [--set generator.options.kv_cache_gb=2 ...]

A run attaches with ``--set generator.options.fleet=FLEET``: it starts no servers, finds
them through the endpoint files, and its adapter is served under a name of its own
(:func:`adapter_name`). The fleet's process owns the servers: a run never stops them;
at its end it unloads its adapter.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext

    from .options import Options

FLEET_FILE = "fleet.json"
#: Seconds the local scheduler gives a server to stop before it is killed.
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class FleetInfo:
    """What a fleet directory says about its servers (:data:`FLEET_FILE`)."""

    directory: Path
    model: str
    replicas: int
    max_adapters: int
    max_rank: int
    #: While the fleet's process runs it: why its servers' job ended (None: it has not).
    outcome: Callable[[], str | None] | None = field(default=None, compare=False, repr=False)

    def ready(self) -> bool:
        """Every server of the fleet has published its endpoint."""
        return endpoints_up(self) >= self.replicas

    def ended(self) -> str | None:
        """Why the fleet's servers stopped for good (restarts spent), or None while they run."""
        return self.outcome() if self.outcome is not None else None


def adapter_name(context: RunContext) -> str:
    """The name a run's adapter is served under in a fleet: one per run directory (a
    resumed run gets its own name back, two runs never share one)."""
    run_dir = Path(context.run_dir).resolve()
    digest = hashlib.sha256(str(run_dir).encode()).hexdigest()[:10]
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in run_dir.name)[:40]
    return f"forge-adapter-{safe}-{digest}"


def read_fleet(directory: str | Path) -> FleetInfo:
    """The fleet in ``directory``; ConfigError (one line) where there is none."""
    path = Path(directory).expanduser()
    where = "generator.options.fleet"
    if not path.is_dir():
        raise ConfigError(f"{where}: {path} does not exist: start the fleet first "
                          f"(forge fleet --dir {path} --model ...)")  # fmt: skip
    try:
        data = json.loads((path / FLEET_FILE).read_text())
        info = FleetInfo(
            path.resolve(), str(data["model"]), int(data["replicas"]), int(data["max_adapters"]), int(data["max_rank"])
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{where}: {path} is not a generator fleet (no readable {FLEET_FILE}: {type(exc).__name__}); "
            "start one there with forge fleet"
        ) from None
    return info


def check_attach(options: Options, context: RunContext) -> FleetInfo:
    """The fleet a run attaches to, after every check that makes attaching safe: the run
    trains an adapter (a full-weight update would change every other run's base model),
    on the fleet's base model, of a rank the servers hold, updated under ``wait``, and the
    fleet's servers have published their endpoints."""
    from .server import endpoint_file

    assert options.fleet is not None
    where = "generator.options.fleet"
    if context.adapter is None:
        raise ConfigError(
            f"{where}: a run attached to a shared fleet must train a LoRA adapter (set trainer.options.lora.rank): "
            "a full-weight update would change the base model every other run of the fleet samples from"
        )
    info = read_fleet(options.fleet)
    if not same_model(info.model, context.model_name):
        raise ConfigError(
            f"{where}: the fleet in {info.directory} serves model {info.model!r}, this run trains {context.model_name!r}: "
            "attach to a fleet of the same base model, or start one for it"
        )
    if context.adapter.rank > info.max_rank:
        raise ConfigError(
            f"{where}: trainer.options.lora.rank {context.adapter.rank} is above the fleet's largest rank "
            f"{info.max_rank}: lower the rank, or start the fleet with --max-rank {context.adapter.rank}"
        )
    if options.update_policy != "wait":
        raise ConfigError(
            f"{where}: generator.options.update_policy {options.update_policy} pauses or aborts the fleet's "
            "servers for every run on them: use wait"
        )
    if options.stage_updates:
        raise ConfigError(f"{where}: generator.options.stage_updates is for full weights: leave it off")
    found = [i for i in range(info.replicas) if endpoint_file(info.directory, i).is_file()]
    if not found:
        raise ConfigError(
            f"{where}: the fleet in {info.directory} has no server endpoint (generators/vllm-*.json): "
            "is its fleet process running?"
        )
    return info


def same_model(a: str, b: str) -> bool:
    """The same model name, or two spellings of one folder."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def endpoints_up(info: FleetInfo) -> int:
    """How many of the fleet's servers have published their endpoint."""
    from .server import endpoint_file

    return sum(endpoint_file(info.directory, i).is_file() for i in range(info.replicas))


# ------------------------------------------------------------------------ starting one


def fleet_config(model: str, *, max_adapters: int, max_rank: int, sets: Sequence[str] = ()) -> Any:
    """The fleet's resolved config: a run config whose generator section says how its
    servers run (``generator.options.max_adapters``) and whose adapter rank is the
    largest any attached run may train."""
    from forgerl.configuration.config import build_config
    from forgerl.configuration.sections import options_dict
    from forgerl.registry.plugins import build_registry
    from forgerl.registry.resolve import resolve

    if Path(model).expanduser().exists():  # a folder: named absolutely, whatever the runs' working directory
        model = str(Path(model).expanduser().resolve())
    base = {
        "model": {"name": model},
        "generator": {"name": "vllm", "options": {"max_adapters": max_adapters}},
    }
    settings = [*sets, f"trainer.options.lora.rank={max_rank}"]
    registry = build_registry()
    config = resolve(build_config(base=base, sets=settings), registry)
    if config.generator.name != "vllm":
        raise ConfigError(f"a fleet's generator is vllm (got generator {config.generator.name!r})")
    if options_dict(config.generator.options).get("fleet") is not None:
        raise ConfigError("a fleet's servers attach to no other fleet: leave generator.options.fleet unset")
    # What `forge run` checks before it starts a server: a model name that cannot be built
    # or found here, vLLM engine arguments its own parser refuses (one line, nothing started).
    from forgerl.runloop.preflight import model_context_length

    model_context_length(config, registry)
    registry.require("generator", "vllm").check_before_run(config.generator.options, runs_here=True)
    return config


def start(
    directory: Path, *, model: str, max_adapters: int, max_rank: int, sets: Sequence[str] = ()
) -> AbstractContextManager[FleetInfo]:
    """The fleet ``forge fleet`` starts: :func:`fleet_config`'s servers, :func:`started` in
    ``directory`` (the config is checked before anything starts)."""
    return started(directory, fleet_config(model, max_adapters=max_adapters, max_rank=max_rank, sets=sets))


@contextmanager
def started(directory: Path, config: Any) -> Iterator[FleetInfo]:
    """The fleet of ``config`` serving from ``directory`` (created), its servers started
    by the local scheduler; stopped when the block ends. A fleet directory holds one fleet."""
    from forgerl.interfaces import RunContext
    from forgerl.registry.plugins import build_registry
    from forgerl.rundirs import runs
    from forgerl.types import JobSpec

    from .server import endpoint_file

    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    # Endpoint files of servers that still run: another fleet's (a killed fleet's files,
    # of servers gone, are left over and replaced).
    if any(_serving(endpoint_file(directory, i)) for i in range(config.generator.options.replicas)):
        raise ConfigError(f"{directory} holds a running fleet: stop that fleet, or choose another --dir")
    runs.write_config(directory, config)
    registry = build_registry()
    context = RunContext.for_run(config, directory)
    roles = [spec for spec, *_ in runs.server_roles(config, registry, context)]
    options = config.generator.options
    assert context.adapter is not None
    info = FleetInfo(directory, config.model.name, options.replicas, options.max_adapters, context.adapter.rank)
    record = {"directory": str(directory), "model": info.model, "replicas": info.replicas,
              "max_adapters": info.max_adapters, "max_rank": info.max_rank}  # what read_fleet reads
    (directory / FLEET_FILE).write_text(json.dumps(record, indent=1))
    scheduler = registry.require("scheduler", "local").build({"stop_timeout": STOP_TIMEOUT})
    try:
        stop, outcome = _supervise(scheduler, JobSpec("forge-fleet", str(directory), tuple(roles)), directory)
    except BaseException:
        (directory / FLEET_FILE).unlink(missing_ok=True)
        raise
    try:
        yield replace(info, outcome=outcome)
    finally:
        stop()
        (directory / FLEET_FILE).unlink(missing_ok=True)


def _serving(endpoint: Path) -> bool:
    """The server of endpoint file ``endpoint`` still runs."""
    import os

    try:
        pid = int(json.loads(endpoint.read_text())["pid"])
        os.kill(pid, 0)
    except PermissionError:
        return True  # another user's process
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no file, no pid in it, or no such process
    return True


def _supervise(
    scheduler: Any, job: Any, directory: Path
) -> tuple[Callable[[], None], Callable[[], str | None]]:
    """Submit ``job`` from a thread that then waits on it (the local scheduler's children
    die with the thread that started them); returns what stops it, and what says why the
    job ended (None while it runs)."""
    submitted = threading.Event()
    failed: list[BaseException] = []
    ended: list[str] = []

    def supervise() -> None:
        try:
            handle = scheduler.submit(job)
        except BaseException as exc:  # noqa: BLE001 - raised by the caller below
            failed.append(exc)
            return
        finally:
            submitted.set()
        status = scheduler.wait(handle)
        ended.append(status.detail or f"its servers' job ended: {status.state.value}")

    thread = threading.Thread(target=supervise, name="forge-fleet", daemon=True)
    thread.start()
    submitted.wait()
    if failed:
        raise failed[0]

    def stop() -> None:
        scheduler.cancel(str(directory))
        thread.join(STOP_TIMEOUT * 6)

    return stop, lambda: ended[0] if ended else None
