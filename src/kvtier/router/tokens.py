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

A chat's count is what its template renders, and the template sees more
than the messages: vLLM's chat completions render ``tools`` and merge
``documents``, ``reasoning_effort``, ``add_generation_prompt`` and
``continue_final_message`` over ``chat_template_kwargs`` into the
template's arguments (``template_kwargs`` does the same). Both tokenizers
render with all of them; vLLM's ``/tokenize`` takes no ``documents`` or
``reasoning_effort`` field (it ignores unknown fields), so they go to it
inside ``chat_template_kwargs``, where its template sees them as the
chat's does. What the router cannot count is refused by name before
anything is charged (``check_chat``): a content part the engine expands
itself (an image, audio, video or embeddings: ``UNCOUNTED_PARTS``), and
``chat_template_kwargs`` entries that would change how the template runs
rather than what it renders (``chat_template``, ``tokenize``; vLLM refuses
them too). Counting only the messages let 240 KB of ``documents`` pass a
100-token budget and the context check.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import aiohttp

from kvtier.router.body import MAX_TOKEN_ID, BadRequest
from kvtier.router.core import Node
from kvtier.router.health import HealthProbe
from kvtier.router.relay import EngineFailed, failure_reason, watched

# A chat's fields that vLLM's chat completions merge over chat_template_kwargs
# into the template's arguments (ChatCompletionRequest.build_chat_params), with
# their defaults there; None leaves chat_template_kwargs' own value.
MERGED = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "documents": None,
    "reasoning_effort": None,
}
# A chat's fields vLLM's /tokenize takes as they are (the others go inside
# chat_template_kwargs).
TOKENIZE_FIELDS = ("tools", "add_special_tokens")
# chat_template_kwargs entries that change how the template runs, not what it
# renders: vLLM refuses them, and a local render must not take them.
NOT_TEMPLATE_KWARGS = ("chat_template", "tokenize")
# Content parts the engine expands into tokens of its own (media it fetches,
# embeddings it is sent): the router cannot count their prefill (vLLM's part
# types; an untyped part is named by its key).
UNCOUNTED_PARTS = frozenset(
    {
        "image_url",
        "input_image",
        "image_pil",
        "image_embeds",
        "audio_url",
        "input_audio",
        "audio_embeds",
        "video_url",
        "video_embeds",
        "prompt_embeds",
    }
)


class BadPrompt(BadRequest):
    """The request's prompt is not one this router can tokenize."""

    reason = "bad_prompt"


class UncountedField(BadPrompt):
    """A chat field the template renders that the router cannot count."""

    reason = "uncounted_field"


class _Refused(Exception):
    """An engine answered ``/tokenize`` with a 5xx: ask the next one."""


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
    """A chat's ``messages``: a non-empty list of objects, no content part
    the router cannot count (``UncountedField`` naming it)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadPrompt("'messages' must be a non-empty list")
    if not all(isinstance(m, dict) for m in messages):
        raise BadPrompt("each of 'messages' must be an object with 'role' and 'content'")
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict):
                continue  # the template's (or the engine's) to refuse
            kind = part.get("type")
            untyped = UNCOUNTED_PARTS & part.keys()  # vLLM names an untyped part by its key
            named = kind if kind in UNCOUNTED_PARTS else min(untyped, default="")
            if named:
                raise UncountedField(
                    f"messages[{i}].content[{j}] is a {named!r} part: the router counts a "
                    "chat's text only, and the engine expands this part into tokens of its own"
                )
    return messages


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The arguments a chat's template is rendered with besides the messages
    and ``tools``: ``chat_template_kwargs`` with ``MERGED`` over it, as vLLM
    merges them (a value of None or "auto" leaves the one beneath).
    ``BadPrompt`` naming the field if one cannot be rendered as the engine would."""
    given = body.get("chat_template_kwargs")
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise BadPrompt("'chat_template_kwargs' must be an object")
    for name in NOT_TEMPLATE_KWARGS:
        if name in given:
            raise UncountedField(
                f"'chat_template_kwargs.{name}' may not be set: the chat is rendered with "
                "the model's own template, as the router counts it"
            )
    documents = body.get("documents")
    if documents is not None and not (
        isinstance(documents, list) and all(_strings(d) for d in documents)
    ):
        raise BadPrompt("'documents' must be a list of objects of strings")
    kwargs = dict(given)
    for name, default in MERGED.items():
        value = body.get(name)
        value = default if value is None else value
        if value is not None and value != "auto":
            kwargs[name] = value
    return kwargs


def _strings(document: Any) -> bool:
    """An object of strings (vLLM's type for a document)."""
    return isinstance(document, dict) and all(isinstance(v, str) for v in document.values())


def check_chat(body: dict[str, Any]) -> None:
    """Everything a chat's template renders can be counted (``check_messages``,
    ``template_kwargs``); ``BadPrompt`` naming the field otherwise."""
    check_messages(body)
    template_kwargs(body)


