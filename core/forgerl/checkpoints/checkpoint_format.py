"""What a checkpoint holds besides the trainer's state, in formats that run no code on load.

Loading a checkpoint must never execute anything its author put there, so nothing here
is pickled: plain state is JSON, arrays are safetensors (a JSON header plus raw bytes).
Every value read back is checked against the version-1 layout below (the pydantic models
of :mod:`forgerl.rundirs.checkpoint_layout`); anything else (a wrong type, a missing or unknown
key, arrays that do not add up) is refused with a
:class:`~forgerl.errors.CheckpointUnusable` naming the file and the field.

``loop.json`` (version 1)::

    {"format": "forgerl.loop-state", "version": 1,
     "step": int, "policy_version": int, "next_rollout_index": int,
     "task_state": {...}, "time_totals": {name: float}, "eval_start": float|null,
     "eval_last": float|null, "eval_start_row": {eval key: float}|null (optional),
     "rng": {"python": {"version": 3, "state": [625 ints], "gauss_next": float|null},
             "numpy": {"bit_generator": "MT19937", "key": [624 ints], "pos": int,
                       "has_gauss": 0|1, "gauss": float}},
     "pending_rollouts": [batch, ...]}

A pending batch is ``RolloutBatch`` as a dict whose episodes hold everything but their
token ids and logprobs: those are concatenated, in episode order, into the arrays
``rollouts/prompt_token_ids`` (int64), ``rollouts/completion_token_ids`` (int64) and
``rollouts/completion_logprobs`` (float64, the exact Python floats) of ``arrays.safetensors``,
which also holds ``rng/torch`` (uint8, ``torch.get_rng_state()``). Each episode records
its two lengths. Problem metadata and task state are JSON: a tuple comes back as a list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.errors import CheckpointUnusable
from forgerl.rundirs.checkpoint_layout import LOOP_FORMAT, LOOP_VERSION, LoopState, first_problem

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from forgerl.rollouts.rollout import RolloutBatch

LOOP_FILE = "loop.json"
ARRAYS_FILE = "arrays.safetensors"

PROMPT_IDS = "rollouts/prompt_token_ids"
COMPLETION_IDS = "rollouts/completion_token_ids"
LOGPROBS = "rollouts/completion_logprobs"
TORCH_RNG = "rng/torch"
_ARRAY_DTYPES = {PROMPT_IDS: "int64", COMPLETION_IDS: "int64", LOGPROBS: "float64", TORCH_RNG: "uint8"}


@dataclass
class Snapshot:
    """The loop's part of a checkpoint: plain state, pending rollouts, arrays."""

    state: dict[str, Any]
    rollouts: list[RolloutBatch] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


# ---------------------------------------------------------------------------- writing


def encode(snapshot: Snapshot) -> tuple[str, dict[str, np.ndarray]]:
    """``loop.json``'s text and the arrays for ``arrays.safetensors``."""
    import numpy as np

    prompt_ids: list[int] = []
    completion_ids: list[int] = []
    logprobs: list[float] = []
    batches = []
    for b in snapshot.rollouts:
        episodes = []
        for e in b.episodes:
            c = e.completion
            prompt_ids.extend(e.prompt_token_ids)
            completion_ids.extend(c.token_ids)
            logprobs.extend(c.logprobs)
            episodes.append(
                {
                    "problem": {
                        "id": e.problem.id,
                        "prompt": e.problem.prompt,
                        "answer": e.problem.answer,
                        "metadata": dict(e.problem.metadata),
                    },
                    "group_id": e.group_id,
                    "prompt_len": len(e.prompt_token_ids),
                    "completion": {
                        "len": len(c.token_ids),
                        "finish_reason": c.finish_reason,
                        "policy_version": c.policy_version,
                        "text": c.text,
                        # Only a trajectory's: a single-turn checkpoint stays as it was.
                        **({"mask": list(c.mask)} if c.mask is not None else {}),
                        **({"versions": list(c.versions)} if c.versions is not None else {}),
                    },
                    "reward": float(e.reward),
                    "reward_components": {k: float(v) for k, v in e.reward_components.items()},
                    "reward_failed": bool(e.reward_failed),
                    "advantage": float(e.advantage),
                    # Only where there are some: a checkpoint without them stays as it was.
                    **({"error": e.error} if e.error is not None else {}),
                    **({"messages": e.messages} if e.messages is not None else {}),
                }
            )
        batches.append(
            {
                "index": b.index,
                "policy_version": b.policy_version,
                "task_state": b.task_state,
                "gen_seconds": float(b.gen_seconds),
                "reward_seconds": float(b.reward_seconds),
                "gen_tokens": int(b.gen_tokens),
                "rewards_failed": int(b.rewards_failed),
                "extra": {k: float(v) for k, v in b.extra.items()},
                "episodes": episodes,
            }
        )
    state = {"format": LOOP_FORMAT, "version": LOOP_VERSION, **snapshot.state, "pending_rollouts": batches}
    text = json.dumps(state, default=_plain)
    arrays = dict(snapshot.arrays)
    arrays[PROMPT_IDS] = np.asarray(prompt_ids, dtype=np.int64)
    arrays[COMPLETION_IDS] = np.asarray(completion_ids, dtype=np.int64)
    arrays[LOGPROBS] = np.asarray(logprobs, dtype=np.float64)
    return text, arrays


