"""stopline.grammar on its own: formats, tool calls, matcher, masks, the compile service.

Uses SmolLM2's real 49,152-token vocabulary (read from the GGUF's metadata only, no weights)
and the tiny test tokenizer for a model whose logits are wider than its vocabulary.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from stopline.grammar import bitmask, tool_format
from stopline.grammar.compiler import CompileService, GrammarError
from stopline.grammar.formats import response_format_grammar
from stopline.grammar.tools import tool_plan
from stopline.grammar.vocab import grammar_vocab
from stopline.request import InvalidRequest
from stopline.tokenizer.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tok(smollm2_gguf) -> Tokenizer:
    from stopline.model.loaders.gguf import read_gguf

    return Tokenizer.from_gguf_fields(read_gguf(smollm2_gguf).fields)


@pytest.fixture(scope="module")
def vocab(tok):
    return grammar_vocab(tok)


@pytest.fixture(scope="module")
def svc(vocab):
    s = CompileService(vocab, deadline_s=30)
    yield s
    s.close()


def compiled(svc: CompileService, grammar: str):
    t = svc.subscribe(grammar)
    deadline = time.monotonic() + 30
    while (c := svc.poll(t)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return c


def accepts(svc, tok, grammar: str, text: str, *, complete: bool = True) -> bool:
    m = compiled(svc, grammar).matcher()
    row = bitmask.allocate(1, svc.vocab.n_vocab)[0]
    for t in tok.encode(text, add_special_tokens=False):
        if not m.fill(row) or not bitmask.allowed(row, svc.vocab.n_vocab)[t] or not m.consume(t):
            return False
    return m.is_accepting() if complete else True


# ---- formats ------------------------------------------------------------------------------

def test_response_formats_accept_what_they_describe(svc, tok) -> None:
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    g = response_format_grammar({"type": "json_schema", "json_schema": {"name": "p", "schema": person,
                                                                          "strict": True}})
    assert accepts(svc, tok, g, '{"name": "Ada", "age": 36}')
    assert not accepts(svc, tok, g, '{"name": "Ada", "age": "36"}')
    assert not accepts(svc, tok, g, '{"name": "Ada"}')  # not complete: age is required
    obj = response_format_grammar({"type": "json_object"})
    assert accepts(svc, tok, obj, '{"a": [1, 2, {"b": null}]}')
    assert not accepts(svc, tok, obj, "[1, 2]")
    assert response_format_grammar({"type": "text"}) is None and response_format_grammar(None) is None
    rx = response_format_grammar({"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"})
    assert accepts(svc, tok, rx, "555-1234") and not accepts(svc, tok, rx, "555-12345")
    ch = response_format_grammar({"type": "choice", "choice": ["yes", "no"]})
    assert accepts(svc, tok, ch, "no") and not accepts(svc, tok, ch, "maybe", complete=False)
    lark = response_format_grammar({"type": "grammar", "grammar": 'start: "a"+ "b"'})
    assert accepts(svc, tok, lark, "aaab") and not accepts(svc, tok, lark, "ba", complete=False)
    gbnf = response_format_grammar({"type": "grammar", "grammar": 'root ::= "x" [0-9]+'})
    assert accepts(svc, tok, gbnf, "x42")


def test_recursive_schema(svc, tok) -> None:
    tree = {"$defs": {"n": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
        "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/n"}
    g = response_format_grammar({"type": "json_schema", "json_schema": {"name": "t", "schema": tree}})
    assert accepts(svc, tok, g, '{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3, "kids": []}]}]}')
    assert not accepts(svc, tok, g, '{"v": 1, "kids": [{"v": 2}]}')


@pytest.mark.parametrize("rf, param", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "regex"}, "response_format.regex"),
    ({"type": "grammar", "grammar": " "}, "response_format.grammar"),
    ({"type": "choice", "choice": []}, "response_format.choice"),
    ({"type": "choice", "choice": ["a", 1]}, "response_format.choice"),
])
def test_bad_response_format_names_the_param(rf, param) -> None:
    with pytest.raises(InvalidRequest, match=f"^{param.replace('.', '[.]')}: "):
        response_format_grammar(rf)


# ---- tool calls -----------------------------------------------------------------------------

def test_tool_choices_constrain_calls(svc, tok) -> None:
    call = tool_format.call_text
    req = tool_plan([WEATHER, ADD], "required").grammar
    two = call("add", {"a": 1, "b": 2}) + "\n" + call("get_weather", {"city": "Paris"})
    assert accepts(svc, tok, req, two)
    assert not accepts(svc, tok, req, "Hello", complete=False)
    assert not accepts(svc, tok, req, call("add", {"a": "x", "b": 2}))
    assert not accepts(svc, tok, req, call("nope", {}))
    single = tool_plan([WEATHER, ADD], "required", parallel_tool_calls=False).grammar
    assert accepts(svc, tok, single, call("add", {"a": 1, "b": 2}))
    assert not accepts(svc, tok, single, two)
    named = tool_plan([WEATHER, ADD], {"type": "function", "function": {"name": "get_weather"}})
    assert named.choice == "function" and not named.parallel
    assert accepts(svc, tok, named.grammar, call("get_weather", {"city": "Oslo"}))
    assert not accepts(svc, tok, named.grammar, call("add", {"a": 1, "b": 2}))
    auto = tool_plan([WEATHER, ADD], "auto").grammar
    assert accepts(svc, tok, auto, "It is sunny, I think.")
    assert accepts(svc, tok, auto, "Let me check.\n" + call("get_weather", {"city": "Rome"}))
    # After the trigger the grammar holds: a call to an unknown tool is refused.
    assert not accepts(svc, tok, auto, "Sure.\n" + call("nope", {}))
    assert tool_plan([WEATHER], "none").grammar is None
    assert tool_plan(None, None).choice == "none"
    assert tool_plan([WEATHER], None).choice == "auto"


def test_tool_parameters_with_defs(svc, tok) -> None:
    # As Pydantic writes a nested model and an Enum: $defs at the parameters' root, "#/$defs/..."
    # references, and a recursive one; two tools with the same $defs names.
    paint = {"type": "function", "function": {"name": "paint", "strict": True, "parameters": {
        "$defs": {"Color": {"enum": ["red", "blue"], "type": "string"},
                  "Box": {"type": "object", "properties": {"w": {"type": "integer"},
                                                           "inner": {"anyOf": [{"$ref": "#/$defs/Box"}, {"type": "null"}]}},
                          "required": ["w", "inner"], "additionalProperties": False}},
        "type": "object", "properties": {"color": {"$ref": "#/$defs/Color"}, "box": {"$ref": "#/$defs/Box"}},
        "required": ["color", "box"], "additionalProperties": False}}}
    other = {"type": "function", "function": {"name": "other", "strict": True, "parameters": {
        "$defs": {"Color": {"const": "green"}}, "type": "object",
        "properties": {"c": {"$ref": "#/$defs/Color"}, "again": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["c", "again"], "additionalProperties": False}}}
    call = tool_format.call_text
    g = tool_plan([paint, other], "required").grammar
    assert accepts(svc, tok, g, call("paint", {"color": "red", "box": {"w": 1, "inner": {"w": 2, "inner": None}}}))
    assert not accepts(svc, tok, g, call("paint", {"color": "green", "box": {"w": 1, "inner": None}}))
    assert accepts(svc, tok, g, call("other", {"c": "green", "again": {"c": "green", "again": None}}))
    assert not accepts(svc, tok, g, call("other", {"c": "red", "again": None}))
    # zod-to-json-schema's shape: draft-07 `definitions`, `$schema` and an `$id` at the root.
    zod = {"type": "function", "function": {"name": "zod", "parameters": {
        "$schema": "http://json-schema.org/draft-07/schema#", "$id": "https://example.com/zod.json",
        "definitions": {"N": {"type": "integer", "minimum": 3, "maximum": 5}}, "type": "object",
        "properties": {"n": {"$ref": "#/definitions/N"}}, "required": ["n"], "additionalProperties": False}}}
    g = tool_plan([zod], "required").grammar
    assert accepts(svc, tok, g, call("zod", {"n": 4})) and not accepts(svc, tok, g, call("zod", {"n": 7}))
    # The tools as sent are unchanged (the prompt shows them so).
    assert "$defs" in paint["function"]["parameters"] and "args0" not in json.dumps(tool_plan([paint], "auto").tools)


@pytest.mark.parametrize("tools, choice, param", [
    ("x", None, "tools"),
    ([{"type": "code_interpreter"}], None, "tools.0.type"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, "tools.0.function.parameters"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], "always", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "add"}}, "tool_choice.function.name"),
    ([], "required", "tool_choice"),
])
def test_bad_tools_name_the_param(tools, choice, param) -> None:
    with pytest.raises(InvalidRequest, match=f"^{param.replace('.', '[.]')}: "):
        tool_plan(tools, choice)


def test_tool_call_parse() -> None:
    call = tool_format.call_text
    text = "Let me look.\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("add", {"a": 1, "b": 2})
    content, calls = tool_format.parse(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert calls[0].body()["type"] == "function" and calls[0].id.startswith("call_")
    assert tool_format.parse("plain answer") == ("plain answer", [])
    # A call left open is never content: cut before its name, it is dropped; after, it is a
    # call whose arguments are cut (OpenAI's answer at max_tokens).
    unfinished = "ok " + tool_format.OPEN + '\n{"name": "add", "argu'
    assert tool_format.parse("ok " + tool_format.OPEN + '\n{"name": "ad', "length") == ("ok", [])
    content, calls = tool_format.parse(unfinished, "length")
    assert content == "ok" and [(c.name, c.arguments, c.complete) for c in calls] == [("add", "", False)]
    content, calls = tool_format.parse(unfinished + 'ments": {"a": 1', "length")
    assert content == "ok" and [(c.name, c.arguments, c.complete) for c in calls] == [("add", '{"a": 1', False)]
    # After a cancel, a deadline or a failure, held text is dropped, and so is an open call.
    assert tool_format.parse(unfinished + 'ments": {"a": 1', "abort") == ("ok", [])
    assert tool_format.parse("ok\n<tool", "abort") == ("ok", [])
    assert tool_format.parse("ok\n<tool", "length") == ("ok", [])
    assert tool_format.parse("ok\n<tool", "stop") == ("ok\n<tool", [])
    # A past turn renders back to the same text.
    past = [{"id": "x", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    assert tool_format.assistant_text(None, past) == call("add", {"a": 1, "b": 2})


def test_streamed_tool_calls_add_up_to_the_whole() -> None:
    call = tool_format.call_text
    texts = ["plain <tool answer\n", "Hi.\n" + call("f", {"x": [1, "</tool_call>"]}) + "\n" + call("g", {}),
             call("f", {}) + " trailing words", "ok " + tool_format.OPEN + '\n{"name": "add"',
             "a\n\n" + call("f", {"k": "v"}) + "\n\n",
             tool_format.OPEN + '\n{"arguments": {"x": 1}, "name": "f"}\n' + tool_format.CLOSE,
             tool_format.OPEN + '\n{"name": "f", "id": 3, "arguments": {"x": 1}}\n' + tool_format.CLOSE]
    rng = random.Random(0)
    for text in texts:
        want_content, want_calls = tool_format.parse(text)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
            sp = tool_format.StreamParser()
            content, deltas = "", []
            for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
                c, d = sp.feed(text[a:b])
                content += c
                deltas += d
            content += sp.finish()
            assert (content or None) == want_content, text
            # The first entry of a call has its id and name; the others add argument text.
            got: dict[int, list[str]] = {}
            for d in deltas:
                fn = d["function"]
                if d["index"] not in got:
                    assert d["id"].startswith("call_") and d["type"] == "function"
                    got[d["index"]] = [fn["name"], ""]
                else:
                    assert "id" not in d and "name" not in fn
                got[d["index"]][1] += fn["arguments"]
            assert [(i, *got[i]) for i in sorted(got)] == [(i, c.name, c.arguments) for i, c in enumerate(want_calls)]
            assert all(json.loads(c.arguments) is not None for c in want_calls if c.complete)


# ---- matcher and masks ----------------------------------------------------------------------

def test_matcher_masks_eos_until_accepting_and_rolls_back(svc, tok) -> None:
    g = response_format_grammar({"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}})
    m = compiled(svc, g).matcher()
    row = bitmask.allocate(1, svc.vocab.n_vocab)[0]
    ids = tok.encode('{"a": 12}', add_special_tokens=False)
    eos = tok.eos_token_id
    for i, t in enumerate(ids):
        assert m.fill(row)
        flags = bitmask.allowed(row, svc.vocab.n_vocab)
        assert flags[t] and not flags[eos], i  # EOS only once the object is complete
        assert m.consume(t)
    assert m.consumed == len(ids) and m.is_accepting()
    assert m.fill(row) and bitmask.allowed(row, svc.vocab.n_vocab)[eos]
    copy = m.copy()
    m.rollback(2)
    assert m.consumed == len(ids) - 2 and not m.is_accepting()
    assert m.consume_all(ids[-2:]) and m.is_accepting()
    m.reset()
    assert m.consumed == 0 and m.consume_all(ids)
    assert copy.consumed == len(ids) and copy.is_accepting()
    with pytest.raises(ValueError):
        m.rollback(len(ids) + 1)
    # A token the grammar refuses puts it in its error state: no mask can be made.
    bad = compiled(svc, g).matcher()
    assert not bad.consume(tok.encode("x", add_special_tokens=False)[0])
    assert not bad.fill(row) and bad.error


def test_batched_fill_equals_one_by_one(svc, tok) -> None:
    """fill_batch (one llguidance call for a step's rows) writes, row for row, what each
    matcher's own fill writes, in any row order, and reports a stuck row as stuck."""
    from stopline.grammar.matcher import fill_batch
    person = response_format_grammar({"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"]}}})
    choice = response_format_grammar({"type": "choice", "choice": ["yes", "no"]})
    ms = []
    for text in ('', '{"a": 1', '{"a": 12, "b": "x'):
        m = compiled(svc, person).matcher()
        assert m.consume_all(tok.encode(text, add_special_tokens=False))
        ms.append(m)
    stuck = compiled(svc, choice).matcher()
    assert not stuck.consume(tok.encode("x", add_special_tokens=False)[0])
    ms.append(stuck)
    n = svc.vocab.n_vocab
    for order in (ms, ms[::-1]):
        out = bitmask.allocate(len(order) + 1, n)
        oks = fill_batch(order, out)
        for i, m in enumerate(order):
            row = bitmask.allocate(1, n)[0]
            assert oks[i] == m.fill(row)
            if oks[i]:
                assert torch.equal(out[i], row), i
    assert oks == [False, True, True, True]
    assert fill_batch([], bitmask.allocate(1, n)) == []


