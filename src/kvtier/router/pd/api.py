"""The two OpenAI endpoints ``kvtier pd-proxy`` serves, as the proxy sees them:
what to check in a body, how to ask the prefill engine for the first token,
how to ask the decode engine for the rest, and how to join the two answers.

- ``/v1/completions``: the decode engine gets the prompt as token ids (the
  prefill's prompt ids and its first token) in ``prompt``.
- ``/v1/chat/completions``: the decode engine gets the same messages with
  those ids in ``kv_transfer_params.prompt_token_ids``, which vLLM's
  renderer takes instead of rendering the messages again (vLLM's own
  disaggregated chat path): the conversation is templated once, by the
  prefill engine, so both engines see the same tokens.

Both count ``usage`` as the client sent the request: the prompt once, every
generated token once.

``kv_transfer_params`` is the proxy's alone: a client's is refused (it could
name another request's hand-off, or prompt ids no check has seen), and the
decode engine gets only what the prefill engine returned. An engine's answer
is read only once it has the shape the proxy reads (``Api.unreadable``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Generic, TypeVar

import msgspec

from kvtier.protocol.handoff import CAUSE, HANDOFF_ID, NOT_OFFERED, OUTCOME, RECOMPUTED

DEFAULT_MAX_TOKENS = 16  # vLLM's, for a completion that names none
NEVER_OFFERED = {OUTCOME: RECOMPUTED, CAUSE: NOT_OFFERED}
KV_TRANSFER = "kv_transfer_params"
SWITCHES = ("stream", "return_token_ids")  # booleans the proxy itself acts on

Body = dict[str, Any]


# What the proxy reads of an engine's answer; any other field passes through.
class EngineUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int


class TextLogprobs(msgspec.Struct):
    tokens: list[Any]
    token_logprobs: list[Any]
    text_offset: list[int]
    top_logprobs: list[Any] | None = None


class TextChoice(msgspec.Struct):
    text: str
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: TextLogprobs | None = None


class ChatMessage(msgspec.Struct):
    content: str | None = None


class ChatLogprobs(msgspec.Struct):
    content: list[Any]


class ChatChoice(msgspec.Struct):
    message: ChatMessage
    token_ids: list[int] | None = None
    logprobs: ChatLogprobs | None = None


Choice = TypeVar("Choice", TextChoice, ChatChoice)


class EngineAnswer(msgspec.Struct, Generic[Choice]):
    id: str
    created: int
    model: str
    choices: Annotated[list[Choice], msgspec.Meta(min_length=1)]
    usage: EngineUsage
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class Api:
    """One endpoint's bodies; see the module docstring."""

    path: ClassVar[str]
    limit_fields: ClassVar[tuple[str, ...]]  # where a body names its token limit
    answer: ClassVar[type[EngineAnswer[Any]]]  # what the proxy reads of an engine's answer

    def check(self, body: Body) -> str:
        """What is wrong with a client's body ("": nothing)."""
        if body.get(KV_TRANSFER) not in (None, {}):
            return f"{KV_TRANSFER} is set by pd-proxy for its engines, not by clients: leave it out"
        for name in SWITCHES:
            if not isinstance(body.get(name), bool | None):
                return f"{name} must be true or false"
        if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
            return "pd-proxy serves n = 1 and best_of = 1 only"
        for name in self.limit_fields:
            value = body.get(name)
            if value is not None and (not _integer(value) or value < 1):
                return f"{name} must be a positive integer"
        if body.get("echo"):
            return "pd-proxy does not echo the prompt"
        return ""

    def max_tokens(self, body: Body) -> int:
        for name in self.limit_fields:
            if body.get(name):
                return int(body[name])
        return DEFAULT_MAX_TOKENS

    def prefill_body(self, body: Body) -> Body:
        """The client's request for its first token only, handed off."""
        prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        prefill.update({name: 1 for name in self.limit_fields})
        prefill.update(return_token_ids=True, kv_transfer_params={"do_remote_decode": True})
        return prefill

    def decode_body(self, body: Body, first: Body, params: Body, max_tokens: int) -> Body:
        """The rest of the answer: the prompt and the first token, one token
        fewer; ``params`` (what the prefill engine returned) its only
        ``kv_transfer_params``."""
        decode = {k: v for k, v in body.items() if k != KV_TRANSFER}
        for name in self.limit_fields:
            decode.pop(name, None)
        decode[self.limit_fields[0]] = max_tokens - 1
        if isinstance(body.get("min_tokens"), int):
            decode["min_tokens"] = max(0, body["min_tokens"] - 1)
        if params:
            decode["kv_transfer_params"] = params
        decode["return_token_ids"] = bool(body.get("return_token_ids"))
        return decode

    def unreadable(self, answer: Any, prefill: bool) -> str:
        """What keeps the proxy from reading an engine's 200 answer ("":
        nothing). The prefill's must carry its prompt and token ids: the
        decode engine's prompt is made of them."""
        try:
            msgspec.convert(answer, self.answer)
        except msgspec.ValidationError as exc:
            return str(exc)
        prompt, generated = self.ids(answer)
        if prefill and not (prompt and generated):
            return "no prompt_token_ids or token_ids (does the engine know return_token_ids?)"
        return ""

    def ids(self, answer: Body) -> tuple[list[int], list[int]]:
        """An engine's answer's prompt ids and generated ids."""
        raise NotImplementedError

    def joined(self, first: Body, rest: Body, return_ids: bool) -> Body:
        """One answer: the first token's, then the rest's."""
        raise NotImplementedError

    def first_chunk(self, first: Body, return_ids: bool) -> Body:
        """The prefill's token as the stream's first event."""
        raise NotImplementedError

    def alone(self, first: Body, return_ids: bool) -> Body:
        """The prefill's answer as the whole answer (its token ended it)."""
        answer = {k: v for k, v in first.items() if k != "kv_transfer_params"}
        if not return_ids:
            answer.pop("prompt_token_ids", None)
            answer["choices"] = [_without_ids(c) for c in answer["choices"]]
        return answer


