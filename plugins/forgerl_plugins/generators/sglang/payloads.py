"""What the sglang generator sends to SGLang and how it reads the answers: the bodies of
``/generate`` and of the weight-update calls, under SGLang's own field names
(``sglang.srt.managers.io_struct`` of the release named in :data:`..SGLANG_VERSION`).

Generation sends one ``/generate`` per sample: the prompt as ``input_ids``, the sampling
parameters, ``return_logprob: true`` with ``logprob_start_len: -1`` (logprobs of the
completion's tokens only) and a request id of its own (``rid``, what ``/abort_request``
names). Per sample, not one request with ``n``: each sample then has its own seed, and
a failed sample is retried alone.

Every answer of SGLang 0.5.23 names the weights that sampled each token:
``meta_info.weight_versions``, spans ``{version, start, end}`` over the output tokens,
recorded by SGLang's scheduler when its weight version changed (the number of tokens each
request had sampled then: exact, not a timing estimate). Under update policy ``keep`` a
request runs across updates and its spans name several versions
(:func:`token_versions`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from forgerl.errors import GeneratorError
from forgerl.interfaces import TensorSpec
from forgerl.types import Completion, FinishReason, GenerationRequest
from forgerl_plugins.generators.common.client import error_message
from forgerl_plugins.generators.common.crossings import set_versions
from forgerl_plugins.generators.common.pool import ReplicaFailed

if TYPE_CHECKING:  # pragma: no cover
    import httpx

FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
#: Seeds of a request's samples are ``seed + i * SEED_STRIDE``: distinct draws, reproducible.
SEED_STRIDE = 1_000_003


def generate_body(
    request: GenerationRequest, sample: int, rid: str, *, send_seed: bool, lora: str | None = None
) -> dict[str, Any]:
    """The ``/generate`` body of sample ``sample`` of ``request`` (sampled with the LoRA
    adapter named ``lora``, when given: SGLang takes its name in ``lora_path``)."""
    prompt = [int(t) for t in request.prompt_token_ids]
    if not prompt:
        raise GeneratorError(f"request {request.request_id!r} has an empty prompt")
    s = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": int(s.max_tokens),
        "temperature": float(s.temperature),
        "top_p": float(s.top_p),
        "top_k": int(s.top_k) if s.top_k > 0 else -1,  # -1: the whole vocabulary
        "skip_special_tokens": True,
    }
    if s.stop:
        params["stop"] = list(s.stop)
    if send_seed and s.seed is not None:
        params["sampling_seed"] = int(s.seed) + sample * SEED_STRIDE
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": prompt,
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if lora is not None:
        body["lora_path"] = lora
    return body


def parse_generate(
    request: GenerationRequest, resp: httpx.Response, version: int, *, crossed: Collection[int] = ()
) -> Completion:
    """One sample's completion, dispatched under weights ``version``; ``crossed``: the
    versions loaded into the replica while it was in flight (update policy ``keep``), which
    its tokens may also name. Raises ReplicaFailed where another replica (or a restarted
    one) should be asked, GeneratorError where the request itself is at fault."""
    if resp.status_code >= 500 or resp.status_code in (401, 403):
        raise ReplicaFailed(f"HTTP {resp.status_code}: {error_message(resp)}")
    if resp.status_code != 200:
        raise GeneratorError(
            f"SGLang rejected request {request.request_id!r} (HTTP {resp.status_code}): {error_message(resp)}"
        )
    out = resp.json()
    if isinstance(out, list):  # a batched answer: we send one sample per request
        if len(out) != 1:
            raise GeneratorError(f"request {request.request_id!r}: one sample asked, {len(out)} returned")
        out = out[0]
    meta = out.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    kind = str(finish.get("type") if isinstance(finish, dict) else finish)
    if kind == "abort":
        # Not one of our updates (those are caught by Replica.aborts): the server's own.
        raise ReplicaFailed(
            f"the server aborted the request: {finish.get('message') if isinstance(finish, dict) else ''}"
        )
    triples = meta.get("output_token_logprobs") or []
    tokens = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) for t in triples]
    ids = out.get("output_ids")
    if ids is not None and [int(t) for t in ids] != tokens:
        raise GeneratorError(
            f"request {request.request_id!r}: SGLang's output_ids and output_token_logprobs disagree"
        )
    completion = Completion(tokens, logprobs, FINISH.get(kind, "stop"), version, out.get("text") or "")
    versions = token_versions(request, meta, len(tokens), version, crossed)
    set_versions(completion, version, versions)
    return completion


def token_versions(
    request: GenerationRequest, meta: dict[str, Any], n: int, version: int, crossed: Collection[int]
) -> list[int]:
    """The version that sampled each of ``n`` output tokens, from SGLang's spans. A version
    neither dispatched nor loaded while the request ran means the replica's weights
    changed under it by someone else's hand: ReplicaFailed."""
    allowed = {version, *crossed}
    spans = meta.get("weight_versions")
    if spans is None:
        # An SGLang that does not report spans: its one label is trusted only where no
        # update happened while the request ran (then there is one version to name).
        served = meta.get("weight_version")
        if served is not None and str(served) != str(version):
            raise ReplicaFailed(f"served by weights {served!r}, expected version {version}")
        if crossed:
            raise GeneratorError(
                f"request {request.request_id!r} ran across a weight update, but SGLang's answer has no "
                "meta_info.weight_versions to say which weights sampled each token: update_policy keep needs "
                "SGLang 0.5.23 or later (or use update_policy wait or abort)"
            )
        return [version] * n
    versions: list[int] = []
    for span in spans if isinstance(spans, list) else [spans]:
        try:
            name, start, end = str(span["version"]), int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError) as exc:
            raise GeneratorError(f"request {request.request_id!r}: SGLang's weight_versions is malformed: {spans!r}") from exc
        if not name.isdigit() or int(name) not in allowed:
            raise ReplicaFailed(f"served by weights {name!r}, expected version {version}")
        if start != len(versions) or end < start or (versions and int(name) < versions[-1]):
            raise GeneratorError(f"request {request.request_id!r}: SGLang's weight_versions is malformed: {spans!r}")
        versions += [int(name)] * (end - start)
    if len(versions) != n:
        raise GeneratorError(
            f"request {request.request_id!r}: SGLang's weight_versions cover {len(versions)} tokens, the answer has {n}"
        )
    return versions