def test_bitmask_apply_matches_the_flags() -> None:
    g = torch.Generator().manual_seed(0)
    n = 1024  # the mask's width; the row is wider
    mask = torch.randint(-2**31, 2**31 - 1, (bitmask.words(n),), dtype=torch.int32, generator=g)
    want = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:n].bool()
    assert torch.equal(bitmask.allowed(mask, n), want)
    assert torch.equal(bitmask.allowed(mask, 1000), want[:1000])
    row = torch.randn(n + 5, generator=g)
    out = bitmask.apply(row.clone(), mask)
    assert torch.equal(out[:n][want], row[:n][want])
    assert torch.isneginf(out[:n][~want]).all() and torch.isneginf(out[n:]).all()
    # A step's rows at once: the same as each row alone, wherever the rows sit.
    logits = torch.randn(6, n + 5, generator=g)
    masks = torch.randint(-2**31, 2**31 - 1, (3, bitmask.words(n)), dtype=torch.int32, generator=g)
    block = bitmask.apply_rows(logits, [4, 0, 2], masks)
    for j, r in enumerate([4, 0, 2]):
        assert torch.equal(block[j], bitmask.apply(logits[r].clone(), masks[j])), j


def test_wider_logits_than_vocabulary_never_allow_padding(tiny_model_dir) -> None:
    tiny = Tokenizer.from_hf_dir(tiny_model_dir)
    v = grammar_vocab(tiny, tiny.vocab_size + 40)
    assert grammar_vocab(tiny, tiny.vocab_size + 40) is v and v.mask_words == (tiny.vocab_size + 71) // 32
    s = CompileService(v, probe=False)
    try:
        m = compiled(s, response_format_grammar({"type": "regex", "regex": "(.|\n)*"})).matcher()
        row = bitmask.allocate(1, v.n_vocab)[0]
        assert m.fill(row)
        flags = bitmask.allowed(row, v.n_vocab)
        assert flags[:tiny.vocab_size].any() and not flags[tiny.vocab_size:].any()
    finally:
        s.close()


