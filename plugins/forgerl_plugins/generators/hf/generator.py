"""The ``hf`` generator: sampling with transformers in this process.

The reference backend: small, exact, and easy to read. It runs its own decoding loop
(left-padded batches, a KV cache) instead of ``model.generate`` so that two promises hold:

* Logprobs follow the contract shared with the trainer: ``log_softmax(logits / T)`` at the
  sampled token (T = 1 when greedy), before any top-k/top-p filtering. The trainer
  computes the same from its forward pass, so the train/inference gap is ~0 at equal
  weights.
* Sampling is reproducible per sequence: sequence ``i`` of a request draws its uniforms
  from a generator seeded with ``seed + i``, one per token, so its tokens do not depend on
  the batch it happens to be in (exact resume relies on it).

A vision-language model (a folder with a ``vision_config``) takes requests with images:
the processor's features travel with the request (:class:`forgerl.types.ImageInputs`) and
are fed at the prefill; the sequences of one image prompt are decoded together (they share
its features and its length), apart from other prompts.

With a LoRA trainer (``context.adapter``) each version holds only the adapter, which is
loaded onto the model's PEFT layers in place (:mod:`.adapter`): no merge, the base weights
untouched; version 0 is the base model.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from pydantic import Field

from forgerl.errors import ConfigError, GeneratorError, TransportError
from forgerl.interfaces import Generator, RunContext, Transport, TransportReceiver
from forgerl.options import OptionsModel
from forgerl.types import (
    Completion,
    FinishReason,
    GenerationRequest,
    GeneratorHealth,
    ImageInputs,
    SamplingParams,
    tie_key,
)
from forgerl_plugins.models.vision import (
    image_kwargs,
    is_vision_folder,
    load_model,
    placeholder_ids,
    text_config,
)

from .adapter import ServedAdapter, few

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

WORKER_ID = "hf-0"
_DTYPES = ("float32", "bfloat16", "float16")


# ---------------------------------------------------------------------------- sampling


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``[B, V]`` and its logprob under the contract.

    ``temperature`` 0 is greedy (argmax; logprob at T = 1). Otherwise the token is drawn
    by inverting the CDF of ``softmax(logits / T)`` restricted to top-k then top-p at the
    row's ``uniform`` in [0, 1). The returned logprob is ``log_softmax(logits / T)`` at the
    token, unfiltered: filtering shapes what is drawn, not the policy the loss corrects for.
    """
    import torch

    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = scaled.argmax(dim=-1)
    if not bool(greedy.all()):
        sampled = _sample(scaled, top_k, top_p, uniform)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _sample(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    import torch

    vocab = scaled.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    if bool((k >= vocab).all()) and bool((top_p >= 1).all()):
        return _inverse_cdf(torch.softmax(scaled, dim=-1), uniform)
    # stable: equal logits keep vocabulary order, so the draw is deterministic.
    values, order = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=scaled.device)
    values = values.masked_fill(ranks >= k.unsqueeze(-1), float("-inf"))
    probs = torch.softmax(values, dim=-1)
    # top-p on the top-k distribution (as vLLM and transformers do): keep a token while the
    # mass before it is below p; the most likely token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p.unsqueeze(-1), 0.0)
    return order.gather(-1, _inverse_cdf(probs, uniform).unsqueeze(-1)).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i]: never a zero-probability token."""
    import torch

    cdf = probs.double().cumsum(dim=-1)
    target = (uniform.double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


# ----------------------------------------------------------------------------- decoding


@dataclass
class _Sequence:
    """One sequence being generated: where its completion goes and its random stream."""

    request: int
    index: int
    prompt: list[int]
    sampling: SamplingParams
    rng: torch.Generator
    max_new: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    text: str | None = None
    images: ImageInputs | None = None


def _seeded(seed: int) -> torch.Generator:
    import torch

    # CPU generator whatever the device: the same seed draws the same uniforms everywhere.
    return torch.Generator(device="cpu").manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)


class HFGenerator(Generator):
    """``HFGenerator(options, *, context, transport)``: loads ``context.model_path`` and
    samples in-process; new weights come through a receiver of ``transport``."""

    name = "hf"
    description = "transformers forward passes with a KV cache, in the trainer's process"
    requires = ("torch", "transformers")
    #: With a LoRA trainer, the model gets the same PEFT layers as the trainer's and each
    #: version's adapter is copied into them (:mod:`.adapter`).
    serves_adapters: ClassVar[bool] = True
    #: Requests may carry images (served when the model is a vision-language model).
    accepts_images: ClassVar[bool] = True

    class Options(OptionsModel):
        batch_size: int = Field(16, ge=1, le=65_536, description="Sequences generated together in one forward pass.")
        dtype: str | None = Field(
            None,
            pattern="^(float32|bfloat16|float16)$",
            description="Override the model dtype for generation (default: model.dtype of the run).",
        )
        device: str | None = Field(
            None, description="torch device to generate on (default: cuda when available, else cpu)."
        )

    def __init__(self, options: HFGenerator.Options, *, context: RunContext, transport: Transport) -> None:
        import torch
        from transformers import AutoTokenizer

        if context.model_path is None:
            raise ConfigError("the hf generator needs a local model folder (RunContext.model_path is unset)")
        self.options = options
        self.ctx = context
        self.transport = transport
        dtype_name = options.dtype or context.dtype
        if dtype_name not in _DTYPES:
            raise ConfigError(f"hf generator: dtype {dtype_name!r} is not one of {', '.join(_DTYPES)}")
        self.dtype = getattr(torch, dtype_name)
        self.device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        path = Path(context.model_path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            model = load_model(path, self.dtype)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"hf generator cannot load the model in {path}: {exc}") from exc
        self.model = model.to(self.device).eval().requires_grad_(False)
        # The trainer's adapter, off until its first version arrives: version 0 is the base model.
        self.adapter = ServedAdapter(self.model, context.adapter) if context.adapter is not None else None
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_positions = getattr(text_config(self.model), "max_position_embeddings", None)
        self.vision = is_vision_folder(path)
        self.eos_ids = self._eos_ids()
        #: A VLM's image placeholder tokens end a sequence when sampled (see placeholder_ids).
        self.placeholder_ids = placeholder_ids(self.model)
        if not self.eos_ids:
            log.warning("hf generator: %s defines no eos token; completions end at max_tokens", path)
        pad = self.model.generation_config.pad_token_id
        if pad is None:
            pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0))
        # Guards the weights: generation and loading never overlap.
        self._lock = threading.Lock()
        self._version = 0
        self._receiver: TransportReceiver | None = None
        self._closed = False

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if source is None:
                continue
            ids.update([source] if isinstance(source, int) else source)
        return frozenset(int(i) for i in ids)

    @property
    def policy_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ generation

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        return await asyncio.to_thread(self._generate_locked, list(requests))

    def _generate_locked(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        with self._lock:
            if self._closed:
                raise GeneratorError("the hf generator is closed")
            version = self._version
            sequences = list(self._expand(requests))
            size = self.options.batch_size
            plain = [s for s in sequences if s.images is None]
            for start in range(0, len(plain), size):
                self._decode(plain[start : start + size])
            for r in sorted({s.request for s in sequences if s.images is not None}):
                same = [s for s in sequences if s.request == r]
                for start in range(0, len(same), size):
                    self._decode(same[start : start + size])
        out: list[list[Completion]] = [[] for _ in requests]
        for s in sequences:
            text = s.text if s.text is not None else self._text(s.tokens)
            assert s.finish is not None, f"sequence {s.request}/{s.index} did not finish"
            out[s.request].append(Completion(s.tokens, s.logprobs, s.finish, version, text))
        return out

    def _expand(self, requests: list[GenerationRequest]) -> Iterable[_Sequence]:
        for r, request in enumerate(requests):
            prompt = [int(t) for t in request.prompt_token_ids]
            if not prompt:
                raise GeneratorError(f"request {request.request_id!r} has an empty prompt")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise GeneratorError(
                    f"request {request.request_id!r}: token ids {bad[:5]} are outside the "
                    f"model's vocabulary of {self.vocab_size}"
                )
            if request.images is not None and not self.vision:
                raise GeneratorError(
                    f"request {request.request_id!r} has {len(request.images)} images but the model "
                    "is not a vision-language model (its config has no vision_config)"
                )
            sampling = request.sampling
            max_new = sampling.max_tokens
            if self.max_positions is not None:
                room = self.max_positions - len(prompt)
                if room <= 0 < max_new:
                    raise GeneratorError(
                        f"request {request.request_id!r}: its prompt of {len(prompt)} tokens "
                        f"fills the model's context of {self.max_positions}"
                    )
                max_new = min(max_new, room)
            seed = sampling.seed if sampling.seed is not None else random.SystemRandom().getrandbits(63)
            for i in range(request.n):
                yield _Sequence(r, i, prompt, sampling, _seeded(seed + i), max(0, max_new), images=request.images)

    def _decode(self, batch: list[_Sequence]) -> None:
        """Generate ``batch`` to completion: one prefill, then one token per step."""
        import torch
        from transformers import DynamicCache

        dev = self.device
        width = max(len(s.prompt) for s in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, width - len(s.prompt) :] = torch.tensor(s.prompt)
            mask[row, width - len(s.prompt) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        # Left padding: positions count real tokens only, as in an unpadded forward.
        positions: torch.Tensor | None = (mask.cumsum(-1) - 1).clamp(min=0)
        temperature = torch.tensor([s.sampling.temperature for s in batch], dtype=torch.float32, device=dev)
        top_k = torch.tensor([s.sampling.top_k for s in batch], dtype=torch.long, device=dev)
        top_p = torch.tensor([s.sampling.top_p for s in batch], dtype=torch.float32, device=dev)
        for s in batch:
            if s.max_new == 0:
                s.finish = "length"

        images = batch[0].images
        extra: dict[str, Any] = {}
        if images is not None:
            # One prompt's sequences (see _generate_locked): no padding, and the model
            # computes its own positions (Qwen2-VL's are 3-D, from the image grid).
            extra = image_kwargs(images, dev, self.dtype, repeat=len(batch))
            positions = None
        cache = DynamicCache(config=text_config(self.model))
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **extra,
            )
            next_position = None if positions is None else positions[:, -1:] + 1
            while True:
                active = [s.finish is None for s in batch]
                if not any(active):
                    return
                uniform = torch.tensor(
                    [
                        float(torch.rand((), generator=s.rng)) if live and s.sampling.temperature > 0 else 0.0
                        for s, live in zip(batch, active, strict=True)
                    ],
                    dtype=torch.float64,
                    device=dev,
                )
                tokens, logprobs = choose_tokens(out.logits[:, -1, :], temperature, top_k, top_p, uniform)
                for s, live, token, logprob in zip(batch, active, tokens.tolist(), logprobs.tolist(), strict=True):
                    if live:
                        self._append(s, token, logprob)
                if all(s.finish is not None for s in batch):
                    return
                # Finished rows keep stepping on padding (their outputs are ignored): the
                # cache stays one rectangular batch.
                feed = torch.tensor(
                    [t if s.finish is None else self.pad_id for s, t in zip(batch, tokens.tolist(), strict=True)],
                    dtype=torch.long,
                    device=dev,
                ).unsqueeze(-1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                out = self.model(
                    input_ids=feed,
                    attention_mask=mask,
                    position_ids=next_position,
                    past_key_values=cache,
                    use_cache=True,
                )
                if next_position is not None:
                    next_position = next_position + 1

    def _append(self, s: _Sequence, token: int, logprob: float) -> None:
        s.tokens.append(token)
        s.logprobs.append(logprob)
        if token in self.eos_ids or token in self.placeholder_ids:
            s.finish = "stop"  # the eos token stays, with its logprob: the policy chose it
        elif s.sampling.stop and self._hit_stop_string(s):
            s.finish = "stop"
        elif len(s.tokens) >= s.max_new:
            s.finish = "length"

    def _text(self, tokens: list[int]) -> str:
        # decode returns a list of strings only for a batch of sequences.
        return cast(str, self.tokenizer.decode(tokens, skip_special_tokens=True))

    def _hit_stop_string(self, s: _Sequence) -> bool:
        text = self._text(s.tokens)
        hits = [i for stop in s.sampling.stop if stop and (i := text.find(stop)) >= 0]
        if not hits:
            return False
        # As vLLM does: the text ends before the stop string; the tokens keep it.
        s.text = text[: min(hits)]
        return True

    # --------------------------------------------------------------------- weights

    def update_weights(self, version: int) -> None:
        """Receive ``version`` in full, check it, then copy it into the model under the lock
        (with a LoRA trainer: into the adapter's A and B).

        Any failure (timeout, unknown or missing names, wrong shapes) leaves the served
        weights and version as they were.
        """
        if self._closed:
            raise GeneratorError("the hf generator is closed")
        receiver = self._get_receiver()
        timeout = float(self.ctx.transport_timeout)
        try:
            staged = dict(receiver.receive(version, timeout=timeout))
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"hf generator: receiving weights version {version} failed: {exc}") from exc
        with self._lock:
            if self._closed:
                raise GeneratorError("the hf generator is closed")
            if self.adapter is not None:
                self.adapter.check(version, staged)
                self.adapter.load(staged)
            else:
                self._load_weights(version, staged)
            self._version = int(version)
        log.debug("hf generator: loaded weights version %d (%d tensors)", version, len(staged))

    def _load_weights(self, version: int, staged: dict[str, torch.Tensor]) -> None:
        import torch

        targets = self.model.state_dict()
        self._check(version, staged, targets)
        with torch.no_grad():
            for name, tensor in staged.items():
                targets[name].copy_(tensor)

    def _get_receiver(self) -> TransportReceiver:
        if self._receiver is None:
            self._receiver = self.transport.receiver(WORKER_ID)
            if self.ctx.model_path is not None:
                self._receiver.seed_from(self.ctx.model_path)
        return self._receiver

    @staticmethod
    def _check(version: int, staged: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
        """Names and shapes must match the model. Tied weights (embeddings and lm_head) are
        one tensor under several names: any one of them suffices, and copying into either
        updates both."""
        unknown = sorted(set(staged) - set(targets))
        if unknown:
            raise TransportError(
                f"weights version {version} has names the generator's model does not: "
                f"{few(unknown)} (a different model or naming on the trainer side?)"
            )
        groups: dict[Any, list[str]] = {}
        for name, t in targets.items():
            key = tie_key(t) if t.numel() else name
            groups.setdefault(key, []).append(name)
        missing = [names[0] for names in groups.values() if not any(n in staged for n in names)]
        if missing:
            raise TransportError(f"weights version {version} lacks {len(missing)} tensors: {few(missing)}")
        wrong = [
            f"{n} {tuple(t.shape)} (model: {tuple(targets[n].shape)})"
            for n, t in staged.items()
            if tuple(t.shape) != tuple(targets[n].shape)
        ]
        if wrong:
            raise TransportError(f"weights version {version} has wrong shapes: {few(wrong)}")
        for names in groups.values():
            given = [n for n in names if n in staged]
            if len(given) > 1 and not all(staged[n].equal(staged[given[0]]) for n in given[1:]):
                raise TransportError(
                    f"weights version {version}: tied tensors {', '.join(given)} have different values"
                )

    # ---------------------------------------------------------------------- health

    def health(self) -> GeneratorHealth:
        return GeneratorHealth(
            healthy=not self._closed,
            policy_version=self._version,
            detail=f"hf on {self.device}, {str(self.dtype).removeprefix('torch.')}"
            + (f", LoRA adapter on {len(self.adapter.targets)} layers" if self.adapter is not None else "")
            + (" (closed)" if self._closed else ""),
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._receiver is not None:
                self._receiver.close()
                self._receiver = None
            self.model = None
            self.adapter = None  # it holds the model too

