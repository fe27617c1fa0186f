"""The stop path where the server's features meet (issues 41, 45), drawn at random over real
HTTP: batched prompts with n > 1, cancels by the response id on both endpoints (single and
bulk) and by disconnect, tool-call streams cancelled or dropped mid-call, Anthropic
/v1/messages streams with tools, thinking chat streams with budgets and stop strings, all at
once on a pool small enough that requests are preempted, with async scheduling and the audit
after every step (STOPLINE_DEBUG=1). Half the batch and tool jobs run under one of two LoRA
adapters (`model: NAME`), so rows of different adapters and the base share the storm's steps.
SmolLM2 does not think, so the server is told that its thinking runs from the generation
prompt to its first "." (--reasoning-parser): a chat request thinks unless its budget is 0.

Checked: every choice of every stream gets exactly one finish_reason and nothing after it,
never `error`; a survivor's text (or tool call) equals the same prompt served alone; a
cancelled one's is a prefix of it; no tool-call markup ever arrives as content; the engine
ends idle with its pool at baseline. Seeded: a failure reproduces.

Background responses (/v1/responses, issue 45) join the storm: their creator follows the
stream and leaves (the run goes on) or cancels by the cancel endpoint. Each ends with exactly
one terminal event; a cancelled one's text is a prefix of the same input served alone, any
other equals it; the cancel's answer is the run's final status; no background run is left.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
import pytest

from tests.server_harness import ServerProcess, total

pytestmark = pytest.mark.timeout(600)
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time,", "List three colors:", "def add(a, b):",
           "The best way to learn is", "In 1969, the first", "Water boils at", "My favourite food is"]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
ACTIONS = ("none", "none", "disconnect", "cancel", "bulk_cancel")
REASONING = "<|im_start|>assistant,."  # the thinking: from the generation prompt to the first "."
TOOL = {"name": "get_weather", "description": "Current weather in a city",
        "input_schema": WEATHER["function"]["parameters"]}
# Anthropic's ends, as the chat ends they are checked as
ANTHROPIC_ENDS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                  "tool_use": "tool_calls"}
THINK, ANSWER = "\x00", "\x01"  # where a streamed thinking or answer block starts, in `choices`
RESPONSE_ACTIONS = ("none", "disconnect", "cancel", "cancel")
TERMINAL = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")
ADAPTERS = ("fr", "de")  # random LoRA adapters the server loads with --lora


@dataclass
class Job:
    # "batch": completions with several prompts; "tool": a chat stream calling a tool;
    # "messages": an Anthropic stream calling a tool; "reason": a thinking chat stream
    kind: str
    body: dict
    action: str
    after: int  # chunks read before the action
    choices: dict = field(default_factory=lambda: defaultdict(str))  # index -> text or arguments
    finishes: dict = field(default_factory=lambda: defaultdict(list))  # index -> finish reasons
    late: list = field(default_factory=list)  # chunks for a choice after its finish
    numbers: list = field(default_factory=list)  # a response's sequence numbers, as received
    cancel_answer: str | None = None  # the status the cancel endpoint answered
    markup: list = field(default_factory=list)  # content that carries tool-call markup, or ""


def make_jobs(seed: int, count: int) -> list[Job]:
    rng = random.Random(seed)
    models = random.Random(seed + 1)  # its own draws: the jobs' stay as they were
    jobs = []
    for _ in range(count):
        action, after = rng.choice(ACTIONS), rng.randrange(1, 6)
        if rng.random() < 0.7:
            # A batch that is cancelled runs long without EOS: its cancel, after a few chunks,
            # must find every choice running, so each must end `abort`.
            long = action in ("cancel", "bulk_cancel")
            body = {"model": MODEL, "prompt": rng.sample(PROMPTS, rng.choice([2, 2, 3])),
                    "n": rng.choice([1, 2]), "max_tokens": 120 if long else rng.randrange(12, 40),
                    "ignore_eos": long, "temperature": 0, "stream": True}
            jobs.append(Job("batch", body, action, after))
        else:
            city = rng.choice(CITIES)
            body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 40,
                    "tools": [WEATHER], "tool_choice": "required", "max_thinking_tokens": 0,
                    "messages": [{"role": "user", "content": f"What is the weather in {city}?"}]}
            jobs.append(Job("tool", body, action, after))
        jobs[-1].body["model"] = models.choice([MODEL, MODEL, *ADAPTERS])
    return jobs


def make_response_jobs(seed: int, count: int) -> list[Job]:
    """Background responses; drawn from a generator of their own so the other jobs stay as
    they were."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        action, after = rng.choice(RESPONSE_ACTIONS), rng.randrange(3, 9)
        long = action == "cancel"
        body = {"model": MODEL, "input": rng.choice(PROMPTS), "temperature": 0,
                "max_output_tokens": 120 if long else rng.randrange(12, 40), "ignore_eos": long,
                "background": True, "stream": True}
        jobs.append(Job("response", body, action, after))
    return jobs


