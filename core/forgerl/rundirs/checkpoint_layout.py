"""The layout of ``loop.json`` (version 1) as pydantic models: what a checkpoint's loop
state may hold, checked strictly (an integer is not a string or a boolean, no key is
missing or unknown) before anything of it is used. :mod:`forgerl.checkpoints.checkpoint_format`
writes this layout and reads it back through :class:`LoopState`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

LOOP_FORMAT = "forgerl.loop-state"
LOOP_VERSION = 1

_MT_WORDS = 624  # Mersenne Twister state words (Python keeps one more: the position)
Count = Annotated[int, Field(ge=0)]
Word = Annotated[int, Field(ge=0, le=2**32 - 1)]


class _Layout(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PythonRng(_Layout):
    version: Literal[3]
    state: list[Word] = Field(min_length=_MT_WORDS + 1, max_length=_MT_WORDS + 1)
    gauss_next: float | None

    @model_validator(mode="after")
    def _position(self) -> PythonRng:
        if self.state[-1] > _MT_WORDS:
            raise ValueError(
                f"state[{_MT_WORDS}] (the position) is {self.state[-1]}, outside [0, {_MT_WORDS}]"
            )
        return self


class NumpyRng(_Layout):
    bit_generator: Literal["MT19937"]
    key: list[Word] = Field(min_length=_MT_WORDS, max_length=_MT_WORDS)
    pos: Annotated[int, Field(ge=0, le=_MT_WORDS)]
    has_gauss: Annotated[int, Field(ge=0, le=1)]
    gauss: float


class Rng(_Layout):
    python: PythonRng
    numpy: NumpyRng


class ProblemState(_Layout):
    id: str
    prompt: str | list[dict[str, str]]
    answer: str
    metadata: dict[str, Any]


class CompletionState(_Layout):
    len: Count
    finish_reason: Literal["stop", "length", "abort"]
    policy_version: Count
    text: str
    #: A multi-turn trajectory's per-token loss mask and versions (absent: single-turn,
    #: and every checkpoint written before trajectories existed).
    mask: list[Annotated[int, Field(ge=0, le=1)]] | None = None
    versions: list[Count] | None = None

    @model_validator(mode="after")
    def _one_per_token(self) -> CompletionState:
        for name in ("mask", "versions"):
            value = getattr(self, name)
            if value is not None and len(value) != self.len:
                raise ValueError(f"{name} holds {len(value)} entries for {self.len} tokens")
        return self


class EpisodeState(_Layout):
    problem: ProblemState
    group_id: Count
    prompt_len: Count
    completion: CompletionState
    reward: float
    reward_components: dict[str, float]
    reward_failed: bool
    advantage: float
    #: Why a reward or the environment failed it, and a trajectory's messages (sample
    #: records); absent when None, and from every checkpoint written before samples existed.
    error: str | None = None
    messages: list[dict[str, Any]] | None = None


class BatchState(_Layout):
    index: Count
    policy_version: Count
    task_state: dict[str, Any]
    gen_seconds: float
    reward_seconds: float
    gen_tokens: Count
    rewards_failed: Count
    extra: dict[str, float]
    episodes: list[EpisodeState]


class LoopState(_Layout):
    format: Literal["forgerl.loop-state"]
    version: Literal[1]
    step: Count
    policy_version: Count
    next_rollout_index: Count
    task_state: dict[str, Any]
    time_totals: dict[str, float]
    eval_start: float | None
    eval_last: float | None
    #: The evaluation before the first step, whole; absent from 0.2.0's checkpoints.
    eval_start_row: dict[str, float] | None = None
    rng: Rng
    pending_rollouts: list[BatchState]

    @model_validator(mode="after")
    def _order(self) -> LoopState:
        if self.next_rollout_index < self.step:
            raise ValueError(f"next_rollout_index is {self.next_rollout_index}, below step {self.step}")
        for i, batch in enumerate(self.pending_rollouts):
            if batch.index < self.step:
                raise ValueError(f"pending_rollouts[{i}].index is {batch.index}, below step {self.step}")
        return self


# ----------------------------------------------------------------------------- messages

_KINDS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "an object",
    "model_type": "an object",
    "list_type": "a list",
}


def first_problem(exc: ValidationError) -> str:
    """The first thing wrong, as one phrase naming the field: ``step must be an integer,
    got a string``, ``rng.python.state must hold 625 items, got 2``, ``pending_rollouts[1]
    has unknown surprise``, ``version is 2; this forgerl reads version 1``."""
    error = exc.errors(include_url=False)[0]
    loc, kind, given = error["loc"], error["type"], error["input"]
    field = _dotted(loc)
    parent, last = _dotted(loc[:-1]) or "the top level", str(loc[-1]) if loc else ""
    ctx = error.get("ctx") or {}
    if kind == "missing":
        return f"{parent} lacks {last}"
    if kind == "extra_forbidden":
        return f"{parent} has unknown {last}"
    if kind in _KINDS or kind.endswith("_parsing"):
        return f"{field or 'the top level'} must be {_KINDS.get(kind, 'of another type')}, got {_kind(given)}"
    if kind in ("too_short", "too_long"):
        return f"{field} must hold {ctx.get('min_length', ctx.get('max_length'))} items, got {len(given)}"
    if kind == "literal_error" and loc == ("version",):
        return f"version is {given!r}; this forgerl reads version {LOOP_VERSION}"
    if kind == "literal_error":
        return f"{field} is {given!r}, not {ctx.get('expected')}"
    if kind == "value_error":
        return f"{field + ' ' if field else ''}{ctx.get('error', error['msg'])}"
    if kind in ("greater_than_equal", "less_than_equal"):
        return f"{field} is {given}, outside its range ({error['msg'].lower()})"
    return f"{field or 'the top level'}: {error['msg']}"


def _dotted(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"{type(value).__name__} {value!r}"[:60]
    )