class HFTokenizer:
    """A local Hugging Face tokenizer (tokenizing runs on a worker thread)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # the hf extra

        self._tokenizer = AutoTokenizer.from_pretrained(path)

    async def completion(self, prompt: str) -> list[int]:
        return await asyncio.to_thread(self._encode, prompt)

    async def chat(self, body: dict[str, Any]) -> list[int]:
        messages, kwargs = check_messages(body), template_kwargs(body)
        return await asyncio.to_thread(self._render, messages, kwargs, body)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _render(
        self, messages: list[Any], kwargs: dict[str, Any], body: dict[str, Any]
    ) -> list[int]:
        """As vLLM renders a chat: the template to text, then the text encoded
        (with special tokens only if the chat asks: its template adds its own).
        Encoding apart also keeps tokenizer options among the template's
        arguments (``truncation``, ``max_length``) from shortening the count."""
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tools=body.get("tools"), tokenize=False, **kwargs
            )
        except Exception as exc:  # the template's own refusal of these messages
            raise BadPrompt(f"the chat template cannot render these messages: {exc}") from exc
        if not isinstance(text, str):
            raise BadPrompt("the chat template did not render these messages to text")
        return self._encode(text, add_special_tokens=body.get("add_special_tokens") is True)


class EngineTokenizer:
    """Tokenizes with a live engine's ``/tokenize`` (vLLM's OpenAI server).

    ``engines()`` lists the engines to ask, in order. One that cannot answer
    (unreachable, silent, its connection broken, a 200 without a token list)
    is passed to ``failed(node, exc)``, which takes it out as a failed
    generation does, and the next is asked: ``EnginesUnavailable`` when none
    answered. An engine that answers is up, so a refusal is never charged
    to it (a client whose messages make the template fail cannot take
    engines out): a 4xx to ``/tokenize`` (which runs in vLLM's API server,
    not its engine core) is about this prompt, ``BadPrompt`` at once; a 5xx
    may be this engine's trouble (a 503 while it restarts, a request it held
    while stopped), so the next engine is asked, and the prompt is
    ``BadPrompt`` only when every engine refused it. An engine that sends
    nothing is asked ``/health`` meanwhile (``relay.watched``), so a silent
    one costs a request seconds, not ``first_byte_timeout_s``.

    A chat is sent with every field its template renders: ``tools`` and
    ``add_special_tokens`` as they are, the rest inside
    ``chat_template_kwargs`` (``template_kwargs``), where ``/tokenize``
    renders them as the chat completion will.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        engines: Callable[[], Sequence[Node]],
        failed: Callable[[Node, EngineFailed], None],
        model: str,
        probe: HealthProbe,
    ) -> None:
        self._session = session
        self._engines = engines
        self._failed = failed
        self.model = model
        self._probe = probe

    async def completion(self, prompt: str) -> list[int]:
        return await self._ask({"model": self.model, "prompt": prompt})

    async def chat(self, body: dict[str, Any]) -> list[int]:
        messages, kwargs = check_messages(body), template_kwargs(body)
        ask = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": kwargs["add_generation_prompt"],
            "continue_final_message": kwargs["continue_final_message"],
            "chat_template_kwargs": kwargs,
        }
        ask.update((name, body[name]) for name in TOKENIZE_FIELDS if body.get(name) is not None)
        return await self._ask(ask)

    async def _ask(self, payload: dict[str, Any]) -> list[int]:
        refused: _Refused | None = None
        for node in self._engines():
            try:
                return await self._ask_one(node, payload)
            except EngineFailed as exc:
                self._failed(node, exc)
            except _Refused as exc:
                refused = exc
        if refused is not None:
            raise BadPrompt(str(refused))
        raise EnginesUnavailable("no engine could tokenize the prompt (none is up)")

    async def _ask_one(self, node: Node, payload: dict[str, Any]) -> list[int]:
        try:
            response = await watched(self._probe, node, self._post(node, payload))
            async with response:
                status, data = response.status, await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineFailed(failure_reason(exc), str(exc)) from None
        if status != 200:  # it answered, so it is up: see the class docstring
            refusal = data.decode(errors="replace")[:500]
            message = f"the engine could not tokenize this prompt ({status}): {refusal}"
            raise _Refused(message) if status >= 500 else BadPrompt(message)
        try:
            tokens = json.loads(data)["tokens"]
        except (ValueError, TypeError, KeyError, RecursionError):
            tokens = None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise EngineFailed("bad_answer", "/tokenize answered without a list of token ids")
        return tokens

    async def _post(self, node: Node, payload: dict[str, Any]) -> aiohttp.ClientResponse:
        return await self._session.post(node.url + "/tokenize", json=payload)


__all__ = [
    "MERGED",
    "UNCOUNTED_PARTS",
    "BadPrompt",
    "EngineTokenizer",
    "EnginesUnavailable",
    "HFTokenizer",
    "Tokenizer",
    "UncountedField",
    "check_chat",
    "check_messages",
    "check_prompt",
    "template_kwargs",
]