def update_from_disk_body(model_path: str, version: int) -> dict[str, Any]:
    return {"model_path": model_path, "weight_version": str(version), "flush_cache": True}


def init_group_body(group: dict[str, Any]) -> dict[str, Any]:
    keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
    return {k: group[k] for k in keys}


def update_distributed_body(bucket: list[TensorSpec], group_name: str) -> dict[str, Any]:
    return {
        "names": [t.name for t in bucket],
        "dtypes": [t.dtype for t in bucket],
        "shapes": [list(t.shape) for t in bucket],
        "group_name": group_name,
        # Flushed once, after the last bucket; the version is named then too
        # (/update_weight_version), so a half-loaded replica never reports the new one.
        "flush_cache": False,
    }


def weight_version_body(version: int) -> dict[str, Any]:
    # Nothing runs on a paused replica that we would keep: no abort needed.
    return {"new_version": str(version), "abort_all_requests": False}


#: SGLang's pause mode for each update policy.
PAUSE_MODES = {"wait": "in_place", "abort": "abort", "keep": "retract"}


def pause_body(policy: str) -> dict[str, Any]:
    """``wait``: we drained our requests first, and it pauses in place; ``abort``: SGLang
    aborts what runs (we resubmit it); ``keep``: ``retract``, SGLang's running requests go
    back to its waiting queue with their tokens so far and their KV freed: after the
    resume each is prefilled again (prompt and tokens so far) with the new weights and
    goes on (why not ``in_place``: docs/generators.md, "sglang", "Update policy keep")."""
    return {"mode": PAUSE_MODES[policy]}


def begin_update_body() -> dict[str, Any]:
    return {}  # every runner (SGLang's default selector)


def end_update_body() -> dict[str, Any]:
    return {}
