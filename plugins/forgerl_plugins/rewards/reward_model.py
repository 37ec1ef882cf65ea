"""The ``reward_model`` reward: a Hugging Face sequence-classification model scores
(prompt, completion), in the trainer's process or through a vLLM pooling server.

The sample is rendered with the tokenizer's chat template (the prompt's messages, then the
completion as the assistant's turn) or, without a template, as prompt + completion; long
texts keep their end (truncation from the left), where the completion is. The score is
the model's single logit (``num_labels == 1``) or the probability of ``label``.

Samples that arrive together (a step's scoring round) are batched: each ``ascore`` call
queues its text, and one forward pass on a worker thread scores up to ``batch_size`` of
them, so the event loop never blocks on the model. Scores of a sample alone are
bit-for-bit reproducible; in a batch, padding may change the last bits.

Served (``server: vllm``, or ``url``), the forward pass is one ``/classify`` request of
the same token ids (:mod:`.reward_model_client`); rendering, truncation and the
activation stay here, so both ways score alike.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from forgerl.errors import ConfigError, RewardError
from forgerl.interfaces import Reward
from forgerl.types import RewardInput
from forgerl_plugins.rewards.reward_model_options import Options as _Options

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec


class RewardModelReward(Reward):
    name = "reward_model"
    description = (
        "a Hugging Face sequence-classification model scores each sample (in-process, or served by vLLM)"
    )
    requires = ("torch", "transformers")

    #: The options model, in a module of its own that the parts import (not this class).
    Options: TypeAlias = _Options

    @staticmethod
    def roles(options: RewardModelReward.Options, *, context: RunContext) -> list[RoleSpec]:
        """One vLLM pooling server when ``server: vllm``; none otherwise (:mod:`.reward_server`,
        imported only then: it brings in the served engines' launcher)."""
        from .reward_server import roles

        return roles(options, context=context)

    @staticmethod
    def serve(options: RewardModelReward.Options, *, context: RunContext, role: str, replica: int) -> int:
        """The server of ``role``, in the process forgerl.server_role starts (:func:`.reward_server.serve`)."""
        from .reward_server import serve

        return serve(options, context=context, role=role, replica=replica)

    @staticmethod
    def local_preflight(options: RewardModelReward.Options) -> None:
        """Before ``forge run`` starts the trainer on this machine: the API key of a server at
        ``url`` is in the environment (as the ``remote`` reward's)."""
        if options.url is not None and options.auth_env and not os.environ.get(options.auth_env):
            raise ConfigError(
                f"rewards: reward_model: the environment variable {options.auth_env!r} (options.auth_env) is "
                "not set or empty; export it with the API key of the server at url before `forge run`"
            )

    def __init__(self, options: Options):
        from transformers import AutoConfig, AutoTokenizer

        self.options = options
        self.tokenizer = AutoTokenizer.from_pretrained(options.model)
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        config = AutoConfig.from_pretrained(options.model)
        self.num_labels = int(config.num_labels)
        if options.label is not None and not 0 <= options.label < self.num_labels:
            raise ConfigError(
                f"reward_model: label {options.label} but the model has {self.num_labels} labels"
            )
        positions = getattr(config, "max_position_embeddings", None) or options.max_length
        self.max_length = min(options.max_length, int(positions))
        self.model: Any = None
        self.client: Any = None
        if options.server != "none" or options.url is not None:
            from .reward_model_client import ServedClassifier

            self.client = ServedClassifier(options)  # the run's server: waits until it is ready
        else:
            self._load_model()
        self._model_lock = threading.Lock()
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue] = (
            weakref.WeakKeyDictionary()
        )

    def _load_model(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        options = self.options
        self.torch = torch
        self.device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = getattr(torch, options.dtype) if options.dtype else None
        self.model = AutoModelForSequenceClassification.from_pretrained(options.model, torch_dtype=dtype)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()

    # ------------------------------------------------------------------ scoring

    async def until_ready(self) -> None:
        """Served: while the server is out of service (being restarted), wait for it, as
        long as a restart may take (:meth:`.reward_model_client.ServedClassifier.wait_in_service`)."""
        if self.client is not None:
            await self.client.wait_in_service()

    async def ascore(self, sample: RewardInput) -> float:
        loop = asyncio.get_running_loop()
        queue = self._queues.get(loop)
        if queue is None:
            queue = self._queues[loop] = _Queue()
        future: asyncio.Future[float] = loop.create_future()
        queue.pending.append((self.render(sample), future))
        if not queue.flushing:
            queue.flushing = True
            queue.task = asyncio.ensure_future(self._flush(queue))  # held: a bare task may be collected
        return await future

    async def _flush(self, queue: _Queue) -> None:
        try:
            await asyncio.sleep(0)  # let the rest of this scoring round queue up
            while queue.pending:
                batch = queue.pending[: self.options.batch_size]
                del queue.pending[: len(batch)]
                batch = [(text, f) for text, f in batch if not f.done()]  # cancelled: timed out
                if not batch:
                    continue
                try:
                    scores = await asyncio.to_thread(self.forward, [text for text, _ in batch])
                except Exception as exc:  # noqa: BLE001 - each sample of the batch fails with it
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), value in zip(batch, scores, strict=True):
                    if not future.done():
                        future.set_result(value)
        finally:
            queue.flushing = False

    def render(self, sample: RewardInput) -> str:
        prompt = sample.problem.prompt
        completion = _clean(sample.completion_text)
        if self.options.chat_template and getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            messages = [{"role": m["role"], "content": _clean(m["content"])} for m in messages]
            messages.append({"role": "assistant", "content": completion})
            # tokenize=False: the text; transformers types the result as every mode's union.
            return cast(str, self.tokenizer.apply_chat_template(messages, tokenize=False))
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        return _clean(text) + completion

    def forward(self, texts: list[str]) -> list[float]:
        """Scores of ``texts`` in one forward pass (blocking)."""
        rows = self._served_logits(texts) if self.client is not None else self._local_logits(texts)
        return [self.value(row) for row in rows]

    def _local_logits(self, texts: list[str]) -> list[list[float]]:
        torch = self.torch
        batch = self.tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
        ).to(self.device)
        with self._model_lock, torch.inference_mode():
            logits = self.model(**batch).logits.float()
        return cast(list[list[float]], logits.cpu().tolist())

    def _served_logits(self, texts: list[str]) -> list[list[float]]:
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        return cast(list[list[float]], self.client.logits([list(map(int, row)) for row in ids]))

    def value(self, logits: list[float]) -> float:
        """The score from one sample's logits, as the options say."""
        if len(logits) != self.num_labels:
            raise RewardError(f"reward_model: {len(logits)} logits for a model of {self.num_labels} labels")
        activation = self.options.activation
        if self.num_labels == 1:
            return _sigmoid(logits[0]) if activation == "sigmoid" else float(logits[0])
        label = self.num_labels - 1 if self.options.label is None else self.options.label
        if activation == "none":
            return float(logits[label])
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        return exps[label] / sum(exps)


class _Queue:
    def __init__(self) -> None:
        self.pending: list[tuple[str, asyncio.Future[float]]] = []
        self.flushing = False
        self.task: asyncio.Future[None] | None = None


def _sigmoid(x: float) -> float:
    # Either branch keeps exp's argument at most 0: no overflow for any logit.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def _clean(text: Any) -> str:
    """Text the tokenizer accepts: lone surrogates (undecodable bytes) replaced."""
    return str(text).encode("utf-8", "replace").decode("utf-8")
