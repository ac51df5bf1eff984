"""The fixed, versioned prompt set ``bench`` measures speed with.

Speculative decoding (MTP, n-gram) accepts more drafted tokens on predictable text (code,
text that repeats its input) than on free prose, and prefill cost grows with the input, so
the set crosses short and long inputs with prose and code, and short and long outputs. The
prompts never change under a version: a change is a new ``PROMPT_SET_VERSION``, and
``prompt_set_sha256()`` (recorded in the evidence) proves which texts were sent.

Public API:
    Prompt(id, kind, description, system, user, max_tokens)   .messages()
    PROMPT_SET_VERSION, PROMPTS, prompt_set_sha256(prompts)
    select_prompts(ids) -> tuple[Prompt, ...]    a subset by id (KilnError naming an unknown one)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kiln.bench.texts import DESIGN_NOTE, INVENTORY_MODULE
from kiln.errors import KilnError

PROMPT_SET_VERSION = "kiln-bench-1"

SYSTEM = "You are a helpful assistant. Answer directly and completely."


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # "prose" or "code": what the output mostly is
    description: str  # input and output lengths, for the docs and the tables
    system: str
    user: str
    max_tokens: int

    def messages(self, prefix: str = "") -> list[dict]:
        """The chat messages; ``prefix`` (a unique line) defeats the server's prefix cache."""
        return [{"role": "system", "content": prefix + self.system}, {"role": "user", "content": self.user}]

    def to_json(self) -> dict:
        return {"id": self.id, "kind": self.kind, "description": self.description,
                "system": self.system, "user": self.user, "max_tokens": self.max_tokens}


PROMPTS: tuple[Prompt, ...] = (
    Prompt(
        "short-prose", "prose", "short input, medium output", SYSTEM,
        "Explain to a curious twelve-year-old why the sky is blue during the day and red at "
        "sunset. Use three short paragraphs and one everyday comparison.",
        384,
    ),
    Prompt(
        "short-code", "code", "short input, medium output", SYSTEM,
        "Write a Python function `merge_intervals(intervals)` that merges overlapping closed "
        "intervals given as (start, end) tuples and returns them sorted. Include a docstring "
        "with three doctest examples, one of them with touching intervals, and type hints.",
        384,
    ),
    Prompt(
        "long-prose", "prose", "long input (~1,000 words), medium output", SYSTEM,
        "Here is a design note.\n\n" + DESIGN_NOTE + "\nSummarise this note for an engineer who "
        "has not read it: the decision, the reasons, the three biggest risks with their "
        "mitigations, and the open questions. Use headings and bullet points.",
        512,
    ),
    Prompt(
        "long-code", "code", "long input (~100 lines of Python), long output", SYSTEM,
        "Review this Python module.\n\n```python\n" + INVENTORY_MODULE + "```\n\nList every bug "
        "you find with the function it is in and why it is wrong, then give corrected versions "
        "of the functions that have bugs.",
        800,
    ),
    Prompt(
        "gen-prose", "prose", "short input, long output", SYSTEM,
        "Write a story of about 600 words about a lighthouse keeper who finds a message in a "
        "bottle that was written by her own grandmother. Give it a title.",
        800,
    ),
    Prompt(
        "gen-code", "code", "short input, long output", SYSTEM,
        "Implement an LRU cache class in Python with get, put, delete and resize methods, "
        "O(1) get and put, a maximum size, and an optional time-to-live per entry. Then write "
        "pytest tests covering eviction order, expiry and resizing.",
        800,
    ),
)



def prompt_set_sha256(prompts: tuple[Prompt, ...] = PROMPTS) -> str:
    """sha256 of the prompts' canonical JSON: what exactly a run sent."""
    text = json.dumps([p.to_json() for p in prompts], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def select_by_id(items: tuple, ids: list[str] | None, option: str, what: str) -> tuple:
    """``items`` (each with an ``id``) named by ``ids`` in that order, or all of them; an unknown id
    is an error naming ``option``."""
    if not ids:
        return items
    by_id = {item.id: item for item in items}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise KilnError(f"{option}: unknown {what} {unknown[0]!r} (known: {', '.join(by_id)})")
    return tuple(by_id[i] for i in dict.fromkeys(ids))


def select_prompts(ids: list[str] | None) -> tuple[Prompt, ...]:
    return select_by_id(PROMPTS, ids, "--prompts", "prompt")
