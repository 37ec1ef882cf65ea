"""What ``forge run`` checks after the config validates and before anything exists.

Validation sees only the config; these checks look at the world it names, cheaply, so
that a mistake is one line with exit status 2 *before* the run directory is created or a
process starts (and not a traceback in a trainer log a minute later):

* the output location: no run there yet, and a writable directory can be created;
* the model: a named model's backend can build it here, into a usable cache directory; a
  run named as the model has a usable checkpoint that its trainer can export; a
  local folder exists and has a config.json; any other name reads as a hub id
  ``owner/name`` (a bare word is a typo: the close named model is suggested);
  ``loop.sampling.max_tokens`` is below the model's context length;
* on ``--resume``, at least one of the run's checkpoints is usable;
* under ``objective: distill``, teacher and student share one tokenizer (the same vocabulary
  and special tokens: the teacher scores the student's token ids);
* every backend's own ``preflight`` (the ``file`` task: its files exist, are readable and
  have the configured fields), and its ``local_preflight`` where the scheduler starts the
  processes on this machine (``runs_here``: NCCL or MPI exist where asked for, a reward's
  ``auth_env`` is set);
* the scheduler's ``check_job``, where it has one (the local scheduler: the job's
  processes fit this machine's cores and GPUs).

Files are only looked at where the scheduler's processes see this machine's files (a
scheduler may say otherwise with ``shares_filesystem = False``, as a Kubernetes cluster's
pods do not).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import ConfigError
from forgerl.rundirs import runs

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.configuration.config import RunConfig
    from forgerl.interfaces import Scheduler
    from forgerl.registry.plugins import Registry
    from forgerl.types import JobSpec

#: config.json keys that hold a model's context length, in the order transformers uses them.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def check_run(
    config: RunConfig,
    registry: Registry,
    scheduler: Scheduler,
    job: JobSpec,
    *,
    run_dir: Path,
    fresh: bool,
) -> None:
    """Raise a one-line UserError for anything that would make the run fail to start."""
    from forgerl.configuration import needs
    from forgerl.configuration.kinds import SINGLE_BACKEND_FIELDS
    from forgerl.sft.preflight import check_before_run

    if fresh:
        runs.check_output_location(run_dir)
    if needs.uses_trainer(config):
        check_objective(config, registry)
    local_files = scheduler.shares_filesystem
    context = model_context_length(config, registry, local_files=local_files)
    max_tokens = config.loop.sampling.max_tokens
    sampling = needs.uses_generator(config)
    if context is not None and sampling and max_tokens >= context:
        raise ConfigError(
            f"loop.sampling.max_tokens ({max_tokens}) must be below the context length of model "
            f"{config.model.name!r} ({context} tokens): the prompt needs room too"
        )
    if context is not None and config.objective == "sft" and config.sft.max_length > context:
        raise ConfigError(
            f"sft.max_length ({config.sft.max_length}) is beyond the context length of model {config.model.name!r} "
            f"({context} tokens): set sft.max_length={context} or less"
        )
    if sampling:
        check_adapter_served(config, registry)
    check_reward_sources(config, registry)
    check_before_run(config, registry, local_files=local_files)
    if local_files:
        if not fresh:
            check_checkpoints(run_dir, keep=config.checkpoint.keep)
        # What the run does not build (a supervised run: no generator, maybe no task) is not checked.
        built = {"generator": sampling, "transport": sampling, "task": needs.uses_task(config),
                 "trainer": needs.uses_trainer(config)}  # fmt: skip
        choices = [(kind, getattr(config, field)) for field, kind in SINGLE_BACKEND_FIELDS.items()
                   if built.get(field, True)]  # fmt: skip
        if sampling:
            choices += [("reward", reward) for reward in config.rewards]
        if sampling and config.environment.name is not None:
            choices.append(("environment", config.environment))
        if config.objective == "distill":
            choices.append(("teacher", config.distill.teacher))
        for kind, choice in choices:
            assert choice.name is not None, "an environment without a name is not a choice"
            registry.get(kind, choice.name).check_before_run(choice.options, runs_here=scheduler.runs_here)
        if config.objective == "distill":
            from forgerl.distill.tokenizers import check_teacher_tokenizer

            check_teacher_tokenizer(config, registry)
    check_job = getattr(scheduler, "check_job", None)
    if check_job is not None:
        check_job(job)


def check_objective(config: RunConfig, registry: Registry) -> None:
    """The trainer trains the run's objective (:attr:`forgerl.interfaces.Trainer.objectives`;
    a trainer class that does not say trains ``grpo`` only)."""
    name = config.trainer.name
    trainer = registry.require("trainer", name).load_factory()
    objectives = getattr(trainer, "objectives", frozenset({"grpo"}))
    # A trainer lists the losses it computes; distillation trains the policy loss (grpo's)
    # on per-token advantages, which every trainer's kit checks.
    loss = batch_objective(config.objective)
    if loss not in objectives:
        raise ConfigError(
            f"objective {config.objective} is not one the {name} trainer trains ({', '.join(sorted(objectives))}): "
            "use --trainer fsdp or torchtitan, or another objective"
        )


def batch_objective(objective: str) -> str:
    """The loss a run's ``objective`` trains (:attr:`forgerl.types.TrainBatch.objective`):
    ``sft`` for supervised runs, the policy loss (``grpo``) for GRPO and distillation."""
    return "sft" if objective == "sft" else "grpo"


def check_adapter_served(config: RunConfig, registry: Registry) -> None:
    """A trainer that trains a LoRA adapter sends only the adapter: the generator must
    serve it on the base model (``serves_adapters``)."""
    from forgerl.interfaces import trained_adapter

    if trained_adapter(config) is None:
        return
    name = config.generator.name
    generator = registry.require("generator", name).load_factory()
    if not getattr(generator, "serves_adapters", False):
        raise ConfigError(
            f"trainer.options.lora trains a LoRA adapter, which the {name} generator cannot serve: "
            "use --generator vllm, hf or sglang, or remove trainer.options.lora"
        )


def model_context_length(config: RunConfig, registry: Registry, *, local_files: bool = True) -> int | None:
    """The model's context length where it can be known without building or fetching it;
    raises for a named model that cannot be built here and for a bad local folder."""
    from forgerl.models.resolve import _looks_like_path, check_cache_dir, check_hub_id, resolve_model

    name = config.model.name
    if name in registry.backends("model"):
        backend = registry.require("model", name)  # BackendUnavailable names the install step
        if local_files:
            check_cache_dir()
        length = backend.info.get("context_length")
        return length if _positive_int(length) else None
    if not local_files:
        return None
    from forgerl.models import from_run as run_model

    found = run_model.find(name)
    if found is not None:  # another run's weights: its model's length, nothing exported yet
        source = run_model.run_config(found)
        run_model.exporting_trainer(found, source, registry)
        return model_context_length(source, registry, local_files=local_files)
    try:
        is_local = Path(name).expanduser().exists() or _looks_like_path(name)
    except (OSError, ValueError) as exc:  # a name too long for a path, a NUL byte
        raise ConfigError(f"model {name[:80]!r} is neither a named model nor a usable path ({exc})") from None
    if not is_local:
        check_hub_id(name, registry)
        return None  # a hub id: fetched, and checked, when the run starts
    folder = resolve_model(config.model, registry)  # a local folder: no network
    return folder_context_length(folder)


def check_checkpoints(run_dir: Path, *, keep: int) -> None:
    """On resume: the trainer would start from the newest usable checkpoint; when the run
    has checkpoints and none of them is usable, say so now (one line naming each and why)
    instead of in the trainer's log after every process has started. Only the forgerl part
    (manifest, sizes, loop state) is checked here; the trainer's own files load later."""
    from forgerl.checkpoints import checkpoint
    from forgerl.errors import CheckpointError

    found = checkpoint.checkpoints(run_dir)
    for path in found:
        try:
            checkpoint.load(path)
            return
        except CheckpointError:
            continue
    if found:
        checkpoint.latest(run_dir, keep)  # raises CheckpointUnusable with every reason