def _response_event(job: Job, ev: dict) -> None:
    if job.finishes[0]:
        job.late.append(ev)
    job.numbers.append(ev["sequence_number"])
    if ev["type"] == "response.output_text.delta":
        job.choices[0] += ev["delta"]
    if ev["type"] in TERMINAL:
        job.finishes[0].append(ev["response"]["status"])


async def run_response(http: httpx.AsyncClient, job: Job) -> None:
    rid, acted = None, False
    async with http.stream("POST", "/v1/responses", json=job.body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            rid = rid or ev["response"]["id"]
            _response_event(job, ev)
            if len(job.numbers) == job.after and job.action != "none" and not acted:
                acted = True
                if job.action == "disconnect":
                    break  # leaving closes the connection; the run goes on
                c = await http.post(f"/v1/responses/{rid}/cancel")
                assert c.status_code == 200, c.text
                job.cancel_answer = c.json()["status"]
    if job.action == "disconnect":
        # Its creator gone, the run goes on: read all of it again from its first event.
        job.choices.clear()
        job.finishes.clear()
        job.numbers.clear()
        async with http.stream("GET", f"/v1/responses/{rid}", params={"stream": "true"}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    _response_event(job, json.loads(line[6:]))


def make_api_jobs(seed: int, count: int) -> list[Job]:
    """Anthropic /v1/messages streams with tools and thinking chat streams; drawn from a
    generator of their own so the other jobs stay as they were."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        action, after = rng.choice(ACTIONS), rng.randrange(1, 8)
        ask = [{"role": "user", "content": rng.choice(PROMPTS)}]
        if rng.random() < 0.5:
            city = rng.choice(CITIES)
            body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 60,
                    "messages": [{"role": "user", "content": f"What is the weather in {city}?"}],
                    "tools": [TOOL], "tool_choice": {"type": rng.choice(["any", "auto"])},
                    "thinking": rng.choice([{"type": "disabled"}, {"type": "enabled", "budget_tokens": 4}])}
            jobs.append(Job("messages", body, action, after))
        else:
            body = {"model": MODEL, "stream": True, "temperature": 0, "messages": ask,
                    "max_tokens": rng.randrange(8, 48), "max_thinking_tokens": rng.choice([2, 6, 30]),
                    "stop": rng.choice([[], [" the"], ["a", "\n"]])}
            jobs.append(Job("reason", body, action, after))
    return jobs


async def run_messages(http: httpx.AsyncClient, job: Job) -> None:
    """An Anthropic stream: its blocks in order (in choices[0]), its one end (message_stop
    with its stop_reason, or an error event), nothing after it."""
    seen, cancelled, event, mid = 0, False, None, None
    async with http.stream("POST", "/v1/messages", json=job.body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
                continue
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            assert data["type"] == event, (event, data)
            if job.finishes[0] and event != "message_stop":
                job.late.append(data)
            if event == "message_start":
                mid = data["message"]["id"]
            elif event == "content_block_start":
                kind = data["content_block"]["type"]
                job.choices[0] += {"thinking": THINK, "text": ANSWER}.get(kind, "")
            elif event == "content_block_delta":
                d = data["delta"]
                piece = d.get("thinking") or d.get("text") or d.get("partial_json") or ""
                if "<tool_call" in piece:
                    job.markup.append(piece)
                job.choices[0] += piece
            elif event == "message_delta":
                job.finishes[0].append(ANTHROPIC_ENDS[data["delta"]["stop_reason"]])
            elif event == "error":
                cancelled_end = "cancelled" in data["error"]["message"]
                job.finishes[0].append("abort" if cancelled_end else f"error: {data['error']}")
            seen += 1
            if seen == job.after and job.action != "none" and not cancelled:
                cancelled = True
                if job.action == "disconnect":
                    return
                if job.action == "cancel":
                    c = await http.post(f"/v1/requests/{mid}/cancel")
                else:
                    c = await http.post("/v1/requests/cancel", json={"ids": [mid]})
                assert c.status_code == 200, c.text


async def run_job(http: httpx.AsyncClient, job: Job) -> None:
    if job.kind == "response":
        return await run_response(http, job)
    if job.kind == "messages":
        return await run_messages(http, job)
    path = "/v1/completions" if job.kind == "batch" else "/v1/chat/completions"
    seen, cancelled = 0, False
    async with http.stream("POST", path, json=job.body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                i = c["index"]
                if job.finishes[i]:
                    job.late.append(chunk)
                if job.kind == "batch":
                    job.choices[i] += c.get("text") or ""
                elif job.kind == "reason":
                    delta = c.get("delta") or {}
                    if delta.get("reasoning_content"):
                        assert ANSWER not in job.choices[i], f"thinking after the answer: {chunk}"
                        job.choices[i] += delta["reasoning_content"]
                    if delta.get("content"):
                        job.choices[i] += ("" if ANSWER in job.choices[i] else ANSWER) + delta["content"]
                else:
                    delta = c.get("delta") or {}
                    if "content" in delta and (delta["content"] == "" or "<tool_call" in (delta["content"] or "")):
                        job.markup.append(delta["content"])
                    for tc in delta.get("tool_calls") or ():
                        job.choices[i] += (tc.get("function") or {}).get("arguments") or ""
                if c.get("finish_reason"):
                    job.finishes[i].append(c["finish_reason"])
            seen += 1
            if seen == job.after and job.action != "none" and not cancelled:
                cancelled = True
                if job.action == "disconnect":
                    return  # leaving the block closes the connection
                # Answered once the request has ended: every choice not finished by then
                # must end `abort`.
                if job.action == "cancel":
                    c = await http.post(f"/v1/requests/{chunk['id']}/cancel")
                else:
                    c = await http.post("/v1/requests/cancel", json={"ids": [chunk["id"]]})
                assert c.status_code == 200, c.text


async def solo(http: httpx.AsyncClient, job: Job) -> dict[int, str]:
    """What each choice of the job gives served alone (greedy, one prompt at a time)."""
    if job.kind == "response":
        body = {**job.body, "background": False, "stream": False, "store": False}
        r = (await http.post("/v1/responses", json=body)).json()
        return {0: "".join(o["content"][0]["text"] for o in r["output"] if o["type"] == "message")}
    if job.kind == "batch":
        want = {}
        for p, prompt in enumerate(job.body["prompt"]):
            body = {**job.body, "prompt": prompt, "n": 1, "stream": False}
            r = (await http.post("/v1/completions", json=body)).json()
            for j in range(job.body["n"]):
                want[p * job.body["n"] + j] = r["choices"][0]["text"]
        return want
    if job.kind == "messages":  # streamed alone, read the same way
        alone = Job(job.kind, job.body, "none", 0)
        await run_messages(http, alone)
        return {0: alone.choices[0]}
    r = (await http.post("/v1/chat/completions", json={**job.body, "stream": False})).json()
    msg = r["choices"][0]["message"]
    if job.kind == "reason":
        return {0: msg["reasoning_content"] + (ANSWER + msg["content"] if msg["content"] else "")}
    return {0: "".join(tc["function"]["arguments"] for tc in msg["tool_calls"])}


@pytest.fixture(scope="module")
def server(smollm2_gguf, smollm2, stopline_cache_dir, tmp_path_factory):
    from stopline.bench.lora import write_adapter

    root = tmp_path_factory.mktemp("storm_loras")
    loras = [f"{n}={write_adapter(root / n, smollm2.config, rank=8, seed=i)}" for i, n in enumerate(ADAPTERS)]
    # 24 blocks of 16 tokens, admitting into any free room: a few jobs' worth, so the storm
    # preempts (and the largest job, 2 samples of 128 tokens, still fits alone).
    srv = ServerProcess("--num-blocks", "24", "--admission-lookahead", "0", "--async-scheduling",
                        "--preemption-mode", "auto", "--max-lora-rank", "8", "--lora", *loras,
                        "--reasoning-parser", REASONING,
                        env={"STOPLINE_CACHE_DIR": str(stopline_cache_dir), "STOPLINE_DEBUG": "1"})
    try:
        srv.wait_ready(timeout=240)
        yield srv
    finally:
        srv.stop()


def test_server_storm(server):
    jobs = make_jobs(seed=41, count=24) + make_response_jobs(seed=45, count=8) + \
        make_api_jobs(seed=46, count=8)
    baseline = server.metrics()["stopline_kv_blocks_used"]

    async def main() -> list[dict[int, str]]:
        async with httpx.AsyncClient(base_url=server.base, timeout=300) as http:
            await asyncio.gather(*(run_job(http, j) for j in jobs))
            server.wait_idle(baseline, timeout=30)
            return [await solo(http, j) for j in jobs]

    wants = asyncio.run(main())
    aborted = 0
    for n, (job, want) in enumerate(zip(jobs, wants, strict=True)):
        where = f"job {n} ({job.kind}, {job.action} after {job.after})"
        if job.kind == "response":
            check_response(job, want[0], where)
            continue
        assert not job.late, f"{where}: chunks after a finish: {job.late[:2]}"
        assert not job.markup, f"{where}: empty or tool-call markup content: {job.markup[:2]}"
        for i, full in want.items():
            got, reasons = job.choices[i], job.finishes[i]
            if job.action == "disconnect":  # the client left: it saw what it saw, and no more
                assert len(reasons) <= 1 and full.startswith(got), f"{where}[{i}]: {got!r} vs {full!r}"
                continue
            assert len(reasons) == 1, f"{where}[{i}]: finish reasons {reasons}"
            if reasons[0] == "abort":
                aborted += 1
                assert job.action != "none", f"{where}[{i}]: aborted unasked"
                assert full.startswith(got), f"{where}[{i}]: {got!r} is not a prefix of {full!r}"
            else:
                assert reasons[0] in ("stop", "length", "tool_calls"), f"{where}[{i}]: {reasons}"
                assert not (job.kind == "batch" and job.action != "none"), \
                    f"{where}[{i}]: ended {reasons[0]} after its request was cancelled"
                assert got == full, f"{where}[{i}]: {got!r} != alone {full!r}"
    assert aborted > 0
    kinds = {j.kind for j in jobs}
    assert {"messages", "reason"} <= kinds, kinds
    assert {j.body["model"] for j in jobs} == {MODEL, *ADAPTERS}
    m = server.metrics()
    assert m['stopline_api_requests_total{api="messages"}'] > 0 < m["stopline_reasoning_tokens_total"]
    assert m["stopline_responses_background_running"] == 0
    assert m['stopline_responses_ended_total{status="cancelled"}'] > 0
    for name in ADAPTERS:
        assert m[f'stopline_lora_references{{adapter="{name}"}}'] == 0
        assert m[f'stopline_lora_requests_total{{adapter="{name}"}}'] > 0
    assert total(m, "stopline_preemptions_total") > 0, {k: v for k, v in m.items() if "preempt" in k}


def check_response(job: Job, full: str, where: str) -> None:
    got, statuses = job.choices[0], job.finishes[0]
    assert not job.late, f"{where}: events after the terminal one: {job.late[:2]}"
    assert statuses and len(statuses) == 1, f"{where}: terminal statuses {statuses}"
    assert job.numbers == list(range(len(job.numbers))), f"{where}: sequence {job.numbers}"
    if statuses[0] == "cancelled":
        assert job.action == "cancel" and job.cancel_answer == "cancelled", where
        assert full.startswith(got), f"{where}: {got!r} is not a prefix of {full!r}"
        return
    assert statuses[0] in ("completed", "incomplete"), f"{where}: {statuses}"
    assert job.cancel_answer in (None, statuses[0]), f"{where}: cancel said {job.cancel_answer}"
    assert got == full, f"{where}: {got!r} != alone {full!r}"
