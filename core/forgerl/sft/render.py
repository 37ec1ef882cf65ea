"""Demonstrations rendered to token ids and a loss mask, the way rollouts are.

A chat is rendered as an environment renders a trajectory (:mod:`forgerl.rollouts.chat_tokens`),
never as one call of the chat template over the whole conversation: the prompt is the
template's rendering of the leading messages with the generation prompt (tools offered
as the template or the system prompt offers them), each assistant turn is the tokens of
its text (tool calls written as a model writes them, :func:`forgerl.sft.rows.call_text`;
a special token's string in it is text, as a model writes it, never the token)
followed by the end of turn a model samples (the template's close up to its first special
token, ``<|im_end|>`` in ChatML), and the messages between two assistant turns (tool
answers, user turns) are :meth:`~forgerl.rollouts.chat_tokens.ChatTokens.observation_ids`: the rest
of the template's close, those messages, the next assistant header. So the tokens SFT
trains on are, token for token, those of a trajectory in which the model wrote the
demonstration's turns; and a single-turn chat prompt is what the RL loop sends its
generator (:class:`forgerl.rollouts.rollout.Tokenizing`).

The loss mask is 1 on the assistant's tokens (``sft.loss_on: assistant``) or on every
token (``all``; a text row always). Position ``t`` of the mask says whether token ``t``
is trained on (predicted from the tokens before it), as :class:`forgerl.types.TrainBatch`
reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from forgerl.rollouts.chat_tokens import ChatTokens, text_prompt_ids, written_ids
from forgerl.sft.rows import Chat, Demonstration, Text

Outcome = Literal["kept", "truncated", "too_long", "nothing_to_train"]


@dataclass
class Example:
    """One rendered demonstration: ``input_ids`` and its ``loss_mask`` (same length)."""

    input_ids: list[int]
    loss_mask: list[int]
    where: str

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask[1:])


@dataclass(frozen=True)
class Rendered:
    """What became of a demonstration: the example (None when left out) and why."""

    example: Example | None
    outcome: Outcome


class Renderer:
    """Renders demonstrations with one tokenizer (its chat template), ``loss_on``
    (``assistant`` | ``all``), at most ``max_length`` tokens each (``overlong``:
    ``truncate`` or ``drop`` what is longer)."""

    def __init__(self, tokenizer: Any, *, loss_on: str = "assistant", max_length: int = 1024,
                 overlong: str = "truncate") -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.loss_on = loss_on
        self.max_length = max_length
        self.overlong = overlong
        self._chats: dict[str, ChatTokens] = {}

    def render(self, demo: Demonstration) -> Rendered:
        ids, mask = self._chat(demo) if isinstance(demo, Chat) else self._text(demo)
        outcome: Outcome = "kept"
        if len(ids) > self.max_length:
            if self.overlong == "drop":
                return Rendered(None, "too_long")
            ids, mask, outcome = ids[: self.max_length], mask[: self.max_length], "truncated"
        example = Example(ids, mask, demo.where)
        if example.loss_tokens == 0:  # a prompt that fills max_length: nothing left to learn
            return Rendered(None, "nothing_to_train")
        return Rendered(example, outcome)

    # ------------------------------------------------------------------ chats

    def chat_tokens(self, tools: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> ChatTokens:
        """The :class:`ChatTokens` of this tokenizer with ``tools`` (one per set of tools)."""
        key = json.dumps(list(tools), sort_keys=True)
        if key not in self._chats:
            self._chats[key] = ChatTokens(self.tokenizer, list(tools))
        return self._chats[key]

    def turn_end(self, chat: ChatTokens) -> list[int]:
        """The tokens a model samples to end its turn: the template's close up to and
        including its first special token (ChatML ``<|im_end|>``, Llama 3 ``<|eot_id|>``),
        where generation stops; the eos token for a template whose close has none."""
        close = chat.ids(chat.assistant_close)
        special = set(self.tokenizer.all_special_ids)
        for k, token in enumerate(close):
            if token in special:
                return close[: k + 1]
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [int(eos)]

    def _chat(self, demo: Chat) -> tuple[list[int], list[int]]:
        chat = self.chat_tokens(demo.tools)
        every = int(self.loss_on == "all")
        messages = [dict(m) for m in demo.messages]
        ids = chat.prompt_ids(messages[: demo.prompt])
        mask = [every] * len(ids)
        end = self.turn_end(chat)
        i = demo.prompt
        while i < len(messages):
            assert messages[i]["role"] == "assistant", f"{demo.where}: message {i} starts a turn, not an assistant's"
            turn = chat.written_ids(messages[i]["content"]) + end
            ids += turn
            mask += [1] * len(turn)
            j = i + 1
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            if j > i + 1:
                between = chat.observation_ids(turn, messages[i + 1 : j])
                ids += between
                mask += [every] * len(between)
            i = j
        return ids, mask

    # ------------------------------------------------------------------ text

    def _text(self, demo: Text) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        eos = [] if tok.eos_token_id is None else [int(tok.eos_token_id)]
        if demo.whole:
            ids = list(tok(demo.completion, add_special_tokens=True)["input_ids"]) + eos
            return ids, [1] * len(ids)
        # A string prompt is tokenised as the RL loop tokenises one (forgerl.rollouts.rollout.Tokenizing).
        prompt = text_prompt_ids(tok, demo.prompt)
        completion = written_ids(tok, demo.completion) + eos
        every = int(self.loss_on == "all")
        return prompt + completion, [every] * len(prompt) + [1] * len(completion)
