"""The interfaces every backend implements.

Each is a small abstract class: the few methods the loop really calls. A backend is a
class implementing one of them plus a record (see :mod:`forgerl.backends`) that names it
and says how to build it. Constructors receive the backend's validated options and a
:class:`RunContext`.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from forgerl.types import (
    Completion,
    GenerationRequest,
    GeneratorHealth,
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

    from forgerl.config import RunConfig


@dataclass
class RunContext:
    """What a backend may know about the run it is part of.

    ``model_path`` is a local Hugging Face folder (resolved by the core before backends
    are built). ``rank``/``world_size`` describe this process among the trainer ranks.
    """

    config: "RunConfig"
    run_dir: Path
    model_path: Path | None = None
    rank: int = 0
    world_size: int = 1
    extras: dict[str, Any] = field(default_factory=dict)


class Closeable:
    def close(self) -> None:
        """Release processes, ports, memory. Idempotent."""

    def __enter__(self):
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

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class Generator(Closeable, abc.ABC):
    """Prompts → completions with token ids and per-token sampling logprobs.

    Called from trainer rank 0 (a rollout thread with its own event loop). May raise
    :class:`~forgerl.errors.GeneratorError` (or ``GeneratorUnreachable`` when no replica
    answers); a replica failure should be retried on another replica internally.
    """

    @abc.abstractmethod
    async def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        """``requests[i].n`` completions for each request, in request order."""

    @abc.abstractmethod
    def update_weights(self, version: int) -> None:
        """Receive weight version ``version`` through the run's transport and load it.

        Called while the transport's sender sends that version (possibly concurrently,
        in another thread). After it returns every new completion reports ``version``.
        Raises :class:`~forgerl.errors.TransportError` on failure or timeout; the
        generator then keeps serving the last complete version.
        """

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """The weight version currently served."""

    def health(self) -> GeneratorHealth:
        return GeneratorHealth(healthy=True, policy_version=self.policy_version)


class Trainer(Closeable, abc.ABC):
    """Optimises the policy. SPMD: every trainer rank calls every method, in the same order."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on ``batch`` (each rank passes the same full batch; the
        trainer splits it across ranks and micro-batches). Returns metrics (same on all
        ranks), including the algorithm's metrics."""

    @abc.abstractmethod
    def logprobs(self, batch: TrainBatch) -> "torch.Tensor":
        """Per-token logprobs ``[B, T]`` of ``batch`` under the current policy, no grad."""

    @abc.abstractmethod
    def export_weights(self, version: int) -> WeightSet | None:
        """Full weights under Hugging Face names; a WeightSet on rank 0, None elsewhere."""

    @abc.abstractmethod
    def save(self, path: Path) -> None:
        """Save model and optimiser state under ``path`` (a directory; all ranks call)."""

    @abc.abstractmethod
    def load(self, path: Path) -> None:
        """Load what :meth:`save` wrote."""


class Reward(abc.ABC):
    """Scores a finished sample.

    Implement :meth:`score` (blocking; the core runs it in a worker process, built there
    from the backend's name and options, and kills that process on timeout) or override
    :meth:`ascore` (run on the event loop; it must not block). Return a float or a
    :class:`RewardResult`. Raising is allowed: the core scores that sample as failed and
    the run goes on.
    """

    def score(self, sample: RewardInput) -> float | RewardResult:
        raise NotImplementedError(f"{type(self).__name__} implements neither score nor ascore")

    async def ascore(self, sample: RewardInput) -> float | RewardResult:
        return await asyncio.to_thread(self.score, sample)


class TransportSender(Closeable, abc.ABC):
    """The trainer-side half of a transport (trainer rank 0)."""

    @abc.abstractmethod
    def send(self, weights: WeightSet, timeout: float | None = None) -> None:
        """Make ``weights`` available to every receiver. Returns when delivered (or
        published, for pull-based transports). Raises TransportTimeout naming the
        receivers that did not complete."""


class TransportReceiver(Closeable, abc.ABC):
    """The generator-side half, living inside the generator's workers."""

    @abc.abstractmethod
    def receive(self, version: int, timeout: float | None = None) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Named tensors of ``version`` (complete, never partial). Raises
        TransportTimeout when it does not arrive in time."""


class Transport(abc.ABC):
    """Builds the two halves. Must be reconstructible in another process from the same
    options and :meth:`receiver_spec` (a JSON-able dict)."""

    @abc.abstractmethod
    def sender(self) -> TransportSender: ...

    @abc.abstractmethod
    def receiver(self, worker_id: str, spec: Mapping[str, Any] | None = None) -> TransportReceiver: ...

    def receiver_spec(self) -> dict[str, Any]:
        """What a receiver in another process needs to connect (addresses, paths)."""
        return {}


class Scheduler(abc.ABC):
    """Turns a JobSpec into running processes."""

    #: Whether ``submit`` returns while the job runs elsewhere (slurm, kubernetes), so
    #: that ``forge status|logs|cancel`` make sense, or runs it in the foreground (local).
    detached: bool = True
    #: Whether the job's processes see this machine's files at the same paths (local,
    #: Slurm on a shared filesystem). When False (Kubernetes pods), `forge run` does not
    #: check the task files and model folder here before submitting: they live in the
    #: pods' volumes.
    shares_filesystem: bool = True

    def check(self) -> None:
        """Raise a user-fixable error when this scheduler cannot submit from here (no
        sbatch on PATH, no kubeconfig). Called before anything is created or submitted."""

    @abc.abstractmethod
    def submit(self, job: JobSpec) -> JobHandle: ...

    @abc.abstractmethod
    def status(self, job_id: str) -> JobStatus: ...

    @abc.abstractmethod
    def cancel(self, job_id: str) -> None: ...

    def wait(self, handle: JobHandle, timeout: float | None = None) -> JobStatus:
        """Block until the job ends; return its final status."""
        raise NotImplementedError

    def logs(self, job_id: str, role: str | None = None) -> Iterator[str]:
        """Lines of the job's logs (all roles, or one)."""
        raise NotImplementedError

    def render(self, job: JobSpec) -> str:
        """What ``--dry-run`` prints: the script or manifests that would be submitted."""
        return repr(job)
