"""Seeded synthetic prompts.

Random words rather than a corpus: every request gets its own text, so no engine gets a
prefix-cache hit the others don't, and the same seed gives every engine the same prompts.
The word list is plain lower-case English, about 1.1-1.3 tokens a word for BPE tokenizers of
the Llama family; workloads report the prompt length the server counted, not this guess.
"""

from __future__ import annotations

import random

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river garden window market paper music field light voice table road winter "
    "summer bread stone cloud forest island bridge letter animal flower street mountain"
).split()

TOKENS_PER_WORD = 1.2  # rough; only used to size prompts


def words_for_tokens(tokens: int) -> int:
    return max(1, int(tokens / TOKENS_PER_WORD))


def make_prompt(rng: random.Random, approx_tokens: int) -> str:
    """A prompt of about `approx_tokens` tokens, distinct from its first word on."""
    n = words_for_tokens(approx_tokens)
    head = f"Request {rng.randrange(10**9)}:"
    return head + " " + " ".join(rng.choice(_WORDS) for _ in range(n))


def make_prompts(seed: int, count: int, approx_tokens: int) -> list[str]:
    rng = random.Random(seed)
    return [make_prompt(rng, approx_tokens) for _ in range(count)]
