"""The sections of a run config: one pydantic model per section, and :class:`RunConfig`.

Every section refuses unknown keys and checks its ranges (bounds in
:mod:`forgerl.configuration.limits`); a backend choice's ``options`` block is left to the
backend's own model, checked when the config is resolved (:func:`forgerl.registry.resolve.resolve`),
which puts the validated options model in its place (:data:`BackendOptions`).
Import these from :mod:`forgerl.configuration.config`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)

from forgerl.algorithms.config import PRESETS, AlgorithmConfig, fill_length_defaults
from forgerl.configuration.eval_config import EvalConfig
from forgerl.configuration.limits import (
    MAX_GROUP_SIZE,
    MAX_PROMPTS_PER_STEP,
    MAX_RANKS,
    MAX_REWARDS,
    MAX_SAMPLES_PER_STEP,
    MAX_SECONDS,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    is_int,
)
from forgerl.configuration.sft import SFTConfig
from forgerl.options import OptionsModel
from forgerl.types import reserved_component_error

DEFAULT_MODEL = "smollm2-135m-instruct"


class _Strict(OptionsModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _options_block(value: Any) -> dict[str, Any] | BaseModel:
    if isinstance(value, (dict, BaseModel)):
        return value
    raise ValueError(f"must be a mapping of the backend's options, not a {type(value).__name__}")


def _dump_options(value: dict[str, Any] | BaseModel, info: SerializationInfo) -> dict[str, Any]:
    return value.model_dump(mode=info.mode) if isinstance(value, BaseModel) else value


#: A backend's options: the block as written (a mapping) until the config is resolved, then
#: the backend's own options model, validated once (:func:`forgerl.registry.resolve.resolve`). Either
#: way the config dumps (config.yaml, ``forge config show``) as the mapping.
BackendOptions = Annotated[
    dict[str, Any] | BaseModel,
    PlainValidator(_options_block),
    PlainSerializer(_dump_options),
    WithJsonSchema({"type": "object", "additionalProperties": True}),
]


def options_dict(options: dict[str, Any] | BaseModel) -> dict[str, Any]:
    """The options as a JSON-ready mapping (a validated model's values, defaults filled in):
    what another process rebuilds them from."""
    return options.model_dump(mode="json") if isinstance(options, BaseModel) else dict(options)


class BackendChoice(_Strict):
    """A backend selected by name, with its options (validated by the backend)."""

    name: str = Field(description="Backend name, as listed by `forge plugins list`.")
    options: BackendOptions = Field(default_factory=dict, description="The backend's own options.")


class GeneratorChoice(BackendChoice):
    name: str = Field("auto", description="Generator backend; `auto` picks vllm when installed, else hf.")


class TrainerChoice(BackendChoice):
    name: str = Field("fsdp", description="Trainer backend.")
    ranks: int = Field(
        1,
        ge=1,
        le=MAX_RANKS,
        description=f"Trainer processes (torch.distributed ranks), at most {MAX_RANKS}; the scheduler "
        "also refuses more than it can place (local: the cores this machine lets forge use).",
    )


class TransportChoice(BackendChoice):
    name: str = Field("shm", description="Weight transport from trainer to generators.")
    timeout: float = Field(
        120.0, gt=0, le=MAX_SECONDS, description="Seconds a weight transfer may take before it fails (at most a week)."
    )


class SchedulerChoice(BackendChoice):
    name: str = Field("local", description="Where the run's processes run.")


class TaskChoice(BackendChoice):
    name: str = Field("arithmetic", description="Source of prompts and reference answers.")


class EnvironmentChoice(_Strict):
    """Multi-turn rollouts through an environment (docs/environments.md). With no ``name``
    (the default) a rollout is one prompt and one completion, as it always was."""

    name: str | None = Field(
        None, description="Environment backend (`forge plugins list`); none: single-turn rollouts."
    )
    options: BackendOptions = Field(default_factory=dict, description="The environment's own options.")
    max_turns: int = Field(4, ge=1, le=1000, description="Most assistant turns per trajectory.")
    max_total_tokens: int = Field(
        512,
        ge=1,
        le=MAX_TOKENS,
        description="Most tokens after the first prompt (sampled and environment tokens together).",
    )
    max_turn_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Most tokens per assistant turn (default loop.sampling.max_tokens)."
    )
    turn_timeout: float = Field(
        10.0, gt=0, le=MAX_SECONDS, description="Seconds each environment call (reset, step, tools) may take."
    )
    concurrency: int = Field(32, ge=1, le=MAX_SAMPLES_PER_STEP, description="Trajectories in flight at once.")
    sources: list[str] | None = Field(
        None,
        min_length=1,
        description="Only the problems of these sources of a mixture task run through the environment, the "
        "others are single-turn (docs/data.md); none: every problem.",
    )

    @model_serializer(mode="wrap")
    def _without_unset_sources(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # An environment for every problem is written as it always was (config.yaml, `config show`).
        data: dict[str, Any] = handler(self)
        if data.get("sources", ...) is None:
            del data["sources"]
        return data


class TeacherChoice(BackendChoice):
    name: str = Field("model", description="Teacher backend (`forge plugins list`); `model`: a causal LM.")


class DistillConfig(_Strict):
    """On-policy distillation (``objective: distill``, docs/distillation.md): the teacher
    scores the student's own samples and each token's advantage is minus its reverse KL
    term, alone or mixed with the task's group-relative advantage."""

    teacher: TeacherChoice = Field(default_factory=TeacherChoice, description="The teacher and its options.")
    kl_weight: float = Field(
        1.0, ge=0, le=1e6, description="Weight of the per-token reverse KL advantage (log p_teacher - log p_student)."
    )
    reward_weight: float = Field(
        0.0, ge=0, le=1e6, description="Weight of the task's group-relative advantage mixed in (0: distillation alone)."
    )
    kl_clip: float | None = Field(
        None, gt=0, le=1e6, description="Bound on each token's |log p_student - log p_teacher| (none: unbounded)."
    )
    timeout: float = Field(
        300.0, gt=0, le=MAX_SECONDS, description="Seconds the teacher may take to score one step's samples."
    )

    @model_validator(mode="after")
    def _some_signal(self) -> DistillConfig:
        if self.kl_weight == 0 and self.reward_weight == 0:
            raise ValueError("kl_weight and reward_weight are both 0: nothing would be learned; set one above 0")
        return self


class RewardChoice(BackendChoice):
    weight: float = Field(
        1.0, ge=-1e6, le=1e6, description="Weight of this reward in the total (a weighted sum); finite, |weight| <= 1e6."
    )
    sources: list[str] | None = Field(
        None,
        min_length=1,
        description="Score only the problems of these sources of a mixture task (docs/data.md); none: every problem.",
    )

    @model_serializer(mode="wrap")
    def _without_unset_sources(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A reward for every problem is written as it always was (config.yaml, `config show`).
        data: dict[str, Any] = handler(self)
        if data.get("sources", ...) is None:
            del data["sources"]
        return data

    @field_validator("name")
    @classmethod
    def _not_a_run_metric(cls, value: str) -> str:
        # The reward's mean is logged as reward/<name>: it must not overwrite the run's own.
        if (reserved := reserved_component_error(value)) is not None:
            raise ValueError(f"a reward backend cannot be named {value!r}: {reserved}")
        return value


class ModelConfig(_Strict):
    name: str = Field(
        DEFAULT_MODEL,
        description="A named model (`forge plugins list` shows them: tiny, smollm2-135m-instruct), "
        "a local Hugging Face folder, or a hub id given as owner/name where the network allows.",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    options: BackendOptions = Field(default_factory=dict, description="Options of a named model source.")


class SamplingConfig(_Strict):
    max_tokens: int = Field(
        64,
        ge=1,
        le=MAX_TOKENS,
        description=f"Most tokens per completion (at most {MAX_TOKENS}, and no more than the model's "
        "context length, checked before a run starts).",
    )
    temperature: float = Field(1.0, ge=0, le=100, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=1_000_000, description="-1 disables top-k.")


class LoopConfig(_Strict):
    steps: int = Field(
        20, ge=0, le=MAX_STEPS, description=f"Training steps (optimiser updates) in the run, at most {MAX_STEPS}."
    )
    prompts_per_step: int = Field(
        8,
        ge=1,
        le=MAX_PROMPTS_PER_STEP,
        description=f"Prompt groups per training batch, at most {MAX_PROMPTS_PER_STEP}; prompts_per_step x "
        f"group_size at most {MAX_SAMPLES_PER_STEP}.",
    )
    group_size: int = Field(
        4, ge=1, le=MAX_GROUP_SIZE, description=f"Completions sampled per prompt (GRPO group), at most {MAX_GROUP_SIZE}."
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Oldest policy version lag a sample may have when trained on, counted from its oldest "
        "token; 0 = on-policy.",
    )
    stale_samples: Literal["drop", "mask"] = Field(
        "drop",
        description="A sample whose oldest tokens are staler than max_staleness: drop it ('drop'), or train "
        "only on its tokens of allowed versions, the older ones kept as context outside the loss ('mask'; a "
        "sample with none left is dropped).",
    )
    overlap: Literal["versioned", "continuous"] = Field(
        "versioned",
        description="How generation overlaps training. versioned: batch k is generated with policy version "
        "k - max_staleness exactly, and a weight update waits until those batches are done (reproducible step "
        "for step). continuous: weights are updated as soon as a step is trained, with requests in flight "
        "(needs max_staleness >= 1 and a generator that updates in flight: vllm's update_policy keep); prompt "
        "groups are admitted as earlier ones finish, up to max_in_flight, and batches are formed from groups in "
        "completion order (not reproducible step for step).",
    )
    max_in_flight: int | None = Field(
        None,
        ge=1,
        le=MAX_SAMPLES_PER_STEP,
        description="overlap continuous: most prompt groups generating at once (default "
        "(1 + max_staleness) x prompts_per_step, what the staleness bound admits anyway).",
    )
    eval_every: int = Field(0, ge=0, le=MAX_STEPS, description="Evaluate every N steps (0: only at start and end).")
    eval_size: int | None = Field(
        None, ge=1, le=MAX_SAMPLES_PER_STEP, description="Evaluate on the first N held-out problems."
    )
    eval_temperature: float = Field(0.0, ge=0, le=100, description="Sampling temperature for evaluation (0 greedy).")
    eval_at_start: bool = True
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    reward_timeout: float = Field(
        10.0, gt=0, le=MAX_SECONDS, description="Seconds per sample before a reward is failed (at most a week)."
    )
    failed_reward: float = Field(
        0.0, ge=-1e6, le=1e6, description="Score of a sample whose reward raised or timed out."
    )
    seed: int = Field(
        0, ge=0, le=MAX_SEED, description=f"Seeds the task, sampling and initialisation (0 to {MAX_SEED})."
    )

    @model_validator(mode="after")
    def _overlap_is_possible(self) -> LoopConfig:
        if self.overlap == "continuous" and self.max_staleness < 1:
            raise ValueError(
                "overlap continuous generates while weights move, so samples are at least one version old: "
                "set loop.max_staleness=1 (or more), or loop.overlap=versioned"
            )
        if self.overlap == "versioned" and self.max_in_flight is not None:
            raise ValueError(
                "max_in_flight bounds overlap continuous only (versioned generates one batch at a time): "
                "set loop.overlap=continuous, or leave max_in_flight out"
            )
        return self

    @model_validator(mode="after")
    def _batch_is_placeable(self) -> LoopConfig:
        samples = self.prompts_per_step * self.group_size
        if samples > MAX_SAMPLES_PER_STEP:
            raise ValueError(
                f"prompts_per_step x group_size = {self.prompts_per_step} x {self.group_size} = {samples} "
                f"completions per step; at most {MAX_SAMPLES_PER_STEP}"
            )
        return self


class CheckpointConfig(_Strict):
    every: int = Field(10, ge=0, le=MAX_STEPS, description="Checkpoint every N steps (0: only at exit).")
    keep: int = Field(2, ge=1, le=1000, description="Checkpoints kept; older ones are deleted.")


class WandbConfig(_Strict):
    enabled: bool = Field(False, description="Send each step's metrics to Weights & Biases (needs `wandb`).")
    project: str = Field("forgerl", min_length=1, description="The W&B project.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: write <run_dir>/wandb, no network (upload later with `wandb sync`); "
        "online: upload as the run goes (after `wandb login`).",
    )


class MlflowConfig(_Strict):
    enabled: bool = Field(False, description="Send each step's metrics to MLflow (needs `mlflow` or `mlflow-skinny`).")
    tracking_uri: str | None = Field(
        None, description="An MLflow tracking URI (a server, sqlite:///...); default a file store in <run_dir>/mlruns."
    )
    experiment: str = Field("forgerl", min_length=1, description="The MLflow experiment.")


class SamplesConfig(_Strict):
    """What the model wrote, recorded in <run_dir>/samples/ (docs/samples.md, `forge samples`)."""

    enabled: bool = Field(
        True, description="Record samples of each step and of each held-out evaluation in <run_dir>/samples/."
    )
    share: float = Field(
        1.0, gt=0, le=1, description="Each sample is recorded with this probability (1: all, up to per_step)."
    )
    per_step: int = Field(
        64, ge=1, le=MAX_SAMPLES_PER_STEP,
        description="Most samples recorded per step and per evaluation (the first groups, whole).",
    )
    max_chars: int = Field(
        8000, ge=100, le=10_000_000, description="Longest text kept per prompt, completion or message (cut in the "
        "middle beyond).",
    )
    max_file_bytes: int = Field(
        16 << 20, ge=4096, le=1 << 40, description="Size of one samples file before a new one is begun."
    )
    keep_files: int = Field(
        4, ge=1, le=10_000, description="Samples files kept; the oldest is deleted beyond (total at most "
        "keep_files x max_file_bytes).",
    )


class LoggingConfig(_Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    progress: bool = Field(
        True,
        description="Progress on stderr from the start: a step bar in a terminal, one line per event and "
        "step otherwise (`forge run --quiet` turns it off).",
    )
    tensorboard: bool = Field(
        True, description="Write TensorBoard events to <run_dir>/tensorboard (skipped, with a note, without tensorboard)."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    samples: SamplesConfig = Field(default_factory=SamplesConfig)


def default_rewards() -> list[RewardChoice]:
    return [RewardChoice(name="math_answer", weight=1.0), RewardChoice(name="format", weight=0.2)]


class ImagesConfig(_Strict):
    """Bounds on the images of one problem, trajectory or agent episode, checked before
    any pixel is decoded (docs/vision.md). A bad or refused image fails its sample alone."""

    max_images: int = Field(8, ge=1, le=1024, description="Images per problem (or trajectory, or agent episode).")
    max_pixels: int = Field(
        4096 * 4096, ge=1, le=2**31, description="Width x height of one image, read from its header (bombs are refused)."
    )
    max_total_pixels: int = Field(4 * 4096 * 4096, ge=1, le=2**34, description="Pixels of all the images of a problem.")
    max_bytes: int = Field(32 * 2**20, ge=1, le=2**31, description="Encoded size of one image (a data URL or a file).")

    def limits(self) -> Any:
        """As :class:`forgerl.images.ImageLimits`."""
        from forgerl.images import ImageLimits

        return ImageLimits(**self.model_dump())


class RunConfig(_Strict):
    """Everything that defines a run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    objective: Literal["grpo", "sft", "distill", "eval"] = Field(
        "grpo",
        description="What the run trains for: grpo (reinforcement learning on the rewards' group-relative "
        "advantages of its own samples, the algorithm section), sft (supervised fine-tuning on demonstrations, "
        "the sft section; docs/sft.md) or distill (a teacher's per-token reverse KL on the student's own "
        "samples, the distill section; docs/distillation.md) or eval (no training: the model's samples on the task's "
        "held-out problems scored and summed up, the eval section; what `forge eval` runs, docs/eval.md).",
    )
    task: TaskChoice = Field(default_factory=TaskChoice)
    generator: GeneratorChoice = Field(default_factory=GeneratorChoice)
    trainer: TrainerChoice = Field(default_factory=TrainerChoice)
    transport: TransportChoice = Field(default_factory=TransportChoice)
    scheduler: SchedulerChoice = Field(default_factory=SchedulerChoice)
    environment: EnvironmentChoice = Field(default_factory=EnvironmentChoice)
    rewards: list[RewardChoice] = Field(
        default_factory=default_rewards,
        min_length=1,
        max_length=MAX_REWARDS,
        description="Rewards, summed with their weights.",
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    output: str | None = Field(None, description="Run directory (default runs/<timestamp>); not empty.")

    @field_validator("output")
    @classmethod
    def _output_names_a_place(cls, value: str | None) -> str | None:
        # An empty --output would silently mean "the default place".
        if value is not None and not value.strip():
            raise ValueError("must name a directory, not be empty")
        return value

    @model_validator(mode="before")
    @classmethod
    def _fit_algorithm_to_lengths(cls, data: Any) -> Any:
        """Length-dependent algorithm knobs that neither the user nor the preset sets
        default to the run's completion length (see ``fill_length_defaults``)."""
        if not isinstance(data, dict) or not isinstance(data.get("algorithm", {}), dict):
            return data
        loop = data.get("loop") or {}
        sampling = loop.get("sampling") if isinstance(loop, dict) else None
        max_tokens = sampling.get("max_tokens") if isinstance(sampling, dict) else None
        if not is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS:
            # A bad max_tokens is reported by its own field; derive from the default meanwhile.
            max_tokens = SamplingConfig.model_fields["max_tokens"].default
        return {**data, "algorithm": fill_length_defaults(dict(data.get("algorithm") or {}), max_tokens)}

    @model_validator(mode="after")
    def _overlap_fits_rollouts(self) -> RunConfig:
        if self.loop.overlap == "continuous" and self.environment.name is not None:
            raise ValueError(
                "loop.overlap continuous admits single-turn prompt groups only, not an environment's "
                "trajectories: set loop.overlap=versioned, or leave environment.name out"
            )
        return self

    @model_validator(mode="after")
    def _sft_has_demonstrations(self) -> RunConfig:
        if self.objective != "sft":
            return self
        sft = self.sft
        if not sft.data and not sft.task_demonstrations:
            raise ValueError(
                "objective sft needs demonstrations: sft.data (JSONL or Parquet files), or "
                "sft.task_demonstrations=true for the worked answers of a task that gives them (e.g. arithmetic)"
            )
        if sft.data and sft.task_demonstrations:
            raise ValueError("give sft.data or sft.task_demonstrations, not both")
        if self.algorithm.kl_coef > 0:
            raise ValueError(
                "algorithm.kl_coef is a term of the RL loss; objective sft trains on cross-entropy alone: "
                "set algorithm.kl_coef=0"
            )
        return self

    @model_validator(mode="after")
    def _batch_fits_groups(self) -> RunConfig:
        distilling_alone = self.objective == "distill" and self.distill.reward_weight == 0
        if self.algorithm.std_normalize == "group" and self.loop.group_size < 2 and not distilling_alone:
            raise ValueError("loop.group_size must be at least 2 for group-normalised advantages")
        algo = self.algorithm
        max_tokens = self.loop.sampling.max_tokens
        if algo.overlong == "soft_penalty" and algo.overlong_buffer >= max_tokens:
            # Most often the dapo preset's 4096-token ramp (DAPO sampled 20480 tokens)
            # under a short max_tokens: say where the value came from and both fixes.
            from_preset = (
                f", the {algo.preset} preset's"
                if algo.overlong_buffer == PRESETS[algo.preset]["overlong_buffer"]
                else ""
            )
            raise ValueError(
                f"algorithm.overlong_buffer ({algo.overlong_buffer}{from_preset}) must be below "
                f"loop.sampling.max_tokens ({max_tokens}): set algorithm.overlong_buffer "
                f"(e.g. {max(1, max_tokens // 4)}, a quarter of max_tokens) or raise loop.sampling.max_tokens"
            )
        return self

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.dump(), sort_keys=False)
