"""What a checkpoint holds besides the trainer's state, in formats that run no code on load.

Loading a checkpoint must never execute anything its author put there, so nothing here
is pickled: plain state is JSON, arrays are safetensors (a JSON header plus raw bytes).
Every value read back is checked against the version-1 layout below; anything else (a
wrong type, a missing or unknown key, arrays that do not add up) is refused with a
:class:`~forgerl.errors.CheckpointUnusable` naming the file.

``loop.json`` (version 1)::

    {"format": "forgerl.loop-state", "version": 1,
     "step": int, "policy_version": int, "next_rollout_index": int,
     "task_state": {...}, "time_totals": {name: float}, "eval_start": float|null,
     "eval_last": float|null,
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

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from forgerl.rollout import RolloutBatch

LOOP_FILE = "loop.json"
ARRAYS_FILE = "arrays.safetensors"
LOOP_FORMAT = "forgerl.loop-state"
LOOP_VERSION = 1

PROMPT_IDS = "rollouts/prompt_token_ids"
COMPLETION_IDS = "rollouts/completion_token_ids"
LOGPROBS = "rollouts/completion_logprobs"
TORCH_RNG = "rng/torch"
_ARRAY_DTYPES = {PROMPT_IDS: "int64", COMPLETION_IDS: "int64", LOGPROBS: "float64", TORCH_RNG: "uint8"}

_MT_WORDS = 624  # Mersenne Twister state words (Python keeps one more: the position)
_FINISH_REASONS = ("stop", "length", "abort")


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
                    },
                    "reward": float(e.reward),
                    "reward_components": {k: float(v) for k, v in e.reward_components.items()},
                    "reward_failed": bool(e.reward_failed),
                    "advantage": float(e.advantage),
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
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise CheckpointUnusable(f"{where}: not JSON ({exc})") from None
    c = _Checker(where)
    c.obj(raw, "", {
        "format", "version", "step", "policy_version", "next_rollout_index", "task_state",
        "time_totals", "eval_start", "eval_last", "rng", "pending_rollouts",
    })
    if raw["format"] != LOOP_FORMAT:
        c.fail("format", f"is {raw['format']!r}, not {LOOP_FORMAT!r}")
    if raw["version"] != LOOP_VERSION:
        c.fail("version", f"is {raw['version']!r}; this forgerl reads version {LOOP_VERSION}")
    step = c.int(raw["step"], "step")
    c.int(raw["policy_version"], "policy_version")
    c.int(raw["next_rollout_index"], "next_rollout_index", minimum=step)
    c.dict(raw["task_state"], "task_state")
    for k, v in c.dict(raw["time_totals"], "time_totals").items():
        c.float(v, f"time_totals.{k}")
    for key in ("eval_start", "eval_last"):
        if raw[key] is not None:
            c.float(raw[key], key)
    _check_rng(c, raw["rng"])
    for name, dtype in _ARRAY_DTYPES.items():
        if name not in arrays:
            raise CheckpointUnusable(f"{where.with_name(ARRAYS_FILE)}: no array {name!r}")
        if arrays[name].ndim != 1 or str(arrays[name].dtype) != dtype:
            raise CheckpointUnusable(
                f"{where.with_name(ARRAYS_FILE)}: {name!r} must be a 1-d {dtype} array, got "
                f"{arrays[name].ndim}-d {arrays[name].dtype}"
            )
    rollouts = _decode_rollouts(c, raw["pending_rollouts"], arrays, step)
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


def _check_rng(c: _Checker, rng: Any) -> None:
    c.obj(rng, "rng", {"python", "numpy"})
    py = rng["python"]
    c.obj(py, "rng.python", {"version", "state", "gauss_next"})
    if py["version"] != 3:
        c.fail("rng.python.version", f"is {py['version']!r}; Python's random state is version 3")
    words = c.list(py["state"], "rng.python.state", length=_MT_WORDS + 1)
    for i, w in enumerate(words[:-1]):
        c.int(w, f"rng.python.state[{i}]", maximum=2**32 - 1)
    c.int(words[-1], f"rng.python.state[{_MT_WORDS}]", maximum=_MT_WORDS)
    if py["gauss_next"] is not None:
        c.float(py["gauss_next"], "rng.python.gauss_next")
    np_ = rng["numpy"]
    c.obj(np_, "rng.numpy", {"bit_generator", "key", "pos", "has_gauss", "gauss"})
    if np_["bit_generator"] != "MT19937":
        c.fail("rng.numpy.bit_generator", f"is {np_['bit_generator']!r}, not 'MT19937'")
    for i, w in enumerate(c.list(np_["key"], "rng.numpy.key", length=_MT_WORDS)):
        c.int(w, f"rng.numpy.key[{i}]", maximum=2**32 - 1)
    c.int(np_["pos"], "rng.numpy.pos", maximum=_MT_WORDS)
    c.int(np_["has_gauss"], "rng.numpy.has_gauss", maximum=1)
    c.float(np_["gauss"], "rng.numpy.gauss")


def _decode_rollouts(c: _Checker, raw: Any, arrays: dict[str, np.ndarray], step: int) -> list[RolloutBatch]:
    from forgerl.rollout import RolloutBatch
    from forgerl.types import Completion, Episode, Problem

    prompt_ids = arrays[PROMPT_IDS].tolist()
    completion_ids = arrays[COMPLETION_IDS].tolist()
    logprobs = arrays[LOGPROBS].tolist()
    at_prompt = at_completion = 0
    batches = []
    for i, b in enumerate(c.list(raw, "pending_rollouts")):
        w = f"pending_rollouts[{i}]"
        c.obj(b, w, {
            "index", "policy_version", "task_state", "gen_seconds", "reward_seconds", "gen_tokens",
            "rewards_failed", "extra", "episodes",
        })
        episodes = []
        for j, e in enumerate(c.list(b["episodes"], f"{w}.episodes")):
            we = f"{w}.episodes[{j}]"
            c.obj(e, we, {
                "problem", "group_id", "prompt_len", "completion", "reward", "reward_components",
                "reward_failed", "advantage",
            })
            p = e["problem"]
            c.obj(p, f"{we}.problem", {"id", "prompt", "answer", "metadata"})
            c.str(p["id"], f"{we}.problem.id")
            c.str(p["answer"], f"{we}.problem.answer")
            c.dict(p["metadata"], f"{we}.problem.metadata")
            prompt = p["prompt"]
            if not isinstance(prompt, str):
                for k, m in enumerate(c.list(prompt, f"{we}.problem.prompt")):
                    for key, value in c.dict(m, f"{we}.problem.prompt[{k}]").items():
                        c.str(value, f"{we}.problem.prompt[{k}].{key}")
            comp = e["completion"]
            c.obj(comp, f"{we}.completion", {"len", "finish_reason", "policy_version", "text"})
            if comp["finish_reason"] not in _FINISH_REASONS:
                c.fail(f"{we}.completion.finish_reason", f"is {comp['finish_reason']!r}, not one of {_FINISH_REASONS}")
            c.str(comp["text"], f"{we}.completion.text")
            n_prompt = c.int(e["prompt_len"], f"{we}.prompt_len")
            n_comp = c.int(comp["len"], f"{we}.completion.len")
            if at_prompt + n_prompt > len(prompt_ids) or at_completion + n_comp > len(completion_ids):
                c.fail(f"{we}", "has more tokens than the arrays hold")
            comps = {k: c.float(v, f"{we}.reward_components.{k}") for k, v in c.dict(e["reward_components"], f"{we}.reward_components").items()}
            episodes.append(
                Episode(
                    problem=Problem(id=p["id"], prompt=prompt, answer=p["answer"], metadata=p["metadata"]),
                    group_id=c.int(e["group_id"], f"{we}.group_id"),
                    prompt_token_ids=prompt_ids[at_prompt:at_prompt + n_prompt],
                    completion=Completion(
                        token_ids=completion_ids[at_completion:at_completion + n_comp],
                        logprobs=logprobs[at_completion:at_completion + n_comp],
                        finish_reason=comp["finish_reason"],
                        policy_version=c.int(comp["policy_version"], f"{we}.completion.policy_version"),
                        text=comp["text"],
                    ),
                    reward=c.float(e["reward"], f"{we}.reward"),
                    reward_components=comps,
                    reward_failed=c.bool(e["reward_failed"], f"{we}.reward_failed"),
                    advantage=c.float(e["advantage"], f"{we}.advantage"),
                )
            )
            at_prompt += n_prompt
            at_completion += n_comp
        batches.append(
            RolloutBatch(
                index=c.int(b["index"], f"{w}.index", minimum=step),
                episodes=episodes,
                policy_version=c.int(b["policy_version"], f"{w}.policy_version"),
                task_state=c.dict(b["task_state"], f"{w}.task_state"),
                gen_seconds=c.float(b["gen_seconds"], f"{w}.gen_seconds"),
                reward_seconds=c.float(b["reward_seconds"], f"{w}.reward_seconds"),
                gen_tokens=c.int(b["gen_tokens"], f"{w}.gen_tokens"),
                rewards_failed=c.int(b["rewards_failed"], f"{w}.rewards_failed"),
                extra={k: c.float(v, f"{w}.extra.{k}") for k, v in c.dict(b["extra"], f"{w}.extra").items()},
            )
        )
    if (at_prompt, at_completion) != (len(prompt_ids), len(completion_ids)) or len(logprobs) != len(completion_ids):
        c.fail(
            "pending_rollouts",
            f"account for {at_prompt} prompt and {at_completion} completion tokens, the arrays hold "
            f"{len(prompt_ids)}, {len(completion_ids)} and {len(logprobs)} logprobs",
        )
    expected = [step + k for k in range(len(batches))]
    if [b.index for b in batches] != expected:
        c.fail("pending_rollouts", f"are batches {[b.index for b in batches]}, expected {expected}")
    return batches


class _Checker:
    """Type checks that name the file and the field of the first thing that is wrong."""

    def __init__(self, where: Path):
        self.where = where

    def fail(self, field: str, problem: str) -> None:
        raise CheckpointUnusable(f"{self.where}: {field or 'the top level'} {problem}")

    def obj(self, value: Any, field: str, keys: set[str]) -> dict[str, Any]:
        self.dict(value, field)
        missing, unknown = keys - value.keys(), value.keys() - keys
        if missing or unknown:
            what = []
            if missing:
                what.append(f"lacks {', '.join(sorted(missing))}")
            if unknown:
                what.append(f"has unknown {', '.join(sorted(unknown))}")
            self.fail(field, " and ".join(what))
        return value

    def dict(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(field, f"must be an object, got {_kind(value)}")
        return value

    def list(self, value: Any, field: str, length: int | None = None) -> list[Any]:
        if not isinstance(value, list):
            self.fail(field, f"must be a list, got {_kind(value)}")
        if length is not None and len(value) != length:
            self.fail(field, f"must hold {length} items, got {len(value)}")
        return value

    def int(self, value: Any, field: str, minimum: int = 0, maximum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(field, f"must be an integer, got {_kind(value)}")
        if value < minimum or (maximum is not None and value > maximum):
            self.fail(field, f"is {value}, outside [{minimum}, {maximum if maximum is not None else '...'}]")
        return value

    def float(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(field, f"must be a number, got {_kind(value)}")
        return float(value)

    def bool(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            self.fail(field, f"must be true or false, got {_kind(value)}")
        return value

    def str(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            self.fail(field, f"must be a string, got {_kind(value)}")
        return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"{type(value).__name__} {value!r}"[:60]
    )
