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
from typing import TYPE_CHECKING, Any, cast

from pydantic import Field, model_validator

from forgerl.errors import ConfigError, RewardError
from forgerl.interfaces import Reward
from forgerl.options import OptionsModel
from forgerl.types import RewardInput

if TYPE_CHECKING:  # pragma: no cover
    from forgerl.interfaces import RunContext
    from forgerl.types import RoleSpec


class RewardModelReward(Reward):
    name = "reward_model"
    description = (
        "a Hugging Face sequence-classification model scores each sample (in-process, or served by vLLM)"
    )
    requires = ("torch", "transformers")

    class Options(OptionsModel):
        model: str = Field(min_length=1, description="Folder (or hub id) of a sequence-classification model.")
        label: int | None = Field(
            None,
            ge=0,
            description="Which label's probability is the score (default: the last; 1-label models: the logit).",
        )
        activation: str = Field(
            "auto",
            pattern="^(auto|none|sigmoid|softmax)$",
            description="auto: the raw logit for 1 label, softmax otherwise; sigmoid squashes a 1-label logit.",
        )
        chat_template: bool = Field(
            True, description="Render prompt and completion with the tokenizer's chat template."
        )
        batch_size: int = Field(16, ge=1, le=4096, description="Samples per forward pass.")
        max_length: int = Field(4096, ge=8, description="Tokens per sample; longer ones keep their end.")
        device: str | None = Field(None, description="torch device (default: cuda when available, else cpu).")
        dtype: str | None = Field(
            None, pattern="^(float32|bfloat16|float16)$", description="Weights' dtype (default: as saved)."
        )
        # Served scoring: a vLLM pooling server (the run's own, or one at ``url``).
        server: str = Field(
            "none",
            pattern="^(none|vllm)$",
            description="none: score in the trainer's process (transformers); vllm: the run starts a vLLM "
            "pooling server for the model beside the trainer and scores through its /classify endpoint.",
        )
        url: str | None = Field(
            None,
            pattern=r"^https?://",
            description="Score through a vLLM pooling server already running there (its /classify endpoint) "
            "instead; `model` still names its tokenizer and config.",
        )
        auth_env: str | None = Field(
            None,
            pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
            description="Name of the environment variable holding the API key of the server at `url`.",
        )
        request_timeout: float = Field(
            60.0, gt=0, le=3600, description="Seconds one scoring request may take."
        )
        tensor_parallel_size: int = Field(
            1, ge=1, le=1024, description="GPUs of the run's server (server: vllm)."
        )
        startup_timeout: float = Field(
            600.0, gt=0, le=86400, description="Seconds the trainer waits for the run's server to be ready."
        )
        max_restarts: int = Field(
            3, ge=0, le=1000, description="Times the scheduler restarts the run's server."
        )
        host: str = Field("127.0.0.1", description="Address the run's server binds to (loopback by default).")
        kv_cache_gb: float | None = Field(
            None,
            gt=0,
            le=1 << 20,
            description="KV cache of the run's server, GiB (default: 0.25 on CPU, vLLM's on GPU).",
        )
        env: dict[str, str] = Field(
            default_factory=dict, description="Extra environment of the run's server."
        )
        engine_args: dict[str, Any] = Field(
            default_factory=dict,
            description="More vLLM engine arguments for the run's server ({max_num_seqs: 64}).",
        )

        @model_validator(mode="after")
        def _one_server(self) -> RewardModelReward.Options:
            if self.url is not None and self.server != "none":
                raise ValueError(
                    "give either url (a server already running) or server: vllm (the run starts one)"
                )
            if self.auth_env is not None and self.url is None:
                raise ValueError("auth_env is the key of the server at url: give url too")
            return self

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
