"""The interfaces every backend implements.

Each is a small abstract class: the methods forgerl really calls, and nothing else. A
backend is a class implementing one of them plus a record (see :mod:`forgerl.backends`)
that names it and says how to build it. How each kind is built (its validated options
model, then named runtime arguments such as the :class:`RunContext`) is the build
contract of :mod:`forgerl.contract`.

What a caller may use only when the backend says it can is a capability flag on the class
(``Scheduler.supports_logs``), checked before the call; nothing here raises
NotImplementedError at run time.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from forgerl.errors import NotSupported, SchedulerError, TransportError
from forgerl.types import (
    Completion,
    GenerationRequest,
    JobHandle,
    JobSpec,
    JobStatus,
    Problem,
    RewardInput,
    RewardResult,
    TrainBatch,
    WeightSet,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from typing_extensions import Self

    from forgerl.adapters import LoraOptions
    from forgerl.algorithms.config import AlgorithmConfig
    from forgerl.configuration.config import RunConfig
    from forgerl.configuration.sections import SamplingConfig


@dataclass(frozen=True)
class RunContext:
    """The facts of the run a backend may use: where it lives, which model, which rank,
    and the few run-wide settings a backend cannot do without. A backend reads its own
    options and these facts, never another section of the run config.

    ``model_path`` is a local Hugging Face folder (resolved by the core before backends
    are built), ``model_name`` the model as the config names it (a named model, a folder,
    a hub id). ``rank``/``world_size`` describe this process among the trainer ranks.
    ``seed`` is the run's seed, ``dtype`` the model's (``float32`` | ``bfloat16``),
    ``transport_timeout`` the seconds a weight transfer may take, ``temperature`` the
    sampling temperature (the trainer's logprobs are taken at it), ``sampling`` the run's
    sampling settings (:class:`~forgerl.configuration.sections.SamplingConfig`: a generator that
    cannot honour one refuses it when built), ``algorithm`` the loss settings
    (:class:`~forgerl.algorithms.config.AlgorithmConfig`, for trainers) and ``max_staleness``
    how many policy versions a sample may lag (0: generation and training take turns, so a
    generator's servers may use every core while the trainer waits). ``adapter`` is the
    LoRA adapter the trainer trains (:class:`~forgerl.adapters.LoraOptions`, from the
    trainer's ``lora`` option; None: it trains every weight): what the weight versions
    hold, so a generator serves them as an adapter.
    Other backends a backend works with (a generator's transport) are build arguments of
    their own (:mod:`forgerl.contract`), not part of the context. Build one for a run with
    :meth:`for_run`.

    ``config`` (the whole run config, plugin API before 1.0) is deprecated: it still
    answers in a context built by :meth:`for_run`, with a warning naming the facts to read
    instead (:mod:`forgerl.deprecation`).
    """

    run_dir: Path
    model_path: Path | None = None
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    dtype: str = "float32"
    transport_timeout: float = 120.0
    temperature: float = 1.0
    sampling: SamplingConfig | None = None
    algorithm: AlgorithmConfig | None = None
    model_name: str = ""
    max_staleness: int = 0
    adapter: LoraOptions | None = None
    #: The run's config, kept only for the deprecated :attr:`config` (not a fact to read).
    _config: RunConfig | None = field(default=None, repr=False, compare=False)

    @property
    def config(self) -> RunConfig:
        """Deprecated: the run's config (what plugins read before the context carried the
        run's facts). Kept for one release, with a warning naming the plugin."""
        if self._config is None:
            # __getattr__ says why, in one line (an AttributeError here always reaches it).
            raise AttributeError("config")
        from forgerl.deprecation import warn_deprecated

        warn_deprecated("RunContext.config")
        return self._config

    def __getattr__(self, name: str) -> Any:
        # Only for names normal lookup did not find: a removed one is refused in one line
        # (a PluginAPIError, itself an AttributeError: getattr(ctx, name, default) still works).
        from forgerl.deprecation import SINCE, removed

        if name == "config":
            reason = f"deprecated since {SINCE} and unset in a context not built by RunContext.for_run"
            raise removed("RunContext.config", reason=reason)
        if name == "extras":
            raise removed("RunContext.extras")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def for_run(
        cls, config: RunConfig, run_dir: Path, *, model_path: Path | None = None, rank: int = 0, world_size: int = 1
    ) -> RunContext:
        """The context of a run with ``config``: its facts, taken from their sections once."""
        return cls(
            run_dir=Path(run_dir),
            model_path=model_path,
            rank=rank,
            world_size=world_size,
            seed=config.loop.seed,
            dtype=config.model.dtype,
            transport_timeout=float(config.transport.timeout),
            temperature=float(config.loop.sampling.temperature),
            sampling=config.loop.sampling,
            algorithm=config.algorithm,
            model_name=config.model.name,
            max_staleness=config.loop.max_staleness,
            adapter=trained_adapter(config),
            _config=config,
        )


def trained_adapter(config: RunConfig) -> LoraOptions | None:
    """The LoRA adapter the run's trainer trains: its options' ``lora`` field when that
    is a :class:`~forgerl.adapters.LoraOptions` (the one description every trainer that
    trains adapters takes), else None."""
    from forgerl.adapters import LoraOptions

    lora = getattr(config.trainer.options, "lora", None)
    return lora if isinstance(lora, LoraOptions) else None


#: The format of :meth:`Transport.describe`'s description, and its version.
TRANSPORT_FORMAT, TRANSPORT_VERSION = "forgerl.transport", 1


def describe_transport(transport: Any, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Record how ``transport`` was built, for :meth:`Transport.describe` (an object that
    takes no attributes, e.g. with ``__slots__``, keeps none); returns the description."""
    description = {"format": TRANSPORT_FORMAT, "version": TRANSPORT_VERSION, "name": name, "options": options}
    try:
        transport._forge_description = description
    except AttributeError:
        pass
    return description


class Closeable:
    def close(self) -> None:
        """Release processes, ports, memory. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Task(abc.ABC):
    """Where prompts and reference answers come from.

    Called on trainer rank 0 only. ``next_problems`` must be deterministic given the
    seed and the state restored by :meth:`load_state_dict` (exact resume relies on it).
    """

    @abc.abstractmethod
    def next_problems(self, n: int) -> list[Problem]:
        """The next ``n`` training problems (cycling through the data as needed)."""

    @abc.abstractmethod
    def eval_problems(self) -> list[Problem]:
        """The held-out split, the same list every call."""

    def state_dict(self) -> dict[str, Any]:
        """Position in the data and RNG state, JSON-serialisable."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027 - optional, like state_dict
        """Restore what :meth:`state_dict` returned."""

    def demonstration(self, problem: Problem) -> str | list[dict[str, Any]] | None:
        """A worked answer to ``problem`` (one of this task's), for supervised fine-tuning
        (``sft.task_demonstrations``, docs/sft.md): the assistant's reply as a string, or
        the messages that continue the problem's prompt (assistant turns, with
        ``tool_calls`` and the ``tool`` messages answering them), or None for a problem it
        cannot demonstrate (skipped). Optional: a run asks only a task whose class
        overrides it (:meth:`gives_demonstrations`), on trainer rank 0, for problems drawn
        with :meth:`next_problems`; what it returns is checked like a row of a data file."""
        return None

    @classmethod
    def gives_demonstrations(cls) -> bool:
        """Whether the class overrides :meth:`demonstration`."""
        return cls.demonstration is not Task.demonstration

    @classmethod
    def source_names(cls, options: Any) -> list[str] | None:
        """The sources a task with these (validated) options mixes, or None for a task that
        is not a mixture (the default). Called by ``forge run`` before a run starts, to check
        the rewards' ``sources`` (docs/data.md); a mixture tags each problem with its source
        under :data:`forgerl.types.SOURCE_KEY`. Added after 0.2.0 (plugin API 1.1)."""
        return None


class Generator(Closeable, abc.ABC):
    """Prompts → completions with token ids and per-token sampling logprobs.

    Called from trainer rank 0 (a rollout thread with its own event loop). May raise
    :class:`~forgerl.errors.GeneratorError` (or ``GeneratorUnreachable`` when no replica
    answers). The loop does not watch a generator's health: a generator with several
    replicas retries a failed request on another one and keeps a failed replica out of
    service itself, and one whose engine is gone raises from :meth:`generate`.
    """

    #: Whether :meth:`update_weights` can load new weights. False for a generator that
    #: serves fixed weights (a hosted OpenAI-compatible server): the loop then never calls
    #: it, warns once at run start that every rollout comes from the initial weights
    #: (training is off-policy), and trains on all its samples, whatever their version.
    receives_weights: ClassVar[bool] = True
    #: Whether it serves a LoRA adapter on its base model when the trainer trains one
    #: (``context.adapter``): the versions it receives then hold only the adapter's tensors,
    #: under PEFT's names. ``forge run`` refuses a LoRA trainer with a generator without it.
    serves_adapters: ClassVar[bool] = False
    #: Whether requests may carry images (:attr:`GenerationRequest.images`). The loop never
    #: sends one with images to a generator without it: the sample fails in one line
    #: instead, so no image is ever dropped silently (docs/vision.md).
    accepts_images: ClassVar[bool] = False

    @abc.abstractmethod
    async def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        """``requests[i].n`` completions for each request, in request order."""

    @abc.abstractmethod
    def update_weights(self, version: int) -> None:
        """Receive weight version ``version`` through the transport the generator was
        built with (its ``transport`` build argument) and load it.

        Called while the transport's sender sends that version (possibly concurrently,
        in another thread). After it returns every new completion reports ``version``.
        Raises :class:`~forgerl.errors.TransportError` on failure or timeout; the
        generator then keeps serving the last complete version. Never called when
        :attr:`receives_weights` is False.
        """

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """The weight version currently served."""


class Trainer(Closeable, abc.ABC):
    """Optimises the policy. SPMD: every trainer rank calls every method, in the same order.

    The train/inference logprob gap is a metric of :meth:`train_step` (``logprob_gap/*``
    from :func:`forgerl.algorithms.policy_loss`, given the batch's behaviour logprobs): the
    loss's own forward pass computes the trainer's logprobs, so no separate pass is asked for.
    """

    #: The losses :meth:`train_step` computes (:attr:`TrainBatch.objective`): ``"grpo"``
    #: (the policy loss, which runs of ``objective`` grpo and distill train) for every
    #: trainer unless its class says more (the built-in ones add ``"sft"``). ``forge run``
    #: refuses, before launch, a run whose loss its trainer lacks.
    objectives: ClassVar[frozenset[str]] = frozenset({"grpo"})
    #: Whether :meth:`export_checkpoint` can write the policy of one of its checkpoints as
    #: a Hugging Face model folder (``forge export``; a run named as another run's model).
    exports_checkpoints: ClassVar[bool] = False
    #: Whether batches may carry prompt images (:attr:`TrainBatch.images`). ``forge run``
    #: refuses images for a trainer without it (docs/vision.md).
    accepts_images: ClassVar[bool] = False

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on ``batch`` (each rank passes the same full batch; the
        trainer splits it across ranks and micro-batches). Returns metrics (same on all
        ranks), including the algorithm's metrics. ``batch.objective`` is one of
        :attr:`objectives`."""

    @abc.abstractmethod
    def export_weights(self, version: int) -> WeightSet | None:
        """Full weights under Hugging Face names; a WeightSet on rank 0, None elsewhere."""

    @abc.abstractmethod
    def save(self, path: Path) -> None:
        """Save model and optimiser state under ``path`` (a directory; all ranks call)."""

    @abc.abstractmethod
    def load(self, path: Path) -> None:
        """Load what :meth:`save` wrote."""

    @classmethod
    def export_checkpoint(cls, state: Path, output: Path, *, options: Any, model_path: Path, dtype: str) -> None:
        """Write the policy that ``state`` holds (a folder :meth:`save` wrote, read in this
        one process, without building a trainer) as a plain Hugging Face model folder in
        ``output`` (an existing, empty folder): config, safetensors weights and the
        tokenizer of ``model_path``, the run's base model, in ``dtype``; a LoRA adapter
        merged into the weights. ``options`` are the trainer options of the run that saved
        it (validated). Called only when :attr:`exports_checkpoints` is True, when a run
        names another run as its model (``--model runs/NAME``). Raises CheckpointUnusable
        for a state it cannot read."""
        raise NotSupported(f"the {cls.__name__} trainer cannot export its checkpoints as a model")


class Reward(abc.ABC):  # noqa: B024 - score or ascore, checked when built (see below)
    """Scores a finished sample.

    Implement :meth:`score` (blocking; the core runs it in a worker process, built there
    from the backend's name and options, and kills that process on timeout) or override
    :meth:`ascore` (run on the event loop; it must not block). Return a float or a
    :class:`RewardResult`. Raising is allowed: the core scores that sample as failed and
    the run goes on. A reward that implements neither is refused when it is built.
    """

    def score(self, sample: RewardInput) -> float | RewardResult:
        raise TypeError(f"{type(self).__name__} implements neither score nor ascore")

    async def ascore(self, sample: RewardInput) -> float | RewardResult:
        return await asyncio.to_thread(self.score, sample)

    async def until_ready(self) -> None:
        """Awaited before each sample's timeout starts, in the trainer's process (not for
        rewards the core runs in worker processes): return once the reward can score. A
        reward served by a server that is being restarted waits here for it, so that the
        samples meanwhile are not failed by ``loop.reward_timeout``; it must bound the wait
        itself, and raises to fail the sample. Default: at once."""
        return None

    @classmethod
    def implements_scoring(cls) -> bool:
        """Whether the class overrides :meth:`score` or :meth:`ascore`."""
        return cls.score is not Reward.score or cls.ascore is not Reward.ascore


class TransportSender(Closeable, abc.ABC):
    """The trainer-side half of a transport (trainer rank 0)."""

    #: Bytes the last :meth:`send` moved (a tensor under two names counted as the
    #: transport sends it); the loop reports it per step as ``sync/bytes``. None: this
    #: sender does not count them (the metric is then left out).
    last_send_bytes: int | None = None

    @abc.abstractmethod
    def send(self, weights: WeightSet, timeout: float | None = None) -> None:
        """Make ``weights`` available to every receiver. Returns when delivered (or
        published, for pull-based transports). Raises TransportTimeout naming the
        receivers that did not complete."""


class TransportReceiver(Closeable, abc.ABC):
    """The generator-side half, living inside the generator's workers."""

    @abc.abstractmethod
    def receive(self, version: int, timeout: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Named tensors of ``version`` (complete, never partial). Raises
        TransportTimeout when it does not arrive in time."""

    @abc.abstractmethod
    def latest_version(self) -> int | None:
        """The newest version the sender has made available, or None before the first.
        A worker that starts late (a restarted generator) asks for this version instead
        of waiting for one that has already gone by. Does not block for long."""

    def seed_from(self, model_path: Path) -> None:
        """The generator loaded the Hugging Face folder ``model_path`` at start (version 0
        of the run). A transport that sends what changed against a base the receiver holds
        may read its first base there; the default ignores it. Generators call it once,
        before the first ``receive``. Since plugin API 1.3."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor an engine is about to receive: its Hugging Face name, its dtype as torch
    names it without the ``torch.`` prefix (``bfloat16``), and its shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class EngineReceiver(Closeable, abc.ABC):
    """A receiver whose engine takes the weights itself (SGLang loads a folder, or joins a
    process group and receives broadcasts, through its own HTTP API).

    The generator holds this handle in the process it was built in (trainer rank 0, beside
    the sender: it is built from the transport object the generator was given) and tells
    its engine what to do; the transport moves the bytes. One handle per engine instance:
    a restarted engine gets a new one. Which kinds a transport builds is
    :attr:`Transport.engine_receivers`; the two kinds are :class:`FilesEngineReceiver` and
    :class:`BroadcastEngineReceiver`. The transport contract holds for them as for
    :class:`TransportReceiver` (never partial, timeouts everywhere; ``send`` names an
    engine receiver that did not take a version, for a transport that waits for its
    receivers).
    """

    #: ``"files"`` or ``"broadcast"``.
    kind: ClassVar[str] = ""

    @abc.abstractmethod
    def latest_version(self) -> int | None:
        """The newest version the sender has made available, or None (as
        :meth:`TransportReceiver.latest_version`)."""


class FilesEngineReceiver(EngineReceiver):
    """An engine that loads a folder of safetensors files (SGLang's
    ``/update_weights_from_disk``)."""

    kind: ClassVar[str] = "files"

    @abc.abstractmethod
    def stage(self, version: int, timeout: float | None = None) -> Path:
        """Wait for ``version`` and return a folder that holds exactly it: safetensors files
        under Hugging Face names, complete, and nothing else an engine would load. Valid
        until :meth:`release` of that version or :meth:`close`. Raises TransportTimeout
        when it does not arrive in time, TransportError when it is gone."""

    @abc.abstractmethod
    def release(self, version: int) -> None:
        """The engine has loaded ``version``: its folder may go."""


class BroadcastEngineReceiver(EngineReceiver):
    """An engine whose ``ranks`` workers join a ``torch.distributed`` group in which the
    sender is rank 0, and receive each tensor by broadcast (SGLang's
    ``/init_weights_update_group`` and ``/update_weights_from_distributed``).

    The group is this handle's alone (one engine instance), built as
    ``torch.distributed``'s ``rendezvous`` at ``tcp://master_address:master_port`` and a
    ``PrefixStore`` named ``group_name``, the way SGLang's ``init_custom_process_group``
    builds it on its side.
    """

    kind: ClassVar[str] = "broadcast"

    @abc.abstractmethod
    def group(self) -> dict[str, Any]:
        """Where and how the engine joins: ``master_address``, ``master_port``,
        ``world_size`` (1 + the engine's ranks), ``rank_offset`` (1: the sender is 0),
        ``group_name`` and ``backend`` (``nccl`` or ``gloo``)."""

    @abc.abstractmethod
    def connect(self, timeout: float | None = None) -> None:
        """Join the group as rank 0; returns once the engine's ranks have joined too (the
        caller asks the engine to join at the same time, from another thread). Raises
        TransportTimeout when they do not within ``timeout``."""

    @abc.abstractmethod
    def receive(self, version: int, timeout: float | None = None) -> Iterator[list[TensorSpec]]:
        """The buckets of ``version``, in broadcast order, once the sender has sent it.

        Each bucket is broadcast on the group from the moment it is yielded: the caller
        tells the engine to receive exactly those tensors (names, dtypes, shapes, in
        that order) and asks for the next bucket once the engine has them; asking waits
        for the bucket's broadcast and raises what it raised. Leaving the loop early
        breaks the group (the engine must join a new handle's group), and the sender
        learns that this receiver did not take the version. After the last bucket the
        version counts as delivered."""


class Transport(Closeable, abc.ABC):
    """Builds the two halves. Must be reconstructible in another process from the same
    options and :meth:`receiver_spec` (a JSON-able dict). :meth:`close` releases what
    the transport object itself holds (a control store, a directory it created); the run
    closes it after its sender."""

    @abc.abstractmethod
    def sender(self) -> TransportSender: ...

    @abc.abstractmethod
    def receiver(self, worker_id: str, spec: Mapping[str, Any] | None = None) -> TransportReceiver: ...

    def receiver_spec(self) -> dict[str, Any]:
        """What a receiver in another process needs to connect (addresses, paths)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """How another process builds this transport (a generator's worker process builds
        its receiving side from it, then connects with :meth:`receiver_spec`): the backend's
        name and its validated options, in a typed, versioned description
        (``{"format": "forgerl.transport", "version": 1, "name", "options"}``), which
        :meth:`forgerl.registry.plugins.Registry.transport_from` builds. The registry records it when
        it builds the transport; one built by hand describes itself from its class's ``name``
        and its ``options`` model, when it has both."""
        description = getattr(self, "_forge_description", None)
        name, options = type(self).__dict__.get("name"), getattr(self, "options", None)
        if description is None and isinstance(name, str) and hasattr(options, "model_dump"):
            description = describe_transport(self, name, options.model_dump(mode="json"))  # type: ignore[union-attr]
        if description is None:
            raise TransportError(
                f"{type(self).__name__} was not built through the registry, so it cannot describe itself "
                "to another process; build it with build_registry().require('transport', NAME).build(...)"
            )
        return dict(description)

    #: The kinds of :class:`EngineReceiver` that :meth:`engine_receiver` builds
    #: (``"files"``, ``"broadcast"``); empty: engines that load weights themselves cannot
    #: use this transport.
    engine_receivers: ClassVar[tuple[str, ...]] = ()

    def engine_receiver(self, worker_id: str, kind: str, *, ranks: int = 1) -> EngineReceiver:
        """A receiver of ``kind`` (one of :attr:`engine_receivers`) for one engine instance
        with ``ranks`` workers, on the transport object the generator was given (trainer
        rank 0, where the sender is). Raises TransportError for a kind it does not build."""
        raise TransportError(
            f"the {type(self).__name__} transport cannot feed an engine that loads weights itself "
            f"(asked for {kind!r}; it builds {list(self.engine_receivers) or 'none'})"
        )


class Scheduler(abc.ABC):
    """Turns a JobSpec into running processes.

    ``forge run`` calls :meth:`check`, :meth:`render` (``--dry-run``), :meth:`submit` and
    :meth:`wait`; ``forge status|cancel`` call :meth:`status`/:meth:`cancel`; ``forge logs``
    calls :meth:`logs` only when :attr:`supports_logs` says it can.
    """

    #: Whether ``submit`` returns while the job runs elsewhere (slurm, kubernetes), so
    #: that ``forge status|logs|cancel`` make sense, or runs it in the foreground (local).
    detached: bool = True
    #: Whether the job's processes see this machine's files at the same paths (local,
    #: Slurm on a shared filesystem). When False (Kubernetes pods), `forge run` does not
    #: check the task files and model folder here before submitting: they live in the
    #: pods' volumes.
    shares_filesystem: bool = True
    #: Whether the job's processes run on this machine, in this environment (local). Then
    #: ``forge run`` also checks what depends on the machine (a library such as NCCL, a
    #: GPU, an environment variable a backend reads) before starting them; a login node
    #: that submits to GPU nodes (Slurm) must not refuse a run for lacking a GPU itself.
    runs_here: bool = False
    #: Whether :meth:`logs` can show a job's logs. When False, ``forge logs`` says so in
    #: one line (the logs are still files in the run directory) instead of calling it.
    supports_logs: ClassVar[bool] = False

    def check(self) -> None:  # noqa: B027 - optional: most schedulers can always submit
        """Raise a user-fixable error when this scheduler cannot submit from here (no
        sbatch on PATH, no kubeconfig). Called before anything is created or submitted."""

    @abc.abstractmethod
    def submit(self, job: JobSpec) -> JobHandle: ...

    @abc.abstractmethod
    def status(self, job_id: str) -> JobStatus: ...

    @abc.abstractmethod
    def cancel(self, job_id: str) -> None: ...

    @abc.abstractmethod
    def wait(self, handle: JobHandle, timeout: float | None = None) -> JobStatus:
        """Block until the job ends and return its final status (``forge run`` in the
        foreground, ``--wait``). With ``timeout``, give up after that many seconds: return
        the job's current status, or raise SchedulerError; the job itself goes on."""

    def logs(self, job_id: str, role: str | None = None) -> Iterator[str]:
        """Lines of the job's logs (all roles, or one). Only called when
        :attr:`supports_logs` is True: a scheduler that sets it overrides this."""
        raise SchedulerError(f"{type(self).__name__} shows no logs (its supports_logs is False)")

    def render(self, job: JobSpec) -> str:
        """What ``--dry-run`` prints: the script or manifests that would be submitted."""
        return repr(job)
