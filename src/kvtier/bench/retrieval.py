"""A retrieval task for measuring lossy reuse on a real model: documents
about invented places, each holding one access code, and questions that ask
for the code of one of them.

SmolLM2-135M answers questions about invented facts poorly but copies a code
it is asked for well, so the task measures what blending changes in a model
that does the task with full prefill. Each document is a few hundred tokens
of plain sentences about one invented place (its founding year, colour,
staff...), opening with its title line and its code sentence, as a record
card would; a prompt is a system prompt, 2-6 documents from a shared pool in
a shuffled order, and the question. Pure: the same spec gives the same
documents and prompts.

Where the code sentence stands decides how well the model does the task:
over blend-eval's 100 prompts full prefill gives the asked code for 75 with
the code sentence right after the title and for 47 with it anywhere in the
document (``RetrievalSpec.code_first=False``, the task before 2026-12-04;
the documents are otherwise the same word for word). The difference is in
the documents far from the question: asked about the first document of the
prompt, full prefill is right on 31 of 38 prompts with the code first and
on 12 of them with it anywhere. Most wrong answers are another document's
code.

``Prompt.parts`` are the texts of the system block, of each document and of
the question block, in the model's chat format (the tokenizer's template
markers), so a caller tokenizes each part alone and passes the spans of all
but the last as segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

Span = tuple[int, int]

SYSTEM = (
    "<|im_start|>system\nYou are a helpful assistant. Answer the question using the "
    "documents the user gives you.<|im_end|>\n<|im_start|>user\n"
)
QUESTION = (
    "Question: What is the access code of {name}? Answer with the code only."
    "<|im_end|>\n<|im_start|>assistant\n"
)
_SYLLABLES = ["vel", "tra", "kor", "ma", "zen", "dri", "lo", "qua", "shan", "bel", "tor",
              "nix", "fa", "gor", "ri", "sel", "ven", "do", "mar", "cal", "pe", "thu", "ar",
              "wen"]  # fmt: skip
_KINDS = ["Institute", "Observatory", "Mill", "Archive", "Harbour", "Academy", "Foundry",
          "Library", "Station", "Gallery", "Workshop", "Clinic"]  # fmt: skip
_ANIMALS = ["MARLIN", "OTTER", "FALCON", "BADGER", "HERON", "LYNX", "WALRUS", "IBIS", "PUMA",
            "GECKO", "BISON", "RAVEN", "MOOSE", "KOALA", "TAPIR", "CONDOR"]  # fmt: skip
_COLOURS = ["red", "blue", "green", "yellow", "grey", "white", "orange", "purple", "brown"]
_CITIES = ["Lisbon", "Oslo", "Kyoto", "Lima", "Cairo", "Dublin", "Perth", "Quito", "Tallinn",
           "Accra", "Hanoi", "Bergen", "Porto", "Turin", "Leeds"]  # fmt: skip
_FILLER = [
    "{name} was founded in {year} by a group of {adjective} engineers from {city}.",
    "The main building of {name} is painted {colour} and has {number} windows.",
    "{name} employs {number} people, most of whom live within walking distance.",
    "Every spring, {name} hosts a small fair where visitors trade {things}.",
    "The oldest room in {name} holds a collection of {adjective} {things}.",
    "A narrow {colour} bridge connects {name} to the market square.",
    "Local guides say that {name} is best visited in the early morning.",
    "In {year}, a storm damaged the roof of {name}, and it was rebuilt within a year.",
    "The staff of {name} meet every {weekday} to plan the week ahead.",
    "{name} keeps a garden with {number} kinds of {adjective} flowers.",
    "The library of {name} lends out maps, old letters and {things}.",
    "Visitors to {name} often remark on the {adjective} smell of fresh bread.",
    "A clock tower stands next to {name}; it has not been wound since {year}.",
    "Children from {city} come to {name} on school trips to see the {things}.",
    "The director of {name} writes a short report about the {things} each {weekday}.",
]
_CODE_SENTENCE = "The access code of {name} is {code}."
CODE_ANYWHERE_HELP = (
    "put each document's code sentence anywhere in it, not right after its title "
    "(the task of the runs before 2026-12-04)"
)
_ADJECTIVES = ["quiet", "famous", "curious", "patient", "careful", "cheerful", "ancient", "rare"]
_THINGS = ["glass beads", "wooden toys", "copper coins", "paper kites", "clay pots", "old books",
           "silk scarves", "brass keys", "river stones", "woven baskets"]  # fmt: skip
_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


@dataclass(frozen=True, slots=True)
class Document:
    name: str  # the invented place
    code: str  # its access code, e.g. MARLIN-42
    text: str


@dataclass(frozen=True, slots=True)
class Prompt:
    parts: tuple[str, ...]  # the system block, each document, the question block
    documents: tuple[int, ...]  # pool indices, in prompt order
    asked: int  # the pool index of the document the question is about
    answer: str  # its code
    codes: tuple[str, ...] = ()  # every document's code, in prompt order

    def correct(self, output: str) -> bool:
        """Whether a generated answer gives the asked code."""
        return self.answer in output

    def answered(self, output: str) -> str:
        """Which code a generated answer gives: ``asked``, ``another`` (the
        code of another document in the prompt) or ``none``."""
        if self.correct(output):
            return "asked"
        return "another" if any(code in output for code in self.codes) else "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrievalSpec:
    prompts: int = 120
    pool: int = 60  # documents shared by the prompts
    documents: Span = (2, 6)  # per prompt
    words: Span = (110, 450)  # per document (~1.35 tokens a word: 150-600 tokens)
    seed: int = 0
    code_first: bool = True  # the code sentence right after the title line, else anywhere

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.pool < self.documents[1]:
            raise ValueError("RetrievalSpec needs prompts >= 1 and pool >= the most documents")
        if not 1 <= self.documents[0] <= self.documents[1]:
            raise ValueError(f"RetrievalSpec.documents {self.documents} is not a range")


def document_pool(spec: RetrievalSpec) -> list[Document]:
    rng = np.random.default_rng(spec.seed)
    names: set[str] = set()
    codes: set[str] = set()
    pool: list[Document] = []
    while len(pool) < spec.pool:
        syllables = rng.choice(_SYLLABLES, int(rng.integers(2, 4)))
        name = f"{''.join(syllables).capitalize()} {rng.choice(_KINDS)}"
        code = f"{rng.choice(_ANIMALS)}-{int(rng.integers(10, 100))}"
        if name in names or code in codes:
            continue
        names.add(name)
        codes.add(code)
        words = int(rng.integers(spec.words[0], spec.words[1] + 1))
        pool.append(Document(name, code, _text(rng, name, code, words, spec.code_first)))
    return pool


def _text(rng: np.random.Generator, name: str, code: str, words: int, code_first: bool) -> str:
    sentences = []
    count = 0
    while count < words:
        template = str(rng.choice(_FILLER))
        sentence = template.format(
            name=name,
            year=int(rng.integers(1820, 2020)),
            adjective=rng.choice(_ADJECTIVES),
            city=rng.choice(_CITIES),
            colour=rng.choice(_COLOURS),
            number=int(rng.integers(3, 400)),
            things=rng.choice(_THINGS),
            weekday=rng.choice(_WEEKDAYS),
        )
        sentences.append(sentence)
        count += len(sentence.split())
    at = int(rng.integers(0, len(sentences) + 1))  # drawn either way: the same filler
    sentences.insert(0 if code_first else at, _CODE_SENTENCE.format(name=name, code=code))
    return f"Document about {name}.\n" + " ".join(sentences) + "\n\n"


def retrieval_prompts(spec: RetrievalSpec, pool: list[Document] | None = None) -> list[Prompt]:
    """``spec.prompts`` prompts over ``pool`` (default ``document_pool(spec)``)."""
    pool = pool if pool is not None else document_pool(spec)
    rng = np.random.default_rng(spec.seed + 1)
    prompts = []
    for _ in range(spec.prompts):
        count = int(rng.integers(spec.documents[0], spec.documents[1] + 1))
        chosen = [int(d) for d in rng.choice(len(pool), count, replace=False)]
        asked = chosen[int(rng.integers(0, count))]
        parts = (SYSTEM, *(pool[d].text for d in chosen), QUESTION.format(name=pool[asked].name))
        codes = tuple(pool[d].code for d in chosen)
        prompts.append(Prompt(parts, tuple(chosen), asked, pool[asked].code, codes))
    return prompts


def tokenize(prompt: Prompt, tokenizer: Any) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt's ids and the spans of its segments (every part but the question)."""
    ids: list[int] = []
    spans = []
    for i, part in enumerate(prompt.parts):
        encoded = tokenizer(part, add_special_tokens=False).input_ids
        if i < len(prompt.parts) - 1:
            spans.append((len(ids), len(ids) + len(encoded)))
        ids += encoded
    return ids, spans


__all__ = [
    "CODE_ANYWHERE_HELP",
    "Document",
    "Prompt",
    "RetrievalSpec",
    "document_pool",
    "retrieval_prompts",
    "tokenize",
]
