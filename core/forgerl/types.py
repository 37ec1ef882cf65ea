"""Typed records that flow between the interfaces.

They are plain dataclasses so that plugins can build them without importing anything
heavy; tensors appear only in :class:`TrainBatch` and :class:`WeightSet`, typed as
``torch.Tensor`` for readers but never imported here (core must import without torch).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

# ---------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Problem:
    """One prompt with the reference a reward may check against.

    ``prompt`` is either plain text or a chat (a list of ``{"role", "content"}`` dicts);
    the loop applies the model's chat template to chats. A message's content may be a list
    of OpenAI-style parts with images (docs/vision.md). ``answer`` is the reference
    answer (may be empty for rewards that need none); ``metadata`` is free-form and
    reaches every reward unchanged.
    """

    id: str
    prompt: str | list[dict[str, Any]]
    answer: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)


#: The metadata key under which a mixture task names the source a problem came from
#: (docs/data.md). Rewards configured with ``sources`` score only their sources' problems,
#: and the run's metrics break down by it (``source/<name>/...``).
SOURCE_KEY = "forgerl/source"


def source_of(problem: Problem) -> str | None:
    """The mixture source ``problem`` came from; None for a task that is not a mixture."""
    value = problem.metadata.get(SOURCE_KEY)
    return value if isinstance(value, str) else None


# ------------------------------------------------------------------------ generation


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """The images of one prompt, as the model's processor prepared them, once.

    ``images`` are the decoded RGB images (``PIL.Image.Image``) in prompt order: an engine
    that runs the processor itself (vLLM) gets these. ``features`` are the processor's
    tensors for them (``pixel_values`` and the model's other image inputs, batch
    dimension 1): the ``hf`` generator and the trainers feed these, so the trainer sees
    the pixels the generator saw and never decodes the files again. The image
    placeholders are already expanded in the prompt's token ids that go with it
    (docs/vision.md).
    """

    images: tuple[Any, ...]
    features: Mapping[str, Any]
    #: The prompt's ids before the processor expanded its images (one placeholder each),
    #: for an engine that expands them itself (vLLM), which must arrive at the same ids.
    unexpanded_ids: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.images)


@dataclass(frozen=True)
class GenerationRequest:
    """``n`` completions of one tokenised prompt.

    Token ids (not text) cross the interface so that the trainer scores exactly the
    tokens the generator saw. ``images`` (None for a text prompt) carries the prompt's
    images; a generator whose class does not set ``accepts_images`` never receives one.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    n: int
    sampling: SamplingParams
    images: ImageInputs | None = None


FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Completion:
    """One sampled continuation.

    ``logprobs[i]`` is the log-probability (natural log) that the *sampling* policy gave
    ``token_ids[i]``; the loss uses it as the behaviour policy. ``policy_version`` is the
    weight version that produced it. A completion that ran across a weight update (the
    vllm generator's update policy ``keep``) carries ``versions[i]``, the version that
    sampled token ``i``, and ``policy_version`` the oldest of them (``mask`` stays None).

    A multi-turn trajectory (:mod:`forgerl.rollouts.trajectory`) is one Completion holding every
    token after the first prompt: ``mask[i]`` is 1 for a sampled token, 0 for an
    environment token (never in the loss; its logprob is 0), ``versions[i]`` the policy
    version that sampled token ``i`` (environment tokens carry their turn's), and
    ``policy_version`` the oldest of them. Both None for a single-turn completion: every
    token sampled, by ``policy_version``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    text: str = ""
    mask: list[int] | None = None
    versions: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"a Completion needs one logprob per token: got {len(self.token_ids)} token ids "
                f"but {len(self.logprobs)} logprobs"
            )
        for name in ("mask", "versions"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.token_ids):
                raise ValueError(
                    f"a Completion's {name} needs one entry per token: got {len(self.token_ids)} token ids "
                    f"but {len(value)}"
                )


@dataclass
class GeneratorHealth:
    """A generator's state for people and tools (the ``health()`` of the vllm and hf
    generators). Not part of the Generator interface: the loop does not call it."""

    healthy: bool
    policy_version: int
    replicas: int = 1
    healthy_replicas: int = 1
    detail: str = ""


# --------------------------------------------------------------------------- rewards


@dataclass(frozen=True)
class RewardInput:
    """What a reward sees of one finished sample."""

    problem: Problem
    completion_text: str
    finish_reason: FinishReason = "stop"


#: The run's own metrics under ``reward/``, by name. A reward's or an environment's
#: component is logged as ``reward/<name>``, so these names are refused for components:
#: one would overwrite the run's own figure in metrics.jsonl and every tracker, silently.
RUN_REWARD_METRICS = {
    "mean": "the step's mean reward",
    "failed": "the samples a reward failed to score",
}


def reserved_component_error(name: object) -> str | None:
    """Why ``name`` cannot name a component (None: it can)."""
    if isinstance(name, str) and name in RUN_REWARD_METRICS:
        return (f"reward/{name} is the run's own metric ({RUN_REWARD_METRICS[name]}), which a component "
                f"named {name!r} would overwrite; names the run keeps: {', '.join(sorted(RUN_REWARD_METRICS))}")
    return None


@dataclass(frozen=True)
class RewardResult:
    """A score, plus named components for the metrics.

    ``failed`` marks a sample whose reward could not be computed (raised, timed out);
    its ``value`` is the configured failure score and ``error`` says why.
    """

    value: float
    components: Mapping[str, float] = field(default_factory=dict)
    failed: bool = False
    error: str | None = None


# -------------------------------------------------------------------------- training


@dataclass
class Episode:
    """A scored completion, ready for advantage estimation.

    ``group_id`` ties together the completions of one prompt (GRPO's group).
    """

    problem: Problem
    group_id: int
    prompt_token_ids: list[int]
    completion: Completion
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    reward_failed: bool = False
    advantage: float = 0.0
    #: Why the reward or the environment failed it (None: it did not); for sample records.
    error: str | None = None
    #: The whole trajectory as chat messages, when an environment ran it (sample records).
    messages: list[dict[str, Any]] | None = None
    #: The prompt's images as the generator saw them (None: a text prompt); the batch
    #: builder hands them to the trainer with the row.
    images: ImageInputs | None = None


@dataclass
class TrainBatch:
    """A padded batch for :meth:`Trainer.train_step`.

    Shapes: ``input_ids``/``attention_mask``/``loss_mask``/``behaviour_logprobs`` are
    ``[B, T]`` (prompt followed by completion, right-padded); ``loss_mask`` is 1 on
    completion tokens that count in the loss; ``behaviour_logprobs`` holds the sampler's
    logprob of token ``t`` at position ``t`` (0 elsewhere). ``advantages`` is ``[B]`` (one
    per row: GRPO's) or ``[B, T]`` (one per token, at the token's position like
    ``behaviour_logprobs``: on-policy distillation's, :mod:`forgerl.distill`); a trainer
    honours both (the trainer kit checks it). ``policy_versions`` is ``[B]``, the version of
    each row's oldest token.

    ``token_versions`` (``[B, T]``, optional) is the version that sampled token ``t`` at
    position ``t`` (outside the completion: the row's ``policy_versions``), and
    ``trainer_version`` the version of the weights this step trains: a token's age is
    ``trainer_version - token_versions``. The loop fills both; a trainer that gets them
    reports the logprob gap by age (``logprob_gap/age_{a}``, :func:`forgerl.algorithms.policy_loss`).

    ``objective`` says which loss the batch is for: ``"grpo"``, the policy loss on the
    advantages (runs of ``objective`` grpo and distill), or ``"sft"``, the cross-entropy of the
    tokens under ``loss_mask`` (:func:`forgerl.sft.loss.sft_loss`; advantages, behaviour
    logprobs and versions are zeros then). A trainer trains only the objectives its class
    lists in :attr:`forgerl.interfaces.Trainer.objectives`.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    policy_versions: torch.Tensor
    num_groups: int = 0
    token_versions: torch.Tensor | None = None
    trainer_version: int | None = None
    objective: str = "grpo"
    #: ``images[b]``: row ``b``'s prompt images (None for a text row); None when no row
    #: has any. Only a trainer whose class sets ``accepts_images`` is given a batch with them.
    images: list[ImageInputs | None] | None = None

    def token_ages(self) -> torch.Tensor | None:
        """``[B, T]``: how many versions older than the trained weights each token's
        sampling policy was; None without per-token versions."""
        if self.token_versions is None or self.trainer_version is None:
            return None
        return self.trainer_version - self.token_versions

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class WeightSet:
    """A versioned, ordered set of named tensors (Hugging Face parameter names).

    ``tensors`` may be a lazy iterator factory: transports must iterate it once.
    """

    version: int
    tensors: Mapping[str, torch.Tensor]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def tie_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two non-empty tensors exactly when they are one tensor under two names
    (tied weights such as ``lm_head.weight`` and ``model.embed_tokens.weight``): the same
    memory seen with the same dtype, shape and strides. Whoever keeps a tie in a
    :class:`WeightSet` and whoever sends or checks it once must agree on what a tie is, so
    they all ask this. Empty tensors may share an address without being tied: skip them."""
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
    )


# ------------------------------------------------------------------------ scheduling


@dataclass(frozen=True)
class Resources:
    """Per-replica resources. ``memory`` is a Slurm/Kubernetes-style string ("16G")."""

    cpus: int = 1
    gpus: int = 0
    memory: str | None = None
    nodes: int = 1


@dataclass(frozen=True)
class RoleSpec:
    """One role of a job: ``replicas`` copies of ``command``.

    ``ranks_per_replica > 1`` makes each replica an SPMD group: the scheduler sets
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for a
    torch.distributed rendezvous. Every process also gets ``FORGE_ROLE`` and
    ``FORGE_REPLICA``.
    """

    name: str
    command: tuple[str, ...]
    replicas: int = 1
    ranks_per_replica: int = 1
    resources: Resources = field(default_factory=Resources)
    env: Mapping[str, str] = field(default_factory=dict)
    # A role whose exit ends the job (the trainer); others (servers) are stopped then.
    primary: bool = False
    # Restart a replica that dies, up to this many times (generator servers).
    max_restarts: int = 0


@dataclass(frozen=True)
class JobSpec:
    """What a scheduler runs: named roles, sharing one run directory."""

    name: str
    run_dir: str
    roles: tuple[RoleSpec, ...]
    env: Mapping[str, str] = field(default_factory=dict)


class JobState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"

    @property
    def finished(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class JobHandle:
    """Identifies a submitted job to the scheduler that runs it."""

    scheduler: str
    job_id: str
    run_dir: str


@dataclass(frozen=True)
class JobStatus:
    state: JobState
    exit_code: int | None = None
    detail: str = ""
