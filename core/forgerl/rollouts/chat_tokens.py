"""Chat-template renderings turned into token ids, for token-exact multi-turn rollouts.

The conversation of a trajectory is never re-rendered. It is built once as tokens: the
first prompt (the template's rendering of the environment's first messages, tools
offered), then each sampled turn exactly as sampled, then each observation as the ids of
the template's rendering of just those messages. That rendering is the difference
between the template's text for a fixed probe conversation (user, assistant) with and
without the observation messages appended: whatever the template writes around a tool
or user message (Qwen's ``<tool_response>`` wrapping, the next assistant header) is
there, and nothing of earlier turns.

Templates that rewrite earlier turns (Qwen3 drops the ``<think>`` reasoning of past
assistant turns) are not followed into that rewrite: the model sampled turn 2 while
seeing turn 1's reasoning, so the trajectory keeps turn 1's tokens as sampled and the
trainer scores the tokens with the context the sampler had. A chat re-rendered by the
template would be a different sequence than the one sampled.

The end of a sampled turn: the template closes an assistant message with a suffix
(ChatML: ``<|im_end|>\\n``). A turn that stopped on the eos token has sampled part of it
(``<|im_end|>``); the rest (``\\n``) is put in front of the observation, as environment
tokens. A turn cut by its token limit gets the whole suffix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_PROBE = "FORGEPROBE7Q"
_PROBE_CHAT = [{"role": "user", "content": "FORGEUSER7Q"}, {"role": "assistant", "content": _PROBE}]

TOOLS_PREAMBLE = (
    "You can call tools. To call one, write a JSON object on its own line between tags, e.g.\n"
    '<tool_call>{{"name": "{example}", "arguments": {{...}}}}</tool_call>\n'
    "The tool's answer comes back in the next message. The tools:\n{tools}"
)


def text_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A string prompt's ids: tokenised with the tokenizer's special tokens (a BOS it adds),
    once. A text that already begins with the BOS (a prompt recorded from its ids, the chat
    template applied: ``forge samples --export``) is not given a second one."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        del ids[0]
    return ids


def written_ids(tokenizer: Any, text: str) -> list[int]:
    """:meth:`ChatTokens.written_ids` for any tokenizer (one without ``split_special_tokens``
    tokenises as :meth:`ChatTokens.ids` does)."""
    try:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    except TypeError:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class ChatTokens:
    """Renders and tokenises with one tokenizer's chat template and one set of tools."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] = ()):
        self.tokenizer = tokenizer
        self.tools = list(tools)
        #: "template" when the chat template renders ``tools=`` itself; "system" when it
        #: ignores them and they are described in the system prompt instead.
        self.tools_via = "template" if self.tools and self._template_takes_tools() else "system"
        before = self._render(_PROBE_CHAT, generation_prompt=False)
        at = before.rfind(_PROBE)
        if at < 0:
            raise ValueError("the chat template drops the assistant's content; it cannot be used for trajectories")
        self._assistant_suffix = before[at + len(_PROBE) :]
        self._probe_text = before

    # ------------------------------------------------------------------ rendering

    def _render(self, messages: Sequence[dict[str, Any]], *, generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {}
        if self.tools and getattr(self, "tools_via", "template") == "template":
            kwargs["tools"] = self.tools
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False, **kwargs
        )
        return str(text)

    def _template_takes_tools(self) -> bool:
        probe = [{"role": "user", "content": "x"}]
        plain = self.tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
        try:
            offered = self.tokenizer.apply_chat_template(
                probe, add_generation_prompt=True, tokenize=False, tools=self.tools
            )
        except Exception:  # noqa: BLE001 - a template that fails on tools= does not take them
            return False
        return bool(offered != plain)

    def with_tools_in_system(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the tools described in the system prompt, where the template
        does not render ``tools=`` itself."""
        messages = [dict(m) for m in messages]
        if not self.tools or self.tools_via == "template":
            return messages
        text = TOOLS_PREAMBLE.format(
            example=self.tools[0]["function"]["name"],
            tools="\n".join(json.dumps(t["function"]) for t in self.tools),
        )
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        else:
            messages.insert(0, {"role": "system", "content": text})
        return messages

    @property
    def assistant_close(self) -> str:
        """What the template writes after an assistant message's content (ChatML:
        ``<|im_end|>\\n``): a turn samples its start (up to the stop token), the rest is
        put in front of the next observation (:meth:`turn_close`)."""
        return self._assistant_suffix

    # ------------------------------------------------------------------ tokens

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def written_ids(self, text: str) -> list[int]:
        """The ids of text a model wrote (a demonstration's turn): a special token's string in
        it (``<|im_end|>``, ``<|im_start|>user``) is text the model wrote character by
        character, never the token itself: what a model writes is data, not structure."""
        return written_ids(self.tokenizer, text)

    def prompt_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The first prompt: the environment's first messages, tools offered, ready for the
        assistant's first turn."""
        return self.ids(self.prompt_text(messages))

    def prompt_text(self, messages: Sequence[dict[str, Any]]) -> str:
        """:meth:`prompt_ids`'s text (images as the template's placeholders)."""
        return self._render(self.with_tools_in_system(messages), generation_prompt=True)

    def observation_ids(self, sampled_ids: Sequence[int], messages: Sequence[dict[str, Any]]) -> list[int]:
        """The environment tokens after a sampled turn ``sampled_ids``: the rest of the
        template's close of that turn, then ``messages`` as the template renders them,
        then the header of the assistant's next turn."""
        return self.ids(self.turn_close(sampled_ids) + self.observation_text(messages))

    def observation_text(self, messages: Sequence[dict[str, Any]]) -> str:
        """``messages`` as the template renders them after earlier turns, then the header
        of the assistant's next turn (images as the template's placeholders)."""
        after = self._render([*_PROBE_CHAT, *messages], generation_prompt=True)
        if not after.startswith(self._probe_text):
            raise ValueError(
                "the chat template renders earlier turns differently once messages follow them; "
                "observations cannot be rendered on their own"
            )
        return after[len(self._probe_text) :]

    def turn_close(self, sampled_ids: Sequence[int]) -> str:
        """What the template writes after an assistant turn that the turn did not sample
        itself (the longest end of the sampled text that begins the suffix is skipped)."""
        sampled = str(self.tokenizer.decode(list(sampled_ids), skip_special_tokens=False))
        suffix = self._assistant_suffix
        for k in range(len(suffix), 0, -1):
            if sampled.endswith(suffix[:k]):
                return suffix[k:]
        return suffix
