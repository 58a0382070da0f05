"""A request's prompt as token ids, the way the engine will see it.

The router hashes tokens, so it must tokenize exactly as the engines do:

- ``HFTokenizer`` loads the model's tokenizer (``transformers``, the ``hf``
  extra) from ``--tokenizer``: a completion's text is encoded with the
  special tokens vLLM adds, a chat is rendered by the model's chat template
  with the generation prompt, as vLLM's OpenAI server does.
- ``EngineTokenizer`` asks an engine's ``/tokenize`` instead (no local
  tokenizer needed; one more round trip per request).

For completions the router then sends the engine the token ids, not the
text, so the two can never disagree; for chats it sends the messages and
relies on both applying the same template (a disagreement costs a miss).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import aiohttp


class BadPrompt(ValueError):
    """The request's prompt is not one this router can tokenize."""


class Tokenizer(Protocol):
    async def completion(self, prompt: Any) -> list[int]: ...

    async def chat(self, body: dict[str, Any]) -> list[int]: ...


def _token_list(prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and all(type(t) is int and t >= 0 for t in prompt):
        return list(prompt)
    return None


def check_prompt(prompt: Any) -> str | list[int]:
    """One prompt: text, or token ids (a batch of prompts is refused: route each)."""
    tokens = _token_list(prompt)
    if tokens is not None:
        return tokens
    if isinstance(prompt, list) and len(prompt) == 1:
        return check_prompt(prompt[0])
    if isinstance(prompt, str):
        return prompt
    raise BadPrompt(
        "'prompt' must be one text or one list of token ids; send a batch as separate requests"
    )


class HFTokenizer:
    """A local Hugging Face tokenizer (tokenizing runs on a worker thread)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # the hf extra

        self._tokenizer = AutoTokenizer.from_pretrained(path)

    async def completion(self, prompt: Any) -> list[int]:
        checked = check_prompt(prompt)
        if isinstance(checked, list):
            return checked
        return await asyncio.to_thread(self._encode, checked)

    async def chat(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadPrompt("'messages' must be a non-empty list")
        return await asyncio.to_thread(self._render, messages, body)

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    def _render(self, messages: list[Any], body: dict[str, Any]) -> list[int]:
        try:
            ids: Any = self._tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                add_generation_prompt=body.get("add_generation_prompt", True),
                **(body.get("chat_template_kwargs") or {}),
            )
        except Exception as exc:  # the template's own refusal of these messages
            raise BadPrompt(f"the chat template cannot render these messages: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]


class EngineTokenizer:
    """Tokenizes with an engine's ``/tokenize`` (vLLM's OpenAI server)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        self._session = session
        self._url = url.rstrip("/") + "/tokenize"
        self.model = model

    async def completion(self, prompt: Any) -> list[int]:
        checked = check_prompt(prompt)
        if isinstance(checked, list):
            return checked
        return await self._ask({"model": self.model, "prompt": checked})

    async def chat(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadPrompt("'messages' must be a non-empty list")
        ask = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        return await self._ask(ask)

    async def _ask(self, payload: dict[str, Any]) -> list[int]:
        async with self._session.post(self._url, json=payload) as response:
            data = await response.json(content_type=None)
            if response.status != 200:
                raise BadPrompt(f"the engine could not tokenize this prompt: {data}")
        return [int(t) for t in data["tokens"]]


__all__ = ["BadPrompt", "EngineTokenizer", "HFTokenizer", "Tokenizer", "check_prompt"]