def folder_context_length(folder: Path) -> int | None:
    """The context length a model folder's config.json gives, if any."""
    return _context_length(folder / "config.json")


def _context_length(path: Path) -> int | None:
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model folder: {path} is not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model folder: {path} is not a JSON object")
    for section in (data, data.get("text_config")):
        if isinstance(section, dict):
            for key in CONTEXT_KEYS:
                if _positive_int(section.get(key)):
                    return section[key]
    return None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_reward_sources(config: RunConfig, registry: Registry) -> None:
    """Rewards that name ``sources`` name sources of the task (a mixture), and every source
    of a mixture has a reward: a problem no reward scores would train on nothing."""
    from forgerl.interfaces import Task

    env_sources = config.environment.sources if config.environment.name is not None else None
    if all(c.sources is None for c in config.rewards) and env_sources is None:
        return  # every reward scores every problem, the environment (if any) runs them all
    backend = registry.require("task", config.task.name)
    factory = backend.load_factory()
    sources = None
    if isinstance(factory, type) and issubclass(factory, Task):
        sources = factory.source_names(backend.validate_options(config.task.options))
    if env_sources is not None:
        _check_named_sources("environment.sources", env_sources, sources, config.task.name)
    for i, choice in enumerate(config.rewards):
        if choice.sources is None:
            continue
        _check_named_sources(f"rewards.{i}.sources", choice.sources, sources, config.task.name)
    if sources is None:
        return
    # A source played by an environment that scores its trajectories needs no reward.
    env_scored = set(env_sources or sources) if _environment_scores(config, registry) else set()
    for source in sources:
        if source in env_scored:
            continue
        if not any(c.sources is None or source in c.sources for c in config.rewards):
            raise ConfigError(
                f"no reward scores source {source!r} of task {config.task.name!r}: add one with "
                f"sources: [{source}], or one without sources"
            )


def _environment_scores(config: RunConfig, registry: Registry) -> bool:
    from forgerl.registry.resolve import scores_itself

    if config.environment.name is None:
        return False
    return scores_itself(registry.require("environment", config.environment.name).load_factory())


def _check_named_sources(where: str, named: list[str], sources: list[str] | None, task: str) -> None:
    """``named`` (a reward's or the environment's ``sources``) are sources of the task."""
    if sources is None:
        raise ConfigError(
            f"{where} names sources ({', '.join(named)}), but task {task!r} mixes none; sources are "
            "those of a mixture task (docs/data.md)"
        )
    unknown = [s for s in named if s not in sources]
    if unknown:
        raise ConfigError(f"{where}: task {task!r} has no source {unknown[0]!r}; its sources: {', '.join(sources)}")
