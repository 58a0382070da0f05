"""A request's prompt as token ids, the way the engine will see it.

The router hashes tokens, so it must tokenize exactly as the engines do:

- ``HFTokenizer`` loads the model's tokenizer (``transformers``, the ``hf``
  extra) from ``--tokenizer``: a completion's text is encoded with the
  special tokens vLLM adds, a chat is rendered by the model's chat template
  with the generation prompt, as vLLM's OpenAI server does.
- ``EngineTokenizer`` asks a live engine's ``/tokenize`` instead (no local
  tokenizer needed; one more round trip per request), failing over to the
  next engine as generation does.

For completions the router then sends the engine the token ids, not the
text, so the two can never disagree; for chats it sends the messages and
relies on both applying the same template (a disagreement costs a miss).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import aiohttp

from kvtier.router.body import MAX_TOKEN_ID, BadRequest
from kvtier.router.core import Node
from kvtier.router.relay import EngineFailed, failure_reason

# A chat request's fields that change how its messages render (both tokenizers
# render with them, so the count is the prompt the engine will prefill).
RENDERING = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")


class BadPrompt(BadRequest):
    """The request's prompt is not one this router can tokenize."""

    reason = "bad_prompt"


class EnginesUnavailable(Exception):
    """No engine could tokenize the prompt (none live, or every one failed)."""


class Tokenizer(Protocol):
    async def completion(self, prompt: str) -> list[int]: ...

    async def chat(self, body: dict[str, Any]) -> list[int]: ...


def check_prompt(prompt: Any) -> str | list[int]:
    """One prompt: text, or token ids from 0 to ``MAX_TOKEN_ID`` (a batch of
    one is unwrapped; a larger batch is refused: route each)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise BadPrompt(f"'prompt' holds a token id outside 0..{MAX_TOKEN_ID}")
        return prompt
    raise BadPrompt(
        "'prompt' must be one text or one non-empty list of token ids; "
        "send a batch as separate requests"
    )


def check_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat's ``messages``: a non-empty list of objects."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadPrompt("'messages' must be a non-empty list")
    if not all(isinstance(m, dict) for m in messages):
        raise BadPrompt("each of 'messages' must be an object with 'role' and 'content'")
    return messages


class HFTokenizer:
    """A local Hugging Face tokenizer (tokenizing runs on a worker thread)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # the hf extra

        self._tokenizer = AutoTokenizer.from_pretrained(path)

    async def completion(self, prompt: str) -> list[int]:
        return await asyncio.to_thread(self._encode, prompt)

    async def chat(self, body: dict[str, Any]) -> list[int]:
        return await asyncio.to_thread(self._render, check_messages(body), body)

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    def _render(self, messages: list[Any], body: dict[str, Any]) -> list[int]:
        try:
            ids: Any = self._tokenizer.apply_chat_template(
                messages,
                tools=body.get("tools"),
                tokenize=True,
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                **(body.get("chat_template_kwargs") or {}),
            )
        except Exception as exc:  # the template's own refusal of these messages
            raise BadPrompt(f"the chat template cannot render these messages: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]


class EngineTokenizer:
    """Tokenizes with a live engine's ``/tokenize`` (vLLM's OpenAI server).

    ``engines()`` lists the engines to ask, in order. One that cannot answer
    (unreachable, silent, its connection broken, a 200 without a token list)
    is passed to ``failed(node, exc)``, which takes it out as a failed
    generation does, and the next is asked: ``EnginesUnavailable`` when none
    answered. Any other status is ``BadPrompt``: an engine that answers is
    up, and a 4xx or 5xx to ``/tokenize`` (which runs in vLLM's API server,
    not its engine core) is about this prompt, so a client whose messages
    make the template fail cannot take engines out.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        engines: Callable[[], Sequence[Node]],
        failed: Callable[[Node, EngineFailed], None],
        model: str,
    ) -> None:
        self._session = session
        self._engines = engines
        self._failed = failed
        self.model = model

    async def completion(self, prompt: str) -> list[int]:
        return await self._ask({"model": self.model, "prompt": prompt})

    async def chat(self, body: dict[str, Any]) -> list[int]:
        ask = {"model": self.model, "messages": check_messages(body), "add_generation_prompt": True}
        ask.update((name, body[name]) for name in RENDERING if body.get(name) is not None)
        return await self._ask(ask)

    async def _ask(self, payload: dict[str, Any]) -> list[int]:
        for node in self._engines():
            try:
                return await self._ask_one(node, payload)
            except EngineFailed as exc:
                self._failed(node, exc)
        raise EnginesUnavailable("no engine could tokenize the prompt (none is up)")

    async def _ask_one(self, node: Node, payload: dict[str, Any]) -> list[int]:
        try:
            async with self._session.post(node.url + "/tokenize", json=payload) as response:
                status, data = response.status, await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineFailed(failure_reason(exc), str(exc)) from None
        if status != 200:  # it answered, so it is up: what it choked on is this prompt
            refusal = data.decode(errors="replace")[:500]
            raise BadPrompt(f"the engine could not tokenize this prompt ({status}): {refusal}")
        try:
            tokens = json.loads(data)["tokens"]
        except (ValueError, TypeError, KeyError, RecursionError):
            tokens = None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise EngineFailed("bad_answer", "/tokenize answered without a list of token ids")
        return tokens


__all__ = [
    "RENDERING",
    "BadPrompt",
    "EngineTokenizer",
    "EnginesUnavailable",
    "HFTokenizer",
    "Tokenizer",
    "check_messages",
    "check_prompt",
]
