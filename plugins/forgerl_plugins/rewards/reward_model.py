"""The ``reward_model`` reward: a Hugging Face sequence-classification model scores
(prompt, completion), in the trainer's process.

The sample is rendered with the tokenizer's chat template (the prompt's messages, then the
completion as the assistant's turn) or, without a template, as prompt + completion; long
texts keep their end (truncation from the left), where the completion is. The score is
the model's single logit (``num_labels == 1``) or the probability of ``label``.

Samples that arrive together (a step's scoring round) are batched: each ``ascore`` call
queues its text, and one forward pass on a worker thread scores up to ``batch_size`` of
them, so the event loop never blocks on the model. Scores of a sample alone are
bit-for-bit reproducible; in a batch, padding may change the last bits.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, cast

from forgerl.interfaces import Reward
from forgerl.types import RewardInput
from forgerl_plugins.rewards import RewardModelOptions


class RewardModelReward(Reward):
    def __init__(self, options: RewardModelOptions):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.options = options
        self.torch = torch
        self.device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(options.model)
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = getattr(torch, options.dtype) if options.dtype else None
        self.model = AutoModelForSequenceClassification.from_pretrained(options.model, torch_dtype=dtype)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()
        self.num_labels = int(self.model.config.num_labels)
        if options.label is not None and not 0 <= options.label < self.num_labels:
            from forgerl.errors import ConfigError

            raise ConfigError(
                f"reward_model: label {options.label} but the model has {self.num_labels} labels"
            )
        positions = getattr(self.model.config, "max_position_embeddings", None) or options.max_length
        self.max_length = min(options.max_length, int(positions))
        self._model_lock = threading.Lock()
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue] = (
            weakref.WeakKeyDictionary()
        )

    # ------------------------------------------------------------------ scoring

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
        torch = self.torch
        batch = self.tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
        ).to(self.device)
        with self._model_lock, torch.inference_mode():
            logits = self.model(**batch).logits.float()
        if self.num_labels == 1:
            values = logits[:, 0]
            if self.options.activation == "sigmoid":
                values = torch.sigmoid(values)
        else:
            label = self.num_labels - 1 if self.options.label is None else self.options.label
            values = (
                logits[:, label] if self.options.activation == "none" else torch.softmax(logits, -1)[:, label]
            )
        return [float(v) for v in values.cpu()]


class _Queue:
    def __init__(self) -> None:
        self.pending: list[tuple[str, asyncio.Future[float]]] = []
        self.flushing = False
        self.task: asyncio.Future[None] | None = None


def _clean(text: Any) -> str:
    """Text the tokenizer accepts: lone surrogates (undecodable bytes) replaced."""
    return str(text).encode("utf-8", "replace").decode("utf-8")
