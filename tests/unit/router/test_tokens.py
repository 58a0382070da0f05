"""A chat's prompt as the router counts it: everything its template renders
(issue 55 #6), with a local tokenizer and as sent to an engine's /tokenize."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvtier.router.tokens import BadPrompt, HFTokenizer, UncountedField, check_chat, template_kwargs

# Every word is one token ("w", the unknown word): the count is the words rendered.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% for d in documents or [] %}doc {{ d['text'] }} {% endfor %}"
    "{% for t in tools or [] %}tool {{ t['function']['name'] }} {% endfor %}"
    "{% if reasoning_effort %}effort {{ reasoning_effort }} {% endif %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({"w": 0}, unk_token="w"))
    words.pre_tokenizer = WhitespaceSplit()
    local = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w")
    local.chat_template = TEMPLATE
    path: Path = tmp_path_factory.mktemp("tokenizer")
    local.save_pretrained(path)
    return HFTokenizer(str(path))


def count(tokenizer: HFTokenizer, **fields: Any) -> int:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return len(asyncio.run(tokenizer.chat(body)))


def test_a_local_tokenizer_counts_documents_tools_and_the_merged_kwargs(
    tokenizer: HFTokenizer,
) -> None:
    """The old router rendered only the messages and tools: documents went
    uncounted, and tokenizer options among chat_template_kwargs
    (truncation, max_length) cut the count to what the client chose."""
    assert count(tokenizer) == 3  # user hi assistant
    documents = [{"title": "t", "text": "a b c d"}]
    assert count(tokenizer, documents=documents) == 3 + 5
    assert count(tokenizer, chat_template_kwargs={"documents": documents}) == 3 + 5
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert count(tokenizer, tools=tools) == 3 + 2
    assert count(tokenizer, reasoning_effort="high") == 3 + 2
    shortened = {"truncation": True, "max_length": 1}
    assert count(tokenizer, documents=documents, chat_template_kwargs=shortened) == 3 + 5
    assert count(tokenizer, add_generation_prompt=False) == 2


def test_the_template_kwargs_merge_as_vllm_merges_them() -> None:
    """vLLM's chat completions: the top-level fields over chat_template_kwargs,
    None or "auto" leaving the value beneath."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {
            "documents": [{"text": "beneath"}],
            "reasoning_effort": "low",
            "add_generation_prompt": False,
            "enable_thinking": True,
        },
        "documents": [{"text": "over"}],
        "reasoning_effort": "auto",
    }
    assert template_kwargs(body) == {
        "documents": [{"text": "over"}],
        "reasoning_effort": "low",
        "add_generation_prompt": True,  # vLLM's default, over the kwargs'
        "continue_final_message": False,
        "enable_thinking": True,
    }


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"documents": [{"text": 1}]}, "'documents'"),
        ({"documents": "text"}, "'documents'"),
        ({"chat_template_kwargs": "x"}, "'chat_template_kwargs'"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs.chat_template"),
        (
            {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
            "messages[0].content[0] is a 'video_url' part",
        ),
        (
            {"messages": [{"role": "user", "content": [{"image_embeds": "AAAA"}]}]},
            "'image_embeds' part",
        ),
    ],
)
def test_what_cannot_be_counted_is_refused_by_name(fields: dict[str, Any], named: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(BadPrompt, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_chat(body)


def test_text_parts_and_a_plain_chat_pass() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "no"}, "odd"]
    check_chat({"messages": [{"role": "user", "content": parts}]})
    check_chat({"messages": [{"role": "user", "content": "hi"}], "documents": [{"text": "x"}]})
    assert issubclass(UncountedField, BadPrompt)