# ---- the compile service -----------------------------------------------------------------------

def slow_grammar(rules: int = 20_000, tag: str = "") -> str:
    """A Lark grammar that takes seconds to compile on 2 cores (1.6-3.6 s measured)."""
    from stopline.grammar.formats import lark_grammar

    return lark_grammar("start: " + " | ".join(f'"w{tag}{i}" x{i}' for i in range(rules)) + "\n"
                        + "\n".join(f"x{i}: /[a-z]{{{i % 50}}}/" for i in range(rules)))


def wait(pred, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_one_compile_shared_and_cached(vocab) -> None:
    s = CompileService(vocab, deadline_s=30)
    try:
        s.wait_warm(30)
        g = response_format_grammar({"type": "regex", "regex": "shared-[0-9]+"})
        a, b = s.subscribe(g), s.subscribe(g)
        ca, cb = compiled_ticket(s, a), compiled_ticket(s, b)
        assert ca is cb and s.compiles == 1
        assert s.poll(s.subscribe(g)) is ca  # cached: served at once
        ma, mb = ca.matcher(), cb.matcher()
        assert ma.consume_all([]) and ma._m is not mb._m  # each request its own state
        assert s.pending() == 0
    finally:
        s.close()


def compiled_ticket(s, t):
    wait(lambda: s.poll(t) is not None)
    return s.poll(t)


def test_invalid_grammar_fails_and_is_remembered(vocab) -> None:
    s = CompileService(vocab, deadline_s=30)
    try:
        g = response_format_grammar({"type": "regex", "regex": "[a-"})
        err = compiled_ticket(s, s.subscribe(g))
        assert isinstance(err, GrammarError) and "invalid grammar" in str(err) and "regex" in str(err)
        n = s.compiles
        again = s.subscribe(g)
        assert isinstance(s.poll(again), GrammarError) and s.compiles == n  # refused at once
    finally:
        s.close()


def test_deadline_fails_subscribers_kills_the_compile_and_remembers(vocab) -> None:
    s = CompileService(vocab, deadline_s=0.4)
    try:
        s.wait_warm(30)
        g = slow_grammar()
        t0 = time.monotonic()
        t = s.subscribe(g)
        err = compiled_ticket(s, t)
        took = time.monotonic() - t0
        assert isinstance(err, GrammarError) and "did not compile within 0.4 s" in str(err)
        assert took < 1.0, took
        wait(lambda: s.pending() == 0, timeout=2.0)  # the compile was stopped, not run out
        assert s.stopped == 1
        t1 = time.monotonic()
        assert isinstance(s.poll(s.subscribe(g)), GrammarError)  # remembered
        assert time.monotonic() - t1 < 0.05
    finally:
        s.close()


def test_last_subscriber_leaving_stops_the_compile(vocab) -> None:
    s = CompileService(vocab, deadline_s=30)
    try:
        s.wait_warm(30)
        g = slow_grammar(tag="c")
        a, b = s.subscribe(g), s.subscribe(g)
        wait(lambda: s.compiles == 1)  # running in the probe
        s.unsubscribe(a)
        time.sleep(0.1)
        assert s.pending() == 1 and s.stopped == 0  # b still waits
        t0 = time.monotonic()
        s.unsubscribe(b)
        s.unsubscribe(b)  # idempotent
        wait(lambda: s.pending() == 0, timeout=2.0)
        assert time.monotonic() - t0 < 1.5 and s.stopped == 1  # kill, then the probe restarts
        # Not remembered as failed: nobody learned whether it compiles. A queued compile
        # whose subscriber leaves never runs.
        c = s.subscribe(slow_grammar(tag="q1"))
        d = s.subscribe(slow_grammar(tag="q2"))
        wait(lambda: s.compiles == 2)
        s.unsubscribe(d)
        s.unsubscribe(c)
        wait(lambda: s.pending() == 0, timeout=2.0)
        assert s.compiles == 2
    finally:
        s.close()
    assert not s._probe.alive
