"""Time llguidance on SmolLM2's 49,152-token vocabulary: one token's mask, applying it to a
row of logits, a request's matcher copy, and compiles (the worst one under stopline's limits).

    python bench/grammar_mask.py              # mask and apply, per grammar, median / p90 / max
    python bench/grammar_mask.py --worst      # also: the largest grammar the limits admit

Each grammar is walked along a valid answer (tokenized as the model would write it): at every
position the mask is computed into a preallocated row (timed), then the answer's next token
is consumed, as the engine does per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from stopline.grammar import bitmask
from stopline.grammar.compiler import CompileService
from stopline.grammar.formats import choice_grammar, json_schema_grammar, regex_grammar
from stopline.grammar.tool_format import call_text
from stopline.grammar.tools import tool_plan
from stopline.grammar.vocab import grammar_vocab
from stopline.model.loaders.gguf import read_gguf
from stopline.model.loaders.loader import default_model_path
from stopline.tokenizer.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
PERSON_ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                 "tags": ["math", "engines"], "address": {"city": "London", "zip": "12345"}}
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
TREE_ANSWER = {"value": 1, "children": [{"value": 2, "children": [{"value": 3, "children": []}]},
                                         {"value": 4, "children": []}]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}}]


def cases() -> list[tuple[str, str, str]]:
    dumps = json.dumps
    return [
        ("json_object", json_schema_grammar({"type": "object"}), dumps(PERSON_ANSWER)),
        ("json_schema person", json_schema_grammar(PERSON), dumps(PERSON_ANSWER)),
        ("json_schema tree ($ref)", json_schema_grammar(TREE), dumps(TREE_ANSWER)),
        ("regex phone", regex_grammar(r"\(\d{3}\) \d{3}-\d{4}"), "(555) 123-4567"),
        ("choice", choice_grammar(["positive", "negative", "neutral"]), "neutral"),
        ("tools auto", tool_plan(TOOLS, "auto").grammar,
         "Let me check the weather for you.\n" + call_text("get_weather", {"city": "Paris", "unit": "C"})),
        ("tools required", tool_plan(TOOLS, "required").grammar,
         call_text("get_weather", {"city": "Paris", "unit": "C"})),
    ]


def q(xs: list[float], f: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(f * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worst", action="store_true", help="also time the largest grammar the limits admit")
    ap.add_argument("--repeat", type=int, default=20, help="walks of each answer")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf_fields(read_gguf(default_model_path()).fields)
    vocab = grammar_vocab(tok)
    print(f"vocabulary {vocab.n_vocab} tokens; llguidance tokenizer built in "
          f"{time.perf_counter() - t0:.2f} s (with the GGUF read)")
    svc = CompileService(vocab, deadline_s=60)
    row = bitmask.allocate(1, vocab.n_vocab)[0]
    logits = torch.randn(vocab.n_vocab)
    print(f"{'grammar':26s} {'compile ms':>10s} {'copy us':>8s} {'tokens':>6s} "
          f"{'mask us p50':>11s} {'p90':>6s} {'max':>7s} {'apply us':>8s}")
    all_masks: list[float] = []
    for name, grammar, answer in cases():
        t = svc.subscribe(grammar)
        while (c := svc.poll(t)) is None:
            time.sleep(0.001)
        if not hasattr(c, "matcher"):
            raise SystemExit(f"{name}: {c}")
        ids = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
        masks, copies, applies = [], [], []
        for _ in range(args.repeat):
            t1 = time.perf_counter()
            m = c.matcher()
            copies.append(time.perf_counter() - t1)
            for tid in ids:
                t1 = time.perf_counter()
                m.fill(row)
                masks.append(time.perf_counter() - t1)
                t1 = time.perf_counter()
                bitmask.apply(logits.clone(), row)
                applies.append(time.perf_counter() - t1)
                if not m.consume(tid):
                    raise SystemExit(f"{name}: answer token {tid} refused: {m.error}")
        all_masks += masks
        us = [x * 1e6 for x in masks]
        print(f"{name:26s} {c.seconds * 1000:10.1f} {statistics.median(copies) * 1e6:8.0f} {len(ids):6d} "
              f"{statistics.median(us):11.0f} {q(us, 0.9):6.0f} {max(us):7.0f} "
              f"{statistics.median(applies) * 1e6:8.0f}")
    us = [x * 1e6 for x in all_masks]
    print(f"all grammars: mask median {statistics.median(us):.0f} us, p90 {q(us, 0.9):.0f}, "
          f"p99 {q(us, 0.99):.0f} over {len(us)} tokens")
    if args.worst:
        worst(svc)
    svc.close()


def worst(svc: CompileService) -> None:
    """Lark grammars of growing size: how long a compile runs before it ends or is refused
    (llguidance's limits are checked after most of the work), in the probe process and here."""
    print(f"limits: {svc.limits or 'llguidance defaults'}")
    for n in (1000, 5000, 10000, 20000, 40000, 80000):
        lark = "start: " + " | ".join(f'"w{i}" x{i}' for i in range(n)) + "\n" + \
            "\n".join(f"x{i}: /[a-z]{{{i % 50}}}/" for i in range(n))
        t = svc.subscribe(svc_grammar(lark))
        t0 = time.perf_counter()
        while (c := svc.poll(t)) is None:
            time.sleep(0.005)
        ok = hasattr(c, "matcher")
        print(f"  {n:6d} rules: {time.perf_counter() - t0:6.2f} s  {'ok' if ok else str(c)[:90]}")
        if not ok and "did not compile" in str(c):
            break


def svc_grammar(lark: str) -> str:
    from stopline.grammar.formats import lark_grammar
    return lark_grammar(lark)


if __name__ == "__main__":
    main()