class Completions(Api):
    path = "/v1/completions"
    limit_fields = ("max_tokens",)
    answer = EngineAnswer[TextChoice]

    def check(self, body: Body) -> str:
        prompt = body.get("prompt")
        single = isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(_integer(t) and t >= 0 for t in prompt)
        )
        if not single:
            return (
                "prompt must be one string or one list of token ids, integers from 0 "
                "(pd-proxy takes one prompt)"
            )
        return super().check(body)

    def decode_body(self, body: Body, first: Body, params: Body, max_tokens: int) -> Body:
        decode = super().decode_body(body, first, params, max_tokens)
        prompt, generated = self.ids(first)
        decode["prompt"] = prompt + generated
        return decode

    def ids(self, answer: Body) -> tuple[list[int], list[int]]:
        choice = answer["choices"][0]
        return list(choice.get("prompt_token_ids") or []), list(choice.get("token_ids") or [])

    def joined(self, first: Body, rest: Body, return_ids: bool) -> Body:
        head, tail = first["choices"][0], rest["choices"][0]
        choice = dict(tail)
        choice["text"] = head["text"] + tail["text"]
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
        if return_ids:
            choice["token_ids"] = list(head["token_ids"]) + list(tail.get("token_ids") or [])
            choice["prompt_token_ids"] = head["prompt_token_ids"]
        choice["logprobs"] = _join_logprobs(head.get("logprobs"), tail.get("logprobs"), head)
        return {**rest, "choices": [choice]}

    def first_chunk(self, first: Body, return_ids: bool) -> Body:
        choice = first["choices"][0]
        chunk: Body = {"index": 0, "text": choice["text"], "finish_reason": None}
        chunk["logprobs"] = choice.get("logprobs")
        if return_ids:
            chunk["token_ids"] = choice["token_ids"]
            chunk["prompt_token_ids"] = choice["prompt_token_ids"]
        return {**_head(first, "text_completion"), "choices": [chunk]}