def _plain(obj: Any) -> Any:
    """numpy scalars and arrays in task metadata or state become JSON numbers and lists;
    anything else cannot be saved without pickle."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(
        f"cannot save a {type(obj).__name__} in a checkpoint: task state and problem metadata "
        "must be JSON (str, int, float, bool, None, lists, dicts with str keys)"
    )


def capture_rng() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The Python, numpy and torch (CPU) global generators' states: JSON and arrays."""
    import random

    import numpy as np
    import torch

    version, words, gauss_next = random.getstate()
    npst = np.random.get_state(legacy=False)
    rng = {
        "python": {"version": version, "state": list(words), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": npst["bit_generator"],
            "key": [int(x) for x in npst["state"]["key"]],
            "pos": int(npst["state"]["pos"]),
            "has_gauss": int(npst["has_gauss"]),
            "gauss": float(npst["gauss"]),
        },
    }
    return rng, {TORCH_RNG: torch.get_rng_state().numpy().copy()}


# ---------------------------------------------------------------------------- reading


def decode(text: str, arrays: dict[str, np.ndarray], where: Path) -> Snapshot:
    """Parse and check ``loop.json`` (``where``) with its arrays; refuse anything else."""
    from pydantic import ValidationError

    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise CheckpointUnusable(f"{where}: not JSON ({exc})") from None
    try:
        loop = LoopState.model_validate(raw)
    except ValidationError as exc:
        raise CheckpointUnusable(f"{where}: {first_problem(exc)}") from None
    for name, dtype in _ARRAY_DTYPES.items():
        if name not in arrays:
            raise CheckpointUnusable(f"{where.with_name(ARRAYS_FILE)}: no array {name!r}")
        if arrays[name].ndim != 1 or str(arrays[name].dtype) != dtype:
            raise CheckpointUnusable(
                f"{where.with_name(ARRAYS_FILE)}: {name!r} must be a 1-d {dtype} array, got "
                f"{arrays[name].ndim}-d {arrays[name].dtype}"
            )
    rollouts = _rollouts(loop, arrays, where)
    state = {k: v for k, v in raw.items() if k not in ("format", "version", "pending_rollouts")}
    return Snapshot(state=state, rollouts=rollouts, arrays={TORCH_RNG: arrays[TORCH_RNG]})


def restore_rng(snapshot: Snapshot) -> None:
    """Set the global generators to the (already checked) states of ``snapshot``."""
    import random

    import numpy as np
    import torch

    py = snapshot.state["rng"]["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npst = snapshot.state["rng"]["numpy"]
    np.random.set_state(
        {
            "bit_generator": npst["bit_generator"],
            "state": {"key": np.asarray(npst["key"], dtype=np.uint32), "pos": npst["pos"]},
            "has_gauss": npst["has_gauss"],
            "gauss": npst["gauss"],
        }
    )
    saved = snapshot.arrays[TORCH_RNG]
    expected = torch.get_rng_state().numel()
    if saved.size != expected:
        raise CheckpointUnusable(
            f"rng/torch holds {saved.size} bytes, this torch's generator state is {expected} bytes"
        )
    torch.set_rng_state(torch.from_numpy(saved.copy()))


def _rollouts(loop: LoopState, arrays: dict[str, np.ndarray], where: Path) -> list[RolloutBatch]:
    """The pending batches, their token ids and logprobs cut from the arrays; the arrays
    must hold exactly what the episodes' lengths add up to."""
    from forgerl.rollouts.rollout import RolloutBatch
    from forgerl.types import Completion, Episode, Problem

    prompt_ids = arrays[PROMPT_IDS].tolist()
    completion_ids = arrays[COMPLETION_IDS].tolist()
    logprobs = arrays[LOGPROBS].tolist()
    at_prompt = at_completion = 0
    batches = []
    for i, b in enumerate(loop.pending_rollouts):
        episodes = []
        for j, e in enumerate(b.episodes):
            n_prompt, n_comp = e.prompt_len, e.completion.len
            if at_prompt + n_prompt > len(prompt_ids) or at_completion + n_comp > len(completion_ids):
                raise CheckpointUnusable(
                    f"{where}: pending_rollouts[{i}].episodes[{j}] has more tokens than the arrays hold"
                )
            p, c = e.problem, e.completion
            episodes.append(
                Episode(
                    problem=Problem(id=p.id, prompt=p.prompt, answer=p.answer, metadata=p.metadata),
                    group_id=e.group_id,
                    prompt_token_ids=prompt_ids[at_prompt : at_prompt + n_prompt],
                    completion=Completion(
                        token_ids=completion_ids[at_completion : at_completion + n_comp],
                        logprobs=logprobs[at_completion : at_completion + n_comp],
                        finish_reason=c.finish_reason,
                        policy_version=c.policy_version,
                        text=c.text,
                        mask=c.mask,
                        versions=c.versions,
                    ),
                    reward=e.reward,
                    reward_components=dict(e.reward_components),
                    reward_failed=e.reward_failed,
                    advantage=e.advantage,
                    error=e.error,
                    messages=e.messages,
                )
            )
            at_prompt += n_prompt
            at_completion += n_comp
        batches.append(
            RolloutBatch(
                index=b.index,
                episodes=episodes,
                policy_version=b.policy_version,
                task_state=b.task_state,
                gen_seconds=b.gen_seconds,
                reward_seconds=b.reward_seconds,
                gen_tokens=b.gen_tokens,
                rewards_failed=b.rewards_failed,
                extra=dict(b.extra),
            )
        )
    if (at_prompt, at_completion) != (len(prompt_ids), len(completion_ids)) or len(logprobs) != len(
        completion_ids
    ):
        raise CheckpointUnusable(
            f"{where}: pending_rollouts account for {at_prompt} prompt and {at_completion} completion tokens, "
            f"the arrays hold {len(prompt_ids)}, {len(completion_ids)} and {len(logprobs)} logprobs"
        )
    expected = [loop.step + k for k in range(len(batches))]
    if [b.index for b in batches] != expected:
        raise CheckpointUnusable(
            f"{where}: pending_rollouts are batches {[b.index for b in batches]}, expected {expected}"
        )
    return batches