class ChatCompletions(Api):
    path = "/v1/chat/completions"
    limit_fields = ("max_completion_tokens", "max_tokens")
    answer = EngineAnswer[ChatChoice]

    def check(self, body: Body) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages must be a non-empty list (pd-proxy takes one conversation)"
        if body.get("continue_final_message") or body.get("tools"):
            return "pd-proxy does not proxy continue_final_message or tools yet"
        return super().check(body)

    def decode_body(self, body: Body, first: Body, params: Body, max_tokens: int) -> Body:
        prompt, generated = self.ids(first)
        forwarded = {**params, "prompt_token_ids": prompt + generated}  # rendered once
        return super().decode_body(body, first, forwarded, max_tokens)

    def ids(self, answer: Body) -> tuple[list[int], list[int]]:
        choice = answer["choices"][0]
        return list(answer.get("prompt_token_ids") or []), list(choice.get("token_ids") or [])

    def joined(self, first: Body, rest: Body, return_ids: bool) -> Body:
        head, tail = first["choices"][0], rest["choices"][0]
        choice = _without_ids(dict(tail))
        message = dict(tail["message"])
        message["content"] = (head["message"].get("content") or "") + (message.get("content") or "")
        choice["message"] = message
        if head.get("logprobs") is not None and tail.get("logprobs") is not None:
            choice["logprobs"] = {
                "content": head["logprobs"]["content"] + tail["logprobs"]["content"]
            }
        answer = {**rest, "choices": [choice]}
        answer.pop("prompt_token_ids", None)
        if return_ids:
            choice["token_ids"] = list(head["token_ids"]) + list(tail.get("token_ids") or [])
            answer["prompt_token_ids"] = first.get("prompt_token_ids")
        return answer

    def first_chunk(self, first: Body, return_ids: bool) -> Body:
        choice = first["choices"][0]
        delta = {"role": "assistant", "content": choice["message"].get("content") or ""}
        chunk: Body = {"index": 0, "delta": delta, "finish_reason": None}
        chunk["logprobs"] = choice.get("logprobs")
        event = {**_head(first, "chat.completion.chunk"), "choices": [chunk]}
        if return_ids:
            chunk["token_ids"] = choice["token_ids"]
            event["prompt_token_ids"] = first.get("prompt_token_ids")
        return event


def usage(first: Body, rest: Body, decoded: Body | None) -> Body:
    """The joined answer's usage: the prompt once, every generated token,
    and what became of the hand-off (``decoded``: the decode engine's
    ``kv_transfer_params``; None when there was no hand-off)."""
    prompt = int(first["usage"]["prompt_tokens"])
    generated = int(first["usage"]["completion_tokens"]) + int(rest["usage"]["completion_tokens"])
    joined: Body = {"prompt_tokens": prompt, "completion_tokens": generated}
    joined["total_tokens"] = prompt + generated
    handoff = {k: v for k, v in (decoded or {}).items() if k in (HANDOFF_ID, OUTCOME, CAUSE)}
    joined["kvtier_handoff"] = handoff or dict(NEVER_OFFERED)
    return joined


def streamed_usage(event_usage: Any, first: Body) -> Body:
    """A decode stream's usage, counting the prompt as the client sent it
    and the prefill's token. ``msgspec.ValidationError`` (a ``ValueError``)
    if it is not a usage."""
    counted = msgspec.convert(event_usage, EngineUsage)
    patched = dict(event_usage)
    patched["prompt_tokens"] = int(first["usage"]["prompt_tokens"])
    patched["completion_tokens"] = counted.completion_tokens + 1
    patched["total_tokens"] = patched["prompt_tokens"] + patched["completion_tokens"]
    return patched


API_PATHS: dict[str, Api] = {api.path: api for api in (Completions(), ChatCompletions())}


def _integer(value: Any) -> bool:
    """An integer in JSON's sense (Python's ``True`` is an ``int`` too)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _head(first: Body, kind: str) -> Body:
    return {"id": first["id"], "object": kind, "created": first["created"], "model": first["model"]}


def _without_ids(choice: Body) -> Body:
    return {k: v for k, v in choice.items() if k not in ("token_ids", "prompt_token_ids")}


def _join_logprobs(head: Body | None, tail: Body | None, first: Body) -> Body | None:
    if head is None or tail is None:
        return head or tail
    shift = len(first["text"])
    return {
        "tokens": head["tokens"] + tail["tokens"],
        "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
        "top_logprobs": (head.get("top_logprobs") or []) + (tail.get("top_logprobs") or []),
        "text_offset": head["text_offset"] + [o + shift for o in tail["text_offset"]],
    }


__all__ = ["API_PATHS", "Api", "ChatCompletions", "Completions", "streamed_usage", "usage"]
